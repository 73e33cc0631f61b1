"""Stand-ins for the activities gpufleet's remediation and fleet guard workflows call, over a
simulated world (sim/world.py), registered under the real activity names.

Each one reads the simulated time the server scheduled it at, brings the world up to it, and acts
there at once: it never sleeps, never waits and never fails (the time-skipping server stalls
around retry backoff). A repair in place or a replacement takes its time in the world instead
(the node is usable again only after it). The guard's own Temporal plumbing (signal-with-start,
signals, describe) is the real GuardActivities.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity

from activities.guard import GuardActivities
from models.incident import JobInfo, JobRequeue, NodeInfo, RequeueOutcome
from models.policy import Action, Policy
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
    StopRepairsRequest,
    WorkerConfig,
)
from models.topology import DomainNodesRequest, DomainsRequest, NodeDomains
from models.validation import ProbationRequest, RungOutcome, RungRequest, RungResult
from sim.world import Job, Where, World

PARTITION = "train"
USER = "trainer"


@dataclass
class SimFleet:
    """One what-if case: its cluster name, its world and the policy its worker reads."""

    cluster: str
    world: World
    policy: Policy
    start: datetime  # second 0 of the world, in the server's (simulated) time
    # Activities run, by name (how much of the workflows' work each part of the model costs).
    calls: Counter[str] = field(default_factory=Counter)

    def seconds(self, when: datetime) -> float:
        return (when - self.start).total_seconds()

    def time(self, seconds: float) -> datetime:
        return self.start + timedelta(seconds=seconds)

    def now(self) -> World:
        """The world brought up to the calling activity's time."""
        info = activity.info()
        self.calls[info.activity_type] += 1
        scheduled = info.current_attempt_scheduled_time
        self.world.advance(self.seconds(scheduled.astimezone(UTC)))
        return self.world

    def job_info(self, job: Job) -> JobInfo:
        world = self.world
        stamp = int(self.time(world.checkpoint_time(job, world.now)).timestamp())
        ended = self.time(job.ended_at) if job.ended_at is not None else None
        return JobInfo(
            job_id=job.job_id,
            name=f"train-{job.job_id}",
            user=USER,
            state=job.state,
            restarts=job.restarts,
            nodes=",".join(job.nodes),
            start_time=self.time(job.start),
            end_time=ended,
            comment=f"gpufleet:checkpoint:{stamp}",
            gpus=job.gpus,
        )

    def activities(self) -> list[Callable[..., Any]]:
        """Every activity the remediation and guard workflows call, for this case's workers."""
        fleet = self

        @activity.defn(name="worker_config")
        async def worker_config(cluster: str) -> WorkerConfig:
            return WorkerConfig(cluster=cluster, settings=fleet.policy.remediation, policy=fleet.policy)

        @activity.defn(name="slurm_node_state")
        async def node_state(node: str) -> NodeInfo:
            world = fleet.now()
            found = world.nodes[node]
            flags = ["DRAIN"] if found.drained else []
            state = "allocated" if found.job is not None else "idle"
            return NodeInfo(name=node, state=state, flags=flags, reason=found.drained, partitions=[PARTITION])

        @activity.defn(name="kube_node_facts")
        async def node_facts(node: str) -> NodeFacts:
            found = fleet.now().nodes[node]
            return NodeFacts(pool="training", quarantine=found.quarantine)

        @activity.defn(name="guard_fleet_size")
        async def fleet_size() -> int:
            world = fleet.now()
            return sum(1 for node in world.nodes.values() if node.where is Where.PARTITION)

        @activity.defn(name="classify_xids")
        async def classify(request: ClassifyRequest) -> Action:
            return (request.policy or fleet.policy).decide(request.events)

        @activity.defn(name="notify")
        async def notify(request: NotifyRequest) -> int:
            return 0

        @activity.defn(name="drain_slurm_node")
        async def drain(request: DrainRequest) -> NodeInfo:
            world = fleet.now()
            node = world.drain(request.node, request.reason)
            state = "allocated" if node.job is not None else "idle"
            return NodeInfo(name=request.node, state=state, flags=["DRAIN"], reason=request.reason)

        @activity.defn(name="resume_slurm_node")
        async def resume_node(request: ResumeNodeRequest) -> NodeInfo:
            world = fleet.now()
            world.resume(request.node)
            return NodeInfo(name=request.node, state="idle", partitions=[PARTITION])

        @activity.defn(name="jobs_on_node")
        async def jobs_on_node(node: str) -> list[JobInfo]:
            world = fleet.now()
            return [fleet.job_info(job) for job in world.jobs_on(node)]

        @activity.defn(name="jobs_hit_by_failure")
        async def jobs_hit(request: FailureJobsRequest) -> list[JobInfo]:
            world = fleet.now()
            since = fleet.seconds(request.since)
            return [fleet.job_info(job) for job in world.jobs_on(request.node, since=since)]

        @activity.defn(name="signal_job")
        async def signal_job(request: SignalJobRequest) -> SignalJobResult:
            world = fleet.now()
            job = world.jobs[request.job_id]
            if job.state != "RUNNING":
                return SignalJobResult(job_id=job.job_id, signalled=False, why=f"not running ({job.state})")
            if job.restarts > request.restarts_before:
                return SignalJobResult(job_id=job.job_id, signalled=False, why="already restarted")
            world.signal(job.job_id)
            return SignalJobResult(job_id=job.job_id, signalled=True)

        @activity.defn(name="jobs_still_running")
        async def still_running(request: StillRunningRequest) -> list[int]:
            world = fleet.now()
            return [job_id for job_id in request.job_ids if world.jobs[job_id].state == "RUNNING"]

        @activity.defn(name="requeue_job")
        async def requeue_job(request: RequeueJobRequest) -> JobRequeue:
            world = fleet.now()
            job = world.jobs[request.job_id]
            if job.restarts > request.restarts_before:
                return JobRequeue(job_id=job.job_id, outcome=RequeueOutcome.SKIPPED, why="already restarted")
            if job.state == "PENDING":
                return JobRequeue(job_id=job.job_id, outcome=RequeueOutcome.REQUEUED, why="already in the queue")
            if request.ended_by_failure and job.state not in ("NODE_FAIL", "FAILED"):
                return JobRequeue(job_id=job.job_id, outcome=RequeueOutcome.SKIPPED, why=f"ended {job.state}")
            if not request.signalled and not request.ended_by_failure and job.state != "RUNNING":
                return JobRequeue(job_id=job.job_id, outcome=RequeueOutcome.SKIPPED, why="had ended before")
            if request.dry_run:
                return JobRequeue(job_id=job.job_id, outcome=RequeueOutcome.REQUEUED, why="dry run")
            world.requeue(job.job_id)
            return JobRequeue(job_id=job.job_id, outcome=RequeueOutcome.REQUEUED, why="back in the queue")

        @activity.defn(name="jobs_resumed")
        async def resumed(request: ResumeCheckRequest) -> ResumeCheck:
            world = fleet.now()
            check = ResumeCheck()
            for job_id in request.job_ids:
                job = world.jobs[job_id]
                back = job.state == "RUNNING" and job.restarts > request.restarts_before.get(job_id, 0)
                (check.resumed if back else check.waiting).append(fleet.job_info(job))
            return check

        @activity.defn(name="take_node_lease")
        async def take_lease(request: NodeLeaseRequest) -> str:
            return ""

        @activity.defn(name="give_back_node_lease")
        async def give_back_lease(request: NodeLeaseRequest) -> bool:
            return True

        @activity.defn(name="cordon_and_drain_node")
        async def cordon(request: KubeDrainRequest) -> KubeDrainResult:
            return KubeDrainResult()

        @activity.defn(name="retire_node")
        async def retire(request: RetireRequest) -> None:
            if not request.dry_run:
                fleet.now().retire(request.node)

        @activity.defn(name="claim_spare")
        async def claim(request: ClaimRequest) -> str | None:
            world = fleet.now()
            if request.dry_run:
                return next((n.name for n in world.nodes.values() if n.where is Where.POOL), None)
            return world.claim(request.incident_id, request.node)

        @activity.defn(name="release_spare")
        async def release(request: ClaimRequest) -> str | None:
            return None

        @activity.defn(name="quarantine_node")
        async def quarantine(request: QuarantineRequest) -> None:
            fleet.now().nodes[request.node].quarantine = request.code or "quarantined"

        @activity.defn(name="repair_node")
        async def repair(request: RepairRequest) -> RepairResult:
            world = fleet.now()
            job = f"{request.action.value.lower()}-{request.attempt}"
            if request.dry_run or world.repair(request.node, request.action):
                return RepairResult(succeeded=True, job=job, detail=f"{request.action} held")
            return RepairResult(
                succeeded=False, job=job, detail=f"{request.action} did not hold: the GPU does not answer"
            )

        @activity.defn(name="start_reboot")
        async def start_reboot(request: RepairRequest) -> str:
            return f"reboot-{request.attempt}"

        @activity.defn(name="stop_repair_jobs")
        async def stop_repairs(request: StopRepairsRequest) -> list[str]:
            return []

        @activity.defn(name="validation_rung")
        async def run_rung(request: RungRequest) -> RungResult:
            return RungResult(name=request.rung.name, kind=request.rung.kind, outcome=RungOutcome.PASSED)

        @activity.defn(name="set_probation")
        async def set_probation(request: ProbationRequest) -> None:
            return None

        # The simulated fleet has no failure domains (racks, zones, switches): each node is in none.
        @activity.defn(name="node_domains")
        async def node_domains(request: DomainsRequest) -> NodeDomains:
            return NodeDomains(node=request.node)

        @activity.defn(name="domain_nodes")
        async def domain_nodes(request: DomainNodesRequest) -> list[str]:
            return []

        # The guard's plumbing is Temporal's own (signal-with-start, signals, describe): the real one.
        guard = GuardActivities(None, cluster=fleet.cluster, partition=PARTITION)  # type: ignore[arg-type]
        return [
            guard.request_slot,
            guard.drained,
            guard.answer,
            guard.tell,
            guard.running,
            fleet_size,
            node_facts,
            worker_config,
            node_state,
            classify,
            notify,
            drain,
            resume_node,
            jobs_on_node,
            jobs_hit,
            signal_job,
            still_running,
            requeue_job,
            resumed,
            take_lease,
            give_back_lease,
            cordon,
            retire,
            claim,
            release,
            quarantine,
            repair,
            start_reboot,
            stop_repairs,
            run_rung,
            set_probation,
            node_domains,
            domain_nodes,
        ]
