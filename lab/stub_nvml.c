/* A stand-in libnvidia-ml.so.1 with only the calls gpufleet's NVML source makes.
 *
 * STUB_NVML_GPUS: how many GPUs (default 2); GPU i sits at bus 0x3b + i.
 * STUB_NVML_EVENTS: a file the test appends to; each line is one event:
 *     event INDEX TYPE DATA    an event of TYPE (8 = Xid critical error) with eventData DATA
 *     lost INDEX               the GPU falls off the bus (NVML_ERROR_GPU_IS_LOST)
 * STUB_NVML_LOG: where registrations are written ("registered INDEX TYPES").
 * STUB_NVML_NODE_FILE: read at each init when it exists: "COUNT [LOST...]", the GPU count (over
 *     STUB_NVML_GPUS) and the indexes of GPUs lost from the start (a test changes one node's GPUs).
 * STUB_NVML_STATE: a file read at every call below it, the degradation the detector polls for;
 *     each line is "INDEX WHAT VALUES..." (the last line that matches wins), or "INDEX WHAT
 *     unsupported" for NVML_ERROR_NOT_SUPPORTED ("INDEX WHAT failing": NVML_ERROR_UNKNOWN).
 *     Unset WHATs read as a healthy GPU.
 *     pcie GEN MAXGEN WIDTH MAXWIDTH       (default 5 5 16 16)
 *     util GPU_PERCENT                     (default 0)
 *     clocks REASONS                       current clocks event reasons, a bit mask (default 0)
 *     remap CORR UNC PENDING FAILURE       remapped rows (default 0 0 0 0)
 *     retired PENDING SBE_PAGES DBE_PAGES  retired pages (default: not supported)
 *     nvlink LINKS                         how many NVLinks, all active (default: not supported)
 *     nvlink_error LINK COUNTER VALUE      one NVLink error counter (default 0)
 *     fabric STATE STATUS                  GPU fabric info (default: not supported)
 *     uuid failing                         NVML counts the GPU but cannot identify it
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef struct { int index; int lost; } stub_device;
typedef stub_device *nvmlDevice_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

enum { OK = 0, INVALID_ARGUMENT = 2, TIMEOUT = 10, GPU_IS_LOST = 15 };

static stub_device devices[8];
static unsigned int count = 2;
static long events_offset = 0;
static int event_set;

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    const char *gpus = getenv("STUB_NVML_GPUS");
    count = gpus ? (unsigned int)atoi(gpus) : 2;
    if (count > 8) count = 8;
    for (unsigned int i = 0; i < count; i++) { devices[i].index = (int)i; devices[i].lost = 0; }
    const char *node_file = getenv("STUB_NVML_NODE_FILE");
    FILE *node = node_file ? fopen(node_file, "r") : NULL;
    if (node) {
        int n, lost;
        if (fscanf(node, "%d", &n) == 1 && n >= 0) {
            count = n > 8 ? 8 : (unsigned int)n;
            for (unsigned int i = 0; i < count; i++) { devices[i].index = (int)i; devices[i].lost = 0; }
            while (fscanf(node, "%d", &lost) == 1)
                if (lost >= 0 && (unsigned int)lost < count) devices[lost].lost = 1;
        }
        fclose(node);
    }
    return OK;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { return OK; }

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case OK: return "Success";
    case TIMEOUT: return "Timeout";
    case GPU_IS_LOST: return "GPU is lost";
    case INVALID_ARGUMENT: return "Invalid Argument";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *out) { *out = count; return OK; }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index >= count) return INVALID_ARGUMENT;
    *device = &devices[index];
    return OK;
}

static nvmlReturn_t stub_read(nvmlDevice_t device, const char *what, unsigned long long *values, int size);

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (device->lost) return GPU_IS_LOST;
    nvmlReturn_t ret = stub_read(device, "uuid", NULL, 0); /* "INDEX uuid failing": counted, unusable */
    if (ret != OK) return ret;
    snprintf(uuid, length, "GPU-57ab0000-0000-0000-0000-%012d", device->index);
    return OK;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    memset(pci, 0, sizeof(*pci));
    pci->bus = 0x3b + (unsigned int)device->index;
    snprintf(pci->busId, sizeof(pci->busId), "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "0000:%02X:00.0", pci->bus);
    return OK;
}

nvmlReturn_t nvmlEventSetCreate(void **set) { *set = &event_set; return OK; }
nvmlReturn_t nvmlEventSetFree(void *set) { (void)set; return OK; }

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, void *set) {
    (void)set;
    const char *path = getenv("STUB_NVML_LOG");
    if (path) {
        FILE *log = fopen(path, "a");
        if (log) { fprintf(log, "registered %d %llu\n", device->index, types); fclose(log); }
    }
    return OK;
}

/* Reads the next complete line of the events file, if any. */
static int next_line(char *line, size_t size) {
    const char *path = getenv("STUB_NVML_EVENTS");
    if (!path) return 0;
    FILE *file = fopen(path, "r");
    if (!file) return 0;
    int found = 0;
    if (fseek(file, events_offset, SEEK_SET) == 0 && fgets(line, (int)size, file) && strchr(line, '\n')) {
        events_offset = ftell(file);
        found = 1;
    }
    fclose(file);
    return found;
}

nvmlReturn_t nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)set;
    char line[128];
    struct timespec step = {0, 10 * 1000 * 1000};
    for (unsigned int waited = 0; waited <= timeout_ms; waited += 10) {
        if (next_line(line, sizeof(line))) {
            int index;
            unsigned long long type, value;
            if (sscanf(line, "event %d %llu %llu", &index, &type, &value) == 3 && index >= 0 && index < (int)count) {
                memset(data, 0, sizeof(*data));
                data->device = &devices[index];
                data->eventType = type;
                data->eventData = value;
                data->gpuInstanceId = 0xFFFFFFFFu;
                data->computeInstanceId = 0xFFFFFFFFu;
                return OK;
            }
            if (sscanf(line, "lost %d", &index) == 1 && index >= 0 && index < (int)count) {
                devices[index].lost = 1;
                return GPU_IS_LOST;
            }
            continue; /* a line the stub does not understand: skip it */
        }
        nanosleep(&step, NULL);
    }
    return TIMEOUT;
}

/* ---- Degradation: what the detector polls between Xids (STUB_NVML_STATE). ---- */

enum { NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7, UNKNOWN_ERROR = 999 };
enum { ABSENT = -1, UNSUPPORTED = -2, FAILING = -3 };

/* The values of the last line "INDEX WHAT v0 v1 ..." whose first `match` values equal `want`:
 * how many it holds, ABSENT or UNSUPPORTED. */
static int stub_state(const stub_device *device, const char *what, const unsigned long long *want, int match,
                      unsigned long long *values, int size) {
    const char *path = getenv("STUB_NVML_STATE");
    FILE *file = path ? fopen(path, "r") : NULL;
    if (!file) return ABSENT;
    int found = ABSENT;
    char line[256];
    while (fgets(line, sizeof(line), file)) {
        char name[32], rest[200];
        int index;
        if (sscanf(line, "%d %31s %199[^\n]", &index, name, rest) < 2 || index != device->index) continue;
        if (strcmp(name, what) != 0) continue;
        if (strncmp(rest, "unsupported", 11) == 0 && match == 0) { found = UNSUPPORTED; continue; }
        if (strncmp(rest, "failing", 7) == 0 && match == 0) { found = FAILING; continue; }
        unsigned long long parsed[8];
        int n = 0;
        char *cursor = rest, *end;
        while (n < 8) {
            unsigned long long value = strtoull(cursor, &end, 0);
            if (end == cursor) break;
            parsed[n++] = value;
            cursor = end;
        }
        int same = n >= match;
        for (int i = 0; same && i < match; i++) same = parsed[i] == want[i];
        if (!same) continue;
        for (int i = 0; i < n - match && i < size; i++) values[i] = parsed[match + i];
        found = n - match;
    }
    fclose(file);
    return found;
}

static nvmlReturn_t stub_read(nvmlDevice_t device, const char *what, unsigned long long *values, int size) {
    if (device->lost) return GPU_IS_LOST;
    int n = stub_state(device, what, NULL, 0, values, size);
    return n == UNSUPPORTED ? NOT_SUPPORTED : n == FAILING ? UNKNOWN_ERROR : OK;
}

static nvmlReturn_t stub_pcie(nvmlDevice_t device, int which, unsigned int *out) {
    unsigned long long v[4] = {5, 5, 16, 16};
    nvmlReturn_t ret = stub_read(device, "pcie", v, 4);
    if (ret == OK) *out = (unsigned int)v[which];
    return ret;
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *g) { return stub_pcie(d, 0, g); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *g) { return stub_pcie(d, 1, g); }
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *w) { return stub_pcie(d, 2, w); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *w) { return stub_pcie(d, 3, w); }

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    unsigned long long v[1] = {0};
    nvmlReturn_t ret = stub_read(device, "util", v, 1);
    if (ret == OK) { utilization->gpu = (unsigned int)v[0]; utilization->memory = 0; }
    return ret;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    unsigned long long v[1] = {0};
    nvmlReturn_t ret = stub_read(device, "clocks", v, 1);
    if (ret == OK) *reasons = v[0];
    return ret;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    unsigned long long v[4] = {0, 0, 0, 0};
    nvmlReturn_t ret = stub_read(device, "remap", v, 4);
    if (ret == OK) {
        *corr = (unsigned int)v[0];
        *unc = (unsigned int)v[1];
        *pending = (unsigned int)v[2];
        *failure = (unsigned int)v[3];
    }
    return ret;
}

/* Retired pages: not supported unless the state file names them (as on Ampere and later). */
static nvmlReturn_t stub_retired(nvmlDevice_t device, unsigned long long v[3]) {
    if (device->lost) return GPU_IS_LOST;
    int n = stub_state(device, "retired", NULL, 0, v, 3);
    return n < 0 ? NOT_SUPPORTED : OK;
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending) {
    unsigned long long v[3] = {0, 0, 0};
    nvmlReturn_t ret = stub_retired(device, v);
    if (ret == OK) *pending = v[0] ? 1 : 0;
    return ret;
}
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    unsigned long long v[3] = {0, 0, 0};
    nvmlReturn_t ret = stub_retired(device, v);
    if (ret != OK) return ret;
    unsigned int pages = (unsigned int)(cause == 0 ? v[1] : v[2]); /* 0: multiple single-bit, 1: double-bit */
    if (addresses == NULL || *count < pages) { *count = pages; return pages ? INSUFFICIENT_SIZE : OK; }
    for (unsigned int i = 0; i < pages; i++) addresses[i] = 0x1000ull * (i + 1);
    *count = pages;
    return OK;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *active) {
    if (device->lost) return GPU_IS_LOST;
    unsigned long long v[1] = {0};
    int n = stub_state(device, "nvlink", NULL, 0, v, 1);
    if (n < 1) return NOT_SUPPORTED;
    if (link >= v[0]) return INVALID_ARGUMENT;
    *active = 1;
    return OK;
}
nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, unsigned int counter,
                                             unsigned long long *value) {
    int active;
    nvmlReturn_t ret = nvmlDeviceGetNvLinkState(device, link, &active);
    if (ret != OK) return ret;
    unsigned long long want[2] = {link, counter}, v[1] = {0};
    stub_state(device, "nvlink_error", want, 2, v, 1);
    *value = v[0];
    return OK;
}

typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} nvmlGpuFabricInfo_t;
nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info) {
    if (device->lost) return GPU_IS_LOST;
    unsigned long long v[2] = {0, 0};
    if (stub_state(device, "fabric", NULL, 0, v, 2) < 1) return NOT_SUPPORTED;
    memset(info, 0, sizeof(*info));
    info->state = (unsigned int)v[0];
    info->status = (nvmlReturn_t)v[1];
    return OK;
}
