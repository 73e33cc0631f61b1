"""Silent degradation: what slows or weakens a GPU without an Xid, read from NVML.

``read_gpu`` reads one GPU handle: its PCIe link (generation and width, now and at most), its
utilisation, its clock event reasons, its remapped rows (Ampere and later) or else its retired
pages, its NVLink error counters and its fabric registration (NVSwitch systems). A call the GPU
or the driver does not support (``NVML_ERROR_NOT_SUPPORTED``, or ``NVML_ERROR_FUNCTION_NOT_FOUND``
on an older driver) leaves its reading out: no event.

``degradations`` turns a reading (and the one before it, for counters that rise) into the
degradations it shows, each of its own ``models.xid.GpuEventKind``; ``Tracker`` reports each
one once when it appears, not again while it lasts, and again if it clears and comes back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from models.degradation import DegradationSettings
from models.xid import GpuEventKind

# Clock event reasons (nvmlClocksEventReason*): the hardware ones, each documented as cutting
# the core clocks by a factor of 2 or more. The others (idle, application clocks, the software
# power cap and thermal slowdown, sync boost, display clocks) are normal operation.
HW_SLOWDOWN = 0x08
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
HARDWARE_REASONS = {
    HW_SLOWDOWN: "HW slowdown",
    HW_THERMAL_SLOWDOWN: "HW thermal slowdown",
    HW_POWER_BRAKE_SLOWDOWN: "HW power brake slowdown",
}
# nvmlNvLinkErrorCounter_t
NVLINK_COUNTERS = {0: "replay", 1: "recovery", 2: "CRC flit", 3: "CRC data", 4: "ECC data"}
NVLINK_MAX_LINKS = 36
# nvmlGpuFabricState_t
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
FABRIC_COMPLETED = 3
FABRIC_NOT_SUPPORTED = 0
# NVML's answers that mean "not on this GPU or this driver": no reading, no event.
_NOT_AVAILABLE = (3, 13)  # NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND
_INVALID_ARGUMENT = 2  # a link number past the GPU's last


@dataclass(frozen=True)
class Degradation:
    """One degradation seen at one poll. ``key`` tells it from others of its kind on the same
    GPU (an NVLink's number, pending or failed remapping), so each is reported on its own."""

    kind: GpuEventKind
    message: str
    key: str = ""


@dataclass
class GpuReading:
    """What NVML said about one GPU at one poll; None where it does not say (not supported)."""

    pcie_generation: int | None = None
    pcie_max_generation: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    utilization_percent: int | None = None
    clocks_event_reasons: int | None = None
    # (correctable, uncorrectable, pending, failure), Ampere and later
    remapped_rows: tuple[int, int, bool, bool] | None = None
    # (pending, pages retired for multiple single-bit errors, for double-bit errors), before Ampere
    retired_pages: tuple[bool, int, int] | None = None
    # link -> counter name -> count, for the links NVML reports active
    nvlink_errors: dict[int, dict[str, int]] = field(default_factory=dict)
    # (state, status) of the GPU's fabric registration, NVSwitch systems only
    fabric: tuple[int, int] | None = None
    # Calls that failed for another reason than "not supported": the call, NVML's error.
    errors: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The reading as JSON would hold it (``make gpu-check`` prints it)."""
        data = asdict(self)
        data["nvlink_errors"] = {str(link): counters for link, counters in self.nvlink_errors.items()}
        if self.clocks_event_reasons is not None:
            data["clocks_event_reasons"] = hex(self.clocks_event_reasons)
        if self.remapped_rows is not None:
            rows = ("correctable", "uncorrectable", "pending", "failure")
            data["remapped_rows"] = dict(zip(rows, self.remapped_rows, strict=True))
        if self.retired_pages is not None:
            pages = ("pending", "single_bit_pages", "double_bit_pages")
            data["retired_pages"] = dict(zip(pages, self.retired_pages, strict=True))
        if self.fabric is not None:
            state, status = self.fabric
            data["fabric"] = {"state": FABRIC_STATES.get(state, str(state)), "status": status}
        return data


class _Reader:
    """Calls pynvml for one reading, keeping "not supported" apart from other failures."""

    def __init__(self, pynvml: Any, reading: GpuReading) -> None:
        self.pynvml = pynvml
        self.reading = reading

    def call(self, name: str, *args: Any) -> Any:
        """``pynvml.name(*args)``; None when the GPU or driver lacks it. A lost GPU raises."""
        pynvml = self.pynvml
        function = getattr(pynvml, name, None)
        if function is None:  # a pynvml older than the call
            return None
        try:
            return function(*args)
        except pynvml.NVMLError as exc:
            if exc.value in _NOT_AVAILABLE:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            self.reading.errors[name] = str(exc)
            return None


def read_gpu(pynvml: Any, handle: Any) -> GpuReading:
    """Read the degradation state of one GPU handle (NVML initialised by the caller).

    Raises:
        pynvml.NVMLError: NVML_ERROR_GPU_IS_LOST only (the GPU fell off the bus); any other
            failure is kept in the reading's ``errors``.
    """
    reading = GpuReading()
    nvml = _Reader(pynvml, reading)
    reading.pcie_generation = nvml.call("nvmlDeviceGetCurrPcieLinkGeneration", handle)
    reading.pcie_max_generation = nvml.call("nvmlDeviceGetMaxPcieLinkGeneration", handle)
    reading.pcie_width = nvml.call("nvmlDeviceGetCurrPcieLinkWidth", handle)
    reading.pcie_max_width = nvml.call("nvmlDeviceGetMaxPcieLinkWidth", handle)
    utilization = nvml.call("nvmlDeviceGetUtilizationRates", handle)
    reading.utilization_percent = None if utilization is None else int(utilization.gpu)
    reasons = nvml.call("nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None and "nvmlDeviceGetCurrentClocksEventReasons" not in reading.errors:
        # drivers before R535 name it "throttle reasons"
        reasons = nvml.call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    reading.clocks_event_reasons = None if reasons is None else int(reasons)
    rows = nvml.call("nvmlDeviceGetRemappedRows", handle)
    if rows is not None:
        correctable, uncorrectable, pending, failure = rows
        reading.remapped_rows = (int(correctable), int(uncorrectable), bool(pending), bool(failure))
    else:  # before Ampere: dynamic page retirement
        pending = nvml.call("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if pending is not None:
            single = nvml.call("nvmlDeviceGetRetiredPages", handle, 0)  # multiple single-bit errors
            double = nvml.call("nvmlDeviceGetRetiredPages", handle, 1)  # double-bit errors
            reading.retired_pages = (bool(pending), len(single or []), len(double or []))
    reading.nvlink_errors = _nvlink_errors(pynvml, nvml, handle)
    reading.fabric = _fabric(pynvml, nvml, handle)
    return reading


def _nvlink_errors(pynvml: Any, nvml: _Reader, handle: Any) -> dict[int, dict[str, int]]:
    links: dict[int, dict[str, int]] = {}
    for link in range(NVLINK_MAX_LINKS):
        try:
            active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if exc.value in _NOT_AVAILABLE and link == 0:
                return links  # no NVLink on this GPU
            if exc.value in (*_NOT_AVAILABLE, _INVALID_ARGUMENT):
                continue  # no such link here
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise
            nvml.reading.errors[f"nvmlDeviceGetNvLinkState({link})"] = str(exc)
            continue
        if not active:
            continue
        counters = {}
        for counter, name in NVLINK_COUNTERS.items():
            value = nvml.call("nvmlDeviceGetNvLinkErrorCounter", handle, link, counter)
            if value is not None:
                counters[name] = int(value)
        links[link] = counters
    return links


def _fabric(pynvml: Any, nvml: _Reader, handle: Any) -> tuple[int, int] | None:
    info_type = getattr(pynvml, "c_nvmlGpuFabricInfo_t", None)
    if info_type is None:
        return None
    info = info_type()
    if nvml.call("nvmlDeviceGetGpuFabricInfo", handle, pynvml.byref(info)) is None:
        return None
    if int(info.state) == FABRIC_NOT_SUPPORTED:
        return None
    return int(info.state), int(info.status)


def degradations(
    reading: GpuReading,
    previous: GpuReading | None,
    settings: DegradationSettings,
    *,
    error_text: Any = str,
) -> list[Degradation]:
    """The degradations one GPU's reading shows; ``previous`` (the poll before) for rising counters.

    Args:
        error_text: names an NVML return code (``pynvml.nvmlErrorString``) for a failed fabric status.
    """
    found: list[Degradation] = []
    found += _pcie(reading, settings)
    if reading.clocks_event_reasons is not None:
        hardware = [name for bit, name in HARDWARE_REASONS.items() if reading.clocks_event_reasons & bit]
        if hardware:
            found.append(
                Degradation(
                    GpuEventKind.CLOCKS_THROTTLED,
                    f"clocks held down by hardware: {', '.join(hardware)} "
                    f"(clocks event reasons {reading.clocks_event_reasons:#x})",
                )
            )
    if reading.remapped_rows is not None:
        correctable, uncorrectable, pending, failure = reading.remapped_rows
        rows = f"{correctable} row(s) remapped for correctable errors, {uncorrectable} for uncorrectable"
        if pending:
            found.append(Degradation(GpuEventKind.ROW_REMAP, f"row remapping pending a GPU reset; {rows}", "pending"))
        if failure:
            found.append(Degradation(GpuEventKind.ROW_REMAP, f"row remapping failed; {rows}", "failure"))
    if reading.retired_pages is not None and reading.retired_pages[0]:
        _, single, double = reading.retired_pages
        found.append(
            Degradation(
                GpuEventKind.RETIRED_PAGES,
                f"page retirement pending a reset; {single} page(s) retired for single-bit errors, "
                f"{double} for double-bit errors",
            )
        )
    found += _nvlink(reading, previous, settings)
    if reading.fabric is not None:
        state, status = reading.fabric
        if state != FABRIC_COMPLETED:
            message = f"GPU not registered with the NVLink fabric (state: {FABRIC_STATES.get(state, state)})"
            found.append(Degradation(GpuEventKind.FABRIC_MANAGER, message))
        elif status != 0:
            message = f"GPU fabric registration failed: {error_text(status)} (status {status})"
            found.append(Degradation(GpuEventKind.FABRIC_MANAGER, message))
    return found


def _pcie(reading: GpuReading, settings: DegradationSettings) -> list[Degradation]:
    parts = []
    width, widest = reading.pcie_width, reading.pcie_max_width
    if width is not None and widest is not None and 0 < width < widest:
        parts.append(f"PCIe link x{width} of x{widest}")
    generation, newest = reading.pcie_generation, reading.pcie_max_generation
    busy = reading.utilization_percent
    # At idle a link drops its generation to save power, by design: only under load is it a fault.
    under_load = busy is not None and busy >= settings.load_percent
    if generation is not None and newest is not None and 0 < generation < newest and under_load:
        parts.append(f"PCIe link gen {generation} of gen {newest} with the GPU {busy}% busy")
    if not parts:
        return []
    return [Degradation(GpuEventKind.PCIE_LINK, "; ".join(parts))]


def undetermined(reading: GpuReading, settings: DegradationSettings) -> list[tuple[GpuEventKind, str]]:
    """The degradations (kind, key) that a reading can neither show nor clear.

    A link below its maximum generation at idle may be degraded or merely saving power: the
    PCIe link's state is not known until the GPU is under load again, so a degradation already
    reported stays reported (a job's quiet spell is not the link healing).
    """
    width, widest = reading.pcie_width, reading.pcie_max_width
    if width is not None and widest is not None and 0 < width < widest:
        return []  # seen degraded, whatever the load
    generation, newest = reading.pcie_generation, reading.pcie_max_generation
    busy = reading.utilization_percent
    under_load = busy is not None and busy >= settings.load_percent
    if generation is not None and newest is not None and 0 < generation < newest and not under_load:
        return [(GpuEventKind.PCIE_LINK, "")]
    return []


def _nvlink(reading: GpuReading, previous: GpuReading | None, settings: DegradationSettings) -> list[Degradation]:
    if previous is None:
        return []
    found = []
    for link, counters in reading.nvlink_errors.items():
        before = previous.nvlink_errors.get(link)
        if before is None:
            continue
        rises = {
            name: value - before[name]
            for name, value in counters.items()
            if name in before and value - before[name] >= settings.nvlink_error_rise
        }
        if rises:
            said = ", ".join(f"{name} +{rise} (now {counters[name]})" for name, rise in rises.items())
            found.append(
                Degradation(GpuEventKind.NVLINK_ERRORS, f"NVLink {link} error counters rising: {said}", f"link {link}")
            )
    return found


def gpu_missing(seen: int, expected: int) -> Degradation | None:
    """Fewer GPUs than the node advertises (``expected``; 0: not known, no check)."""
    if expected and seen < expected:
        return Degradation(GpuEventKind.GPU_MISSING, f"NVML sees {seen} GPU(s) of the {expected} this node advertises")
    return None


class Tracker:
    """Reports each degradation once it has been seen at ``confirm_polls`` polls in a row; not
    again while it lasts; again when it has cleared at a poll and comes back."""

    def __init__(self) -> None:
        self._streak: dict[tuple[str | None, GpuEventKind, str], int] = {}
        self._reported: set[tuple[str | None, GpuEventKind, str]] = set()

    def update(
        self,
        where: str | None,
        seen: Iterable[Degradation],
        *,
        confirm_polls: int,
        unknown: Iterable[tuple[GpuEventKind, str]] = (),
    ) -> list[Degradation]:
        """What to report of ``where`` (a GPU's UUID; None for the node) after a poll that saw
        ``seen``; the (kind, key) pairs in ``unknown`` the poll could not tell: left as they were."""
        now = {(where, d.kind, d.key): d for d in seen}
        unsure = {(where, kind, key) for kind, key in unknown}
        for key in [key for key in self._streak if key[0] == where and key not in now and key not in unsure]:
            del self._streak[key]  # cleared: reported again if it comes back
            self._reported.discard(key)
        report = []
        for key, degradation in now.items():
            self._streak[key] = self._streak.get(key, 0) + 1
            if key not in self._reported and self._streak[key] >= confirm_polls:
                self._reported.add(key)
                report.append(degradation)
        return report
