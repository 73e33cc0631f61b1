"""Silent degradation read through the real pynvml from the stub libnvidia-ml.so.1 (lab/stub_nvml.c).

The test writes the stub's state file (STUB_NVML_STATE) as a GPU would be; the NVML source reads
every GPU, reports each degradation as an event of its own kind, once, and the default policy
classifies it.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from detector.daemon import Folder
from detector.degradation import read_gpu
from detector.nvml import NvmlSource
from detector.parse import XidReport
from lab.nvmlstub import LIBRARY, StubUnavailable, build_stub
from models.degradation import DegradationSettings
from models.intake import IntakeEvent
from models.policy import DEFAULT_KIND_ACTIONS, Action, Policy, PolicyError, policy_from_mapping
from models.xid import GpuEventKind, XidEvent
from tests.conftest import REPO, gpufleet_cli

GPU0 = "GPU-57ab0000-0000-0000-0000-000000000000"
GPU1 = "GPU-57ab0000-0000-0000-0000-000000000001"
EVERY_POLL = DegradationSettings(confirm_polls=1)


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_stub(tmp_path_factory.mktemp("nvml"))
    except StubUnavailable as exc:
        pytest.fail(str(exc))


@pytest.fixture
def state(stub_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stub's state file, with pynvml in this process bound to the stub (not a real driver)."""
    path = tmp_path / "state"
    path.write_text("")
    monkeypatch.setenv("STUB_NVML_STATE", str(path))
    monkeypatch.setenv("STUB_NVML_GPUS", "2")
    monkeypatch.delenv("STUB_NVML_EVENTS", raising=False)
    monkeypatch.setattr(pynvml, "nvmlLib", ctypes.CDLL(str(stub_lib / LIBRARY)))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    yield path


@pytest.fixture
def source(state: Path) -> Iterator[NvmlSource]:
    nvml = NvmlSource(wait_ms=0)
    assert nvml.open()
    yield nvml
    nvml.close()


def event(report: XidReport) -> XidEvent:
    """The event the detector makes of a report (as Detector.handle does)."""
    return XidEvent(
        node="gpu1",
        kind=GpuEventKind(report.kind),
        xid=report.xid,
        pci=report.pci,
        gpu_uuid=report.gpu_uuid,
        message=report.message,
        source="nvml",
    )


@pytest.mark.parametrize(
    ("lines", "kind", "said", "action"),
    [
        ("1 pcie 5 5 8 16\n", GpuEventKind.PCIE_LINK, "PCIe link x8 of x16", Action.DRAIN_AFTER_JOBS),
        (
            "1 pcie 3 5 16 16\n1 util 95\n",
            GpuEventKind.PCIE_LINK,
            "PCIe link gen 3 of gen 5 with the GPU 95% busy",
            Action.DRAIN_AFTER_JOBS,
        ),
        ("1 clocks 0x88\n", GpuEventKind.CLOCKS_THROTTLED, "HW slowdown, HW power brake", Action.DRAIN_AFTER_JOBS),
        ("1 clocks 0x40\n", GpuEventKind.CLOCKS_THROTTLED, "HW thermal slowdown", Action.DRAIN_AFTER_JOBS),
        ("1 remap 0 1 1 0\n", GpuEventKind.ROW_REMAP, "pending a GPU reset; 0 row(s)", Action.DRAIN_AFTER_JOBS),
        ("1 remap 3 8 0 1\n", GpuEventKind.ROW_REMAP, "row remapping failed; 3 row(s)", Action.DRAIN_AFTER_JOBS),
        (
            "1 remap unsupported\n1 retired 1 2 1\n",
            GpuEventKind.RETIRED_PAGES,
            "2 page(s) retired for single-bit errors, 1 for double-bit",
            Action.DRAIN_AFTER_JOBS,
        ),
        ("1 fabric 1 0\n", GpuEventKind.FABRIC_MANAGER, "state: not started", Action.DRAIN_AFTER_JOBS),
        ("1 fabric 2 0\n", GpuEventKind.FABRIC_MANAGER, "state: in progress", Action.DRAIN_AFTER_JOBS),
        ("1 fabric 3 999\n", GpuEventKind.FABRIC_MANAGER, "registration failed", Action.DRAIN_AFTER_JOBS),
    ],
)
def test_each_degradation_is_read_and_classified(
    source: NvmlSource, state: Path, lines: str, kind: GpuEventKind, said: str, action: Action
) -> None:
    state.write_text(lines)
    reports = source.read_degradation(EVERY_POLL)
    assert [(r.kind, r.pci, r.gpu_uuid, r.xid) for r in reports] == [(kind.value, "0000:3c:00", GPU1, None)]
    assert said in reports[0].message
    assert Policy().action_for(event(reports[0])) is action


def test_nvlink_counters_rising_are_reported_and_observed(source: NvmlSource, state: Path) -> None:
    state.write_text("0 nvlink 4\n0 nvlink_error 2 2 10\n0 nvlink_error 2 0 5\n")
    assert source.read_degradation(EVERY_POLL) == []  # the first poll is the baseline
    assert source.read_degradation(EVERY_POLL) == []  # steady counts: nothing new
    with state.open("a") as file:
        file.write("0 nvlink_error 2 2 22\n0 nvlink_error 2 0 9\n")
    reports = source.read_degradation(EVERY_POLL)
    assert [(r.kind, r.gpu_uuid) for r in reports] == [("nvlink_errors", GPU0)]
    assert reports[0].message == "NVLink 2 error counters rising: replay +4 (now 9), CRC flit +12 (now 22)"
    assert Policy().action_for(event(reports[0])) is Action.OBSERVE


def test_an_nvlink_rise_below_the_threshold_is_not_reported(source: NvmlSource, state: Path) -> None:
    settings = DegradationSettings(confirm_polls=1, nvlink_error_rise=10)
    state.write_text("0 nvlink 1\n0 nvlink_error 0 3 100\n")
    source.read_degradation(settings)
    state.write_text("0 nvlink 1\n0 nvlink_error 0 3 109\n")
    assert source.read_degradation(settings) == []
    state.write_text("0 nvlink 1\n0 nvlink_error 0 3 119\n")
    assert [r.message for r in source.read_degradation(settings)] == [
        "NVLink 0 error counters rising: CRC data +10 (now 119)"
    ]


def test_fewer_gpus_than_the_node_advertises(state: Path) -> None:
    nvml = NvmlSource(wait_ms=0, expect_gpus=8)
    assert nvml.open()
    try:
        reports = nvml.read_degradation(EVERY_POLL)
    finally:
        nvml.close()
    assert [(r.kind, r.pci, r.gpu_uuid, r.message) for r in reports] == [
        ("gpu_missing", None, None, "NVML sees 2 GPU(s) of the 8 this node advertises")
    ]
    assert Policy().action_for(event(reports[0])) is Action.DRAIN_AFTER_JOBS


def test_a_gpu_nvml_counts_but_cannot_use_is_missing(state: Path) -> None:
    state.write_text("1 uuid failing\n")
    nvml = NvmlSource(wait_ms=0, expect_gpus=2)
    assert nvml.open()
    try:
        reports = nvml.read_degradation(EVERY_POLL)
        assert [gpu.index for gpu in nvml.gpus] == [0]
    finally:
        nvml.close()
    assert [(r.kind, r.message) for r in reports] == [
        ("gpu_missing", "NVML sees 1 GPU(s) of the 2 this node advertises")
    ]


def test_as_many_gpus_as_advertised_is_no_event(state: Path) -> None:
    nvml = NvmlSource(wait_ms=0, expect_gpus=2)
    assert nvml.open()
    try:
        assert nvml.read_degradation(EVERY_POLL) == []
    finally:
        nvml.close()


def test_an_idle_link_at_a_lower_generation_is_not_reported(source: NvmlSource, state: Path) -> None:
    state.write_text("0 pcie 1 4 16 16\n0 util 0\n")  # idle: the link dropped to gen 1 by design
    assert source.read_degradation(EVERY_POLL) == []
    state.write_text("0 pcie 1 4 16 16\n0 util 29\n")  # lightly used: still below the load threshold
    assert source.read_degradation(EVERY_POLL) == []
    state.write_text("0 pcie 1 4 16 16\n0 util 30\n")  # under load, the same link is a fault
    assert [r.message for r in source.read_degradation(EVERY_POLL)] == [
        "PCIe link gen 1 of gen 4 with the GPU 30% busy"
    ]


def test_a_slow_link_is_not_reported_again_after_an_idle_spell(source: NvmlSource, state: Path) -> None:
    state.write_text("0 pcie 3 5 16 16\n0 util 90\n")
    assert [r.kind for r in source.read_degradation(EVERY_POLL)] == ["pcie_link"]
    state.write_text("0 pcie 1 5 16 16\n0 util 0\n")  # the job pauses: idle, gen 1 says nothing
    assert source.read_degradation(EVERY_POLL) == []
    state.write_text("0 pcie 3 5 16 16\n0 util 90\n")  # busy again, the same slow link
    assert source.read_degradation(EVERY_POLL) == []  # not a second report
    state.write_text("0 pcie 5 5 16 16\n0 util 90\n")  # under load at gen 5: healed
    assert source.read_degradation(EVERY_POLL) == []
    state.write_text("0 pcie 3 5 16 16\n0 util 90\n")
    assert [r.kind for r in source.read_degradation(EVERY_POLL)] == ["pcie_link"]  # back: again


def test_software_clock_reasons_are_no_event(source: NvmlSource, state: Path) -> None:
    # idle, application clocks, SW power cap, sync boost, SW thermal, display clocks
    state.write_text("0 clocks 0x137\n1 clocks 0x4\n")
    assert source.read_degradation(EVERY_POLL) == []


def test_reported_once_not_again_while_it_lasts_and_again_when_it_comes_back(source: NvmlSource, state: Path) -> None:
    settings = DegradationSettings(confirm_polls=2)
    state.write_text("0 pcie 5 5 4 16\n")
    assert source.read_degradation(settings) == []  # seen once: not yet confirmed
    first = source.read_degradation(settings)
    assert [(r.kind, r.message) for r in first] == [("pcie_link", "PCIe link x4 of x16")]
    for _ in range(3):
        assert source.read_degradation(settings) == []  # it lasts: not again
    state.write_text("")  # the link trains back to x16
    assert source.read_degradation(settings) == []
    state.write_text("0 pcie 5 5 4 16\n")
    assert source.read_degradation(settings) == []
    assert [r.kind for r in source.read_degradation(settings)] == ["pcie_link"]  # back: reported again


def test_a_pending_remap_then_a_failure_are_two_reports(source: NvmlSource, state: Path) -> None:
    state.write_text("0 remap 0 1 1 0\n")
    assert [r.message.split(";")[0] for r in source.read_degradation(EVERY_POLL)] == [
        "row remapping pending a GPU reset"
    ]
    state.write_text("0 remap 0 1 1 1\n")
    assert [r.message.split(";")[0] for r in source.read_degradation(EVERY_POLL)] == ["row remapping failed"]


def test_not_supported_is_no_event(source: NvmlSource, state: Path) -> None:
    state.write_text(
        "".join(
            f"{gpu} {what} unsupported\n"
            for gpu in (0, 1)
            for what in ("pcie", "util", "clocks", "remap")  # retired, nvlink, fabric: unsupported by default
        )
    )
    assert source.read_degradation(EVERY_POLL) == []
    reading = read_gpu(pynvml, source.gpus[0].handle)
    assert reading.as_dict() == {
        "pcie_generation": None,
        "pcie_max_generation": None,
        "pcie_width": None,
        "pcie_max_width": None,
        "utilization_percent": None,
        "clocks_event_reasons": None,
        "remapped_rows": None,
        "retired_pages": None,
        "nvlink_errors": {},
        "fabric": None,
        "errors": {},
    }


def test_a_failing_call_is_said_once_and_is_no_event(
    source: NvmlSource, state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state.write_text("0 clocks failing\n0 pcie 5 5 8 16\n")
    reports = [report for _ in range(3) for report in source.read_degradation(EVERY_POLL)]
    assert [r.kind for r in reports] == ["pcie_link"]  # the other readings go on
    reading = read_gpu(pynvml, source.gpus[0].handle)
    assert reading.clocks_event_reasons is None
    assert list(reading.errors) == ["nvmlDeviceGetCurrentClocksEventReasons"]
    said = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("GPU 0 (0000:3b:00): nvmlDeviceGetCurrentClocksEventReasons failed")


class OlderDriver:
    """The stub library without some functions, as an older driver's libnvidia-ml lacks them."""

    def __init__(self, library: Any, missing: set[str]) -> None:
        self._library = library
        self._missing = missing

    def __getattr__(self, name: str) -> Any:
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._library, name)


def test_functions_an_older_driver_lacks_are_no_event(
    source: NvmlSource, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state.write_text("0 clocks 0x8\n0 fabric 1 0\n0 remap 0 0 1 0\n")
    missing = {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetRemappedRows"}
    monkeypatch.setattr(pynvml, "nvmlLib", OlderDriver(pynvml.nvmlLib, missing))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    reports = source.read_degradation(EVERY_POLL)
    # The clock reasons come from the older name (throttle reasons); the rest is not read.
    assert [r.kind for r in reports] == ["clocks_throttled"]
    reading = read_gpu(pynvml, source.gpus[0].handle)
    assert (reading.fabric, reading.remapped_rows, reading.retired_pages, reading.errors) == (None, None, None, {})


def test_an_older_driver_s_clock_reasons_are_read_though_another_call_failed(
    source: NvmlSource, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state.write_text("0 util failing\n0 clocks 0x40\n")
    monkeypatch.setattr(pynvml, "nvmlLib", OlderDriver(pynvml.nvmlLib, {"nvmlDeviceGetCurrentClocksEventReasons"}))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    reading = read_gpu(pynvml, source.gpus[0].handle)
    assert list(reading.errors) == ["nvmlDeviceGetUtilizationRates"]
    assert reading.clocks_event_reasons == 0x40  # from nvmlDeviceGetCurrentClocksThrottleReasons


def test_a_gpu_lost_while_read_is_reported_fallen_off_the_bus(source: NvmlSource, state: Path) -> None:
    # The stub's device is {int index; int lost;}: mark GPU 1 lost, as its "lost" event line would.
    ctypes.cast(source.gpus[1].handle, ctypes.POINTER(ctypes.c_int * 2)).contents[1] = 1
    reports = source.read_degradation(EVERY_POLL)
    assert [(r.xid, r.pci) for r in reports] == [(79, "0000:3c:00")]
    assert source.read_degradation(EVERY_POLL) == []  # once


class CountedSource(NvmlSource):
    """The NVML source, counting its reads so that the test waits for them, not for time."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads = 0
        self.read_done = threading.Condition()

    def read_degradation(self, settings: DegradationSettings) -> list[XidReport]:
        reports = super().read_degradation(settings)
        with self.read_done:
            self.reads += 1
            self.read_done.notify_all()
        return reports

    def wait_reads(self, more: int) -> None:
        with self.read_done:
            target = self.reads + more
            assert self.read_done.wait_for(lambda: self.reads >= target, timeout=30), f"{self.reads} reads"


def test_the_running_source_polls_at_the_policy_interval(state: Path) -> None:
    settings = DegradationSettings(poll_seconds=0.01, confirm_polls=2)  # each read confirmed by the next
    emitted: list[XidReport] = []
    nvml = CountedSource(wait_ms=0, degradation=lambda: settings)
    stop = threading.Event()
    state.write_text("1 clocks 0x80\n")
    thread = threading.Thread(target=nvml.run, args=(lambda report, _: emitted.append(report), stop, lambda: None))
    thread.start()
    try:
        nvml.wait_reads(5)
        assert [(r.kind, r.gpu_uuid) for r in emitted] == [("clocks_throttled", GPU1)]  # once, while it lasts
        state.write_text("")
        nvml.wait_reads(2)
        state.write_text("1 clocks 0x80\n")
        nvml.wait_reads(3)
        assert [r.kind for r in emitted] == ["clocks_throttled", "clocks_throttled"]  # back: again
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def detect(lib: Path, tmp_path: Path, state: str, *args: str, policy: str | None = None) -> list[dict[str, Any]]:
    (tmp_path / "state").write_text(state)
    (tmp_path / "events").write_text("event 0 8 48\n")
    env = {
        "LD_LIBRARY_PATH": str(lib),
        "STUB_NVML_STATE": str(tmp_path / "state"),
        "STUB_NVML_EVENTS": str(tmp_path / "events"),
    }
    if policy is not None:
        (tmp_path / "policy.yaml").write_text(policy)
        env["GPUFLEET_POLICY_FILE"] = str(tmp_path / "policy.yaml")
    done = gpufleet_cli("detect", "--nvml", "--node", "gpu1", "--dry-run", "--once", *args, env=env)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_detector_reports_degradation_with_the_policy_action(stub_lib: Path, tmp_path: Path) -> None:
    events = detect(stub_lib, tmp_path, "0 pcie 5 5 8 16\n1 nvlink 2\n1 fabric 3 0\n", "--expect-gpus", "3")
    assert [(e["kind"], e["pci"], e["gpu_uuid"], e["message"], e["action"], e["source"]) for e in events] == [
        ("gpu_missing", None, None, "NVML sees 2 GPU(s) of the 3 this node advertises", "DRAIN_AFTER_JOBS", "nvml"),
        ("pcie_link", "0000:3b:00", GPU0, "PCIe link x8 of x16", "DRAIN_AFTER_JOBS", "nvml"),
        ("xid", "0000:3b:00", GPU0, "NVML: Xid critical error", "RESET_GPU", "nvml"),
    ]


def test_two_degradations_of_one_kind_on_one_gpu_are_two_events(stub_lib: Path, tmp_path: Path) -> None:
    events = detect(stub_lib, tmp_path, "1 remap 0 2 1 1\n")
    assert [(e["kind"], e["gpu_uuid"], e["message"].split(";")[0]) for e in events[:2]] == [
        ("row_remap", GPU1, "row remapping pending a GPU reset"),
        ("row_remap", GPU1, "row remapping failed"),
    ]


def test_repeats_fold_by_message_only_for_degradations() -> None:
    def one(kind: GpuEventKind, message: str) -> XidEvent:
        return XidEvent(node="gpu1", kind=kind, pci="0000:3b:00", message=message, source="kmsg")

    folder = Folder(window=60)
    assert folder.fresh(one(GpuEventKind.NVLINK_ERRORS, "NVLink 0 error counters rising: replay +1 (now 1)"))
    assert folder.fresh(one(GpuEventKind.NVLINK_ERRORS, "NVLink 1 error counters rising: replay +1 (now 1)"))
    # The kernel log's codeless events fold by kind and GPU, as before degradations were read.
    assert folder.fresh(one(GpuEventKind.INIT_FAILED, "RmInitAdapter failed! (0x26:0x56:1474)"))
    assert not folder.fresh(one(GpuEventKind.INIT_FAILED, "RmInitAdapter failed! (0x25:0xffff:1481)"))


def test_the_intake_takes_every_degradation_kind() -> None:
    kinds = [
        GpuEventKind.PCIE_LINK,
        GpuEventKind.CLOCKS_THROTTLED,
        GpuEventKind.ROW_REMAP,
        GpuEventKind.RETIRED_PAGES,
        GpuEventKind.NVLINK_ERRORS,
        GpuEventKind.GPU_MISSING,
        GpuEventKind.FABRIC_MANAGER,
    ]
    for kind in kinds:
        body = {"cluster": "prod", "event": {"node": "gpu1", "kind": kind.value, "xid": None, "message": "read"}}
        taken = IntakeEvent.model_validate(body).event
        assert (taken.kind, taken.xid, taken.reason_word) == (kind, None, kind.value)
        assert Policy().action_for(taken) is DEFAULT_KIND_ACTIONS[kind]


def test_the_policy_sets_the_interval_and_the_actions(stub_lib: Path, tmp_path: Path) -> None:
    off = detect(stub_lib, tmp_path, "0 pcie 5 5 8 16\n", policy="degradation:\n  poll_seconds: 0\n")
    assert [e["kind"] for e in off] == ["xid"]  # not read at all
    observed = detect(stub_lib, tmp_path, "0 pcie 5 5 8 16\n", policy="kinds:\n  pcie_link: OBSERVE\n")
    assert [(e["kind"], e["action"]) for e in observed] == [("pcie_link", "OBSERVE"), ("xid", "RESET_GPU")]


def test_the_policy_checks_the_degradation_section() -> None:
    settings = policy_from_mapping({"degradation": {"poll_seconds": 60, "nvlink_error_rise": 100}}).degradation
    assert (settings.poll_seconds, settings.nvlink_error_rise, settings.confirm_polls) == (60, 100, 2)
    with pytest.raises(PolicyError, match=r"degradation\.load_percent"):
        policy_from_mapping({"degradation": {"load_percent": 0}})
    with pytest.raises(PolicyError, match=r"degradation\.poll_second"):
        policy_from_mapping({"degradation": {"poll_second": 10}})


def test_gpu_check_prints_every_reading(stub_lib: Path, tmp_path: Path) -> None:
    (tmp_path / "events").write_text("")
    (tmp_path / "state").write_text("0 nvlink 1\n0 fabric 3 0\n1 remap 2 0 1 0\n1 clocks 0x1\n")
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(stub_lib),
        "STUB_NVML_EVENTS": str(tmp_path / "events"),
        "STUB_NVML_STATE": str(tmp_path / "state"),
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-m", "detector.gpu_check", "--seconds", "0.2", "--expect-gpus", "2"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    degradation = json.loads(done.stdout)["degradation"]
    assert (degradation["gpu_count"], degradation["expected_gpus"], degradation["node"]) == (2, 2, [])
    first, second = degradation["gpus"]
    assert first["read"]["nvlink_errors"] == {
        "0": {"replay": 0, "recovery": 0, "CRC flit": 0, "CRC data": 0, "ECC data": 0}
    }
    assert first["read"]["fabric"] == {"state": "completed", "status": 0}
    assert first["read"]["pcie_width"] == 16
    assert first["degradations"] == []
    assert second["read"]["remapped_rows"] == {"correctable": 2, "uncorrectable": 0, "pending": True, "failure": False}
    assert second["read"]["clocks_event_reasons"] == "0x1"
    assert [d["kind"] for d in second["degradations"]] == ["row_remap"]
