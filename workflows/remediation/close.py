"""How an incident ends, whichever way: a lemon quarantined, the guard's slot and the node's lease
given back, an unused spare released, the last messages out, and Xids that came too late for
this incident carried into the node's next one. An incident that cannot go on fails at its step,
says why to the owner and the operators, and is counted."""

from __future__ import annotations

import contextlib

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, RetryState, TimeoutType
from temporalio.exceptions import TimeoutError as ActivityTimeout

from workflows.patches import CANCEL_CLEANS_UP, PAGE_ON_FAILURE
from workflows.remediation.notify import Notifications
from workflows.remediation.slot import GuardSlot
from workflows.retries import SPARE_STEP

with workflow.unsafe.imports_passed_through():
    from activities.kube import KubeActivities
    from activities.repair import RepairActivities
    from activities.slurm import SlurmActivities
    from activities.spares import SpareActivities
    from models.constants import NODE_LEASE_ANNOTATION, QUARANTINE_LABEL, REPAIR_LABEL
    from models.incident import CancelRequest, JobRequeue, Outcome, RemediationInput, RequeueOutcome, Step
    from models.metrics import INCIDENTS_FAILED, INCIDENTS_FAILED_HELP
    from models.requests import ClaimRequest, NodeLeaseRequest, QuarantineRequest, RequeueJobRequest, StopRepairsRequest


def _gave_up(exc: ActivityError) -> bool:
    """The activity was retried until its budget (schedule-to-close) ran out."""
    cause = exc.cause
    return exc.retry_state == RetryState.TIMEOUT or (
        isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.SCHEDULE_TO_CLOSE
    )


def _last_failure(exc: ActivityError) -> BaseException | None:
    """What the activity's last attempt failed with (a budget that ran out during an attempt
    carries the attempt before's failure, if there was one)."""
    cause = exc.cause
    if isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.SCHEDULE_TO_CLOSE:
        return cause.cause
    return cause


def failure_text(exc: ActivityError | ApplicationError) -> str:
    """What stopped the incident, in one line: the error, and why it was not tried again."""
    if not isinstance(exc, ActivityError):
        return str(exc)
    last = _last_failure(exc)
    text = str(last if last is not None else exc.cause or exc)
    if _gave_up(exc):
        return f"{text} (the step's retry budget ran out)"
    if exc.retry_state == RetryState.MAXIMUM_ATTEMPTS_REACHED:
        return f"{text} (the step's attempts ran out)"
    return text


def failure_type(exc: ActivityError | ApplicationError) -> str:
    """The failure's type for the incident's own error and the metric: the error type an activity
    raised (Unavailable, NotFound, PolicyInvalid, ...), Timeout, or RemediationFailed."""
    last = _last_failure(exc) if isinstance(exc, ActivityError) else exc
    if isinstance(last, ApplicationError) and last.type:
        return last.type
    if isinstance(last, ActivityTimeout) or (isinstance(exc, ActivityError) and isinstance(exc.cause, ActivityTimeout)):
        return "Timeout"
    return "RemediationFailed"


class Closing(GuardSlot, Notifications):
    """How the incident ends, whichever way it ends."""

    async def _record_only(self, outcome: Outcome, kind: str, text: str) -> None:
        """Close without touching the node: the outcome, one message to the owner, the close."""
        self._status.outcome = outcome
        self._notify(kind, f"{self._message_prefix()}: {text}")
        await self._close()

    async def _close(self) -> None:
        await self._quarantine()
        await self._release_slot(self._status.outcome.value)
        await self._give_back_node()
        self._enter(Step.CLOSED)
        self._mark(Step.CLOSED, self._status.outcome.value)
        self._settle_ledger()
        self._count_closed()
        await self._flush_notifications()
        late = self._events[self._events_classified :]
        if late and self._events_classified:
            # Xids that arrived after the last classification (while messages were still going
            # out) would be lost with this run: they open the node's next incident instead.
            workflow.continue_as_new(
                RemediationInput(
                    cluster=self._input.cluster,
                    node=self._input.node,
                    search_attributes=self._input.search_attributes,
                    pending_events=late,
                    dry_run=self._dry_run,
                )
            )

    async def _fail(self, exc: ActivityError | ApplicationError) -> ApplicationError:
        """The incident cannot go on: it fails at its step, with the error. It gives back what it
        holds (an unused spare claim, its guard slot, its node's lease; each bounded, and only
        tried once it has failed: workflows/retries.py), never resumes the node (drained, it waits
        for a person), tells the owner and pages the operators. Returns the workflow's failure."""
        status = self._status
        self._cancel_handled = True  # a cancel now must not cut the release short
        message = failure_text(exc)
        status.outcome = Outcome.FAILED
        status.error = message
        self._mark(status.step, "failed", message)
        self._count_failed(failure_type(exc))
        self._count_closed()
        self._settle_ledger()
        await self._release_unused_claim()
        await self._release_slot(f"failed: {message}")
        await self._give_back_node()
        # Never fail silently: tell the owner and the operators (beside the flow; bounded).
        self._notify("failed", f"{self._message_prefix()}: gpufleet stopped at {status.step}: {message}")
        if workflow.patched(PAGE_ON_FAILURE):
            self._notify("incident_failed", self._failure_page(message))
        await self._flush_notifications()
        return ApplicationError(
            f"incident {status.incident_id} failed at {status.step}: {message}",
            type=failure_type(exc),
            non_retryable=True,
        )

    def _cancel_asked(self) -> bool:
        """Whether an activity's cancel that reached the flow counts as the incident's cancel: only
        a cancel of the workflow cancels its activities (a branch cancelled because the other
        failed raises that failure). Before v0.3.0 the incident failed instead."""
        return workflow.patched(CANCEL_CLEANS_UP)

    async def _cancelled(self) -> None:
        """Stopped by a person: give back what the incident holds and say what it leaves.

        Before v0.3.0 (patch cancel-cleans-up) a cancel gave back the claim, the slot and the
        lease only. Since, it also requeues the jobs it signalled and had not requeued, stops its
        repair Jobs, closes ``cancelled`` and tells the owner what stays drained."""
        status = self._status
        self._cancel_handled = True
        if not workflow.patched(CANCEL_CLEANS_UP):
            status.outcome = Outcome.FAILED
            status.error = "cancelled"
            self._mark(status.step, "cancelled")
            self._count_failed("cancelled")
            self._count_closed()
            self._settle_ledger()
            await self._release_unused_claim()
            await self._release_slot("cancelled")
            await self._give_back_node()
            self._notify("cancelled", f"{self._message_prefix()}: the incident was cancelled at {status.step}.")
            await self._flush_notifications()
            return
        stopped_at = status.step
        status.outcome = Outcome.CANCELLED  # from here each call retries for minutes, not a quarter hour
        request = self._cancel_request or CancelRequest()
        status.cancelled = f"by {request.by or '?'}" + (f": {request.reason}" if request.reason else "")
        self._mark(stopped_at, "cancelled", status.cancelled)
        self._count_closed()
        left: list[str] = []
        requeued_all = await self._requeue_signalled(left)
        await self._stop_repairs(left)
        await self._release_unused_claim()
        await self._release_slot("cancelled")
        if requeued_all:
            await self._give_back_node()
        else:  # the reaper finds the incident by its lease and requeues what is left
            left.append(f"{self._input.node} stays leased to the incident until the cluster's reaper requeues them")
        node = self._input.node
        if self._took_node_out:
            left.append(f"{node} stays drained in Slurm: `gpufleet nodes return {node}` once it is checked")
        if status.node_leased and requeued_all:
            left.append(f"its lease could not be given back (`kubectl annotate node {node} {NODE_LEASE_ANNOTATION}-`)")
        status.left = left
        self._enter(Step.CLOSED)
        self._mark(Step.CLOSED, Outcome.CANCELLED.value, "; ".join(left))
        self._settle_ledger()
        self._notify(
            "cancelled",
            f"{self._message_prefix()}: cancelled at {stopped_at} {status.cancelled}. "
            + ("; ".join(left) + "." if left else "Nothing was changed."),
        )
        await self._flush_notifications()

    async def _requeue_signalled(self, left: list[str]) -> bool:
        """The jobs this incident sent SIGTERM and has not requeued go back in the queue now
        (each guarded by its restart count, as in the flow): none is left to end on the node.
        False when a requeue could not be made (Slurm away): named in ``left``."""
        status = self._status
        done = {*status.requeued, *status.unrequeued, *status.skipped}
        pending = [job_id for job_id in status.signalled if job_id not in done]
        if not pending or self._dry_run:
            return True
        all_made = True
        for job_id in pending:
            try:
                requeue: JobRequeue = await self._activity(
                    SlurmActivities.requeue_job,
                    RequeueJobRequest(
                        job_id=job_id,
                        restarts_before=self._restarts_before.get(job_id, 0),
                        signalled=True,
                        incident_id=status.incident_id,
                    ),
                    summary=f"requeue job {job_id} (cancelled)",
                )
            except ActivityError as exc:
                all_made = False
                left.append(f"job {job_id} was sent SIGTERM and not requeued yet ({exc.cause or exc})")
                continue
            if requeue.outcome is RequeueOutcome.REQUEUED:
                status.requeued.append(job_id)
            elif requeue.outcome is RequeueOutcome.SKIPPED:
                status.skipped.setdefault(job_id, requeue.why)
            else:
                status.unrequeued[job_id] = requeue.why
                left.append(f"job {job_id} could not be requeued ({requeue.why}): resubmit it")
        self._mark(status.step, "requeued", f"{len(pending)} signalled job(s) on cancel")
        return all_made

    async def _stop_repairs(self, left: list[str]) -> None:
        """A repair Job of this incident that still runs is stopped (suspended, with why)."""
        if not self._repair_started or self._dry_run or self._policy is None:
            return
        namespace = self._policy.repair.namespace
        try:
            stopped: list[str] = await self._activity(
                RepairActivities.stop_repairs,
                StopRepairsRequest(
                    incident_id=self._status.incident_id,
                    namespace=namespace,
                    why=f"stopped: incident {self._status.incident_id} was cancelled",
                ),
                summary="stop the incident's repair Jobs",
            )
        except ActivityError:
            left.append(f"its repair Jobs in {namespace} could not be checked (Jobs labelled {REPAIR_LABEL})")
            return
        if stopped:
            self._mark(self._status.step, "stopped", f"repair Job(s) {', '.join(stopped)}")

    def _failure_page(self, message: str) -> str:
        """The operators' page: where the incident stopped, why, and what it left for a person."""
        status, node = self._status, self._input.node
        left = [
            f"{node} stays drained in Slurm for a person to look at"
            if self._took_node_out
            else f"{node} was not changed"
        ]
        if status.node_leased:
            left.append(f"its lease could not be given back (`kubectl annotate node {node} {NODE_LEASE_ANNOTATION}-`)")
        return (
            f"{self._message_prefix()}: incident failed at {status.step}: {message}. {'; '.join(left)}. "
            f"`gpufleet incidents show {workflow.info().workflow_id}` has its timeline."
        )

    def _count_failed(self, error: str) -> None:
        """The incident in gpufleet_incidents_failed_total, by the step it stopped at (before
        _count_closed, which counts every incident once)."""
        if self._counted_in_metrics or self._dry_run or workflow.unsafe.is_replaying():
            return
        workflow.metric_meter().create_counter(INCIDENTS_FAILED, INCIDENTS_FAILED_HELP).add(
            1, {"cluster": self._input.cluster, "step": self._status.step.value, "error": error}
        )

    async def _quarantine(self) -> None:
        """A lemon this incident took out of service stays out: labelled quarantined."""
        status = self._status
        if not (status.quarantine_label and self._took_node_out) or status.quarantined:
            return
        await self._activity(
            SpareActivities.quarantine_node,
            QuarantineRequest(
                node=self._input.node,
                code=status.quarantine_label,
                reason=status.quarantine,
                incident_id=status.incident_id,
            ),
            summary=f"quarantine {self._input.node}",
            timeout=SPARE_STEP,
        )
        status.quarantined = True
        self._mark(status.step, "quarantined", f"{QUARANTINE_LABEL}={status.quarantine_label}: {status.quarantine}")
        self._notify(
            "quarantined",
            f"{self._message_prefix()}: {self._input.node} is quarantined ({status.quarantine}): never a spare, and "
            f"`gpufleet nodes return` refuses it until `gpufleet nodes release {self._input.node}`.",
        )

    async def _give_back_node(self) -> None:
        """Let go of the node's lease: nothing of this incident changes it any more (a retired or
        quarantined node stays out of every pool by its labels, not by the lease)."""
        if not self._status.node_leased:
            return
        with contextlib.suppress(ActivityError):
            await self._activity(
                KubeActivities.give_back_node_lease,
                NodeLeaseRequest(node=self._input.node, holder=self._status.incident_id),
                summary=f"let go of {self._input.node}",
            )
            self._status.node_leased = False

    async def _release_unused_claim(self) -> None:
        """A spare claimed but never brought into service goes back to the pool."""
        if self._status.spare is not None or not self._claim_attempted or self._dry_run:
            return
        with contextlib.suppress(ActivityError):
            released = await self._activity(
                SpareActivities.release_spare,
                ClaimRequest(incident_id=self._status.incident_id),
                summary="release an unused spare claim",
                timeout=SPARE_STEP,
            )
            if released:
                self._mark(self._status.step, "released", f"claim on {released} released")
