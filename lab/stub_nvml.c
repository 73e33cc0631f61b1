/* A stand-in libnvidia-ml.so.1 with only the calls gpufleet's NVML source makes.
 *
 * STUB_NVML_GPUS: how many GPUs (default 2); GPU i sits at bus 0x3b + i.
 * STUB_NVML_EVENTS: a file the test appends to; each line is one event:
 *     event INDEX TYPE DATA    an event of TYPE (8 = Xid critical error) with eventData DATA
 *     lost INDEX               the GPU falls off the bus (NVML_ERROR_GPU_IS_LOST)
 * STUB_NVML_LOG: where registrations are written ("registered INDEX TYPES").
 * STUB_NVML_NODE_FILE: read at each init when it exists: "COUNT [LOST...]", the GPU count (over
 *     STUB_NVML_GPUS) and the indexes of GPUs lost from the start (a test changes one node's GPUs).
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

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (device->lost) return GPU_IS_LOST;
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
