"""NodeRemediationWorkflow on the time-skipping test server, with stand-in activities.

Proves the order of the nine steps, the grace period and its early end, waiting for a
spare, a second Xid joining the incident, retries of a failing activity, and that an
unknown node or an application Xid changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.guard import GuardActivities
from models.constants import REMEDIATION_LABEL, guard_task_queue, task_queue
from models.incident import (
    Approval,
    IncidentStatus,
    JobInfo,
    JobRequeue,
    NodeInfo,
    Outcome,
    RemediationInput,
    RequeueOutcome,
    Step,
)
from models.policy import Action, Policy, RemediationSettings
from models.requests import (
    ClaimRequest,
    ClassifyRequest,
    DrainRequest,
    FailureJobsRequest,
    KubeDrainRequest,
    KubeDrainResult,
    NodeFacts,
    NodeLeaseRequest,
    NotifyRequest,
    QuarantineRequest,
    RepairRequest,
    RepairResult,
    RequeueJobRequest,
    ResumeCheck,
    ResumeCheckRequest,
    ResumeNodeRequest,
    RetireRequest,
    SignalJobRequest,
    SignalJobResult,
    StillRunningRequest,
    WorkerConfig,
)
from models.sxid import sxid_catalog
from models.topology import Domain, DomainNodesRequest, DomainsRequest, NodeDomains
from models.xid import GpuEventKind, XidEvent
from starters.temporal import report_xid
from workflows.domain import DomainIncidentWorkflow
from workflows.guard import FleetGuardWorkflow
from workflows.nodes import ProbationWorkflow
from workflows.remediation import NodeRemediationWorkflow


@dataclass
class Fleet:
    """What the stand-in activities see and do; records each call by activity name."""

    nodes: set[str] = field(default_factory=lambda: {"gpu1", "gpu2"})
    jobs: list[JobInfo] = field(default_factory=lambda: [JobInfo(job_id=7, user="alice", state="RUNNING")])
    spare_free: bool = True
    jobs_exit_on_sigterm: bool = True
    drain_failures: int = 0
    unrequeueable: set[int] = field(default_factory=set)
    # Per job: what Slurm shows at requeue time (default: exited after SIGTERM).
    states_at_requeue: dict[int, tuple[str, int]] = field(default_factory=dict)
    node_reason: str = ""
    node_drained: bool = False
    pool: str | None = "training"
    settings: RemediationSettings = field(default_factory=RemediationSettings)
    policy: Policy = field(default_factory=Policy)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)  # per node, beside the pool label
    partition_size: int = 4
    drained: list[str] = field(default_factory=list)  # nodes drained in Slurm, in order
    writes: list[Any] = field(default_factory=list)  # every request of an activity that changes the fleet
    quarantined: dict[str, str] = field(default_factory=dict)  # node: gpufleet.io/quarantine value
    leases: dict[str, str] = field(default_factory=dict)  # node: who holds it (gpufleet.io/lease)
    # Repairs in place: whether each attempt's Job succeeds (default: yes), and what ran.
    repair_succeeds: list[bool] = field(default_factory=list)
    repairs: list[RepairRequest] = field(default_factory=list)
    resumed_nodes: list[str] = field(default_factory=list)
    notify_gate: asyncio.Event | None = None  # set: the webhook answers; None: it answers at once
    notify_refuses: bool = False
    retire_fails: bool = False
    kube_drain_refused: str = ""  # the Kubernetes drain fails, not retried, saying this
    calls: list[str] = field(default_factory=list)
    notifications: list[NotifyRequest] = field(default_factory=list)
    signalled: asyncio.Event = field(default_factory=asyncio.Event)
    claim_started: asyncio.Event = field(default_factory=asyncio.Event)
    drain_attempts: int = 0
    drain_reasons: list[str] = field(default_factory=list)
    cluster: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    # Each node's failure domains (none unless a test gives them).
    domains: dict[str, list[Domain]] = field(default_factory=dict)

    def activities(self) -> list[object]:
        fleet = self

        @activity.defn(name="worker_config")
        async def worker_config(cluster: str) -> WorkerConfig:
            # The fleet guard reads the same configuration (for its limits).
            guard = activity.info().workflow_id.startswith("guard-")
            fleet.calls.append("guard:worker_config" if guard else "worker_config")
            return WorkerConfig(cluster=cluster, settings=fleet.settings, policy=fleet.policy)

        @activity.defn(name="slurm_node_state")
        async def node_state(node: str) -> NodeInfo:
            fleet.calls.append("slurm_node_state")
            if node not in fleet.nodes:
                raise ApplicationError(f"Slurm has no node named {node!r}", type="NotFound", non_retryable=True)
            flags = ["DRAIN"] if fleet.node_drained else []
            return NodeInfo(name=node, state="allocated", flags=flags, reason=fleet.node_reason, partitions=["train"])

        @activity.defn(name="kube_node_facts")
        async def node_facts(node: str) -> NodeFacts:
            fleet.calls.append("kube_node_facts")
            if fleet.pool is None:
                return NodeFacts(found=False)
            labels = fleet.labels.get(node, {})
            return NodeFacts(pool=fleet.pool, remediation=labels.get(REMEDIATION_LABEL, ""))

        @activity.defn(name="guard_fleet_size")
        async def fleet_size() -> int:
            return fleet.partition_size

        @activity.defn(name="classify_xids")
        async def classify(request: ClassifyRequest) -> Action:
            fleet.calls.append("classify_xids")
            return (request.policy or Policy()).decide(request.events)

        @activity.defn(name="notify")
        async def notify(request: NotifyRequest) -> int:
            if fleet.notify_gate is not None:
                await fleet.notify_gate.wait()
            fleet.calls.append(f"notify:{request.kind}")
            fleet.notifications.append(request)
            if fleet.notify_refuses:
                raise ApplicationError("the webhook at hooks refused the message: HTTP 403", type="InvalidInput")
            return 1

        @activity.defn(name="drain_slurm_node")
        async def drain(request: DrainRequest) -> NodeInfo:
            fleet.writes.append(request)
            fleet.drain_attempts += 1
            if fleet.drain_attempts <= fleet.drain_failures:
                raise ApplicationError("slurmctld unreachable", type="Unavailable")
            fleet.calls.append("drain_slurm_node")
            fleet.drain_reasons.append(request.reason)
            fleet.drained.append(request.node)
            return NodeInfo(name=request.node, state="allocated", flags=["DRAIN"], reason=request.reason)

        @activity.defn(name="jobs_on_node")
        async def jobs_on_node(node: str) -> list[JobInfo]:
            fleet.calls.append("jobs_on_node")
            return fleet.jobs

        @activity.defn(name="jobs_hit_by_failure")
        async def jobs_hit(request: FailureJobsRequest) -> list[JobInfo]:
            fleet.calls.append("jobs_hit_by_failure")
            return fleet.jobs

        @activity.defn(name="signal_job")
        async def signal_job(request: SignalJobRequest) -> SignalJobResult:
            fleet.writes.append(request)
            fleet.calls.append(f"signal_job:{request.job_id}")
            fleet.signalled.set()
            job = next(j for j in fleet.jobs if j.job_id == request.job_id)
            if job.state != "RUNNING":
                return SignalJobResult(job_id=job.job_id, signalled=False, why=f"not running ({job.state})")
            return SignalJobResult(job_id=request.job_id, signalled=True)

        @activity.defn(name="jobs_still_running")
        async def still_running(request: StillRunningRequest) -> list[int]:
            fleet.calls.append("jobs_still_running")
            return [] if fleet.jobs_exit_on_sigterm else request.job_ids

        @activity.defn(name="requeue_job")
        async def requeue_job(request: RequeueJobRequest) -> JobRequeue:
            fleet.writes.append(request)
            fleet.calls.append(f"requeue_job:{request.job_id}")
            if request.job_id in fleet.unrequeueable:
                return JobRequeue(
                    job_id=request.job_id, outcome=RequeueOutcome.FAILED, why="submitted with --no-requeue"
                )
            if request.ended_by_failure:
                # Requeued only when the failure ended it (as Slurm shows it now, else as listed).
                listed = next((j.state for j in fleet.jobs if j.job_id == request.job_id), "COMPLETED")
                state, _ = fleet.states_at_requeue.get(request.job_id, ("COMPLETED", 0))
                if listed in ("FAILED", "NODE_FAIL") or state in ("FAILED", "NODE_FAIL"):
                    return JobRequeue(job_id=request.job_id, outcome=RequeueOutcome.REQUEUED, why="back in the queue")
                return JobRequeue(job_id=request.job_id, outcome=RequeueOutcome.SKIPPED, why=f"ended {state}")
            if not request.signalled:
                return JobRequeue(job_id=request.job_id, outcome=RequeueOutcome.SKIPPED, why="had ended before")
            state, restarts = fleet.states_at_requeue.get(request.job_id, ("COMPLETED", request.restarts_before))
            if restarts > request.restarts_before:
                return JobRequeue(job_id=request.job_id, outcome=RequeueOutcome.SKIPPED, why="already restarted")
            if state == "CANCELLED":
                return JobRequeue(job_id=request.job_id, outcome=RequeueOutcome.SKIPPED, why="cancelled by its owner")
            return JobRequeue(job_id=request.job_id, outcome=RequeueOutcome.REQUEUED)

        @activity.defn(name="take_node_lease")
        async def take_lease(request: NodeLeaseRequest) -> str:
            fleet.writes.append(request)
            fleet.calls.append("take_node_lease")
            held = fleet.leases.get(request.node, "")
            fleet.leases[request.node] = request.holder
            return "" if held == request.holder else held

        @activity.defn(name="give_back_node_lease")
        async def give_back_lease(request: NodeLeaseRequest) -> bool:
            fleet.writes.append(request)
            fleet.calls.append("give_back_node_lease")
            return fleet.leases.pop(request.node, None) == request.holder

        @activity.defn(name="cordon_and_drain_node")
        async def cordon(request: KubeDrainRequest) -> KubeDrainResult:
            fleet.writes.append(request)
            fleet.calls.append("cordon_and_drain_node")
            # Only returns once the spare's claim has begun: proves the two branches overlap.
            await asyncio.wait_for(fleet.claim_started.wait(), timeout=10)
            if fleet.kube_drain_refused:
                raise ApplicationError(fleet.kube_drain_refused, type="NotOwned", non_retryable=True)
            return KubeDrainResult(evicted=["default/web-1"])

        @activity.defn(name="retire_node")
        async def retire(request: RetireRequest) -> None:
            fleet.writes.append(request)
            fleet.calls.append("retire_node")
            if fleet.retire_fails:
                raise ApplicationError("spare1 is held by someone else", type="NotOwned", non_retryable=True)

        @activity.defn(name="claim_spare")
        async def claim(request: ClaimRequest) -> str | None:
            fleet.writes.append(request)
            fleet.claim_started.set()
            fleet.calls.append("claim_spare")
            return "spare1" if fleet.spare_free else None

        @activity.defn(name="node_domains")
        async def node_domains(request: DomainsRequest) -> NodeDomains:
            fleet.calls.append("guard:node_domains")
            return NodeDomains(node=request.node, domains=fleet.domains.get(request.node, []))

        @activity.defn(name="domain_nodes")
        async def domain_nodes(request: DomainNodesRequest) -> list[str]:
            return sorted(node for node, domains in fleet.domains.items() if request.domain in domains)

        @activity.defn(name="quarantine_node")
        async def quarantine(request: QuarantineRequest) -> None:
            fleet.writes.append(request)
            fleet.quarantined[request.node] = request.code

        @activity.defn(name="repair_node")
        async def repair(request: RepairRequest) -> RepairResult:
            fleet.writes.append(request)
            fleet.repairs.append(request)
            ok = (
                fleet.repair_succeeds[len(fleet.repairs) - 1]
                if len(fleet.repairs) <= len(fleet.repair_succeeds)
                else True
            )
            job = f"job-{len(fleet.repairs)}"
            return RepairResult(
                succeeded=ok,
                job=job,
                detail=f"Job {job} completed: the GPU answers" if ok else f"Job {job} failed: exit 1",
            )

        @activity.defn(name="start_reboot")
        async def start_reboot(request: RepairRequest) -> str:
            fleet.writes.append(request)
            fleet.calls.append("start_reboot")
            return f"reboot-{request.attempt}"

        @activity.defn(name="resume_slurm_node")
        async def resume_node(request: ResumeNodeRequest) -> NodeInfo:
            fleet.writes.append(request)
            fleet.resumed_nodes.append(request.node)
            return NodeInfo(name=request.node, state="idle")

        @activity.defn(name="release_spare")
        async def release(request: ClaimRequest) -> str | None:
            fleet.calls.append("release_spare")
            return None

        @activity.defn(name="jobs_resumed")
        async def resumed(request: ResumeCheckRequest) -> ResumeCheck:
            fleet.calls.append("jobs_resumed")
            return ResumeCheck(
                resumed=[JobInfo(job_id=j, state="RUNNING", restarts=1, nodes="gpu2,spare1") for j in request.job_ids]
            )

        # The guard's plumbing is Temporal's own (signal-with-start, signals, describe): the real one.
        guard = GuardActivities(None, cluster=fleet.cluster, partition="train")  # type: ignore[arg-type]
        return [
            guard.request_slot,
            guard.drained,
            guard.answer,
            guard.tell,
            guard.running,
            guard.domain_join,
            node_domains,
            domain_nodes,
            fleet_size,
            node_facts,
            worker_config,
            node_state,
            classify,
            notify,
            drain,
            jobs_on_node,
            jobs_hit,
            signal_job,
            still_running,
            requeue_job,
            cordon,
            retire,
            claim,
            release,
            resumed,
            quarantine,
            repair,
            start_reboot,
            resume_node,
            take_lease,
            give_back_lease,
        ]


async def start(
    client: Client,
    fleet: Fleet,
    *,
    node: str = "gpu1",
    xid: int | None = 79,
    kind: GpuEventKind = GpuEventKind.XID,
    dry_run: bool = False,
    message: str = "",
) -> Any:
    """Report an event as the detector would: cluster and node only, on the fleet's own cluster."""
    event = XidEvent(node=node, kind=kind, xid=xid, source="test", message=message)
    return await report_xid(client, event, cluster=fleet.cluster, search_attributes=False, dry_run=dry_run)


@contextlib.asynccontextmanager
async def worker(
    env: WorkflowEnvironment, fleet: Fleet, *, activities: list[Any] | None = None, **options: Any
) -> AsyncIterator[Worker]:
    """The fleet's workers, as `gpufleet worker` runs them: the cluster's task queue and its guard's."""
    acts = activities if activities is not None else fleet.activities()
    async with (
        Worker(
            env.client,
            task_queue=task_queue(fleet.cluster),
            # The incident's and the probation it may begin (a child on the same queue).
            workflows=[NodeRemediationWorkflow, ProbationWorkflow],
            activities=acts,
            **options,
        ) as cluster,
        Worker(
            env.client,
            task_queue=guard_task_queue(fleet.cluster),
            workflows=[FleetGuardWorkflow, DomainIncidentWorkflow],
            activities=acts,
            **options,
        ),
    ):
        yield cluster


def span(status: IncidentStatus, step: Step) -> float:
    started = next(e.at for e in status.timeline if e.step == step and e.event == "started")
    finished = next(e.at for e in status.timeline if e.step == step and e.event == "finished")
    return (finished - started).total_seconds()


async def test_happy_path_runs_the_steps_in_order(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert status.action == Action.REPLACE_NODE
    assert status.spare == "spare1"
    # The claim names the failed node's partitions, so that the spare joins the right one.
    claims = [w for w in fleet.writes if isinstance(w, ClaimRequest)]
    assert claims and all(c.partitions == ["train"] for c in claims) and status.partitions == ["train"]
    branches = {"cordon_and_drain_node", "retire_node", "claim_spare", "jobs_resumed"}
    # Notifications run beside the flow: their place among the steps is not fixed.
    sequential = [c for c in fleet.calls if c not in branches and not c.startswith(("notify:", "guard:"))]
    assert sequential == [
        "worker_config",
        "slurm_node_state",
        "kube_node_facts",
        "classify_xids",
        "take_node_lease",  # the node is the incident's before anything changes it
        "drain_slurm_node",  # at once: the fleet guard never holds back a drain
        "jobs_hit_by_failure",  # the jobs the failure ended are requeued now (none here)
        "jobs_hit_by_failure",  # again once the guard gave a slot to kill the running ones
        "signal_job:7",
        "jobs_still_running",
        "requeue_job:7",
        "classify_xids",
        "give_back_node_lease",  # once the incident closes
    ]
    assert fleet.leases == {}
    assert [c for c in fleet.calls if c.startswith("notify:")] == ["notify:opened", "notify:resolved"]
    granted = [e for e in status.timeline if e.step == Step.GUARD and e.event == "finished"]
    # A slot to kill the jobs, given back once they are requeued; another to retire the node.
    assert [e.detail for e in granted] == ["slot granted: slot 1 of 2", "slot granted: slot 1 of 2"]
    assert not status.guard_slot
    # After approve: the failed node's branch and the spare's branch, then resolved.
    middle = [
        c
        for c in fleet.calls[fleet.calls.index("requeue_job:7") + 2 : fleet.calls.index("give_back_node_lease")]
        if not c.startswith("notify:")
    ]
    assert sorted(middle) == sorted(branches)
    assert middle.index("cordon_and_drain_node") < middle.index("retire_node")
    assert middle.index("claim_spare") < middle.index("jobs_resumed")
    assert [(n.kind, n.outcome, n.attempts) for n in status.notifications] == [
        ("opened", "sent", 1),
        ("resolved", "sent", 1),
    ]
    assert status.settings == RemediationSettings()
    steps = [e.step for e in status.timeline if e.event == "started"]
    assert steps[:9] == [
        Step.CLASSIFY,
        Step.NOTIFY,
        Step.DRAIN_SLURM,
        Step.REQUEUE_ENDED,
        Step.GUARD,
        Step.CHECKPOINT,
        Step.REQUEUE,
        Step.APPROVE,
        Step.GUARD,
    ]
    assert steps[-1] == Step.CLOSED


async def test_an_incident_takes_its_node_from_a_pool_move_and_says_so(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    fleet.leases["gpu1"] = "pool-shared"  # a rebalance was moving the node when its GPU failed
    async with worker(env, fleet):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.outcome == Outcome.RESOLVED
    took = [e.detail for e in status.timeline if e.event == "took the node"]
    assert took == ["from pool-shared, which stops where it is"]
    assert fleet.calls.index("take_node_lease") < fleet.calls.index("drain_slurm_node")
    assert fleet.leases == {}  # let go at the close: nothing holds the retired node


async def test_grace_period_is_honoured_when_jobs_ignore_sigterm(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert 120 <= span(status, Step.CHECKPOINT) < 125
    assert "requeue_job:7" in fleet.calls
    # Backing off to 5 s keeps the history short over the whole grace.
    assert 10 < fleet.calls.count("jobs_still_running") < 40


async def test_checkpoint_done_ends_the_grace_early(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        await asyncio.wait_for(fleet.signalled.wait(), timeout=10)
        await handle.signal(NodeRemediationWorkflow.checkpoint_done, 7)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert span(status, Step.CHECKPOINT) < 120
    assert status.checkpointed == [7]


async def test_no_spare_waits_notifies_and_takes_the_next_one(env: WorkflowEnvironment) -> None:
    fleet = Fleet(spare_free=False)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        for _ in range(200):
            if "notify:no_spare" in fleet.calls:
                break
            await asyncio.sleep(0.05)
        assert "notify:no_spare" in fleet.calls
        waiting: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        assert waiting.waiting_for_spare and waiting.outcome == Outcome.OPEN
        fleet.spare_free = True
        await handle.signal(NodeRemediationWorkflow.spare_available)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert status.spare == "spare1"
    assert fleet.calls.count("notify:no_spare") == 1
    assert fleet.calls.count("claim_spare") >= 2


async def test_second_xid_joins_the_open_incident(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        await asyncio.wait_for(fleet.signalled.wait(), timeout=10)
        cluster = handle.id.removeprefix("remediate-").removesuffix("-gpu1")
        again = await report_xid(
            env.client, XidEvent(node="gpu1", xid=48, source="test"), cluster=cluster, search_attributes=False
        )
        assert again.id == handle.id
        assert again.result_run_id == handle.result_run_id
        await handle.signal(NodeRemediationWorkflow.checkpoint_done, 7)
        status: IncidentStatus = await handle.result()
    assert status.xids == [79, 48]
    assert status.outcome == Outcome.RESOLVED


async def test_failing_activity_is_retried(env: WorkflowEnvironment) -> None:
    fleet = Fleet(drain_failures=2)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert fleet.drain_attempts == 3
    assert status.outcome == Outcome.RESOLVED


async def test_unknown_node_fails_fast_and_changes_nothing(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, fleet, node="nosuch")
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert "no node named 'nosuch'" in str(failure.value.cause)
    # Nothing changed; the owner is told why the incident stopped, and the operators are paged.
    assert fleet.calls[:2] == ["worker_config", "slurm_node_state"]
    assert sorted(fleet.calls[2:]) == ["notify:failed", "notify:incident_failed"]


async def test_application_xid_is_only_recorded(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, fleet, xid=13)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.OBSERVED
    assert "drain_slurm_node" not in fleet.calls
    assert fleet.calls[-1] == "notify:observed"


async def test_job_that_cannot_be_requeued_names_its_owner(env: WorkflowEnvironment) -> None:
    fleet = Fleet(unrequeueable={7})
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.unrequeued == {7: "submitted with --no-requeue"}
    message = next(n for n in fleet.notifications if n.kind == "unrequeued")
    assert "job 7 (owner alice)" in message.text
    assert "jobs_resumed" not in fleet.calls


# -- away from the happy path ---------------------------------------------------------------------


async def test_a_hanging_webhook_never_holds_the_node_in_service(env: WorkflowEnvironment) -> None:
    fleet = Fleet(notify_gate=asyncio.Event())
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        # The webhook has not answered, yet the node is drained and its job signalled.
        await asyncio.wait_for(fleet.signalled.wait(), timeout=30)
        assert "drain_slurm_node" in fleet.calls and not any(c.startswith("notify:") for c in fleet.calls)
        waiting: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        assert waiting.notifications[0].kind == "opened" and waiting.notifications[0].outcome == "pending"
        fleet.notify_gate.set()  # type: ignore[union-attr]
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert [n.outcome for n in status.notifications] == ["sent", "sent"]


async def test_a_webhook_that_refuses_does_not_fail_the_incident(env: WorkflowEnvironment) -> None:
    fleet = Fleet(notify_refuses=True)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert status.spare == "spare1"
    assert [(n.kind, n.outcome) for n in status.notifications] == [("opened", "failed"), ("resolved", "failed")]
    assert "HTTP 403" in status.notifications[0].error
    # A refusal is final: one attempt per message, not a retry storm.
    assert fleet.calls.count("notify:opened") == 1
    assert any(e.event == "notify opened: failed" for e in status.timeline)


async def test_the_workers_settings_apply_and_are_recorded(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False, settings=RemediationSettings(grace_seconds=30))
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert 30 <= span(status, Step.CHECKPOINT) < 35
    assert status.settings is not None and status.settings.grace_seconds == 30
    assert fleet.calls.count("worker_config") == 1  # read once, at the start


async def test_jobs_are_signalled_and_requeued_one_by_one_with_their_guards(env: WorkflowEnvironment) -> None:
    fleet = Fleet(
        jobs=[
            JobInfo(job_id=7, user="alice", state="RUNNING"),
            JobInfo(job_id=8, user="bob", state="COMPLETING"),  # had ended before gpufleet signalled it
            JobInfo(job_id=9, user="carol", state="RUNNING"),  # its owner cancels it during the grace
            JobInfo(job_id=10, user="dan", state="RUNNING"),  # another incident's requeue restarted it
        ],
        states_at_requeue={9: ("CANCELLED", 0), 10: ("RUNNING", 1)},
    )
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert sorted(status.signalled) == [7, 9, 10]
    assert status.requeued == [7]
    assert status.skipped == {
        8: "not running (COMPLETING)",
        9: "cancelled by its owner",
        10: "already restarted",
    }
    assert status.unrequeued == {}
    assert sorted(c for c in fleet.calls if c.startswith("signal_job")) == [f"signal_job:{j}" for j in (10, 7, 8, 9)]


async def test_a_job_the_failure_ends_between_two_listings_is_requeued(env: WorkflowEnvironment) -> None:
    """The job runs at the drain's listing; by the checkpoint step's it has ended and left the
    node's listing (its nodes finish completing one by one). It is requeued by its state, as one
    the failure ended, not forgotten."""
    fleet = Fleet(states_at_requeue={7: ("FAILED", 0)})
    looks: list[int] = []

    @activity.defn(name="jobs_hit_by_failure")
    async def jobs_hit(request: FailureJobsRequest) -> list[JobInfo]:
        looks.append(1)
        return fleet.jobs if len(looks) == 1 else []

    acts = [a for a in fleet.activities() if activity._Definition.must_from_callable(a).name != "jobs_hit_by_failure"]
    async with worker(env, fleet, activities=[*acts, jobs_hit]):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert len(looks) == 2 and status.signalled == []
    assert status.requeued == [7] and status.unrequeued == {}
    requeue = next(w for w in fleet.writes if isinstance(w, RequeueJobRequest))
    assert requeue.ended_by_failure and not requeue.signalled
    assert status.outcome == Outcome.RESOLVED


async def test_a_node_drained_by_its_owner_waits_for_approval(env: WorkflowEnvironment) -> None:
    fleet = Fleet(node_drained=True, node_reason="bob: swapping the NIC, back at 3pm")
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        waiting = await _until(handle, lambda s: s.outcome == Outcome.AWAITING_APPROVAL)
        assert waiting.step == Step.AWAITING_APPROVAL
        assert "swapping the NIC" in (waiting.waiting_for_approval or "")
        assert "drain_slurm_node" not in fleet.calls and not fleet.signalled.is_set()
        # Held while it waits: no pool move may take the node meanwhile.
        assert fleet.leases == {"gpu1": waiting.incident_id}
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=True, by="ops", reason="go"))
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert status.approval == Approval(approved=True, by="ops", reason="go")
    assert "notify:approval_needed" in fleet.calls


async def test_a_rejected_incident_changes_nothing(env: WorkflowEnvironment) -> None:
    fleet = Fleet(node_drained=True, node_reason="slurm-operator: node maintenance")
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        await _until(handle, lambda s: s.outcome == Outcome.AWAITING_APPROVAL)
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="ops"))
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.REJECTED
    changing = {"drain_slurm_node", "signal_job:7", "requeue_job:7", "cordon_and_drain_node", "claim_spare"}
    assert not changing & set(fleet.calls)
    assert fleet.leases == {}  # let go with the rejection


async def test_a_node_slurm_marked_not_responding_needs_no_approval(env: WorkflowEnvironment) -> None:
    fleet = Fleet(node_drained=True, node_reason="Not responding")
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    assert status.approval is None


async def test_slurms_prolog_error_drain_after_a_health_check_is_the_incidents_own(env: WorkflowEnvironment) -> None:
    """gpufleet health-check failed in the prolog: Slurm drained the node ("Prolog error") and the
    health_check event opened the incident, which takes that drain as its own (nobody is asked)
    and writes its own reason over it; an Xid's incident on such a node asks, as for any hold."""
    policy = Policy(kinds={GpuEventKind.HEALTH_CHECK: Action.REPLACE_NODE})
    fleet = Fleet(node_drained=True, node_reason="Prolog error", policy=policy)
    async with worker(env, fleet):
        handle = await start(
            env.client, fleet, kind=GpuEventKind.HEALTH_CHECK, xid=None, message="prolog: gpu_count: NVML sees 1"
        )
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.approval is None
    assert fleet.drain_reasons[0].startswith("gpufleet: health_check prolog REPLACE_NODE incident ")
    taken = [entry for entry in status.timeline if entry.event == "took the drain"]
    assert taken and "'Prolog error' follows gpufleet's health check" in taken[0].detail

    fleet = Fleet(node_drained=True, node_reason="Prolog error")
    async with worker(env, fleet):
        handle = await start(env.client, fleet)  # an Xid 79: its prolog's failure is not known to be ours
        waiting = await _until(handle, lambda s: s.outcome == Outcome.AWAITING_APPROVAL)
        assert "Prolog error" in (waiting.waiting_for_approval or "")
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="ops"))
        await handle.result()


async def test_a_hook_drain_is_not_taken_by_a_health_check_of_another_hook(env: WorkflowEnvironment) -> None:
    """A node drained "Prolog error" runs no prolog: a check that failed later, in the
    HealthCheckProgram (which runs on drained nodes too) or an epilog, did not make that prolog
    fail, so the drain stays someone else's (else the incident would resume a node drained for
    another reason)."""
    policy = Policy(kinds={GpuEventKind.HEALTH_CHECK: Action.REPLACE_NODE})
    for reason, message in (("Prolog error", "healthcheck: gpu_count"), ("Prolog error", "epilog: gpu_lost")):
        fleet = Fleet(node_drained=True, node_reason=reason, policy=policy)
        async with worker(env, fleet):
            handle = await start(env.client, fleet, kind=GpuEventKind.HEALTH_CHECK, xid=None, message=message)
            waiting = await _until(handle, lambda s: s.outcome == Outcome.AWAITING_APPROVAL)
            assert reason in (waiting.waiting_for_approval or ""), message
            await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="ops"))
            await handle.result()
        assert not any(r.startswith("gpufleet:") for r in fleet.drain_reasons), message


async def test_an_xid_on_a_retired_node_is_recorded_without_a_second_spare(env: WorkflowEnvironment) -> None:
    fleet = Fleet(pool="retired")
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.ALREADY_RETIRED
    assert "claim_spare" not in fleet.calls and "drain_slurm_node" not in fleet.calls


async def test_a_node_awaiting_repair_goes_on_only_for_a_worse_action(env: WorkflowEnvironment) -> None:
    reason = "gpufleet: xid 48 RESET_GPU incident lab-gpu1-20261201T000000Z"
    fleet = Fleet(node_drained=True, node_reason=reason)
    async with worker(env, fleet):
        same = await (await start(env.client, fleet, xid=48)).result()
        assert same.outcome == Outcome.AWAITING_REPAIR
        assert "drain_slurm_node" not in fleet.calls
        worse = await (await start(env.client, fleet, xid=79)).result()
    assert worse.outcome == Outcome.RESOLVED
    assert worse.action == Action.REPLACE_NODE


async def test_a_failed_incident_releases_its_unused_claim(env: WorkflowEnvironment) -> None:
    fleet = Fleet(spare_free=False, retire_fails=True)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    assert "release_spare" in fleet.calls
    assert "notify:failed" in fleet.calls


async def test_a_kubernetes_drain_that_fails_beside_the_claim_fails_the_incident_at_the_drain(
    env: WorkflowEnvironment,
) -> None:
    """The claim enters its step after the drain (they run side by side): a drain that cannot go
    on (a pod its budget protects past the eviction timeout) still fails the incident at
    drain_kubernetes, which is what the owner and the page are told."""
    refused = "slurm-lab/lab-train-2 did not leave gpu1 within 5 s: a PodDisruptionBudget protects it"
    fleet = Fleet(spare_free=False, kube_drain_refused=refused)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
    assert status.outcome == Outcome.FAILED and status.step == Step.DRAIN_KUBERNETES
    assert [e.step for e in status.timeline if e.event == "failed"] == [Step.DRAIN_KUBERNETES]
    [failed] = [n for n in fleet.notifications if n.kind == "failed"]
    assert "stopped at drain_kubernetes" in failed.text and refused in failed.text
    assert "release_spare" in fleet.calls


async def test_a_week_without_a_spare_keeps_each_history_small(env: WorkflowEnvironment) -> None:
    fleet = Fleet(spare_free=False, settings=RemediationSettings(spare_recheck_seconds=600))
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        first_run = handle.result_run_id
        for _quarter_day in range(7 * 4):  # one call skipping a week can outlast its RPC on a loaded machine
            await env.sleep(6 * 3600)
        # Off the instant a recheck timer fires: the test server cannot take a timer cancelled in
        # the task it fires during.
        await env.sleep(17)
        fleet.spare_free = True
        await handle.signal(NodeRemediationWorkflow.spare_available)
        status = await env.client.get_workflow_handle(handle.id, result_type=IncidentStatus).result()
        sizes = []
        run_id: str | None = first_run
        while run_id:  # follow the chain of runs, each continued as new from the one before
            history = await env.client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
            sizes.append(len(history.events))
            last = history.events[-1].workflow_execution_continued_as_new_event_attributes
            run_id = last.new_execution_run_id or None
    assert status.outcome == Outcome.RESOLVED
    assert status.spare == "spare1"
    assert status.requeued == [7]
    assert fleet.calls.count("notify:no_spare") == 1
    assert len(sizes) > 10, sizes  # a week of checks every 10 minutes, in several runs
    assert max(sizes) < 500, sizes


async def _until(handle: Any, predicate: Any, timeout: float = 30) -> IncidentStatus:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        if predicate(status):
            return status
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"incident never reached the state; last: {status.step} {status.outcome}")
        await asyncio.sleep(0.05)


async def test_an_xid_arriving_while_the_incident_closes_opens_the_next_one(env: WorkflowEnvironment) -> None:
    fleet = Fleet(notify_gate=asyncio.Event())
    async with worker(env, fleet):
        handle = await start(env.client, fleet, xid=13)  # an application error: recorded, closed at once
        closing = await _until(handle, lambda s: s.step == Step.CLOSED)
        assert closing.outcome == Outcome.OBSERVED  # its message is still going out
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=79, source="test"))
        fleet.notify_gate.set()  # type: ignore[union-attr]
        latest = env.client.get_workflow_handle(handle.id, result_type=IncidentStatus)
        status = await latest.result()
    assert status.xids == [79]
    assert status.action == Action.REPLACE_NODE
    assert status.outcome == Outcome.RESOLVED
    assert status.timeline[0].at >= closing.timeline[-1].at  # a new incident, after the first closed


def an_sxid(severity: str) -> int:
    return next(code for code, entry in sorted(sxid_catalog().items()) if entry.severity == severity)


@pytest.mark.parametrize(
    ("kind", "code", "reason_starts", "label"),
    [
        (GpuEventKind.SXID, an_sxid("fatal"), f"gpufleet: sxid {an_sxid('fatal')} REPLACE_NODE", "SXid"),
        (GpuEventKind.INIT_FAILED, None, "gpufleet: init_failed REPLACE_NODE", "init_failed"),
        (GpuEventKind.BUS_LOST, None, "gpufleet: xid 79 REPLACE_NODE", "bus_lost (Xid 79)"),
    ],
)
async def test_events_without_a_gpu_xid_replace_the_node_under_their_own_name(
    env: WorkflowEnvironment, kind: GpuEventKind, code: int | None, reason_starts: str, label: str
) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, fleet, kind=kind, xid=code)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE
    assert fleet.drain_reasons[0].startswith(reason_starts)
    assert status.events[0].startswith(label)
    assert status.xids == ([79] if kind is GpuEventKind.BUS_LOST else [])
    assert label.split()[0] in fleet.notifications[0].text


async def test_a_non_fatal_sxid_is_only_recorded(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, fleet, kind=GpuEventKind.SXID, xid=an_sxid("non-fatal"))
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.OBSERVED
    assert "drain_slurm_node" not in fleet.calls


async def test_the_drain_reason_names_the_event_that_decided(env: WorkflowEnvironment) -> None:
    """A non-fatal SXid first, then Xid 79: the node is drained for the Xid, and says so."""
    fleet = Fleet()
    sxid = XidEvent(node="gpu1", kind=GpuEventKind.SXID, xid=an_sxid("non-fatal"), source="test")
    both = RemediationInput(
        cluster=fleet.cluster,
        node="gpu1",
        search_attributes=False,
        pending_events=[sxid, XidEvent(node="gpu1", xid=79, source="test")],
    )
    async with worker(env, fleet):
        workflow_id = f"remediate-{fleet.cluster}-gpu1"
        handle = await env.client.start_workflow(
            NodeRemediationWorkflow.run, both, id=workflow_id, task_queue=task_queue(fleet.cluster)
        )
        status: IncidentStatus = await handle.result()
    assert status.events == [sxid.label, "Xid 79"]
    assert status.action == Action.REPLACE_NODE
    assert fleet.drain_reasons[0].startswith("gpufleet: xid 79 REPLACE_NODE")


async def test_jobs_the_failure_ended_are_requeued_at_once_and_a_lost_one_is_never_resolved(
    env: WorkflowEnvironment,
) -> None:
    """The rank on the failed GPU crashed its job before the incident looked (FAILED); another
    job had COMPLETED, another was cancelled by its owner, one FAILED with --no-requeue and one
    slurmctld already purged (only the accounting database knows it). The crashed job is requeued
    right after the drain, before the guard is asked; the finished and cancelled ones are left
    alone; the two that cannot run again are named to their owners, and the incident closes
    jobs_lost, not resolved."""
    fleet = Fleet()
    fleet.jobs = [
        JobInfo(job_id=7, user="alice", state="RUNNING"),
        JobInfo(job_id=8, user="bob", state="FAILED"),
        JobInfo(job_id=9, user="carol", state="COMPLETED"),
        JobInfo(job_id=10, user="dan", state="CANCELLED"),
        JobInfo(job_id=11, user="erin", state="FAILED"),
        JobInfo(job_id=12, user="finn", state="NODE_FAIL", in_controller=False),
    ]
    fleet.unrequeueable = {11}
    async with worker(env, fleet):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.outcome == Outcome.JOBS_LOST
    assert status.ended == [8] and sorted(status.requeued) == [7, 8] and sorted(status.ran_again) == [7, 8]
    assert sorted(status.unrequeued) == [11, 12] and "MinJobAge" in status.unrequeued[12]
    assert set(status.skipped) == {9, 10}
    requeues = [c for c in fleet.calls if c.startswith("requeue_job:")]
    # The crashed job's requeue came before anything waited, before the running one was signalled.
    assert fleet.calls.index("requeue_job:8") < fleet.calls.index("signal_job:7")
    assert "requeue_job:9" not in requeues and "requeue_job:10" not in requeues
    [unrequeued] = [n for n in fleet.notifications if n.kind == "unrequeued"]
    assert "erin" in unrequeued.text and "finn" in unrequeued.text and "resubmit" in unrequeued.text
    [closing] = [n for n in fleet.notifications if n.kind == "jobs_lost"]
    assert "2 job(s) running again; 2 could not be" in closing.text


async def test_a_job_the_failure_ends_while_the_incident_waits_is_requeued_meanwhile(
    env: WorkflowEnvironment,
) -> None:
    """The node's owner drained it; the incident waits for their word. Its job still ran when it
    looked, then a hung rank's watchdog ends it FAILED: it is requeued within minutes, while the
    wait goes on, not after it (by then slurmctld may have forgotten it)."""
    fleet = Fleet(node_drained=True, node_reason="bob: swapping the NIC, back at 3pm")
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        await _until(handle, lambda s: s.outcome == Outcome.AWAITING_APPROVAL)
        fleet.jobs = [JobInfo(job_id=7, user="alice", state="FAILED")]  # its watchdog ended it
        await env.sleep(timedelta(minutes=3))  # the server's clock: the next look is due
        waiting = await _until(handle, lambda s: s.ended == [7])
        assert waiting.outcome == Outcome.AWAITING_APPROVAL and waiting.requeued == [7]
        assert "signal_job:7" not in fleet.calls  # never signalled: it had ended
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=True, by="bob"))
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.ran_again == [7]
    assert fleet.calls.count("requeue_job:7") == 1
