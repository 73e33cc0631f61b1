"""NodeRemediationWorkflow on the time-skipping test server, with stand-in activities.

Proves the order of the nine steps, the grace period and its early end, waiting for a
spare, a second Xid joining the incident, retries of a failing activity, and that an
unknown node or an application Xid changes nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.constants import TASK_QUEUE
from models.incident import IncidentStatus, JobInfo, NodeInfo, Outcome, RemediationInput, RequeueResult, Step
from models.policy import Action, Policy
from models.requests import (
    ClaimRequest,
    ClassifyRequest,
    DrainRequest,
    KubeDrainRequest,
    KubeDrainResult,
    NotifyRequest,
    SignalJobsRequest,
    StillRunningRequest,
    WaitJobsRequest,
)
from models.xid import XidEvent
from starters.temporal import report_xid
from workflows.remediation import NodeRemediationWorkflow


@pytest.fixture(scope="module")
async def env(temporal_test_server: str) -> AsyncIterator[WorkflowEnvironment]:
    environment = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter, test_server_existing_path=temporal_test_server
    )
    yield environment
    await environment.shutdown()


@dataclass
class Fleet:
    """What the stand-in activities see and do; records each call by activity name."""

    nodes: set[str] = field(default_factory=lambda: {"gpu1", "gpu2"})
    jobs: list[JobInfo] = field(default_factory=lambda: [JobInfo(job_id=7, user="alice", state="RUNNING")])
    spare_free: bool = True
    jobs_exit_on_sigterm: bool = True
    drain_failures: int = 0
    unrequeueable: set[int] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    notifications: list[NotifyRequest] = field(default_factory=list)
    signalled: asyncio.Event = field(default_factory=asyncio.Event)
    claim_started: asyncio.Event = field(default_factory=asyncio.Event)
    drain_attempts: int = 0

    def activities(self) -> list[object]:
        fleet = self

        @activity.defn(name="slurm_node_state")
        async def node_state(node: str) -> NodeInfo:
            fleet.calls.append("slurm_node_state")
            if node not in fleet.nodes:
                raise ApplicationError(f"Slurm has no node named {node!r}", type="NotFound", non_retryable=True)
            return NodeInfo(name=node, state="allocated", partitions=["train"])

        @activity.defn(name="classify_xids")
        async def classify(request: ClassifyRequest) -> Action:
            fleet.calls.append("classify_xids")
            return Policy().decide(request.events)

        @activity.defn(name="notify")
        async def notify(request: NotifyRequest) -> None:
            fleet.calls.append(f"notify:{request.kind}")
            fleet.notifications.append(request)

        @activity.defn(name="drain_slurm_node")
        async def drain(request: DrainRequest) -> NodeInfo:
            fleet.drain_attempts += 1
            if fleet.drain_attempts <= fleet.drain_failures:
                raise ApplicationError("slurmctld unreachable", type="Unavailable")
            fleet.calls.append("drain_slurm_node")
            return NodeInfo(name=request.node, state="allocated", flags=["DRAIN"], reason=request.reason)

        @activity.defn(name="jobs_on_node")
        async def jobs_on_node(node: str) -> list[JobInfo]:
            fleet.calls.append("jobs_on_node")
            return fleet.jobs

        @activity.defn(name="signal_jobs")
        async def signal_jobs(request: SignalJobsRequest) -> list[int]:
            fleet.calls.append("signal_jobs")
            fleet.signalled.set()
            return request.job_ids

        @activity.defn(name="jobs_still_running")
        async def still_running(request: StillRunningRequest) -> list[int]:
            fleet.calls.append("jobs_still_running")
            return [] if fleet.jobs_exit_on_sigterm else request.job_ids

        @activity.defn(name="requeue_jobs")
        async def requeue_jobs(job_ids: list[int]) -> RequeueResult:
            fleet.calls.append("requeue_jobs")
            return RequeueResult(
                requeued=[j for j in job_ids if j not in fleet.unrequeueable],
                failed={j: "submitted with --no-requeue" for j in job_ids if j in fleet.unrequeueable},
            )

        @activity.defn(name="cordon_and_drain_node")
        async def cordon(request: KubeDrainRequest) -> KubeDrainResult:
            fleet.calls.append("cordon_and_drain_node")
            # Only returns once the spare's claim has begun: proves the two branches overlap.
            await asyncio.wait_for(fleet.claim_started.wait(), timeout=10)
            return KubeDrainResult(evicted=["default/web-1"])

        @activity.defn(name="retire_node")
        async def retire(node: str) -> None:
            fleet.calls.append("retire_node")

        @activity.defn(name="claim_spare")
        async def claim(request: ClaimRequest) -> str | None:
            fleet.claim_started.set()
            fleet.calls.append("claim_spare")
            return "spare1" if fleet.spare_free else None

        @activity.defn(name="wait_jobs_resumed")
        async def resumed(request: WaitJobsRequest) -> list[JobInfo]:
            fleet.calls.append("wait_jobs_resumed")
            return [JobInfo(job_id=j, state="RUNNING", restarts=1, nodes="gpu2,spare1") for j in request.job_ids]

        return [
            node_state,
            classify,
            notify,
            drain,
            jobs_on_node,
            signal_jobs,
            still_running,
            requeue_jobs,
            cordon,
            retire,
            claim,
            resumed,
        ]


async def start(client: Client, *, node: str = "gpu1", xid: int = 79, grace: float = 120.0) -> object:
    cluster = f"t{uuid.uuid4().hex[:8]}"
    return await report_xid(
        client,
        XidEvent(node=node, xid=xid, source="test"),
        cluster=cluster,
        options=RemediationInput(cluster=cluster, node=node, grace_seconds=grace, search_attributes=False),
        search_attributes=False,
    )


def worker(env: WorkflowEnvironment, fleet: Fleet) -> Worker:
    return Worker(env.client, task_queue=TASK_QUEUE, workflows=[NodeRemediationWorkflow], activities=fleet.activities())


def span(status: IncidentStatus, step: Step) -> float:
    started = next(e.at for e in status.timeline if e.step == step and e.event == "started")
    finished = next(e.at for e in status.timeline if e.step == step and e.event == "finished")
    return (finished - started).total_seconds()


async def test_happy_path_runs_the_steps_in_order(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client)
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.outcome == Outcome.RESOLVED
    assert status.action == Action.REPLACE_NODE
    assert status.spare == "spare1"
    branches = {"cordon_and_drain_node", "retire_node", "claim_spare", "wait_jobs_resumed"}
    sequential = [c for c in fleet.calls if c not in branches]
    assert sequential == [
        "slurm_node_state",
        "classify_xids",
        "notify:opened",
        "drain_slurm_node",
        "jobs_on_node",
        "signal_jobs",
        "jobs_still_running",
        "requeue_jobs",
        "classify_xids",
        "notify:resolved",
    ]
    # After approve: the failed node's branch and the spare's branch, then resolved.
    middle = fleet.calls[fleet.calls.index("requeue_jobs") + 2 : fleet.calls.index("notify:resolved")]
    assert sorted(middle) == sorted(branches)
    assert middle.index("cordon_and_drain_node") < middle.index("retire_node")
    assert middle.index("claim_spare") < middle.index("wait_jobs_resumed")
    steps = [e.step for e in status.timeline if e.event == "started"]
    assert steps[:6] == [Step.CLASSIFY, Step.NOTIFY, Step.DRAIN_SLURM, Step.CHECKPOINT, Step.REQUEUE, Step.APPROVE]
    assert steps[-1] == Step.CLOSED


async def test_grace_period_is_honoured_when_jobs_ignore_sigterm(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with worker(env, fleet):
        handle = await start(env.client, grace=120)
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.outcome == Outcome.RESOLVED
    assert 120 <= span(status, Step.CHECKPOINT) < 125
    assert "requeue_jobs" in fleet.calls
    # Backing off to 5 s keeps the history short over the whole grace.
    assert 10 < fleet.calls.count("jobs_still_running") < 40


async def test_checkpoint_done_ends_the_grace_early(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with worker(env, fleet):
        handle = await start(env.client, grace=120)
        await asyncio.wait_for(fleet.signalled.wait(), timeout=10)
        await handle.signal(NodeRemediationWorkflow.checkpoint_done, 7)  # type: ignore[attr-defined]
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.outcome == Outcome.RESOLVED
    assert span(status, Step.CHECKPOINT) < 120
    assert status.checkpointed == [7]


async def test_no_spare_waits_notifies_and_takes_the_next_one(env: WorkflowEnvironment) -> None:
    fleet = Fleet(spare_free=False)
    async with worker(env, fleet):
        handle = await start(env.client)
        for _ in range(200):
            if "notify:no_spare" in fleet.calls:
                break
            await asyncio.sleep(0.05)
        assert "notify:no_spare" in fleet.calls
        waiting: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)  # type: ignore[attr-defined]
        assert waiting.waiting_for_spare and waiting.outcome == Outcome.OPEN
        fleet.spare_free = True
        await handle.signal(NodeRemediationWorkflow.spare_available)  # type: ignore[attr-defined]
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.outcome == Outcome.RESOLVED
    assert status.spare == "spare1"
    assert fleet.calls.count("notify:no_spare") == 1
    assert fleet.calls.count("claim_spare") >= 2


async def test_second_xid_joins_the_open_incident(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with worker(env, fleet):
        handle = await start(env.client)
        await asyncio.wait_for(fleet.signalled.wait(), timeout=10)
        cluster = handle.id.removeprefix("remediate-").removesuffix("-gpu1")  # type: ignore[attr-defined]
        again = await report_xid(
            env.client,
            XidEvent(node="gpu1", xid=48, source="test"),
            cluster=cluster,
            options=RemediationInput(cluster=cluster, node="gpu1", search_attributes=False),
            search_attributes=False,
        )
        assert again.id == handle.id  # type: ignore[attr-defined]
        assert again.result_run_id == handle.result_run_id  # type: ignore[attr-defined]
        await handle.signal(NodeRemediationWorkflow.checkpoint_done, 7)  # type: ignore[attr-defined]
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.xids == [79, 48]
    assert status.outcome == Outcome.RESOLVED


async def test_failing_activity_is_retried(env: WorkflowEnvironment) -> None:
    fleet = Fleet(drain_failures=2)
    async with worker(env, fleet):
        handle = await start(env.client)
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert fleet.drain_attempts == 3
    assert status.outcome == Outcome.RESOLVED


async def test_unknown_node_fails_fast_and_changes_nothing(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, node="nosuch")
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()  # type: ignore[attr-defined]
    assert "no node named 'nosuch'" in str(failure.value.cause)
    # Nothing changed; the owner is told why the incident stopped.
    assert fleet.calls == ["slurm_node_state", "notify:failed"]


async def test_application_xid_is_only_recorded(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, xid=13)
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.outcome == Outcome.OBSERVED
    assert "drain_slurm_node" not in fleet.calls
    assert fleet.calls[-1] == "notify:observed"


async def test_job_that_cannot_be_requeued_names_its_owner(env: WorkflowEnvironment) -> None:
    fleet = Fleet(unrequeueable={7})
    async with worker(env, fleet):
        handle = await start(env.client)
        status: IncidentStatus = await handle.result()  # type: ignore[attr-defined]
    assert status.unrequeued == {7: "submitted with --no-requeue"}
    message = next(n for n in fleet.notifications if n.kind == "unrequeued")
    assert "job 7 (owner alice)" in message.text
    assert "wait_jobs_resumed" not in fleet.calls
