"""The NVML source: Xid critical-error events from every GPU, through pynvml (nvidia-ml-py).

NVML does not report Xid 79, 119 or 120; the kernel log does. NVML complements it: it
sees Xids on drivers whose log we cannot read, and a GPU that is lost (NVML_ERROR_GPU_IS_LOST)
is reported as fallen off the bus.

Between events it reads every GPU, every ``degradation.poll_seconds`` of the policy, for what
degrades a GPU without an Xid (``detector.degradation``), and reports each degradation once.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from detector.degradation import (
    Degradation,
    GpuReading,
    Tracker,
    degradations,
    gpu_missing,
    read_gpu,
    undetermined,
)
from detector.parse import XidReport
from models.degradation import DegradationSettings

log = logging.getLogger("gpufleet.detector")
UNKNOWN_XID = 999


@dataclass
class Gpu:
    index: int
    handle: Any
    pci: str
    uuid: str
    lost: bool = False


def short_pci(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as the kernel log writes it: ``0000:3b:00``."""
    domain, bus, rest = bus_id.lower().split(":", 2)
    return f"{domain[-4:]}:{bus}:{rest.split('.')[0]}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


class NvmlSource:
    name = "nvml"

    def __init__(
        self,
        *,
        wait_ms: int = 500,
        once: bool = False,
        degradation: Callable[[], DegradationSettings] | None = None,
        expect_gpus: int = 0,
    ) -> None:
        """
        Args:
            once: read the GPUs once, then stop at the first wait for events that brings nothing.
            degradation: the policy's settings now (the policy file is read again when it
                changes); None: no polling for degradation.
            expect_gpus: how many GPUs the node advertises (0: unknown, not checked).
        """
        self._wait_ms = wait_ms
        self._once = once
        self._degradation = degradation
        self._expect_gpus = expect_gpus
        self._tracker = Tracker()
        self._readings: dict[int, GpuReading] = {}
        self._said: set[tuple[int, str, str]] = set()  # failed reads already logged
        self.gpus: list[Gpu] = []
        self.registered: list[int] = []
        self.unusable: list[int] = []  # GPUs NVML counts but gives no handle or identity for
        self.available = False

    def open(self) -> bool:
        """Initialise NVML and register for Xid events on every GPU; False (said once) without NVML."""
        import pynvml

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            log.warning("NVML unavailable (%s); the kernel-log source carries on alone", exc)
            return False
        self._pynvml = pynvml
        self._events = pynvml.nvmlEventSetCreate()
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpu = Gpu(
                    index=index,
                    handle=handle,
                    pci=short_pci(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                )
            except pynvml.NVMLError as exc:
                # Counted but unusable (e.g. NVML_ERROR_INSUFFICIENT_POWER): not read, and not
                # counted among the node's GPUs, so that the count check reports it missing.
                log.warning("GPU %d: NVML counts it but cannot use it: %s", index, exc)
                self.unusable.append(index)
                continue
            self.gpus.append(gpu)
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                self.registered.append(index)
            except pynvml.NVMLError as exc:
                log.warning("GPU %d (%s): cannot register for Xid events: %s", index, gpu.pci, exc)
        self.available = True
        return True

    @property
    def library(self) -> Any:
        """pynvml, once ``open`` succeeded."""
        return self._pynvml

    def _gpu_for(self, handle: Any) -> Gpu | None:
        address = _address(handle)
        return next((gpu for gpu in self.gpus if _address(gpu.handle) == address), None)

    def _lost_gpus(self) -> list[Gpu]:
        pynvml = self._pynvml
        lost = []
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                pynvml.nvmlDeviceGetUUID(gpu.handle)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    gpu.lost = True
                    lost.append(gpu)
        return lost

    def poll(self) -> list[XidReport]:
        """Wait once (up to ``wait_ms``) and return what NVML reported."""
        pynvml = self._pynvml
        try:
            data = pynvml.nvmlEventSetWait_v2(self._events, self._wait_ms)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return []
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                return [
                    XidReport(xid=79, pci=gpu.pci, gpu_uuid=gpu.uuid, message="NVML: GPU is lost")
                    for gpu in self._lost_gpus()
                ]
            raise
        # eventData means something else for other event types: check the type first.
        if data.eventType != pynvml.nvmlEventTypeXidCriticalError or data.eventData == 0:
            return []
        gpu = self._gpu_for(data.device)
        xid = int(data.eventData)
        return [
            XidReport(
                xid=xid,
                pci=gpu.pci if gpu else "unknown",
                gpu_uuid=gpu.uuid if gpu else None,
                message="NVML: unknown Xid (999)" if xid == UNKNOWN_XID else "NVML: Xid critical error",
                gpu_instance=None if data.gpuInstanceId == 0xFFFFFFFF else int(data.gpuInstanceId),
                compute_instance=None if data.computeInstanceId == 0xFFFFFFFF else int(data.computeInstanceId),
            )
        ]

    def read_degradation(self, settings: DegradationSettings) -> list[XidReport]:
        """Read every GPU once; the degradations to report now (each once, ``Tracker``).

        With ``once``, a degradation read once is reported (there is no second poll to confirm
        it), and NVLink counters cannot be seen rising (there is no poll before).
        """
        pynvml = self._pynvml
        confirm = 1 if self._once else settings.confirm_polls
        reports: list[XidReport] = []
        try:
            count: int | None = int(pynvml.nvmlDeviceGetCount()) - len(self.unusable)
        except pynvml.NVMLError as exc:  # said; the GPUs are still read, and their Xids listened to
            log.warning("NVML cannot count this node's GPUs: %s", exc)
            count = None
        if count is not None:
            missing = gpu_missing(count, self._expect_gpus)
            for degradation in self._tracker.update(None, [missing] if missing else [], confirm_polls=confirm):
                reports.append(XidReport(xid=None, pci=None, message=degradation.message, kind=degradation.kind.value))
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                reading = read_gpu(pynvml, gpu.handle)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                    raise
                gpu.lost = True
                reports.append(XidReport(xid=79, pci=gpu.pci, gpu_uuid=gpu.uuid, message="NVML: GPU is lost"))
                continue
            for name, error in reading.errors.items():
                if (gpu.index, name, error) not in self._said:  # once, not at every poll
                    self._said.add((gpu.index, name, error))
                    log.warning("GPU %d (%s): %s failed: %s", gpu.index, gpu.pci, name, error)
            seen = degradations(reading, self._readings.get(gpu.index), settings, error_text=self._error_text)
            self._readings[gpu.index] = reading
            unknown = undetermined(reading, settings)
            for degradation in self._tracker.update(gpu.uuid, seen, confirm_polls=confirm, unknown=unknown):
                reports.append(self._report(gpu, degradation))
        return reports

    def _error_text(self, status: int) -> str:
        try:
            return _text(self._pynvml.nvmlErrorString(status))
        except Exception:  # an unknown code: its number says it
            return f"NVML error {status}"

    @staticmethod
    def _report(gpu: Gpu, degradation: Degradation) -> XidReport:
        return XidReport(
            xid=None, pci=gpu.pci, gpu_uuid=gpu.uuid, message=degradation.message, kind=degradation.kind.value
        )

    def run(self, emit: Any, stop: threading.Event, ready: Any) -> None:
        if not self.available and not self.open():
            ready()  # no NVML here: nothing to wait for
            return
        ready()
        next_read = time.monotonic()
        try:
            while not stop.is_set():
                settings = self._degradation() if self._degradation is not None else None
                if settings is not None and settings.poll_seconds and time.monotonic() >= next_read:
                    for report in self.read_degradation(settings):
                        emit(report, self.name)
                    next_read = time.monotonic() + settings.poll_seconds
                reports = self.poll()
                if not reports and self._once:
                    return
                for report in reports:
                    emit(report, self.name)
        finally:
            self.close()

    def close(self) -> None:
        if self.available:
            self._pynvml.nvmlEventSetFree(self._events)
            self._pynvml.nvmlShutdown()
            self.available = False
