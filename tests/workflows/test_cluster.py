"""Cluster creation on the time-skipping server, its steps stood in for: the order of the steps;
a failure at each step undoes exactly what was done, in reverse, and nothing else; keep-on-failure
waits, then resume finishes from the failed step, or roll back undoes; an undo that fails is said
and the others still run."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.cluster import load_spec
from models.clusterops import (
    STEPS,
    UNDOABLE,
    ClusterCreateInput,
    ClusterDeleteInput,
    ClusterOutcome,
    ClusterRequest,
    ClusterStatus,
    ClusterStep,
    DeleteStep,
    DeletionStatus,
    JobsResult,
    StepResult,
)
from tests.models.test_cluster_spec import EXAMPLE
from workflows.cluster import DO, UNDO, ClusterCreationWorkflow, ClusterDeletionWorkflow

PLACEMENT = {"train": ["free1", "free2"], "debug": ["free3"], "(spares)": ["free4"]}


@dataclass
class Backend:
    """Records each activity called, by its step; fails where told."""

    fail: dict[str, int] = field(default_factory=dict)  # activity name: failures before it passes
    calls: list[str] = field(default_factory=list)
    task_queue: str = field(default_factory=lambda: f"clusters-{uuid.uuid4().hex[:8]}")

    def activities(self) -> list[Callable[..., Any]]:
        made = []
        for name in [*DO.values(), *UNDO.values()]:

            def make(name: str) -> Callable[..., Any]:
                @activity.defn(name=name)
                async def run(request: ClusterRequest) -> StepResult:
                    self.calls.append(name)
                    if self.fail.get(name, 0) > 0:
                        self.fail[name] -= 1
                        raise ApplicationError(f"{name} broke on purpose", type="StepFailed", non_retryable=True)
                    if name == "cluster_reserve":
                        return StepResult(detail="reserved", placement=PLACEMENT)
                    if name == "cluster_render":
                        assert request.placement == PLACEMENT  # what the reservation returned
                        return StepResult(detail="rendered", slurm_conf="ClusterName=research\n")
                    if name in ("cluster_create_objects", "cluster_bring_up"):
                        assert request.slurm_conf == "ClusterName=research\n"
                    return StepResult(detail=f"{name} ok")

                return run

            made.append(make(name))
        return made


def spec_input(**options: Any) -> ClusterCreateInput:
    spec = load_spec(yaml.safe_load(EXAMPLE.read_text()))
    return ClusterCreateInput(spec=spec, backend="lab", **options)


async def create(env: WorkflowEnvironment, backend: Backend, **options: Any) -> WorkflowHandle[Any, ClusterStatus]:
    return await env.client.start_workflow(
        ClusterCreationWorkflow.run,
        spec_input(**options),
        id=f"cluster-research-{uuid.uuid4().hex[:6]}",
        task_queue=backend.task_queue,
        result_type=ClusterStatus,
    )


def worker(env: WorkflowEnvironment, backend: Backend) -> Worker:
    return Worker(
        env.client,
        task_queue=backend.task_queue,
        workflows=[ClusterCreationWorkflow],
        activities=backend.activities(),
    )


async def until(handle: WorkflowHandle[Any, Any], check: Callable[[ClusterStatus], bool], what: str) -> ClusterStatus:
    deadline = time.monotonic() + 60
    while True:
        status: ClusterStatus | None = await handle.query(ClusterCreationWorkflow.status)
        if status is not None and check(status):
            return status
        assert time.monotonic() < deadline, f"never got to: {what} (last: {status})"
        await asyncio.sleep(0.1)


async def test_the_steps_run_in_order_and_the_cluster_is_ready(env: WorkflowEnvironment) -> None:
    backend = Backend()
    async with worker(env, backend):
        status = await (await create(env, backend)).result()
    assert backend.calls == [DO[step] for step in STEPS]
    assert status.outcome == ClusterOutcome.READY and status.done == list(STEPS)
    assert status.placement == PLACEMENT and status.partitions == {"train": 2, "debug": 1}
    assert status.users == ["alice", "bob"] and status.seconds is not None


@pytest.mark.parametrize("failing", STEPS)
async def test_a_failure_at_each_step_undoes_exactly_what_was_done(
    env: WorkflowEnvironment, failing: ClusterStep
) -> None:
    backend = Backend(fail={DO[failing]: 1})
    async with worker(env, backend):
        status = await (await create(env, backend)).result()
    index = STEPS.index(failing)
    attempted = list(STEPS[: index + 1])
    undos = [UNDO[step] for step in reversed(attempted) if step in UNDOABLE]
    assert backend.calls == [DO[step] for step in attempted] + undos
    assert status.outcome == ClusterOutcome.ROLLED_BACK
    assert status.failed_step == failing and status.error == f"{DO[failing]} broke on purpose"
    assert status.done == [s for s in STEPS[:index] if s not in UNDOABLE]  # what needs no undo
    assert [e.step for e in status.timeline if e.event == "undone"] == [s for s in reversed(attempted) if s in UNDOABLE]


async def test_kept_on_failure_then_resumed_from_the_failed_step(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={"cluster_smoke_test": 1})
    async with worker(env, backend):
        handle = await create(env, backend, keep_on_failure=True)
        kept = await until(handle, lambda s: s.outcome == ClusterOutcome.FAILED_KEPT, "failed_kept")
        assert kept.failed_step == ClusterStep.SMOKE and "smoke_test broke" in kept.error
        assert not any(call in UNDO.values() for call in backend.calls)  # nothing undone
        await handle.signal(ClusterCreationWorkflow.resume)
        status = await handle.result()
    assert status.outcome == ClusterOutcome.READY and status.failed_step is None
    assert backend.calls.count("cluster_smoke_test") == 2
    assert all(backend.calls.count(DO[s]) == 1 for s in STEPS if s != ClusterStep.SMOKE)
    assert [e.event for e in status.timeline if e.step == ClusterStep.SMOKE] == [
        "started",
        "failed",
        "resumed",
        "started",
        "done",
    ]


async def test_kept_on_failure_then_rolled_back(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={"cluster_add_users": 1})
    async with worker(env, backend):
        handle = await create(env, backend, keep_on_failure=True)
        await until(handle, lambda s: s.outcome == ClusterOutcome.FAILED_KEPT, "failed_kept")
        await handle.signal(ClusterCreationWorkflow.roll_back)
        status = await handle.result()
    assert status.outcome == ClusterOutcome.ROLLED_BACK
    assert backend.calls[-4:] == [
        "cluster_remove_users",
        "cluster_tear_down",
        "cluster_delete_objects",
        "cluster_release",
    ]


async def test_an_undo_that_fails_is_said_and_the_others_still_run(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={"cluster_smoke_test": 1, "cluster_tear_down": 1})
    async with worker(env, backend):
        status = await (await create(env, backend)).result()
    assert status.outcome == ClusterOutcome.ROLLBACK_INCOMPLETE
    assert "cluster_release" in backend.calls and "cluster_delete_objects" in backend.calls
    [failed] = [e for e in status.timeline if e.event == "undo_failed"]
    assert failed.step == ClusterStep.BRING_UP and "tear_down broke" in failed.detail
    assert ClusterStep.BRING_UP in status.done  # still there: a person must look


@dataclass
class Cluster:
    """Stand-ins for the deletion's activities: jobs that end as told."""

    running: list[int] = field(default_factory=lambda: [0])  # what each look finds; the last repeats
    calls: list[str] = field(default_factory=list)
    accounts_fail: bool = False  # slurmrestd does not answer: the accounts cannot be removed
    task_queue: str = field(default_factory=lambda: f"delete-{uuid.uuid4().hex[:8]}")

    def activities(self) -> list[Callable[..., Any]]:
        def make(name: str) -> Callable[..., Any]:
            @activity.defn(name=name)
            async def run(request: ClusterRequest) -> Any:
                self.calls.append(name)
                if name == "cluster_remove_users" and self.accounts_fail:
                    raise ApplicationError("slurmrestd did not answer", type="StepFailed", non_retryable=True)
                if name == "cluster_running_jobs":
                    count = self.running.pop(0) if len(self.running) > 1 else self.running[0]
                    return JobsResult(running=count, detail=f"{count} job(s) running")
                if name == "cluster_cancel_jobs":
                    return JobsResult(running=self.running[0])
                return StepResult(detail=f"{name} ok")

            return run

        names = [
            "cluster_stop_incidents",
            "cluster_drain",
            "cluster_running_jobs",
            "cluster_cancel_jobs",
            "cluster_unmake_remediable",
            "cluster_remove_users",
            "cluster_tear_down",
            "cluster_release",
            "cluster_delete_objects",
            "cluster_notify_deleted",
        ]
        return [make(name) for name in names]


async def delete(env: WorkflowEnvironment, cluster: Cluster, **options: Any) -> DeletionStatus:
    spec = spec_input().spec
    async with Worker(
        env.client, task_queue=cluster.task_queue, workflows=[ClusterDeletionWorkflow], activities=cluster.activities()
    ):
        result: DeletionStatus = await env.client.execute_workflow(
            ClusterDeletionWorkflow.run,
            ClusterDeleteInput(spec=spec, backend="lab", **options),
            id=f"cluster-research-delete-{uuid.uuid4().hex[:6]}",
            task_queue=cluster.task_queue,
            result_type=DeletionStatus,
        )
    return result


TEARDOWN = [
    "cluster_unmake_remediable",
    "cluster_remove_users",  # the accounts leave the database, which may outlive the cluster
    "cluster_tear_down",
    "cluster_release",
    "cluster_delete_objects",
    "cluster_notify_deleted",
]


async def test_a_deletion_waits_for_running_jobs_then_takes_everything_down(env: WorkflowEnvironment) -> None:
    cluster = Cluster(running=[2, 1, 0])
    status = await delete(env, cluster)
    assert status.outcome == "deleted"
    # The cluster's incidents are cancelled and its guard ended before anything is removed, and
    # again once its jobs are gone (an Xid meanwhile may have opened one).
    stop = "cluster_stop_incidents"
    assert cluster.calls == [stop, "cluster_drain", *["cluster_running_jobs"] * 3, stop, *TEARDOWN]
    assert "cluster_cancel_jobs" not in cluster.calls


async def test_jobs_still_running_at_the_deadline_keep_the_cluster_drained(env: WorkflowEnvironment) -> None:
    cluster = Cluster(running=[1])
    status = await delete(env, cluster, deadline_seconds=60)
    assert status.outcome == "failed" and status.step == DeleteStep.WAIT_JOBS
    assert "1 job(s) still running after 60s" in status.error and "--force" in status.error
    assert cluster.calls[:2] == ["cluster_stop_incidents", "cluster_drain"]
    assert not set(TEARDOWN) & set(cluster.calls)  # nothing torn down


async def test_force_cancels_the_jobs_and_says_so(env: WorkflowEnvironment) -> None:
    cluster = Cluster(running=[3])
    status = await delete(env, cluster, force=True, requested_by="alice", reason="decommissioned")
    assert status.outcome == "deleted" and status.cancelled_jobs == 3
    stop = "cluster_stop_incidents"
    assert cluster.calls == [stop, "cluster_drain", "cluster_cancel_jobs", stop, *TEARDOWN]
    assert any("cancelled 3 job(s), not requeued" in e.detail for e in status.timeline)


async def test_accounts_that_cannot_be_removed_stop_a_deletion_unless_forced(env: WorkflowEnvironment) -> None:
    cluster = Cluster(accounts_fail=True)
    status = await delete(env, cluster)
    assert status.outcome == "failed" and status.step == DeleteStep.ACCOUNTS
    assert "slurmrestd did not answer" in status.error and "--force --reason WHY to leave the accounts" in status.error
    assert "cluster_tear_down" not in cluster.calls and "cluster_release" not in cluster.calls  # kept whole
    forced = Cluster(accounts_fail=True)
    status = await delete(env, forced, force=True, requested_by="alice", reason="decommissioned")
    assert status.outcome == "deleted" and "cluster_release" in forced.calls
    left = [e.detail for e in status.timeline if e.event == "left"]
    assert left == ["--force: accounts left in the database: slurmrestd did not answer"]
