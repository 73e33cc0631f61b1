"""NodeRemediationWorkflow: one incident on one node, from Xid to resumed jobs.

Steps (DESIGN.md): classify, notify, drain in Slurm, SIGTERM and wait for checkpoints,
requeue, approve, then the failed node's cordon/drain/retire side by side with the
spare's claim, and finally watch the jobs run again.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.errors import NON_RETRYABLE
    from activities.kube import KubeActivities
    from activities.notify import NotifyActivities
    from activities.policy import PolicyActivities
    from activities.slurm import SlurmActivities
    from activities.spares import SpareActivities
    from models.constants import REMEDIATION_WORKFLOW, SA_CLUSTER, SA_GPU_NODE, SA_STEP, SA_XID, drain_reason
    from models.incident import IncidentStatus, JobInfo, Outcome, RemediationInput, Step, TimelineEntry
    from models.policy import Action
    from models.requests import (
        ClaimRequest,
        ClassifyRequest,
        DrainRequest,
        KubeDrainRequest,
        NotifyRequest,
        SignalJobsRequest,
        StillRunningRequest,
        WaitJobsRequest,
    )
    from models.xid import XidEvent

# Slurm or Kubernetes being away is retried until they come back; wrong input is not.
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=15),
    non_retryable_error_types=list(NON_RETRYABLE),
)
SHORT = timedelta(seconds=60)
# Grace checks that watch the jobs inside the activity before the workflow falls back to timers
# (Temporal timers are not meant for sub-second waits).
WATCHED_CHECKS = 4
HEARTBEAT = timedelta(seconds=30)


@workflow.defn(name=REMEDIATION_WORKFLOW)
class NodeRemediationWorkflow:
    @workflow.init
    def __init__(self, params: RemediationInput) -> None:
        self._input = params
        self._events: list[XidEvent] = []
        self._checkpointed: set[int] = set()
        self._spare_signalled = False
        self._status = IncidentStatus(
            incident_id=f"{params.cluster}-{params.node}-{workflow.info().start_time:%Y%m%dT%H%M%SZ}",
            cluster=params.cluster,
            node=params.node,
        )

    # -- signals and query --------------------------------------------------------------------------

    @workflow.signal
    def report_xid(self, event: XidEvent) -> None:
        """Another Xid on this node joins the open incident."""
        self._events.append(event)
        if event.xid not in self._status.xids:
            self._status.xids.append(event.xid)
        self._mark(self._status.step, "xid", f"Xid {event.xid} from {event.source}")

    @workflow.signal
    def checkpoint_done(self, job_id: int) -> None:
        """The job saved its checkpoint: its grace period may end now."""
        self._checkpointed.add(job_id)
        if job_id not in self._status.checkpointed:
            self._status.checkpointed.append(job_id)

    @workflow.signal
    def spare_available(self) -> None:
        self._spare_signalled = True

    @workflow.query
    def status(self) -> IncidentStatus:
        return self._status

    # -- run ----------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, params: RemediationInput) -> IncidentStatus:
        try:
            await self._remediate(params)
        except ActivityError as exc:
            cause = exc.cause
            message = str(cause) if cause else str(exc)
            self._status.outcome = Outcome.FAILED
            self._status.error = message
            self._mark(self._status.step, "failed", message)
            # Never fail silently: tell the owner, if the notifier itself still works.
            with contextlib.suppress(ActivityError):
                await self._notify("failed", f"{self._who()}: gpufleet stopped at {self._status.step}: {message}")
            raise ApplicationError(
                f"incident {self._status.incident_id} failed at {self._status.step}: {message}",
                type=getattr(cause, "type", None) or "RemediationFailed",
                non_retryable=True,
            ) from exc
        return self._status

    async def _remediate(self, params: RemediationInput) -> None:
        status = self._status
        try:
            await workflow.wait_condition(lambda: bool(self._events), timeout=timedelta(minutes=5))
        except TimeoutError:
            raise ApplicationError("no Xid was reported to this incident", non_retryable=True) from None
        if params.search_attributes:
            workflow.upsert_search_attributes(
                [
                    SA_GPU_NODE.value_set(params.node),
                    SA_CLUSTER.value_set(params.cluster),
                    SA_XID.value_set(self._events[0].xid),
                ]
            )

        # 1. classify (and check the node exists before anything is changed)
        self._enter(Step.CLASSIFY)
        await self._activity(SlurmActivities.node_state, params.node, summary=f"look up {params.node} in Slurm")
        status.action = await self._classify()
        self._done(Step.CLASSIFY, f"{status.action} for Xid {', '.join(map(str, status.xids))}")
        if status.action is Action.OBSERVE:
            status.outcome = Outcome.OBSERVED
            await self._notify("observed", f"{self._who()}: Xid {status.xids} recorded; no action needed.")
            await self._close()
            return

        # 2. notify
        self._enter(Step.NOTIFY)
        await self._notify(
            "opened",
            f"{self._who()}: Xid {status.xids[0]} -> {status.action}. gpufleet is draining the node, "
            "checkpointing and requeueing its jobs. No action is needed from you.",
        )
        self._done(Step.NOTIFY)

        # 3. drain in Slurm
        self._enter(Step.DRAIN_SLURM)
        node = await self._activity(
            SlurmActivities.drain_node,
            DrainRequest(node=params.node, reason=drain_reason(xid=status.xids[0], incident_id=status.incident_id)),
            summary=f"drain {params.node} in Slurm",
        )
        self._done(Step.DRAIN_SLURM, f"state={node.state} reason={node.reason!r}")

        # 4. SIGTERM, and wait for checkpoints
        self._enter(Step.CHECKPOINT)
        status.jobs = await self._activity(
            SlurmActivities.jobs_on_node, params.node, summary=f"list jobs on {params.node}"
        )
        job_ids = [job.job_id for job in status.jobs]
        if job_ids:
            await self._activity(
                SlurmActivities.signal_jobs,
                SignalJobsRequest(job_ids=job_ids),
                summary=f"SIGTERM jobs {', '.join(map(str, job_ids))}",
            )
            detail = await self._grace(job_ids, params.grace_seconds)
        else:
            detail = "no jobs on the node"
        self._done(Step.CHECKPOINT, detail)

        # 5. requeue
        self._enter(Step.REQUEUE)
        restarts_before = {job.job_id: job.restarts for job in status.jobs}
        if job_ids:
            result = await self._activity(
                SlurmActivities.requeue_jobs, job_ids, summary=f"requeue jobs {', '.join(map(str, job_ids))}"
            )
            status.unrequeued = result.failed
            if result.failed:
                await self._notify("unrequeued", self._unrequeued_text(result.failed))
        self._done(Step.REQUEUE, f"requeued {len(job_ids) - len(status.unrequeued)} of {len(job_ids)}")

        # 6. approve: later Xids may have made it worse
        self._enter(Step.APPROVE)
        status.action = await self._classify()
        if status.action is not Action.REPLACE_NODE:
            status.outcome = Outcome.AWAITING_REPAIR
            self._done(Step.APPROVE, f"{status.action}: node stays drained for repair")
            await self._notify(
                "awaiting_repair",
                f"{self._who()}: drained for {status.action}; jobs requeued. The node stays drained "
                "until it is repaired and resumed.",
            )
            await self._close()
            return
        self._done(Step.APPROVE, "REPLACE_NODE by policy")

        # 7 and 8, side by side: the failed node is retired while the spare joins, and the
        # jobs may run again as soon as the spare is in (9), whatever the retirement still does.
        requeued = [job_id for job_id in job_ids if job_id not in status.unrequeued]
        await asyncio.gather(
            self._retire(params),
            self._replace_and_resume(params, requeued, restarts_before),
        )
        status.outcome = Outcome.RESOLVED
        await self._notify(
            "resolved",
            f"{self._who()}: resolved. {params.node} replaced by {status.spare}; {len(requeued)} job(s) running again.",
        )
        await self._close()

    # -- branches -----------------------------------------------------------------------------------

    async def _retire(self, params: RemediationInput) -> None:
        self._enter(Step.DRAIN_KUBERNETES)
        drained = await self._activity(
            KubeActivities.cordon_and_drain,
            KubeDrainRequest(node=params.node, incident_id=self._status.incident_id),
            summary=f"cordon and drain {params.node} in Kubernetes",
            timeout=timedelta(minutes=10),
        )
        self._done(
            Step.DRAIN_KUBERNETES,
            "no Kubernetes node"
            if not drained.node_found
            else f"evicted {len(drained.evicted)}, forced {len(drained.forced)}",
        )
        self._enter(Step.RETIRE_NODE)
        await self._activity(SpareActivities.retire_node, params.node, summary=f"retire {params.node}")
        self._done(Step.RETIRE_NODE)

    async def _replace_and_resume(
        self, params: RemediationInput, requeued: list[int], restarts_before: dict[int, int]
    ) -> None:
        await self._bring_in_spare(params)
        self._enter(Step.RESUME)
        if not requeued:
            self._done(Step.RESUME, "no jobs to resume")
            return
        resumed: list[JobInfo] = await self._activity(
            SlurmActivities.wait_jobs_resumed,
            WaitJobsRequest(
                job_ids=requeued,
                timeout_seconds=params.resume_timeout_seconds,
                restarts_before=restarts_before,
            ),
            summary=f"wait for jobs {', '.join(map(str, requeued))} to run again",
            timeout=timedelta(seconds=params.resume_timeout_seconds + 60),
        )
        self._status.jobs = resumed
        self._done(Step.RESUME, ", ".join(f"{job.job_id} on {job.nodes}" for job in resumed))

    async def _bring_in_spare(self, params: RemediationInput) -> None:
        status = self._status
        self._enter(Step.CLAIM_SPARE)
        while True:
            spare = await self._activity(
                SpareActivities.claim_spare,
                ClaimRequest(incident_id=status.incident_id),
                summary="claim a spare",
            )
            if spare is not None:
                break
            if not status.waiting_for_spare:
                status.waiting_for_spare = True
                self._mark(Step.WAIT_FOR_SPARE, "started", "no free spare")
                await self._notify(
                    "no_spare",
                    f"{self._who()}: no free spare. {params.node} stays drained and its jobs are queued; "
                    "gpufleet takes the next spare that appears (signal spare_available to hurry it).",
                )
            self._spare_signalled = False
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._spare_signalled, timeout=timedelta(seconds=params.spare_recheck_seconds)
                )
        status.spare = spare
        status.waiting_for_spare = False
        self._done(Step.CLAIM_SPARE, f"{spare} joined the partition")

    async def _grace(self, job_ids: list[int], grace_seconds: float) -> str:
        """Wait until the jobs stopped or reported their checkpoints, at most the grace period.

        Most jobs save and exit within seconds of SIGTERM, so the first checks are activities
        that watch the jobs for up to a second each (noticing an exit within one worker poll).
        After that the workflow sleeps between checks on timers backing off from 1 s to 5 s,
        waking at once on ``checkpoint_done``: a full grace costs about thirty short activities.
        """
        deadline = workflow.now() + timedelta(seconds=grace_seconds)
        interval = 1.0
        check = 0
        while True:
            check += 1
            if all(job_id in self._checkpointed for job_id in job_ids):
                return "every job reported its checkpoint"
            remaining = (deadline - workflow.now()).total_seconds()
            watch = min(1.0, max(remaining, 0.0)) if check <= WATCHED_CHECKS else 0.0
            running: list[int] = await self._activity(
                SlurmActivities.still_running,
                StillRunningRequest(job_ids=job_ids, watch_seconds=watch),
                summary="check which jobs still run",
            )
            if not running:
                return "jobs exited after checkpointing"
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining <= 0:
                return f"grace of {grace_seconds:.0f}s over; {len(running)} job(s) still running"
            if check <= WATCHED_CHECKS:
                continue
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: all(job_id in self._checkpointed for job_id in job_ids),
                    timeout=timedelta(seconds=min(interval, remaining)),
                )
            interval = min(interval * 1.5, 5.0)

    # -- helpers ------------------------------------------------------------------------------------

    async def _classify(self) -> Action:
        action: Action = await self._activity(
            PolicyActivities.classify,
            ClassifyRequest(node=self._input.node, events=self._events),
            summary="classify the Xids",
        )
        return action

    async def _activity(self, method: Any, arg: Any, *, summary: str, timeout: timedelta = SHORT) -> Any:
        return await workflow.execute_activity_method(
            method,
            arg,
            start_to_close_timeout=timeout,
            heartbeat_timeout=HEARTBEAT if timeout > SHORT else None,
            retry_policy=RETRY,
            summary=summary,
        )

    async def _notify(self, kind: str, text: str) -> None:
        await self._activity(
            NotifyActivities.notify,
            NotifyRequest(kind=kind, text=text, incident=self._status),
            summary=f"notify: {kind}",
        )

    def _enter(self, step: Step) -> None:
        self._status.step = step
        self._mark(step, "started")
        # What the Temporal UI shows for the incident while it runs, and once it is over.
        workflow.set_current_details(
            f"{self._input.node} Xid {', '.join(map(str, self._status.xids))}: {step.value}, "
            f"outcome {self._status.outcome.value}"
        )
        if self._input.search_attributes:
            workflow.upsert_search_attributes([SA_STEP.value_set(step.value)])

    def _done(self, step: Step, detail: str = "") -> None:
        self._mark(step, "finished", detail)

    def _mark(self, step: Step, event: str, detail: str = "") -> None:
        self._status.timeline.append(TimelineEntry(step=step, event=event, at=workflow.now(), detail=detail))

    async def _close(self) -> None:
        self._enter(Step.CLOSED)
        self._mark(Step.CLOSED, self._status.outcome.value)

    def _who(self) -> str:
        return f"[{self._status.incident_id}] {self._input.node}"

    def _unrequeued_text(self, failed: dict[int, str]) -> str:
        owners = {job.job_id: job.user for job in self._status.jobs}
        lines = [f"job {job_id} (owner {owners.get(job_id, '?')}): {why}" for job_id, why in failed.items()]
        return f"{self._who()}: these jobs could not be requeued; please resubmit them:\n" + "\n".join(lines)
