"""The NVML source through the real pynvml against a stub libnvidia-ml.so.1 compiled here with gcc.

The stub emits what the test writes: an Xid event on one GPU, events of another type, an
Xid event with eventData 0, NVML's unknown Xid 999, and a GPU falling off the bus.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.nvmlstub import StubUnavailable, build_stub
from tests.conftest import REPO, gpufleet_cli


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_stub(tmp_path_factory.mktemp("nvml"))
    except StubUnavailable as exc:
        pytest.fail(str(exc))


def detect(lib: Path, tmp_path: Path, events: str, *args: str) -> tuple[list[dict[str, object]], str]:
    events_file = tmp_path / "events"
    events_file.write_text(events)
    env = {
        "LD_LIBRARY_PATH": str(lib),
        "STUB_NVML_EVENTS": str(events_file),
        "STUB_NVML_LOG": str(tmp_path / "stub.log"),
    }
    done = gpufleet_cli("detect", "--nvml", "--node", "gpu1", "--dry-run", "--once", *args, env=env)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()], (tmp_path / "stub.log").read_text()


def test_xid_events_come_with_the_right_device(stub_lib: Path, tmp_path: Path) -> None:
    events, registered = detect(stub_lib, tmp_path, "event 1 8 48\nevent 0 8 13\n")
    assert registered.splitlines() == ["registered 0 8", "registered 1 8"]
    assert [(e["xid"], e["pci"], e["gpu_uuid"], e["source"]) for e in events] == [
        (48, "0000:3c:00", "GPU-57ab0000-0000-0000-0000-000000000001", "nvml"),
        (13, "0000:3b:00", "GPU-57ab0000-0000-0000-0000-000000000000", "nvml"),
    ]
    assert [e["action"] for e in events] == ["RESET_GPU", "OBSERVE"]


def test_other_event_types_and_event_data_zero_are_ignored(stub_lib: Path, tmp_path: Path) -> None:
    # type 1 is a single-bit ECC event whose eventData is not an Xid; type 8 with data 0 is no Xid.
    events, _ = detect(stub_lib, tmp_path, "event 0 1 79\nevent 1 8 0\nevent 0 2 48\n")
    assert events == []


def test_unknown_xid_and_a_lost_gpu(stub_lib: Path, tmp_path: Path) -> None:
    events, _ = detect(stub_lib, tmp_path, "event 0 8 999\nlost 1\n")
    assert [(e["xid"], e["pci"]) for e in events] == [(999, "0000:3b:00"), (79, "0000:3c:00")]
    assert "unknown" in str(events[0]["message"])
    assert events[1]["action"] == "REPLACE_NODE"


def test_without_nvml_the_detector_says_so_and_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n")
    done = gpufleet_cli(
        "detect",
        "--nvml",
        "--kmsg",
        str(log),
        "--node",
        "gpu1",
        "--dry-run",
        "--once",
        env={"LD_LIBRARY_PATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("NVML unavailable") == 1
    assert json.loads(done.stdout)["xid"] == 79


def test_gpu_check_lists_gpus_and_registration(stub_lib: Path, tmp_path: Path) -> None:
    events_file = tmp_path / "events"
    events_file.write_text("")
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(stub_lib),
        "STUB_NVML_EVENTS": str(events_file),
        "STUB_NVML_GPUS": "3",
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-m", "detector.gpu_check", "--seconds", "1"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert [g["pci"] for g in result["gpus"]] == ["0000:3b:00", "0000:3c:00", "0000:3d:00"]
    assert result["registered_for_xid_events"] == [0, 1, 2]
    assert result["events"] == []
