"""SlurmCli against real slurmctld and slurmd daemons: drain ownership, signals, requeue, partitions."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.errors import InvalidInput, NotFound, NotOwned, Unavailable
from clients.slurm import SlurmCli, parse_node_record
from lab.procs import free_port, wait_for
from lab.slurm import SlurmLab

pytestmark = pytest.mark.slurm


@pytest.fixture
def slurm(slurm_lab: SlurmLab) -> Iterator[SlurmCli]:
    client = SlurmCli(slurm_conf=slurm_lab.conf)
    yield client
    subprocess.run(["scancel", "--user", "root"], env=slurm_lab.env, check=False)
    for node in slurm_lab.all_nodes:
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
            env=slurm_lab.env,
            capture_output=True,
            check=False,
        )
    subprocess.run(
        ["scontrol", "update", "PartitionName=train", f"Nodes={','.join(slurm_lab.spec.nodes)}"],
        env=slurm_lab.env,
        check=True,
    )


def submit(lab: SlurmLab, tmp_path: Path, script: str, *args: str) -> int:
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n" + script)
    return lab.sbatch(path, "--requeue", "-o", str(tmp_path / "job-%j.out"), "--open-mode=append", *args)


def test_drain_with_our_reason_is_idempotent(slurm: SlurmCli) -> None:
    reason = "gpufleet: xid 79 incident lab-gpu3-1"
    first = slurm.drain("gpu3", reason=reason)
    again = slurm.drain("gpu3", reason=reason)
    assert first.drained and again.drained
    assert slurm.node("gpu3").reason == reason
    slurm.resume("gpu3")
    assert not slurm.node("gpu3").drained


def test_node_drained_by_someone_else_keeps_their_reason(slurm: SlurmCli, slurm_lab: SlurmLab) -> None:
    slurm_lab.scontrol("update", "NodeName=gpu3", "State=DRAIN", "Reason=disk swap by ops")
    after = slurm.drain("gpu3", reason="gpufleet: xid 79 incident x")
    assert after.reason == "disk swap by ops"
    with pytest.raises(NotOwned):
        slurm.resume("gpu3")
    with pytest.raises(NotOwned):
        slurm.down("gpu3", reason="gpufleet: retired")
    node = slurm.node("gpu3")
    assert node.drained and node.reason == "disk swap by ops"


def test_unknown_node_is_not_found(slurm: SlurmCli) -> None:
    with pytest.raises(NotFound, match="no node named 'nosuch'"):
        slurm.node("nosuch")


def test_unsafe_name_is_rejected_before_any_command_runs(tmp_path: Path) -> None:
    # An empty bin dir: running any Slurm command here would fail as "not installed".
    client = SlurmCli(bin_dir=tmp_path)
    with pytest.raises(InvalidInput, match="invalid node name"):
        client.drain("gpu1; scontrol shutdown", reason="gpufleet: x")
    with pytest.raises(InvalidInput):
        client.add_to_partition("train", "$(reboot)")


def test_unreachable_controller_is_unavailable(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    conf = slurm_lab.conf.read_text()
    port = next(line for line in conf.splitlines() if line.startswith("SlurmctldPort="))
    dead = tmp_path / "slurm.conf"
    dead.write_text(conf.replace(port, f"SlurmctldPort={free_port()}"))
    with pytest.raises(Unavailable):
        SlurmCli(slurm_conf=dead, timeout_seconds=20).node("gpu1")


def test_requeue_of_a_running_job(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    job_id = submit(slurm_lab, tmp_path, "echo run $SLURM_RESTART_COUNT\nsleep 300\n", "-w", "gpu1")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
    assert [job.job_id for job in slurm.jobs_on_node("gpu1")] == [job_id]
    slurm.requeue(job_id)
    slurm.requeue(job_id)  # already pending again: a no-op
    job = wait_for(
        lambda: (j := slurm.job(job_id)).state == "RUNNING" and j.restarts == 1 and j, timeout=60, what="the restart"
    )
    assert job.restarts == 1
    assert "run 1" in wait_for(
        lambda: "run 1" in (out := (tmp_path / f"job-{job_id}.out").read_text()) and out, timeout=30, what="the log"
    )


def test_sigterm_reaches_the_batch_script(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    marker, ready = tmp_path / "got-term", tmp_path / "trap-set"
    job_id = submit(
        slurm_lab,
        tmp_path,
        f"trap 'touch {marker}; exit 0' TERM\ntouch {ready}\nwhile true; do sleep 0.1; done\n",
        "-w",
        "gpu2",
    )
    wait_for(ready.exists, timeout=30, what="the trap to be set")
    slurm.signal_job(job_id)
    wait_for(marker.exists, timeout=30, what="SIGTERM to arrive")
    assert wait_for(lambda: slurm.job(job_id).state in {"COMPLETED", "CANCELLED"}, timeout=30, what="the job to end")
    assert slurm.jobs_on_node("gpu2") == []


def test_job_submitted_without_requeue_cannot_be_requeued(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    path = tmp_path / "norequeue.sh"
    path.write_text("#!/bin/bash\nsleep 300\n")
    job_id = slurm_lab.sbatch(path, "--no-requeue", "-o", "/dev/null", "-w", "gpu3")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
    with pytest.raises(InvalidInput, match="--no-requeue"):
        slurm.requeue(job_id)


def test_partition_membership(slurm: SlurmCli) -> None:
    slurm.add_to_partition("train", "spare1")
    slurm.add_to_partition("train", "spare1")
    assert slurm.partition_nodes("train") == ["gpu1", "gpu2", "gpu3", "spare1"]
    slurm.remove_from_partition("train", "gpu1")
    assert "gpu1" not in slurm.partition_nodes("train")
    assert slurm.node("gpu1").partitions == []


def test_parse_node_record_with_reason_and_flags() -> None:
    line = (
        "NodeName=gpu1 Arch=x86_64 OS=Linux 6.1 #1 SMP State=DOWN*+DRAIN ThreadsPerCore=1 "
        "Partitions=train,debug  BootTime=None Reason=gpufleet: xid 79 incident a=b [root@2026-12-02T12:39:18]"
    )
    node = parse_node_record(line)
    assert node.state == "down"
    assert node.flags == ["DRAIN", "NOT_RESPONDING"]
    assert node.partitions == ["train", "debug"]
    assert node.reason == "gpufleet: xid 79 incident a=b"
