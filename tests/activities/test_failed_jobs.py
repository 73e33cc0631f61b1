"""On real Slurm: the jobs a GPU failure touched, found and requeued by the incident's activities.

The lab's counter job runs across two nodes; its GPU fault (lab/faults.py) ends it as a real
Xid 79 does (FAILED, its step cancelled by srun) or hangs it deaf to SIGTERM. The incident lists
what the failure touched and requeues each job once: the crashed one at once, the hung one after
its signal; a job that COMPLETED, or that its owner cancelled, never; one that cannot be requeued
(``--no-requeue``) with a reason its owner can act on.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.slurm import SlurmActivities
from clients.slurm import SlurmCli, parse_sacct
from lab.faults import FAULTS_ENV, GpuFaults
from lab.procs import wait_for
from lab.slurm import SlurmLab
from models.incident import JobInfo, RequeueOutcome
from models.requests import FailureJobsRequest, RequeueJobRequest, ResumeCheckRequest
from tests.conftest import REPO

pytestmark = pytest.mark.slurm
COUNTER_JOB = REPO / "lab" / "jobs" / "counter.sbatch"


def scontrol(lab: SlurmLab, *args: str) -> None:
    subprocess.run(["scontrol", *args], env=lab.env, capture_output=True, check=True)


@pytest.fixture
def cluster(slurm_lab: SlurmLab) -> Iterator[tuple[SlurmCli, SlurmActivities]]:
    client = SlurmCli(slurm_conf=slurm_lab.conf)
    yield client, SlurmActivities(client, poll_seconds=0.2)
    subprocess.run(["scancel", "--user", "root"], env=slurm_lab.env, check=False)
    wait_for(lambda: not any(client.jobs_on_node(n) for n in slurm_lab.spec.nodes), timeout=60, what="idle nodes")
    for node in slurm_lab.all_nodes:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=slurm_lab.env, check=False)


def run(method: Any, request: Any) -> Any:
    return ActivityEnvironment().run(method, request)


def counter_on_gpu2(lab: SlurmLab, tmp_path: Path, *args: str) -> tuple[int, GpuFaults, Path]:
    """The counter job on gpu2 and gpu3 (gpu1 drained while it is placed, so that a requeue may
    take gpu1 instead of a drained gpu2), after its first checkpoint."""
    faults = GpuFaults(tmp_path / "faults")
    log = tmp_path / "job.log"
    env = {"PYTHON": sys.executable, "CHECKPOINT": str(tmp_path / "ckpt"), "PYTHONPATH": str(REPO)}
    scontrol(lab, "update", "NodeName=gpu1", "State=DRAIN", "Reason=placing a test job")
    try:
        job_id = lab.sbatch(
            COUNTER_JOB, "-p", "train", "-N", "2", "-o", str(log), *args, env={**env, FAULTS_ENV: str(faults.folder)}
        )
        wait_for(
            lambda: "checkpoint saved" in log.read_text() if log.exists() else False, timeout=120, what="a checkpoint"
        )
    finally:
        scontrol(lab, "update", "NodeName=gpu1", "State=RESUME")
    return job_id, faults, log


def ended(client: SlurmCli, job_id: int) -> JobInfo:
    return wait_for(
        lambda: (job := client.job(job_id)).state not in {"RUNNING", "COMPLETING", "CONFIGURING"} and job,
        timeout=60,
        what=f"job {job_id} to end",
    )


def requeue(acts: SlurmActivities, job: JobInfo, **options: Any) -> Any:
    request = RequeueJobRequest(
        job_id=job.job_id, restarts_before=job.restarts, signalled=False, incident_id="lab-gpu2-1", **options
    )
    return run(acts.requeue_job, request)


def test_a_job_its_gpu_crashed_is_found_and_requeued_once_and_runs_again(
    cluster: tuple[SlurmCli, SlurmActivities], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    client, acts = cluster
    job_id, faults, _ = counter_on_gpu2(slurm_lab, tmp_path)
    since = datetime.now(UTC) - timedelta(seconds=120)
    faults.inject("gpu2", 79)
    crashed = ended(client, job_id)
    assert crashed.state == "FAILED" and crashed.end_time is not None
    scontrol(slurm_lab, "update", "NodeName=gpu2", "State=DRAIN", "Reason=gpufleet: xid 79 REPLACE_NODE incident t")

    touched = run(acts.jobs_hit, FailureJobsRequest(node="gpu2", since=since))
    assert [(job.job_id, job.state) for job in touched] == [(job_id, "FAILED")]
    # Only what ended inside the window: the same failure seen from long after is not ours.
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert run(acts.jobs_hit, FailureJobsRequest(node="gpu2", since=later)) == []

    first = requeue(acts, touched[0], ended_by_failure=True)
    again = requeue(acts, touched[0], ended_by_failure=True)  # a retry after a lost answer
    assert first.outcome is RequeueOutcome.REQUEUED and again.outcome is RequeueOutcome.REQUEUED
    back = wait_for(
        lambda: (job := client.job(job_id)).state == "RUNNING" and job, timeout=90, what="the job to run again"
    )
    assert back.restarts == 1  # requeued once, however often asked
    assert "gpu2" not in client.hostnames(back.nodes)


def test_a_hung_job_is_on_the_node_and_its_requeue_after_the_signal_runs_it_again(
    cluster: tuple[SlurmCli, SlurmActivities], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    client, acts = cluster
    job_id, faults, _ = counter_on_gpu2(slurm_lab, tmp_path)
    faults.inject("gpu2", 119)  # GSP timeout: the rank hangs
    wait_for(lambda: len(faults.hits(job_id)) == 2, timeout=30, what="both ranks to stop")
    scontrol(slurm_lab, "update", "NodeName=gpu2", "State=DRAIN", "Reason=gpufleet: xid 119 RESET_GPU incident t")
    [hung] = run(acts.jobs_hit, FailureJobsRequest(node="gpu2", since=datetime.now(UTC) - timedelta(seconds=120)))
    assert (hung.job_id, hung.state) == (job_id, "RUNNING")
    # As the incident does once its grace is over: it was signalled (and ignored it).
    outcome = run(
        acts.requeue_job,
        RequeueJobRequest(job_id=job_id, restarts_before=hung.restarts, signalled=True, incident_id="lab-gpu2-2"),
    )
    assert outcome.outcome is RequeueOutcome.REQUEUED
    back = wait_for(
        lambda: (job := client.job(job_id)).state == "RUNNING" and job.restarts == 1 and job,
        timeout=120,
        what="the hung job to run again (after Slurm's SIGKILL)",
    )
    assert "gpu2" not in client.hostnames(back.nodes)


def test_a_requeued_job_that_ran_again_and_completed_before_the_watch_looked_counts_as_resumed(
    cluster: tuple[SlurmCli, SlurmActivities], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    """A short job: its run after the requeue starts and completes between two looks of the
    resume watch. It ran again: the incident counts it resumed, not lost."""
    client, acts = cluster
    script = tmp_path / "short-after-requeue.sh"
    # The first run waits (as a job does on a failing node); the run after the requeue is short.
    script.write_text('#!/bin/bash\nif [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then sleep 600; fi\nsleep 1\n')
    job_id = slurm_lab.sbatch(script, "--requeue", "-w", "gpu2", "-o", "/dev/null")
    running = wait_for(
        lambda: (job := client.job(job_id)).state == "RUNNING" and job, timeout=60, what="the job to start"
    )
    outcome = run(
        acts.requeue_job,
        RequeueJobRequest(job_id=job_id, restarts_before=running.restarts, signalled=True, incident_id="lab-gpu2-3"),
    )
    assert outcome.outcome is RequeueOutcome.REQUEUED
    done = wait_for(
        lambda: (job := client.job(job_id)).state == "COMPLETED" and job,
        timeout=120,
        what="the job to run again and complete",
    )
    assert done.restarts == running.restarts + 1

    check = run(acts.jobs_resumed, ResumeCheckRequest(job_ids=[job_id], restarts_before={job_id: running.restarts}))
    assert [(job.job_id, job.state) for job in check.resumed] == [(job_id, "COMPLETED")]
    assert check.waiting == []
    # Without the requeue it would not count: the same COMPLETED job, compared with its own restarts.
    unchanged = run(acts.jobs_resumed, ResumeCheckRequest(job_ids=[job_id], restarts_before={job_id: done.restarts}))
    assert [job.job_id for job in unchanged.waiting] == [job_id]


def test_completed_and_owner_cancelled_jobs_are_never_requeued_and_no_requeue_is_said_so(
    cluster: tuple[SlurmCli, SlurmActivities], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    client, acts = cluster
    since = datetime.now(UTC) - timedelta(seconds=120)
    script = tmp_path / "short.sh"
    script.write_text("#!/bin/bash\nsleep 1\n")
    done = slurm_lab.sbatch(script, "--requeue", "-w", "gpu2", "-o", "/dev/null")
    sleeper = tmp_path / "long.sh"
    sleeper.write_text("#!/bin/bash\nsleep 600\n")
    cancelled = slurm_lab.sbatch(sleeper, "--requeue", "-w", "gpu2", "-o", "/dev/null")
    wait_for(lambda: client.job(cancelled).state == "RUNNING", timeout=60, what="the job to start")
    subprocess.run(["scancel", str(cancelled)], env=slurm_lab.env, check=True)  # its owner's word
    failing = tmp_path / "fails.sh"
    failing.write_text("#!/bin/bash\nexit 3\n")
    unrequeueable = slurm_lab.sbatch(failing, "--no-requeue", "-w", "gpu2", "-o", "/dev/null")
    for job_id in (done, cancelled, unrequeueable):
        ended(client, job_id)

    touched = {job.job_id: job for job in run(acts.jobs_hit, FailureJobsRequest(node="gpu2", since=since))}
    assert {job_id: touched[job_id].state for job_id in (done, cancelled, unrequeueable)} == {
        done: "COMPLETED",
        cancelled: "CANCELLED",
        unrequeueable: "FAILED",
    }
    assert requeue(acts, touched[done], ended_by_failure=True).outcome is RequeueOutcome.SKIPPED
    assert requeue(acts, touched[cancelled], ended_by_failure=True).outcome is RequeueOutcome.SKIPPED
    refused = requeue(acts, touched[unrequeueable], ended_by_failure=True)
    assert refused.outcome is RequeueOutcome.FAILED and "--no-requeue: resubmit it" in refused.why
    jobs = client.jobs_by_id([done, cancelled, unrequeueable])
    assert all(job.restarts == 0 for job in jobs.values())  # none was requeued
    # No accounting database in this cluster: only what slurmctld keeps (MinJobAge) is found.
    assert client.accounted_jobs("gpu2", since) is None


def test_sacct_lines_are_read_with_who_cancelled_and_unknown_ends() -> None:
    out = (
        "41|train|alice|FAILED|2026-12-05T03:00:01|gpu[1-2]\n"
        "42|eval|bob|CANCELLED by 1000|2026-12-05T03:00:02|gpu2\n"
        "43|x|carol|NODE_FAIL|Unknown|None assigned\n"
        "44.batch|batch||FAILED|2026-12-05T03:00:01|gpu1\n"
    )
    jobs = parse_sacct(out)
    assert [(job.job_id, job.state, job.nodes, job.in_controller) for job in jobs] == [
        (41, "FAILED", "gpu[1-2]", False),
        (42, "CANCELLED", "gpu2", False),
        (43, "NODE_FAIL", "", False),
    ]
    assert jobs[0].end_time is not None and jobs[2].end_time is None
