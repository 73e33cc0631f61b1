"""ReaperWorkflow: one per cluster (``reaper-{cluster}``), started by the cluster's workers.

Every few minutes it asks what incidents that no longer run still hold (activities/reaper.py)
and gives each thing back with the activities the incidents themselves use: the jobs such an
incident sent SIGTERM and never requeued are requeued (each guarded by its restart count), its
repair Jobs that still run are stopped, its unused spare claim is released and, last, its node's
lease is let go (so that a sweep cut short finds the incident again by its lease). The owner and
the operators are told once per incident what was given back and that the node stays drained.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.retries import HEARTBEAT, SHORT_STEP, STEP_RETRY

with workflow.unsafe.imports_passed_through():
    from activities.kube import KubeActivities
    from activities.notify import NotifyActivities
    from activities.policy import PolicyActivities
    from activities.reaper import ReaperActivities
    from activities.repair import RepairActivities
    from activities.slurm import SlurmActivities
    from activities.spares import SpareActivities
    from models.constants import REAPER_WORKFLOW
    from models.incident import JobRequeue, RequeueOutcome
    from models.requests import (
        ClaimRequest,
        Leftover,
        NodeLeaseRequest,
        NotifyRequest,
        ReaperInput,
        ReaperStatus,
        RequeueJobRequest,
        StopRepairsRequest,
        WorkerConfig,
    )

# Sweeps per run: the history stays small however long the reaper lives.
SWEEPS_PER_RUN = 100
# Each call gives up after a few minutes: the next sweep tries again.
BUDGET = timedelta(minutes=3)
# The lines kept in the status.
KEPT = 50


@workflow.defn(name=REAPER_WORKFLOW)
class ReaperWorkflow:
    @workflow.init
    def __init__(self, request: ReaperInput) -> None:
        self._status = ReaperStatus(cluster=request.cluster, sweeps=request.sweeps)
        self._sweep_now = False

    @workflow.query
    def status(self) -> ReaperStatus:
        return self._status

    @workflow.signal
    def sweep(self) -> None:
        """Look now rather than at the next period."""
        self._sweep_now = True

    @workflow.run
    async def run(self, request: ReaperInput) -> None:
        for _ in range(SWEEPS_PER_RUN):
            self._sweep_now = False
            await self._sweep(request.cluster)
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._sweep_now, timeout=timedelta(seconds=request.every_seconds))
        workflow.continue_as_new(request.model_copy(update={"sweeps": self._status.sweeps}))

    async def _call(self, method: Any, *args: Any, summary: str) -> Any:
        return await workflow.execute_activity_method(
            method,
            args=args,
            start_to_close_timeout=SHORT_STEP,
            schedule_to_close_timeout=BUDGET,
            heartbeat_timeout=HEARTBEAT,
            retry_policy=STEP_RETRY,
            summary=summary,
        )

    async def _sweep(self, cluster: str) -> None:
        status = self._status
        try:
            config: WorkerConfig = await self._call(
                PolicyActivities.worker_config, cluster, summary="read the repair namespace"
            )
            leftovers: list[Leftover] = await self._call(
                ReaperActivities.find_leftovers,
                config.policy.repair.namespace,
                summary="look for what stopped incidents still hold",
            )
        except ActivityError as exc:
            status.error = f"could not look: {exc.cause or exc}"
            return
        status.error = ""
        for leftover in leftovers:
            done, left = await self._give_back(leftover, config.policy.repair.namespace)
            line = f"{leftover.incident_id} ({leftover.ended}): " + "; ".join(done or ["nothing given back"])
            if left:
                line += "; not yet: " + "; ".join(left)
            status.reaped = [*status.reaped, line][-KEPT:]
            if done:
                await self._tell(leftover, done)
        status.sweeps += 1
        status.last_sweep = workflow.now()

    async def _give_back(self, leftover: Leftover, namespace: str) -> tuple[list[str], list[str]]:
        """Give back what ``leftover`` holds, the lease last; returns (done, not done)."""
        done: list[str] = []
        left: list[str] = []
        incident = leftover.incident_id
        for job in leftover.requeue:
            try:
                requeue: JobRequeue = await self._call(
                    SlurmActivities.requeue_job,
                    RequeueJobRequest(
                        job_id=job.job_id, restarts_before=job.restarts_before, signalled=True, incident_id=incident
                    ),
                    summary=f"requeue job {job.job_id} of {incident}",
                )
            except ActivityError as exc:
                left.append(f"job {job.job_id} not requeued ({exc.cause or exc})")
                continue
            if requeue.outcome is RequeueOutcome.REQUEUED:
                done.append(f"job {job.job_id} requeued")
            elif requeue.outcome is RequeueOutcome.FAILED:
                done.append(f"job {job.job_id} could not be requeued ({requeue.why}): resubmit it")
        steps: list[tuple[bool, Any, Any, str, str]] = [
            (
                bool(leftover.repair_jobs),
                RepairActivities.stop_repairs,
                StopRepairsRequest(
                    incident_id=incident, namespace=namespace, why=f"stopped: incident {incident} {leftover.ended}"
                ),
                f"repair Job(s) {', '.join(leftover.repair_jobs)} stopped",
                "its repair Jobs",
            ),
            (
                bool(leftover.claim),
                SpareActivities.release_spare,
                ClaimRequest(incident_id=incident, unused_only=True),
                f"claim on spare {leftover.claim} released",
                f"the claim on {leftover.claim}",
            ),
        ]
        for wanted, method, request, said, what in steps:
            if not wanted:
                continue
            try:
                await self._call(method, request, summary=said)
                done.append(said)
            except ActivityError as exc:
                left.append(f"{what} ({exc.cause or exc})")
        if leftover.lease and not left:  # the lease last: a sweep cut short finds the incident again
            try:
                await self._call(
                    KubeActivities.give_back_node_lease,
                    NodeLeaseRequest(node=leftover.node, holder=incident),
                    summary=f"let go of {leftover.node}",
                )
                done.append(f"lease on {leftover.node} let go")
            except ActivityError as exc:
                left.append(f"the lease on {leftover.node} ({exc.cause or exc})")
        return done, left

    async def _tell(self, leftover: Leftover, done: list[str]) -> None:
        """Once per incident and sweep: what was given back, and that the node is a person's now."""
        text = (
            f"[{leftover.incident_id}] {leftover.node}: the incident {leftover.ended} without giving back what it "
            f"held; gpufleet's reaper did: {'; '.join(done)}. {leftover.node} stays as the incident left it "
            f"(drained in Slurm if it was): `gpufleet nodes return {leftover.node}` once it is checked."
        )
        with contextlib.suppress(ActivityError):
            await self._call(
                NotifyActivities.notify, NotifyRequest(kind="incident_reaped", text=text), summary="tell the operators"
            )
