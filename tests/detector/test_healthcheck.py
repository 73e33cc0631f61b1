"""`gpufleet health-check` through the real pynvml against the NVML stand-in (lab/stub_nvml.c).

Each check passes and fails; a failure drops a health_check event, naming the check and what it
read, into the detector's inbox; prolog and epilog exit 1, healthcheck drains the node itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.nvmlstub import StubUnavailable, build_stub
from models.xid import GpuEventKind, XidEvent
from tests.conftest import REPO


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_stub(tmp_path_factory.mktemp("nvml"))
    except StubUnavailable as exc:
        pytest.fail(str(exc))


def health_check(
    tmp_path: Path, *args: str, gpus: str | None = "2", lib: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`gpufleet health-check ARGS` as Slurm runs it (the console script's fast path), on node gpu1."""
    node_file = tmp_path / "gpus"
    if gpus is not None:
        node_file.write_text(gpus + "\n")
    environment = {
        **{k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "SLURMD_NODENAME", "GPUFLEET_NODE_GPUS")},
        "PYTHONPATH": str(REPO),
        "LD_LIBRARY_PATH": str(lib) if lib is not None else str(tmp_path / "no-driver"),
        "STUB_NVML_NODE_FILE": str(node_file),
        "SLURMD_NODENAME": "gpu1",
        "GPUFLEET_INBOX": str(tmp_path / "inbox"),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "workers.command", "health-check", *args],
        env=environment,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def dropped(tmp_path: Path) -> list[XidEvent]:
    inbox = tmp_path / "inbox"
    return (
        [XidEvent.model_validate_json(p.read_bytes()) for p in sorted(inbox.glob("*.json"))] if inbox.exists() else []
    )


def test_a_healthy_node_passes_and_drops_nothing(stub_lib: Path, tmp_path: Path) -> None:
    done = health_check(tmp_path, "--mode", "prolog", "--gpus", "2", lib=stub_lib)
    assert done.returncode == 0, done.stderr
    assert "ok (2 GPU(s) answer" in done.stdout and not done.stderr
    assert dropped(tmp_path) == []


def test_a_missing_gpu_fails_the_prolog_and_names_the_count(stub_lib: Path, tmp_path: Path) -> None:
    done = health_check(tmp_path, "--mode", "prolog", "--gpus", "2", gpus="1", lib=stub_lib)
    assert done.returncode == 1
    assert "FAILED: gpu_count: NVML sees 1 GPU(s), the node should have 2" in done.stderr
    [event] = dropped(tmp_path)
    assert (event.node, event.kind, event.xid, event.source) == (
        "gpu1",
        GpuEventKind.HEALTH_CHECK,
        None,
        "health-check",
    )
    assert event.message == "prolog: gpu_count: NVML sees 1 GPU(s), the node should have 2"


def test_a_lost_gpu_fails_the_epilog_and_names_the_gpu(stub_lib: Path, tmp_path: Path) -> None:
    done = health_check(tmp_path, "--mode", "epilog", gpus="2 1", lib=stub_lib, env={"GPUFLEET_NODE_GPUS": "2"})
    assert done.returncode == 1
    [event] = dropped(tmp_path)
    assert event.message.startswith("epilog: gpu_lost: GPU 1 (00000000:3C:00.0) is lost")
    assert event.pci == "00000000:3C:00.0"


def test_a_memory_repair_waiting_for_a_reset_or_failed_fails_the_prolog(stub_lib: Path, tmp_path: Path) -> None:
    """Row remapping (Ampere and later) pending or failed, page retirement (before) pending: the
    GPU runs on with the bad memory until a reset. Corrected rows alone, done, pass."""
    cases = {
        "1 remap 0 1 1 0\n": ("row_remap", "GPU 1 (00000000:3C:00.0): a row remapping waits for a GPU reset"),
        "0 remap 0 1 0 1\n": ("row_remap", "GPU 0 (00000000:3B:00.0): a row remapping failed (replace the GPU)"),
        "0 remap unsupported\n0 retired 1 0 2\n": (
            "retired_pages",
            "GPU 0 (00000000:3B:00.0): a page retirement waits for a GPU reset",
        ),
    }
    for n, (state, (check, said)) in enumerate(cases.items()):
        folder = tmp_path / str(n)
        folder.mkdir()
        (folder / "state").write_text(state)
        env = {"STUB_NVML_STATE": str(folder / "state")}
        done = health_check(folder, "--mode", "prolog", "--gpus", "2", lib=stub_lib, env=env)
        assert done.returncode == 1, state
        [event] = dropped(folder)
        assert event.message == f"prolog: {check}: {said}"
        assert event.pci == said.split("(")[1].split(")")[0]
    healthy = tmp_path / "healthy"
    healthy.mkdir()
    (healthy / "state").write_text("0 remap 12 0 0 0\n1 remap unsupported\n")
    env = {"STUB_NVML_STATE": str(healthy / "state")}
    done = health_check(healthy, "--mode", "prolog", "--gpus", "2", lib=stub_lib, env=env)
    assert done.returncode == 0, done.stderr
    assert dropped(healthy) == []


def test_without_nvml_a_gpu_node_fails_and_a_node_without_gpus_passes(tmp_path: Path) -> None:
    done = health_check(tmp_path, "--gpus", "2")
    assert done.returncode == 1
    assert "NVML does not answer" in done.stderr and "no NVIDIA driver" in done.stderr
    assert [e.message.split(":")[1].strip() for e in dropped(tmp_path)] == ["nvml"]
    for args in (["--gpus", "0"], []):  # no GPUs configured; a count nobody gave: said, not a failure
        done = health_check(tmp_path / "again", *args, gpus=None)
        assert done.returncode == 0, done.stderr
    assert "not a failure" in done.stdout
    assert not (tmp_path / "again" / "inbox").exists()


def recording_scontrol(tmp_path: Path, state: str) -> tuple[dict[str, str], Path]:
    """A scontrol on PATH that shows the node in ``state`` and records every call's arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$2" = show ]; then\n'
        f'  echo "NodeName=gpu1 Arch=x86_64 State={state} Partitions=gpu Reason=PSU swap [ops@2026-12-06T09:00:00]"\n'
        "fi\n"
    )
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, calls


def test_healthcheck_mode_drains_the_node_itself_and_exits_0(stub_lib: Path, tmp_path: Path) -> None:
    """Slurm ignores a HealthCheckProgram's exit status: the program drains (a recording scontrol here)."""
    path, calls = recording_scontrol(tmp_path, "IDLE")
    done = health_check(tmp_path, "--mode", "healthcheck", "--gpus", "2", gpus="1", lib=stub_lib, env=path)
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines() == [
        "--oneliner show node gpu1",
        "update NodeName=gpu1 State=DRAIN Reason=gpufleet: health_check gpu_count",
    ]
    assert [e.message for e in dropped(tmp_path)] == [
        "healthcheck: gpu_count: NVML sees 1 GPU(s), the node should have 2"
    ]


def test_healthcheck_mode_keeps_the_reason_of_a_node_out_of_service_already(stub_lib: Path, tmp_path: Path) -> None:
    """A person's drain stays theirs: written over with gpufleet's reason, an incident would take the
    node as its own and resume it. HealthCheckProgram runs on drained nodes too (HealthCheckNodeState=ANY)."""
    for state in ("IDLE+DRAIN", "MIXED+DRAIN", "DOWN", "DOWN+DRAIN+NOT_RESPONDING"):
        folder = tmp_path / state.replace("+", "-").lower()
        folder.mkdir()
        path, calls = recording_scontrol(folder, state)
        done = health_check(folder, "--mode", "healthcheck", "--gpus", "2", gpus="1", lib=stub_lib, env=path)
        assert done.returncode == 0, done.stderr
        assert calls.read_text().splitlines() == ["--oneliner show node gpu1"], state
        assert f"gpu1 is {state} already (PSU swap [ops@2026-12-06T09:00:00]): its reason is kept" in done.stderr
        assert [e.kind for e in dropped(folder)] == [GpuEventKind.HEALTH_CHECK]  # reported all the same


def test_bad_input_is_refused(tmp_path: Path) -> None:
    assert health_check(tmp_path, "--node", "gpu1;reboot").returncode == 2
    assert health_check(tmp_path, "--gpus", "-1").returncode == 2
    assert health_check(tmp_path, "--mode", "sometimes").returncode == 2
    assert "GPUFLEET_NODE_GPUS='two'" in health_check(tmp_path, env={"GPUFLEET_NODE_GPUS": "two"}).stderr


def test_a_further_check_runs_in_the_same_nvml_session(stub_lib: Path, tmp_path: Path) -> None:
    """The hook for more checks (EXTRA_CHECKS): called with pynvml and every GPU's handle."""
    program = (
        "import sys\n"
        "from detector import healthcheck\n"
        "def clocks(nvml, handles):\n"
        "    return [healthcheck.Failure('clocks', f'{len(handles)} GPU(s) throttled')]\n"
        "healthcheck.EXTRA_CHECKS.append(clocks)\n"
        "sys.exit(healthcheck.main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "LD_LIBRARY_PATH": str(stub_lib)}
    env |= {"GPUFLEET_INBOX": str(tmp_path / "inbox"), "SLURMD_NODENAME": "gpu1"}
    env.pop("NODE_NAME", None)
    done = subprocess.run(
        [sys.executable, "-c", program, "--gpus", "2"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 1, done.stderr
    assert [e.message for e in dropped(tmp_path)] == ["prolog: clocks: 2 GPU(s) throttled"]


def test_the_fast_path_imports_neither_temporal_nor_kubernetes_nor_pydantic(stub_lib: Path, tmp_path: Path) -> None:
    program = (
        "import sys, runpy\n"
        "sys.argv = ['gpufleet', 'health-check', '--gpus', '2']\n"
        "try:\n"
        "    runpy.run_module('workers.command', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('temporalio', 'kubernetes', 'pydantic', 'httpx')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "LD_LIBRARY_PATH": str(stub_lib), "SLURMD_NODENAME": "gpu1"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=30)
    assert json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')) == [], done.stdout + done.stderr
