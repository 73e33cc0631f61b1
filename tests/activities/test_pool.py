"""The pool's look (the observe activity) over real Slurm and the emulated Kubernetes API: the
order nodes leave each side in (training: the one whose jobs lose least; inference: the last to
come, first), and training's demand from the pending jobs."""

from __future__ import annotations

import dataclasses
import subprocess
import time
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.pool import PoolActivities
from clients.poolmoves import PoolMover
from lab.procs import wait_for
from lab.slurm import SlurmLab
from models.poolops import MoveRequest, MoveResult, PoolRequest, PoolSettings, PoolView, Stopped
from tests.clients.test_spares import Pool, pool  # noqa: F401 - the fixture, reused

pytestmark = pytest.mark.slurm


def job_on(slurm_lab: SlurmLab, tmp_path: Path, node: str, *, checkpointed: int | None = None) -> int:
    script = tmp_path / f"job-{node}.sh"
    script.write_text("#!/bin/sh\nsleep 300\n")
    job = slurm_lab.sbatch(script, "-p", "train", "-w", node, "--requeue", "-o", "/dev/null")
    if checkpointed is not None:
        # What the training script runs after each save.
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", f"Comment=gpufleet:checkpoint:{checkpointed}"],
            env=slurm_lab.env,
            check=True,
        )
    return job


def test_the_look_orders_nodes_by_what_a_move_costs_and_counts_training_demand(
    pool: Pool,  # noqa: F811
    slurm_lab: SlurmLab,
    tmp_path: Path,
) -> None:
    spares, kube, slurm = pool
    activities = PoolActivities(kube, slurm, PoolMover(kube, slurm, spares), None)
    settings = PoolSettings(name="shared", cluster="lab", partition="train")
    now = int(time.time())
    jobs = [
        job_on(slurm_lab, tmp_path, "gpu2", checkpointed=now - 30),  # saved half a minute ago
        job_on(slurm_lab, tmp_path, "gpu3", checkpointed=now - 3600),  # an hour of work at risk
    ]
    # Two spares made inference nodes, one after the other: the later one is the first to go back.
    for node, since in (("spare1", "2026-12-01T10:00:00Z"), ("spare2", "2026-12-01T11:00:00Z")):
        kube.update_metadata(
            node, labels={"gpufleet.io/pool": "inference"}, annotations={"gpufleet.io/pool-since": since}
        )
    try:
        wait_for(lambda: all(slurm.job(j).state == "RUNNING" for j in jobs), timeout=30, what="both jobs running")
        # Every node busy: one more job waits for two of them.
        waiting = tmp_path / "waiting.sh"
        waiting.write_text("#!/bin/sh\nsleep 1\n")
        jobs.append(slurm_lab.sbatch(waiting, "-p", "train", "-N", "3", "--exclusive", "-o", "/dev/null"))

        def counted() -> PoolView | None:
            view: PoolView = ActivityEnvironment().run(activities.observe, PoolRequest(settings=settings))
            return view if view.demand.training_jobs else None

        view = wait_for(counted, timeout=30, what="the waiting job counted")
        assert view.training == ["gpu1", "gpu2", "gpu3"]  # idle, then the recent checkpoint, then the old one
        assert view.inference == ["spare2", "spare1"]  # last in, first out
        assert (view.demand.training, view.demand.training_jobs, view.demand.training_gpus) == (3.0, 1, 0)
        assert view.demand.inference is None and "no query" in view.demand.error  # nothing measured: no move
    finally:
        for job in jobs:
            subprocess.run(["scancel", str(job)], env=slurm_lab.env, check=False)


def test_a_retry_that_finds_the_node_taken_hands_it_over(pool: Pool) -> None:  # noqa: F811
    spares, kube, slurm = pool
    activities = PoolActivities(kube, slurm, PoolMover(kube, slurm, spares), None)
    settings = PoolSettings(name="shared", cluster="lab", partition="train")
    kube.update_metadata("gpu1", annotations={"gpufleet.io/lease": "remediate-lab-gpu1"})
    request = MoveRequest(settings=settings, node="gpu1", to="inference", workflow_id="pool-shared")
    first = ActivityEnvironment()
    result: MoveResult = first.run(activities.move, request)
    assert result.stopped is Stopped.HELD  # a first attempt changed nothing: simply skipped
    retry = ActivityEnvironment()
    retry.info = dataclasses.replace(retry.info, attempt=2)
    result = retry.run(activities.move, request)
    # An earlier attempt may have changed the node before its worker died: settled later, not forgotten.
    assert result.stopped is Stopped.HANDED_OVER and "held by remediate-lab-gpu1" in result.detail
    assert "gpu1" in slurm.partition_nodes("train") and not slurm.node("gpu1").drained
