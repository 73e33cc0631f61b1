"""What an injected Xid does to the lab's jobs: the effect table, the fault file's life (written
with the kernel line, cleared by a reset, a reboot or `lab down`), `inject-xid --effect`, and, on
real Slurm, the counter job across two nodes failing with its GPU (crash) or stuck (hang)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clients.slurm import SlurmCli
from lab.accounting import conf_value
from lab.cli import lab_app
from lab.faults import (
    EFFECTS,
    FAULTS_ENV,
    Effect,
    GpuFaults,
    RankFaults,
    default_effect,
    expand_hostlist,
    parse_effect,
    xid_effect,
)
from lab.fleet import FleetLab, LabConfig
from lab.kubeapi import node_object
from lab.procs import alive, pids_with_env, wait_for
from lab.slurm import SlurmLab
from models.xid import xid_catalog
from tests.conftest import REPO, KubeApiProcess

COUNTER_JOB = REPO / "lab" / "jobs" / "counter.sbatch"
DDP_JOB = REPO / "lab" / "jobs" / "ddp.sbatch"

# -- the effect table --------------------------------------------------------------------------------


@pytest.mark.parametrize("xid", [79, 48, 74, 95, 94, 13, 31, 43, 109, 140])
def test_a_process_on_the_gpu_dies_with_these(xid: int) -> None:
    assert default_effect(xid) is Effect.CRASH
    assert xid_effect(xid).error  # the CUDA error it prints


@pytest.mark.parametrize("xid", [119, 120, 62])
def test_a_process_on_the_gpu_hangs_with_these(xid: int) -> None:
    assert default_effect(xid) is Effect.HANG
    assert xid_effect(xid).until_repair


@pytest.mark.parametrize("xid", [63, 64, 92, 121, 154, 56])
def test_what_only_warns_leaves_the_job_alone(xid: int) -> None:
    assert default_effect(xid) is Effect.NONE


def test_an_unknown_xid_has_no_effect() -> None:
    assert 4242 not in EFFECTS
    assert default_effect(4242) is Effect.NONE
    assert "not in the lab's effect table" in xid_effect(4242).why


def test_every_xid_of_the_catalog_has_its_effect_and_a_reason() -> None:
    assert set(EFFECTS) == set(xid_catalog())
    assert all(row.why for row in EFFECTS.values())
    assert all(row.error for row in EFFECTS.values() if row.effect is Effect.CRASH)


def test_an_application_error_leaves_the_gpu_healthy_a_hardware_one_does_not() -> None:
    assert not any(xid_effect(xid).until_repair for xid in (13, 31, 43, 94))
    assert all(xid_effect(xid).until_repair for xid in (79, 48, 95, 74, 119))


def test_the_table_is_the_one_docs_lab_md_shows() -> None:
    groups: dict[tuple[Effect, bool], set[int]] = {}
    for xid, row in EFFECTS.items():
        groups.setdefault((row.effect, row.until_repair), set()).add(xid)
    assert groups == {
        (Effect.CRASH, True): {79, 48, 95, 74, 109, 110, 136, 140, 143, 54, *range(144, 151), 155},
        (Effect.CRASH, False): {13, 31, 32, 43, 44, 68, 69, 94},
        (Effect.HANG, True): {62, 119, 120},
        (Effect.NONE, False): {38, 45, 56, 57, 58, 61, 63, 64, 92, 121, 123, 154},
    }


def test_an_effect_is_one_of_three() -> None:
    assert parse_effect("hang") is Effect.HANG
    with pytest.raises(ValueError, match="choose one of crash, hang, none"):
        parse_effect("explode")


# -- the fault file -------------------------------------------------------------------------------


def test_a_fault_is_written_read_and_cleared(tmp_path: Path) -> None:
    faults = GpuFaults(tmp_path / "faults")
    fault = faults.inject("gpu1", 79)
    assert fault is not None and fault.effect is Effect.CRASH and fault.until_repair
    assert faults.get("gpu1") == fault
    assert faults.inject("gpu2", 63) is None and faults.get("gpu2") is None  # only warns: nothing written
    assert faults.inject("gpu2", 79, Effect.NONE) is None
    assert faults.inject("gpu2", 4242, Effect.HANG) is not None  # chosen for an Xid it does not know
    assert set(faults.standing()) == {"gpu1", "gpu2"}
    assert faults.clear("gpu1") and not faults.clear("gpu1")
    assert faults.clear_all() == ["gpu2"] and faults.standing() == {}


def test_a_warning_does_not_mend_a_broken_gpu(tmp_path: Path) -> None:
    faults = GpuFaults(tmp_path)
    faults.inject("gpu1", 79)
    faults.inject("gpu1", 63)  # only warns: nothing written, the lost GPU stays lost
    standing = faults.get("gpu1")
    assert standing is not None and standing.xid == 79
    after = faults.inject("gpu1", 13)  # an application error on a broken GPU: still broken
    assert after is not None and after.until_repair


def test_a_node_name_cannot_leave_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid node name"):
        GpuFaults(tmp_path).inject("../etc", 79)


def test_a_broken_gpu_hits_every_rank_an_application_error_only_those_running(tmp_path: Path) -> None:
    faults = GpuFaults(tmp_path)
    lost = faults.inject("gpu1", 79)
    app = faults.inject("gpu2", 13)
    assert lost is not None and app is not None
    assert lost.hits(started=lost.at - 60) and lost.hits(started=lost.at + 60)  # a job that lands later fails too
    assert app.hits(started=app.at - 60) and not app.hits(started=app.at + 60)


def test_a_rank_meets_its_own_nodes_fault_and_waits_for_a_failed_peer(tmp_path: Path) -> None:
    faults = GpuFaults(tmp_path)
    before = time.time() - 1
    faults.inject("gpu1", 119)  # hang
    own = RankFaults(faults, node="gpu1", nodes=["gpu1", "gpu2"], started=before).due()
    assert own is not None and own[1] is Effect.HANG
    peer = RankFaults(faults, node="gpu2", nodes=["gpu1", "gpu2"], wait_for_peers=True, started=before).due()
    assert peer is not None and peer[0].node == "gpu1" and peer[1] is Effect.HANG
    alone = RankFaults(faults, node="gpu2", nodes=["gpu1", "gpu2"], wait_for_peers=False, started=before)
    assert alone.due() is None  # the DDP job's ranks wait in gloo instead
    assert RankFaults(faults, node="gpu3", nodes=["gpu3"], started=before).due() is None


def test_slurm_host_lists() -> None:
    assert expand_hostlist("gpu[1-2,4],spare1") == ["gpu1", "gpu2", "gpu4", "spare1"]
    assert expand_hostlist("n[08-10]") == ["n08", "n09", "n10"]
    assert expand_hostlist("r[1-2]-g[1-2]") == ["r1-g1", "r1-g2", "r2-g1", "r2-g2"]
    assert expand_hostlist("gpu1") == ["gpu1"] and expand_hostlist("") == []


RANK = """
import os
from pathlib import Path
from lab.faults import GpuFaults, RankFaults
rank = RankFaults.from_env(wait_for_peers=True)
assert rank is not None
Path(os.environ["READY"]).write_text(str(os.getpid()))
step = 0
while True:
    rank.check(step)
    step += 1
"""


def start_rank(tmp_path: Path, node: str) -> subprocess.Popen[str]:
    """A process checking its node's fault in a loop, as a lab rank does at every step."""
    ready = tmp_path / f"ready-{node}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        FAULTS_ENV: str(tmp_path / "faults"),
        "SLURMD_NODENAME": node,
        "SLURM_STEP_NODELIST": "gpu[1-2]",
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": node[-1],
        "READY": str(ready),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for(ready.exists, timeout=30, what=f"the rank on {node} to start")
    return proc


def test_a_crash_is_a_cuda_error_and_exit_status_1(tmp_path: Path) -> None:
    proc = start_rank(tmp_path, "gpu1")
    GpuFaults(tmp_path / "faults").inject("gpu1", 79)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "RuntimeError: CUDA error: unspecified launch failure" in stderr
    [hit] = GpuFaults(tmp_path / "faults").hits(7)
    assert hit["effect"] == "crash" and hit["node"] == "gpu1" and hit["xid"] == 79


def sigterm_ignored(pid: int) -> bool:
    """Whether the process ignores SIGTERM, as the kernel records it."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_a_hang_stops_the_rank_and_its_peer_deaf_to_sigterm(tmp_path: Path) -> None:
    ranks = [start_rank(tmp_path, node) for node in ("gpu1", "gpu2")]
    try:
        faults = GpuFaults(tmp_path / "faults")
        faults.inject("gpu1", 119)
        wait_for(lambda: len(faults.hits(7)) == 2, timeout=30, what="both ranks to meet the fault")
        assert sorted(hit["effect"] for hit in faults.hits(7)) == ["hang", "stalled"]
        for proc in ranks:
            wait_for(lambda proc=proc: sigterm_ignored(proc.pid), timeout=10, what="SIGTERM to be ignored")
            proc.send_signal(signal.SIGTERM)  # an ignored signal is dropped as it is sent
            assert proc.poll() is None
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait(timeout=10)
    assert [proc.returncode for proc in ranks] == [-signal.SIGKILL, -signal.SIGKILL]


# -- clearing: the repair stand-in, lab down ------------------------------------------------------


def repair(home: Path, *args: str, api: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPUFLEET_HOME": str(home), "GPUFLEET_LAB_API": api}
    env.pop(FAULTS_ENV, None)
    return subprocess.run(
        [sys.executable, "-m", "lab.repair", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_a_gpu_reset_clears_the_fault_and_the_gpu_answers_again(tmp_path: Path) -> None:
    faults = GpuFaults.of_home(tmp_path)
    faults.inject("gpu1", 48)
    check = repair(tmp_path, "check", "--node", "gpu1", "--gpu", "0000:3b:00")
    assert check.returncode == 1 and "does not answer" in check.stdout
    done = repair(tmp_path, "reset", "--node", "gpu1", "--gpu", "0000:3b:00")
    assert done.returncode == 0 and "GPU fault is cleared" in done.stdout
    assert faults.get("gpu1") is None
    assert repair(tmp_path, "check", "--node", "gpu1", "--gpu", "0000:3b:00").returncode == 0


def test_a_failed_reset_leaves_the_fault(tmp_path: Path) -> None:
    faults = GpuFaults.of_home(tmp_path)
    faults.inject("gpu1", 48)
    (tmp_path / "repair-fails").touch()
    assert repair(tmp_path, "reset", "--node", "gpu1", "--gpu", "0000:3b:00").returncode == 1
    assert faults.get("gpu1") is not None


def test_an_application_error_does_not_fail_the_gpu_check(tmp_path: Path) -> None:
    GpuFaults.of_home(tmp_path).inject("gpu1", 13)
    assert repair(tmp_path, "check", "--node", "gpu1").returncode == 0


def test_a_reboot_clears_the_fault(tmp_path: Path) -> None:
    api = KubeApiProcess(tmp_path / "kube", {"nodes": [node_object("gpu1", pool="training")]})
    try:
        faults = GpuFaults.of_home(tmp_path)
        faults.inject("gpu1", 119)
        done = repair(tmp_path, "reboot", "--node", "gpu1", api=api.url)
        assert done.returncode == 143, done.stdout + done.stderr  # the pod dies with the node
        assert "GPU fault is cleared" in done.stdout
        assert faults.get("gpu1") is None
    finally:
        api.stop()


def test_lab_down_clears_every_fault(tmp_path: Path) -> None:
    lab = FleetLab(tmp_path, LabConfig(training=["gpu1", "gpu2"], spares=["spare1"]))
    lab.faults.inject("gpu1", 79)
    lab.faults.inject("spare1", 119)
    lab.faults.record_hit({"job": 1, "node": "gpu1", "effect": "crash", "at": time.time()})
    lab.down()  # nothing runs: only the faults go, and what met them
    assert lab.faults.standing() == {} and lab.faults.hits() == []


# -- gpufleet lab inject-xid ----------------------------------------------------------------------


@pytest.fixture
def lab_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A lab home the CLI takes as running (nothing is started)."""
    monkeypatch.setattr(FleetLab, "running", lambda self: True)
    FleetLab(tmp_path, LabConfig(training=["gpu1", "gpu2"], spares=["spare1"]))._save(
        {"config": {"training": ["gpu1", "gpu2"], "spares": ["spare1"]}}
    )
    (tmp_path / "kmsg").mkdir()
    return tmp_path


def inject(home: Path, *args: str) -> tuple[int, str]:
    done = CliRunner().invoke(lab_app, ["inject-xid", *args, "--home", str(home)])
    return done.exit_code, done.output


def test_a_bad_effect_is_refused_and_nothing_written(lab_home: Path) -> None:
    code, output = inject(lab_home, "gpu1", "--xid", "79", "--effect", "explode")
    assert code == 2
    assert "explode" in output and all(name in output for name in ("crash", "hang", "none"))
    assert not (lab_home / "kmsg" / "gpu1.log").exists()
    assert not (lab_home / "faults").exists()


def test_drill_refuses_a_bad_effect_too(lab_home: Path) -> None:
    done = CliRunner().invoke(lab_app, ["drill", "--effect", "explode", "--home", str(lab_home)])
    assert done.exit_code == 2 and "explode" in done.output
    assert not (lab_home / "faults").exists()


def test_inject_xid_writes_the_line_and_the_xids_own_effect(lab_home: Path) -> None:
    code, output = inject(lab_home, "gpu1", "--xid", "79")
    assert code == 0, output
    assert "NVRM: Xid (PCI:0000:3b:00): 79" in (lab_home / "kmsg" / "gpu1.log").read_text()
    assert "processes crash" in output and "until the GPU is reset" in output
    fault = GpuFaults.of_home(lab_home).get("gpu1")
    assert fault is not None and fault.effect is Effect.CRASH


def test_inject_xid_with_a_chosen_effect(lab_home: Path) -> None:
    code, output = inject(lab_home, "gpu2", "--xid", "79", "--effect", "hang")
    assert code == 0 and "chosen with --effect" in output
    fault = GpuFaults.of_home(lab_home).get("gpu2")
    assert fault is not None and fault.effect is Effect.HANG
    code, output = inject(lab_home, "spare1", "--xid", "79", "--effect", "none")
    assert code == 0 and "left alone" in output and GpuFaults.of_home(lab_home).get("spare1") is None


def test_inject_xid_says_an_unknown_xid_has_no_effect(lab_home: Path) -> None:
    code, output = inject(lab_home, "gpu1", "--xid", "4242")
    assert code == 0 and "not in the lab's effect table" in output
    assert GpuFaults.of_home(lab_home).get("gpu1") is None


def test_inject_xid_on_an_unknown_node_writes_nothing(lab_home: Path) -> None:
    code, output = inject(lab_home, "nosuch", "--xid", "79")
    assert code == 1 and "no lab node 'nosuch'" in output
    assert not (lab_home / "faults").exists()


def test_clear_fault(lab_home: Path) -> None:
    GpuFaults.of_home(lab_home).inject("gpu1", 79)
    done = CliRunner().invoke(lab_app, ["clear-fault", "gpu1", "--home", str(lab_home)])
    assert done.exit_code == 0 and "GPU fault cleared" in done.output
    assert GpuFaults.of_home(lab_home).get("gpu1") is None
    again = CliRunner().invoke(lab_app, ["clear-fault", "gpu1", "--home", str(lab_home)])
    assert again.exit_code == 0 and "no GPU fault stands" in again.output


# -- on real Slurm: the counter job across two nodes ----------------------------------------------


def run_on_gpu2_and_gpu3(
    slurm_lab: SlurmLab, tmp_path: Path, script: Path
) -> Iterator[tuple[SlurmCli, int, Path, GpuFaults]]:
    """A lab training job on gpu2 and gpu3, its ranks reading the faults in tmp_path; cancelled after."""
    slurm = SlurmCli(slurm_conf=slurm_lab.conf)
    faults = GpuFaults(tmp_path / "faults")
    log, checkpoint = tmp_path / "job.log", tmp_path / "job.ckpt"
    env = {
        "PYTHON": sys.executable,
        "CHECKPOINT": str(checkpoint),
        "PYTHONPATH": str(REPO),
        FAULTS_ENV: str(faults.folder),
    }
    job_id = slurm_lab.sbatch(script, "-p", "train", "-w", "gpu2,gpu3", "-o", str(log), env=env)
    wait_for(lambda: "checkpoint saved" in log.read_text(), timeout=120, what="a first checkpoint")
    yield slurm, job_id, log, faults
    subprocess.run(["scancel", "--signal=KILL", str(job_id)], env=slurm_lab.env, check=False)
    subprocess.run(["scancel", str(job_id)], env=slurm_lab.env, check=False)
    wait_for(
        lambda: not slurm.jobs_on_node("gpu2") and not slurm.jobs_on_node("gpu3"),
        timeout=60,
        what="gpu2 and gpu3 to be free again",
    )


@pytest.fixture
def counter(slurm_lab: SlurmLab, tmp_path: Path) -> Iterator[tuple[SlurmCli, int, Path, GpuFaults]]:
    """The lab's counter job on gpu2 and gpu3."""
    yield from run_on_gpu2_and_gpu3(slurm_lab, tmp_path, COUNTER_JOB)


@pytest.fixture
def ddp(slurm_lab: SlurmLab, tmp_path: Path) -> Iterator[tuple[SlurmCli, int, Path, GpuFaults]]:
    """The lab's PyTorch DDP job on gpu2 and gpu3."""
    pytest.importorskip("torch")
    yield from run_on_gpu2_and_gpu3(slurm_lab, tmp_path, DDP_JOB)


def rank_pids(job_id: int) -> list[int]:
    """The counter's ranks of this job (not srun, slurmstepd or the batch shell)."""
    return [
        pid
        for pid in pids_with_env("SLURM_JOB_ID", str(job_id))
        if b"lab.jobs.counter" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"srun" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def step_saved(checkpoint: Path) -> int:
    return int(json.loads(checkpoint.read_text())["step"])


@pytest.mark.slurm
def test_with_its_gpu_crashed_the_job_fails_within_seconds(
    counter: tuple[SlurmCli, int, Path, GpuFaults], slurm_lab: SlurmLab
) -> None:
    slurm, job_id, log, faults = counter
    started = time.monotonic()
    faults.inject("gpu2", 79)
    ended = wait_for(
        lambda: (j := slurm.job(job_id)).state not in {"RUNNING", "COMPLETING"} and j, timeout=60, what="the job to end"
    )
    took = time.monotonic() - started
    assert ended.state == "FAILED", ended
    text = log.read_text()
    assert "RuntimeError: CUDA error: unspecified launch failure" in text
    assert re.search(r"srun: error: gpu2: task \d+: Exited with exit code 1", text)
    assert "Terminating StepId" in text  # srun cancelled the step
    assert "SIGTERM: checkpoint saved" not in text  # the other rank was stuck, not checkpointing
    # The other rank waited as in its collective until the step's SIGKILL (KillWait).
    assert took < float(conf_value(slurm_lab.conf.read_text(), "KillWait")) + 15, took
    assert sorted((hit["node"], hit["effect"]) for hit in faults.hits(job_id)) == [
        ("gpu2", "crash"),
        ("gpu3", "stalled"),
    ]
    assert ended.restarts == 0  # Slurm does not requeue a failed job by itself


@pytest.mark.slurm
def test_with_its_gpu_hung_the_job_stays_running_without_progress_and_ignores_sigterm(
    counter: tuple[SlurmCli, int, Path, GpuFaults], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    slurm, job_id, log, faults = counter
    faults.inject("gpu2", 119)
    wait_for(lambda: len(faults.hits(job_id)) == 2, timeout=30, what="both ranks to stop")
    assert sorted((hit["node"], hit["effect"]) for hit in faults.hits(job_id)) == [
        ("gpu2", "hang"),
        ("gpu3", "stalled"),
    ]
    stuck_at = step_saved(tmp_path / "job.ckpt")
    ranks = rank_pids(job_id)
    assert len(ranks) == 2
    for pid in ranks:
        assert sigterm_ignored(pid)
        os.kill(pid, signal.SIGTERM)  # ignored: dropped as it is sent
    assert all(alive(pid) for pid in ranks)
    assert slurm.job(job_id).state == "RUNNING"

    # scancel: SIGTERM to every step, then SIGKILL KillWait later. Only the SIGKILL ends it.
    kill_wait = float(conf_value(slurm_lab.conf.read_text(), "KillWait"))
    cancelled = time.monotonic()
    subprocess.run(["scancel", str(job_id)], env=slurm_lab.env, check=True)
    wait_for(lambda: not any(alive(pid) for pid in ranks), timeout=kill_wait + 30, what="the ranks to be killed")
    assert time.monotonic() - cancelled >= kill_wait - 1
    assert step_saved(tmp_path / "job.ckpt") == stuck_at  # no progress, nothing saved on SIGTERM
    assert "SIGTERM: checkpoint saved" not in log.read_text()


@pytest.mark.slurm
def test_the_ddp_job_fails_with_its_gpu_too(ddp: tuple[SlurmCli, int, Path, GpuFaults], slurm_lab: SlurmLab) -> None:
    slurm, job_id, log, faults = ddp
    started = time.monotonic()
    faults.inject("gpu3", 95)  # uncontained ECC error
    ended = wait_for(
        lambda: (j := slurm.job(job_id)).state not in {"RUNNING", "COMPLETING"} and j, timeout=60, what="the job to end"
    )
    assert ended.state == "FAILED", ended
    assert time.monotonic() - started < float(conf_value(slurm_lab.conf.read_text(), "KillWait")) + 15
    text = log.read_text()
    assert "RuntimeError: CUDA error: uncorrectable ECC error encountered" in text
    assert re.search(r"srun: error: gpu3: task \d+: Exited with exit code 1", text)
    assert [(hit["node"], hit["effect"]) for hit in faults.hits(job_id)] == [("gpu3", "crash")]
