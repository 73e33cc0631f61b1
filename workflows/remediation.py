"""NodeRemediationWorkflow: one incident on one node, from Xid to resumed jobs.

Steps (DESIGN.md): classify, notify, drain in Slurm, SIGTERM and wait for checkpoints,
requeue, approve, then the failed node's cordon/drain/retire side by side with the
spare's claim, and finally watch the jobs run again.

What keeps it safe away from the happy path:
- notifications run beside the flow, each attempt bounded, and never block or fail it;
- the worker's configuration (grace, timeouts, policy) is read once, through an activity;
- every activity is short or heartbeats, so a killed worker costs seconds;
- jobs are signalled and requeued one by one, guarded by their state and restart count;
- a node someone else drained waits for `gpufleet approve|reject`;
- the cluster's fleet guard (workflows/guard.py) grants a slot before the first destructive
  step, so a storm of Xids cannot take the whole cluster down; a node labelled
  gpufleet.io/remediation=disabled is only recorded; actions the policy names wait for approval;
- a long wait for a spare continues as new, so the history stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType

from workflows.retries import (
    HEARTBEAT,
    KUBE_DRAIN_STEP,
    NOTIFY_ATTEMPT,
    NOTIFY_BUDGET,
    NOTIFY_RETRY,
    RETRY_UNTIL_BACK,
    SHORT_STEP,
    SPARE_STEP,
)

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.kube import KubeActivities
    from activities.notify import NotifyActivities
    from activities.policy import PolicyActivities
    from activities.repair import RepairActivities
    from activities.slurm import SlurmActivities
    from activities.spares import SpareActivities
    from models.constants import (
        GUARD_ADMIT_SIGNAL,
        GUARD_DECISION_SIGNAL,
        GUARD_RELEASE_SIGNAL,
        POOL_RETIRED,
        QUARANTINE_LABEL,
        REMEDIATION_DISABLED,
        REMEDIATION_LABEL,
        REMEDIATION_WORKFLOW,
        SA_CLUSTER,
        SA_EVENT_KIND,
        SA_GPU_NODE,
        SA_STEP,
        SA_XID,
        drain_reason,
        drained_for,
        held_by_someone_else,
    )
    from models.guard import GuardCommand, GuardDecision, SlotRequest
    from models.incident import (
        Approval,
        CarriedIncident,
        IncidentStatus,
        JobInfo,
        JobRequeue,
        NodeInfo,
        NotificationRecord,
        Outcome,
        RemediationInput,
        RequeueOutcome,
        Step,
        TimelineEntry,
        seen,
    )
    from models.metrics import (
        INCIDENTS,
        INCIDENTS_HELP,
        STEP_DURATION,
        STEP_DURATION_HELP,
        STEP_STARTED,
        STEP_STARTED_HELP,
    )
    from models.policy import Action, OwnerDrained, Policy, RemediationSettings
    from models.requests import (
        ClaimRequest,
        ClassifyRequest,
        DrainRequest,
        KubeDrainRequest,
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
    from models.xid import XidEvent

# Grace checks that watch the jobs inside the activity before the workflow falls back to timers
# (Temporal timers are not meant for sub-second waits).
WATCHED_CHECKS = 4
# Resume checks that watch for up to RESUME_WATCH_SECONDS each before backing off on timers.
RESUME_WATCHED_CHECKS = 12
RESUME_WATCH_SECONDS = 5.0
# Spare checks per run before continuing as new (about ten history events each).
SPARE_CHECKS_PER_RUN = 30
# ... or sooner, when a run with many jobs has a long history already.
HISTORY_SOFT_LIMIT = 400
# Ask the fleet guard again when it has not answered within this (it may have been terminated),
# then twice as long each time, up to the most: each ask is one more signal in the guard's
# history and one more answer for it to send, so a busy guard is asked less and less often.
GUARD_ASK_AGAIN = timedelta(minutes=1)
GUARD_ASK_AGAIN_MOST = timedelta(minutes=8)
# While waiting at a tripped breaker, it is asked again this often.
GUARD_ASK_WHILE_WAITING = timedelta(minutes=30)


class _ContinueAsNew(Exception):
    """Raised inside the spare wait; the run continues as new once the other branch is done."""


@workflow.defn(name=REMEDIATION_WORKFLOW)
class NodeRemediationWorkflow:
    @workflow.init
    def __init__(self, params: RemediationInput) -> None:
        self._input = params
        self._checkpointed: set[int] = set()
        self._spare_signalled = False
        self._approval: Approval | None = None
        self._deliveries: list[asyncio.Task[None]] = []
        self._retire_finished = False
        self._claim_attempted = params.carried is not None
        self._settings = RemediationSettings()
        self._policy: Policy | None = None
        self._restarts_before: dict[int, int] = {}
        self._classified = 0
        self._dry = params.dry_run
        self._asked_guard = False
        # A continued run is past the drain already.
        self._took_node = params.carried is not None and not params.dry_run
        # The least action this incident may take (the fleet guard's escalation of a repeat failure).
        self._floor: Action | None = None
        self._guard_decision: GuardDecision | None = None
        self._counted = False  # in gpufleet_incidents_total (once, whichever way the incident ends)
        if params.carried is not None:
            self._status = params.carried.status
            self._events: list[XidEvent] = list(params.carried.events)
            self._restarts_before = dict(params.carried.restarts_before)
        else:
            self._events = list(params.pending_events)
            prefix = "dryrun-" if params.dry_run else ""
            self._status = IncidentStatus(
                incident_id=f"{prefix}{params.cluster}-{params.node}-{workflow.info().start_time:%Y%m%dT%H%M%SZ}",
                cluster=params.cluster,
                node=params.node,
                dry_run=params.dry_run,
            )
            for event in params.pending_events:
                self._count_event(event)

    # -- signals and query --------------------------------------------------------------------------

    @workflow.signal
    def report_xid(self, event: XidEvent) -> None:
        """Another Xid on this node joins the open incident."""
        self._events.append(event)
        self._count_event(event)
        self._mark(self._status.step, "xid", f"{event.label} from {event.source}")

    def _count_event(self, event: XidEvent) -> None:
        if event.gpu_xid is not None and event.gpu_xid not in self._status.xids:
            self._status.xids.append(event.gpu_xid)
        if event.label not in self._status.events:
            self._status.events.append(event.label)

    @workflow.signal
    def checkpoint_done(self, job_id: int) -> None:
        """The job saved its checkpoint: its grace period may end now."""
        self._checkpointed.add(job_id)
        if job_id not in self._status.checkpointed:
            self._status.checkpointed.append(job_id)

    @workflow.signal
    def spare_available(self) -> None:
        self._spare_signalled = True

    @workflow.signal
    def decide(self, approval: Approval) -> None:
        """An operator's answer (`gpufleet approve|reject`) while the incident awaits approval. An
        answer that comes when nothing waits, or that was meant for an earlier wait, is dropped:
        a second `approve` must never pass a later gate."""
        status = self._status
        if status.waiting_for_approval is None:
            return
        if approval.wait and approval.wait != status.approval_wait:
            return
        if approval.incident_id and approval.incident_id != status.incident_id:
            return  # read from an earlier incident of the same node
        if self._approval is None:
            self._approval = approval

    @workflow.signal(name=GUARD_DECISION_SIGNAL)
    def guard_decision(self, decision: GuardDecision) -> None:
        """The fleet guard's answer: a slot, or wait (and why); and whether the node is a lemon."""
        if decision.incident_id == self._status.incident_id:
            self._guard_decision = decision
            if not decision.granted and self._status.waiting_for_approval is not None and self._asked_guard:
                self._status.waiting_for_approval = decision.why  # e.g. a pause became a tripped breaker
            if decision.quarantine:
                self._status.quarantine = decision.quarantine_why
                self._status.quarantine_label = decision.quarantine
            if decision.escalate_to and not self._status.escalated_by_guard:
                self._status.escalated_by_guard = f"{decision.escalate_to}: {decision.escalate_why}"

    @workflow.query
    def status(self) -> IncidentStatus:
        return self._status

    # -- run ----------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, params: RemediationInput) -> IncidentStatus:
        try:
            if params.carried is not None:
                await self._continue_carried(params)
            else:
                await self._remediate(params)
        except asyncio.CancelledError:
            # Cancelled by a person (Temporal UI or CLI): give back an unused spare, say so.
            self._status.outcome = Outcome.FAILED
            self._status.error = "cancelled"
            self._mark(self._status.step, "cancelled")
            self._count_closed()
            await self._release_unused_claim()
            await self._release_slot("cancelled")
            await self._give_back_node()
            self._notify("cancelled", f"{self._who()}: the incident was cancelled at {self._status.step}.")
            await self._flush_notifications()
            raise
        except (ActivityError, ApplicationError) as exc:
            cause = exc.cause if isinstance(exc, ActivityError) else None
            message = str(cause or exc)
            self._status.outcome = Outcome.FAILED
            self._status.error = message
            self._mark(self._status.step, "failed", message)
            self._count_closed()
            await self._release_unused_claim()
            await self._release_slot(f"failed: {message}")
            await self._give_back_node()
            # Never fail silently: tell the owner (beside the flow; bounded).
            self._notify("failed", f"{self._who()}: gpufleet stopped at {self._status.step}: {message}")
            await self._flush_notifications()
            raise ApplicationError(
                f"incident {self._status.incident_id} failed at {self._status.step}: {message}",
                type=getattr(cause, "type", None) or getattr(exc, "type", None) or "RemediationFailed",
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
            first = self._events[0]
            workflow.upsert_search_attributes(
                [
                    SA_GPU_NODE.value_set(params.node),
                    SA_CLUSTER.value_set(params.cluster),
                    SA_XID.value_set(first.gpu_xid) if first.gpu_xid is not None else SA_XID.value_unset(),
                    SA_EVENT_KIND.value_set(first.kind.value),
                ]
            )

        # 1. classify (and check the node exists before anything is changed)
        self._enter(Step.CLASSIFY)
        config: WorkerConfig = await self._activity(
            PolicyActivities.worker_config, params.cluster, summary="read the worker's settings and policy"
        )
        self._settings = status.settings = config.settings
        self._policy = config.policy
        node = await self._activity(SlurmActivities.node_state, params.node, summary=f"look up {params.node} in Slurm")
        status.partitions = list(node.partitions)
        facts: NodeFacts = await self._activity(
            KubeActivities.node_facts, params.node, summary=f"look up {params.node} in Kubernetes"
        )
        pool: str | None = facts.pool if facts.found else None
        status.action = await self._classify()
        self._done(Step.CLASSIFY, f"{status.action} for {self._seen()}")
        if pool == POOL_RETIRED:
            await self._record_only(
                Outcome.ALREADY_RETIRED, "recorded", f"{self._seen()} on a retired node; recorded, nothing to do."
            )
            return
        earlier = drained_for(node.reason) if node.drained or node.state in {"down", "drained"} else None
        if earlier is not None and earlier in Action.__members__ and status.action.severity <= Action(earlier).severity:
            await self._record_only(
                Outcome.AWAITING_REPAIR,
                "recorded",
                f"{self._seen()} recorded; the node is already drained for {earlier} ({node.reason}), "
                f"which covers {status.action}.",
            )
            return
        if status.action is Action.OBSERVE:
            await self._record_only(Outcome.OBSERVED, "observed", f"{self._seen()} recorded; no action needed.")
            return
        if facts.remediation == REMEDIATION_DISABLED:
            await self._record_only(
                Outcome.OPTED_OUT,
                "opted_out",
                f"{self._seen()} -> {status.action}, but the node is labelled "
                f"{REMEDIATION_LABEL}={REMEDIATION_DISABLED}: gpufleet recorded it and changed nothing.",
            )
            return

        # The node is this incident's from now on, before any wait (an owner's approval, the
        # fleet guard): a pool move that held it stops at its next step, and none starts.
        if not self._dry:
            taken_from: str = await self._activity(
                KubeActivities.take_node_lease,
                NodeLeaseRequest(node=params.node, holder=status.incident_id),
                summary=f"hold {params.node} (gpufleet.io/lease)",
            )
            status.node_leased = True
            if taken_from:
                self._mark(Step.CLASSIFY, "took the node", f"from {taken_from}, which stops where it is")

        # 2. notify, beside the flow: the drain never waits for the webhook
        self._enter(Step.NOTIFY)
        self._notify(
            "opened",
            f"{self._who()}: {self._lead().label} -> {status.action}. gpufleet is draining the node, "
            "checkpointing and requeueing its jobs. No action is needed from you.",
        )
        self._done(Step.NOTIFY, "sent beside the flow")

        # A node someone else took out of service is theirs until they say otherwise.
        held = held_by_someone_else(node.reason)
        if (
            held
            and self._settings.owner_drained is OwnerDrained.ASK
            and not await self._await_approval(f"{params.node} is held by someone else: {node.reason!r}")
        ):
            return

        # The cluster's fleet guard lets this incident take the node down, or makes it wait.
        if self._dry:
            self._mark(Step.GUARD, "dry run", "the fleet guard is not asked: a dry run takes no slot")
        elif not await self._guard_slot():
            return

        # 3. drain in Slurm
        self._enter(Step.DRAIN_SLURM)
        node = await self._activity(
            SlurmActivities.drain_node,
            DrainRequest(
                node=params.node,
                reason=drain_reason(
                    event=self._lead().reason_word, action=status.action.value, incident_id=status.incident_id
                ),
                dry_run=self._dry,
            ),
            summary=f"drain {params.node} in Slurm",
        )
        self._done(Step.DRAIN_SLURM, f"state={node.state} reason={node.reason!r}")
        self._took_node = not self._dry
        # Someone else drained it since we looked: theirs until they say otherwise, as above.
        if (
            held_by_someone_else(node.reason)
            and status.approval is None
            and self._settings.owner_drained is OwnerDrained.ASK
            and not await self._await_approval(f"{params.node} was drained by someone else: {node.reason!r}")
        ):
            return

        # 4. SIGTERM each job once, and wait for checkpoints
        self._enter(Step.CHECKPOINT)
        status.jobs = await self._activity(
            SlurmActivities.jobs_on_node, params.node, summary=f"list jobs on {params.node}"
        )
        self._restarts_before = {job.job_id: job.restarts for job in status.jobs}
        results: list[SignalJobResult] = await asyncio.gather(
            *(
                self._activity(
                    SlurmActivities.signal_job,
                    SignalJobRequest(
                        job_id=job.job_id,
                        restarts_before=job.restarts,
                        incident_id=status.incident_id,
                        dry_run=self._dry,
                    ),
                    summary=f"SIGTERM job {job.job_id}",
                )
                for job in status.jobs
            )
        )
        status.signalled = [result.job_id for result in results if result.signalled]
        for result in results:
            if not result.signalled:
                status.skipped[result.job_id] = result.why
        if status.signalled and self._dry:
            detail = f"dry run: would wait up to {self._settings.grace_seconds:g}s for checkpoints"
        elif status.signalled:
            detail = await self._grace(status.signalled, self._settings.grace_seconds)
        else:
            detail = "no running jobs on the node"
        self._done(Step.CHECKPOINT, detail)

        # 5. requeue, one job at a time, each guarded by its state and restart count
        self._enter(Step.REQUEUE)
        requeues: list[JobRequeue] = await asyncio.gather(
            *(
                self._activity(
                    SlurmActivities.requeue_job,
                    RequeueJobRequest(
                        job_id=job.job_id,
                        restarts_before=job.restarts,
                        signalled=job.job_id in status.signalled,
                        incident_id=status.incident_id,
                        dry_run=self._dry,
                    ),
                    summary=f"requeue job {job.job_id}",
                )
                for job in status.jobs
            )
        )
        for requeue in requeues:
            if requeue.outcome is RequeueOutcome.REQUEUED:
                status.requeued.append(requeue.job_id)
            elif requeue.outcome is RequeueOutcome.SKIPPED:
                status.skipped.setdefault(requeue.job_id, requeue.why)
            else:
                status.unrequeued[requeue.job_id] = requeue.why
        if status.unrequeued:
            self._notify("unrequeued", self._unrequeued_text(status.unrequeued))
        self._done(
            Step.REQUEUE,
            f"requeued {len(status.requeued)} of {len(status.jobs)}"
            + (f"; left alone: {status.skipped}" if status.skipped else ""),
        )

        # 6. approve: later Xids may have made it worse
        self._enter(Step.APPROVE)
        status.action = self._at_least(await self._classify())
        if not await self._approval_gate():
            return
        self._done(Step.APPROVE, f"{status.action} by policy")
        if status.action is not Action.REPLACE_NODE:
            # RESET_GPU or REBOOT_NODE, in place; escalating, up to REPLACE_NODE, if it does not hold.
            if await self._repair():
                await self._repaired()
                return
            if not await self._approval_gate():
                return

        # 7 and 8, side by side: the failed node is retired while the spare joins, and the
        # jobs may run again as soon as the spare is in (9), whatever the retirement still does.
        await self._side_by_side(self._retire(params), self._replace_and_resume(params))
        await self._resolved(params)

    async def _side_by_side(self, *branches: Any) -> None:
        """Run the branches together; when one fails, cancel the others and wait for them to stop."""
        tasks = [asyncio.create_task(branch) for branch in branches]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            raise

    async def _continue_carried(self, params: RemediationInput) -> None:
        """A run continued as new while waiting for a spare: the retirement is done, wait on."""
        self._retire_finished = True
        self._classified = self._input.carried.classified if self._input.carried else len(self._events)
        self._settings = self._status.settings or RemediationSettings()
        self._mark(Step.WAIT_FOR_SPARE, "continued", "history continued as new")
        await self._replace_and_resume(params)
        await self._resolved(params)

    async def _resolved(self, params: RemediationInput) -> None:
        status = self._status
        status.outcome = Outcome.RESOLVED
        if self._dry:
            self._mark(Step.RESUME, "dry run", "resolved as planned; nothing was changed")
        self._notify(
            "resolved",
            f"{self._who()}: resolved. {params.node} replaced by {status.spare}; "
            f"{len(status.requeued)} job(s) running again.",
        )
        await self._close()

    # -- branches -----------------------------------------------------------------------------------

    async def _retire(self, params: RemediationInput) -> None:
        self._enter(Step.DRAIN_KUBERNETES)
        drained = await self._activity(
            KubeActivities.cordon_and_drain,
            KubeDrainRequest(
                node=params.node,
                incident_id=self._status.incident_id,
                eviction_timeout_seconds=self._settings.eviction_timeout_seconds,
                dry_run=self._dry,
            ),
            summary=f"cordon and drain {params.node} in Kubernetes",
            timeout=KUBE_DRAIN_STEP,
        )
        self._done(
            Step.DRAIN_KUBERNETES,
            "no Kubernetes node"
            if not drained.node_found
            else f"evicted {len(drained.evicted)}, forced {len(drained.forced)}",
        )
        self._enter(Step.RETIRE_NODE)
        await self._activity(
            SpareActivities.retire_node,
            RetireRequest(node=params.node, incident_id=self._status.incident_id, dry_run=self._dry),
            summary=f"retire {params.node}",
            timeout=SPARE_STEP,
        )
        self._done(Step.RETIRE_NODE, "cordoned, tainted and kept")
        self._retire_finished = True

    async def _replace_and_resume(self, params: RemediationInput) -> None:
        try:
            await self._bring_in_spare(params)
        except _ContinueAsNew:
            await workflow.wait_condition(lambda: self._retire_finished)
            await self._flush_notifications()
            workflow.continue_as_new(
                RemediationInput(
                    cluster=params.cluster,
                    node=params.node,
                    search_attributes=params.search_attributes,
                    dry_run=self._dry,
                    carried=CarriedIncident(
                        status=self._status,
                        events=self._events,
                        restarts_before=self._restarts_before,
                        classified=self._classified,
                    ),
                )
            )
        self._enter(Step.RESUME)
        requeued = self._status.requeued
        if not requeued:
            self._done(Step.RESUME, "no jobs to resume")
            return
        if self._dry:
            self._done(Step.RESUME, f"dry run: would wait for job(s) {', '.join(map(str, requeued))} to run again")
            return
        resumed = await self._wait_resumed(requeued)
        self._status.jobs = resumed
        self._done(Step.RESUME, ", ".join(f"{job.job_id} on {job.nodes}" for job in resumed))

    async def _bring_in_spare(self, params: RemediationInput) -> None:
        status = self._status
        self._enter(Step.WAIT_FOR_SPARE if status.waiting_for_spare else Step.CLAIM_SPARE)
        checks = 0
        while True:
            # Cleared before the claim, so a spare_available that arrives during it is not lost.
            self._spare_signalled = False
            self._claim_attempted = True
            spare: str | None = await self._activity(
                SpareActivities.claim_spare,
                ClaimRequest(incident_id=status.incident_id, dry_run=self._dry, partitions=status.partitions),
                summary="claim a spare",
                timeout=SPARE_STEP,
            )
            if spare is not None:
                break
            if self._dry:
                self._done(Step.CLAIM_SPARE, "dry run: no free spare; would wait for one")
                return
            if not status.waiting_for_spare:
                status.waiting_for_spare = True
                self._mark(Step.WAIT_FOR_SPARE, "started", "no free spare")
                self._notify(
                    "no_spare",
                    f"{self._who()}: no free spare. {params.node} stays drained and its jobs are queued; "
                    "gpufleet takes the next spare that appears (signal spare_available to hurry it).",
                )
            checks += 1
            info = workflow.info()
            if self._retire_finished and (
                checks >= SPARE_CHECKS_PER_RUN
                or info.get_current_history_length() > HISTORY_SOFT_LIMIT
                or info.is_continue_as_new_suggested()
            ):
                raise _ContinueAsNew
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._spare_signalled, timeout=timedelta(seconds=self._settings.spare_recheck_seconds)
                )
        status.spare = spare
        status.waiting_for_spare = False
        self._done(Step.CLAIM_SPARE, f"dry run: would claim {spare}" if self._dry else f"{spare} joined the partition")

    async def _wait_resumed(self, job_ids: list[int]) -> list[JobInfo]:
        """Until every requeued job runs again: watched checks first, then timers backing off to 30 s."""
        timeout = self._settings.resume_timeout_seconds
        deadline = workflow.now() + timedelta(seconds=timeout)
        interval = 2.0
        check = 0
        while True:
            check += 1
            watch = RESUME_WATCH_SECONDS if check <= RESUME_WATCHED_CHECKS else 0.0
            result: ResumeCheck = await self._activity(
                SlurmActivities.jobs_resumed,
                ResumeCheckRequest(job_ids=job_ids, restarts_before=self._restarts_before, watch_seconds=watch),
                summary=f"check jobs {', '.join(map(str, job_ids))} run again",
                timeout=SHORT_STEP + timedelta(seconds=watch),
            )
            if not result.waiting:
                return result.resumed
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining <= 0:
                names = ", ".join(f"{job.job_id} ({job.state})" for job in result.waiting)
                raise ApplicationError(
                    f"jobs did not resume within {timeout:.0f}s: {names}", type="JobsNotResumed", non_retryable=True
                )
            if check > RESUME_WATCHED_CHECKS:
                await workflow.sleep(min(interval, remaining))
                # At most about 300 checks however long the timeout: the history stays small.
                interval = min(interval * 1.5, max(30.0, timeout / 300))

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
                timeout=SHORT_STEP + timedelta(seconds=watch),
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
            # At most about 200 checks however long the grace: the history stays small.
            interval = min(interval * 1.5, max(5.0, grace_seconds / 200))

    async def _await_approval(self, why: str) -> bool:
        """Wait for `gpufleet approve|reject`; True to go on. Nothing has been changed yet."""
        status = self._status
        if self._dry:
            self._mark(Step.AWAITING_APPROVAL, "dry run", f"would wait for approval: {why}")
            return True
        self._enter(Step.AWAITING_APPROVAL)
        status.outcome = Outcome.AWAITING_APPROVAL
        self._start_wait(why)
        self._notify(
            "approval_needed",
            f"{self._who()}: {why}. gpufleet has changed nothing and waits: "
            f"`gpufleet approve {status.incident_id}` to go on, `gpufleet reject {status.incident_id}` to leave it.",
        )
        await workflow.wait_condition(lambda: self._approval is not None)
        approval = self._answered()
        if approval.approved:
            return True
        self._notify("rejected", f"{self._who()}: rejected by {approval.by or '?'}; nothing was changed.")
        await self._close()
        return False

    async def _guard_slot(self) -> bool:
        """Ask the cluster's fleet guard for a slot; wait while it holds (breaker tripped, paused),
        unless a person approves this incident past it. True to go on; nothing changed yet."""
        status = self._status
        self._enter(Step.GUARD)
        self._guard_decision = None
        self._asked_guard = True
        await self._ask_guard()
        # A guard that was terminated (or lost its state) never answers: ask again, less often the
        # longer it is silent.
        again = GUARD_ASK_AGAIN
        while True:
            try:
                await workflow.wait_condition(lambda: self._guard_decision is not None, timeout=again)
                break
            except TimeoutError:
                self._mark(Step.GUARD, "asking again", "the fleet guard has not answered")
                await self._ask_guard()
                again = min(again * 2, GUARD_ASK_AGAIN_MOST)
        decision = self._guard_decision
        if decision is not None and decision.granted:
            status.guard_slot = True
            self._done(Step.GUARD, f"slot granted: {decision.why}")
            self._apply_guard()
            return True
        why = decision.why if decision is not None else "the fleet guard has not answered"
        self._mark(Step.GUARD, "waiting", why)
        self._enter(Step.AWAITING_APPROVAL)
        status.outcome = Outcome.AWAITING_APPROVAL
        self._start_wait(why)
        # The guard pages the operator once for all of them: no message per incident here. It is
        # asked again now and then, in case it was terminated and started afresh without us.
        while True:
            try:
                await workflow.wait_condition(
                    lambda: (
                        self._approval is not None
                        or (self._guard_decision is not None and self._guard_decision.granted)
                    ),
                    timeout=GUARD_ASK_WHILE_WAITING,
                )
                break
            except TimeoutError:
                await self._ask_guard()
        status.waiting_for_approval = None
        status.outcome = Outcome.OPEN
        if self._approval is None:
            status.guard_slot = True
            granted = self._guard_decision.why if self._guard_decision else ""
            self._done(Step.AWAITING_APPROVAL, f"slot granted: {granted}")
            self._apply_guard()
            return True
        approval, self._approval = self._approval, None
        status.approval = approval
        command = GuardCommand(incident_id=status.incident_id, by=approval.by, reason=approval.reason)
        if approval.approved:
            await self._activity(GuardActivities.tell, GUARD_ADMIT_SIGNAL, command, summary="tell the guard: approved")
            status.guard_slot = True
            self._done(Step.AWAITING_APPROVAL, f"approved past the guard by {approval.by or '?'}: {approval.reason}")
            self._apply_guard()
            return True
        status.outcome = Outcome.REJECTED
        self._done(Step.AWAITING_APPROVAL, f"rejected by {approval.by or '?'}: {approval.reason}".strip())
        self._notify("rejected", f"{self._who()}: rejected by {approval.by or '?'}; nothing was changed.")
        await self._close()
        return False

    async def _approval_gate(self) -> bool:
        """An action the policy names waits for `gpufleet approve|reject`, reminding the owner.
        The node is drained and its jobs requeued already; a rejection leaves it so."""
        status = self._status
        assert self._policy is not None and status.action is not None
        if status.action not in self._policy.guard.require_approval:
            return True
        why = f"{status.action} needs approval in cluster {status.cluster}"
        if self._dry:
            self._mark(Step.APPROVE, "dry run", f"would wait for approval: {why}")
            return True
        self._enter(Step.AWAITING_APPROVAL)
        status.outcome = Outcome.AWAITING_APPROVAL
        self._start_wait(why)
        ask = (
            f"`gpufleet approve {status.incident_id}` to go on, `gpufleet reject {status.incident_id}` "
            "to leave the node drained"
        )
        self._notify(
            "approval_needed",
            f"{self._who()}: {why}. The node is drained and its jobs are requeued; {ask}.",
        )
        every = timedelta(seconds=self._policy.guard.approval_reminder_seconds)
        while True:
            try:
                await workflow.wait_condition(lambda: self._approval is not None, timeout=every)
                break
            except TimeoutError:
                self._notify("approval_reminder", f"{self._who()}: still waiting: {why}; {ask}.")
        approval = self._answered()
        if approval.approved:
            return True
        self._notify(
            "rejected",
            f"{self._who()}: {status.action} rejected by {approval.by or '?'}. The node stays drained "
            "and its jobs stay requeued; `gpufleet nodes return NODE` once it is repaired.",
        )
        await self._close()
        return False

    async def _ask_guard(self) -> None:
        """(Again) ask the guard for a slot; it answers each asking, and counts this incident once."""
        status = self._status
        await self._activity(
            GuardActivities.request_slot,
            SlotRequest(
                incident_id=status.incident_id,
                workflow_id=workflow.info().workflow_id,
                run_id=workflow.info().run_id,
                node=self._input.node,
                action=str(status.action),
            ),
            summary="ask the fleet guard for a slot",
        )

    async def _record_only(self, outcome: Outcome, kind: str, text: str) -> None:
        """Close without touching the node: the outcome, one message to the owner, the close."""
        self._status.outcome = outcome
        self._notify(kind, f"{self._who()}: {text}")
        await self._close()

    def _answered(self) -> Approval:
        """Record the answer to the current wait: the incident's approval and outcome, the verdict
        in the timeline, nothing waiting any more (a later wait needs its own answer)."""
        approval, self._approval = self._approval, None
        assert approval is not None
        status = self._status
        status.approval = approval
        status.waiting_for_approval = None
        verdict = "approved" if approval.approved else "rejected"
        self._done(Step.AWAITING_APPROVAL, f"{verdict} by {approval.by or '?'}: {approval.reason}".strip())
        status.outcome = Outcome.OPEN if approval.approved else Outcome.REJECTED
        return approval

    def _start_wait(self, why: str) -> None:
        """A new wait for `gpufleet approve|reject`: answers to earlier ones do not count."""
        status = self._status
        self._approval = None
        status.approval_wait += 1
        status.waiting_for_approval = why

    def _apply_guard(self) -> None:
        """What the guard knows of the node raises the action: a lemon is replaced (and
        quarantined at the close), a repeat failure after a repair in place escalates a level."""
        status = self._status
        assert status.action is not None
        floor = None
        if status.quarantine_label:
            floor, why = Action.REPLACE_NODE, f"a lemon: {status.quarantine}"
        elif status.escalated_by_guard:
            name, why = status.escalated_by_guard.split(": ", 1)
            floor = Action(name)
        if floor is not None and floor.severity > status.action.severity:
            before, status.action, self._floor = status.action, floor, floor
            self._mark(Step.GUARD, "escalated", f"{before} -> {floor}: {why}")

    def _at_least(self, action: Action) -> Action:
        """The action, but never below what the fleet guard escalated this node to."""
        floor = self._floor
        return action if floor is None or action.severity >= floor.severity else floor

    def _escalate(self, why: str, *, at_least: Action | None = None) -> None:
        status = self._status
        assert status.action is not None
        after = status.action.escalated()
        if at_least is not None and at_least.severity > after.severity:
            after = at_least
        before, status.action = status.action, after
        self._floor = status.action
        self._mark(status.step, "escalated", f"{before} -> {status.action}: {why}")
        self._notify("escalated", f"{self._who()}: {before} did not hold ({why}); escalated to {status.action}.")

    def _gpu(self) -> str:
        """The failed GPU as the driver named it (UUID, else PCI address), from the deciding event."""
        lead = self._lead()
        return lead.gpu_uuid or lead.pci or ""

    async def _repair(self) -> bool:
        """RESET_GPU or REBOOT_NODE through a Job pinned to the node, then a settle period without
        a new event. True when the node is fit to go back; False once escalated to REPLACE_NODE
        (the Job failed, or the node reported again while settling)."""
        status = self._status
        assert self._policy is not None
        settings = self._policy.repair
        attempt = 0
        while status.action in (Action.RESET_GPU, Action.REBOOT_NODE):
            attempt += 1
            self._enter(Step.REPAIR)
            seen = len(self._events)
            request = RepairRequest(
                node=self._input.node,
                action=status.action,
                incident_id=status.incident_id,
                attempt=attempt,
                gpu=self._gpu(),
                settings=settings,
                dry_run=self._dry,
            )
            try:
                result: RepairResult = await self._activity(
                    RepairActivities.repair,
                    request,
                    summary=f"{status.action} {self._input.node} (Job)",
                    # The reset's Job or the reboot, then the check's Job.
                    timeout=timedelta(
                        seconds=settings.job_timeout_seconds
                        + (
                            settings.reboot_timeout_seconds
                            if status.action == Action.REBOOT_NODE
                            else settings.job_timeout_seconds
                        )
                    )
                    + SHORT_STEP,
                )
            except ActivityError as exc:
                # The event named no usable GPU: a reboot needs none. Anything else (no such
                # namespace, a refused Job) is a configuration to fix: the incident fails, loudly,
                # with the node drained, rather than replacing nodes that a fix would have saved.
                if not isinstance(exc.cause, ApplicationError) or exc.cause.type != "InvalidInput":
                    raise
                self._escalate(f"the repair could not start: {exc.cause.message}")
                continue
            if not result.succeeded:
                self._escalate(result.detail or f"Job {result.job} failed")
                continue
            self._done(Step.REPAIR, result.detail or f"Job {result.job} completed")
            if self._dry:
                return True
            self._enter(Step.SETTLE)
            try:
                await workflow.wait_condition(
                    lambda seen=seen: len(self._events) > seen,  # type: ignore[misc]
                    timeout=timedelta(seconds=settings.settle_seconds),
                )
            except TimeoutError:
                self._done(Step.SETTLE, f"no new event for {settings.settle_seconds:g}s")
                return True
            late = await self._classify()  # the new event may call for more than one level up
            self._escalate(f"{self._events[-1].label} while settling", at_least=late)
        return False

    async def _repaired(self) -> None:
        """The node back into service in Slurm, the jobs running again, the owner told."""
        status = self._status
        node: NodeInfo = await self._activity(
            SlurmActivities.resume_node,
            ResumeNodeRequest(node=self._input.node, incident_id=status.incident_id, dry_run=self._dry),
            summary=f"resume {self._input.node} in Slurm",
        )
        if node.drained or node.state in {"down", "drained"}:
            # Someone else drained it meanwhile: theirs now; the repair is not counted as holding.
            status.outcome = Outcome.AWAITING_REPAIR
            self._mark(Step.SETTLE, "held", f"repaired, but drained by someone else: {node.reason!r}")
            self._notify(
                "awaiting_repair",
                f"{self._who()}: {status.action} done, but the node was drained meanwhile by someone else "
                f"({node.reason!r}); gpufleet leaves it to them. Its jobs are requeued.",
            )
            await self._close()
            return
        self._mark(Step.SETTLE, "back in service", f"state={node.state} reason={node.reason!r}")
        self._enter(Step.RESUME)
        if self._dry:
            self._done(Step.RESUME, "dry run: would wait for the jobs to run again")
        elif status.requeued:
            status.jobs = await self._wait_resumed(status.requeued)
            self._done(Step.RESUME, ", ".join(f"{job.job_id} on {job.nodes}" for job in status.jobs))
        else:
            self._done(Step.RESUME, "no jobs to resume")
        status.outcome = Outcome.RESOLVED
        self._notify(
            "resolved",
            f"{self._who()}: resolved by {status.action} in place; {self._input.node} is back in service, "
            f"{len(status.requeued)} job(s) running again.",
        )
        await self._close()

    async def _quarantine(self) -> None:
        """A lemon this incident took out of service stays out: labelled quarantined."""
        status = self._status
        if not (status.quarantine_label and self._took_node) or status.quarantined:
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
            f"{self._who()}: {self._input.node} is quarantined ({status.quarantine}): never a spare, and "
            f"`gpufleet nodes return` refuses it until `gpufleet nodes release {self._input.node}`.",
        )

    async def _release_slot(self, why: str) -> None:
        """Give the fleet guard its slot back (or stop waiting for one), saying whether a repair
        in place put the node back (a repeat failure then escalates)."""
        status = self._status
        if not (status.guard_slot or self._asked_guard):
            return
        repaired = status.outcome == Outcome.RESOLVED and status.action in (Action.RESET_GPU, Action.REBOOT_NODE)
        command = GuardCommand(
            incident_id=status.incident_id,
            reason=why,
            repaired_by=status.action.value if repaired and status.action else "",
        )
        with contextlib.suppress(ActivityError):
            await self._activity(
                GuardActivities.tell, GUARD_RELEASE_SIGNAL, command, summary="give the fleet guard its slot back"
            )
        status.guard_slot = self._asked_guard = False

    # -- helpers ------------------------------------------------------------------------------------

    async def _classify(self) -> Action:
        events = list(self._events)
        action: Action = await self._activity(
            PolicyActivities.classify,
            ClassifyRequest(node=self._input.node, events=events, policy=self._policy),
            summary="classify the Xids",
        )
        self._classified = len(events)
        return action

    async def _activity(self, method: Any, *args: Any, summary: str, timeout: timedelta = SHORT_STEP) -> Any:
        return await workflow.execute_activity_method(
            method,
            args=args,
            start_to_close_timeout=timeout,
            heartbeat_timeout=HEARTBEAT,
            retry_policy=RETRY_UNTIL_BACK,
            summary=summary,
            # A cancelled branch (the other one failed) waits for its activity to end, so that
            # nothing it was doing (a claim, a drain) goes on behind the incident's back.
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )

    def _notify(self, kind: str, text: str) -> None:
        """Send a message beside the flow; its outcome lands in the timeline and the status."""
        record = NotificationRecord(kind=kind, at=workflow.now())
        self._status.notifications.append(record)
        if self._dry:
            record.outcome = "dry_run"
            self._mark(self._status.step, f"dry run: would notify {kind}", text)
            return
        request = NotifyRequest(kind=kind, text=text, incident=self._status.model_copy(deep=True))
        self._deliveries.append(asyncio.create_task(self._deliver(record, request)))

    async def _deliver(self, record: NotificationRecord, request: NotifyRequest) -> None:
        try:
            attempt: int = await workflow.execute_activity_method(
                NotifyActivities.notify,
                request,
                start_to_close_timeout=NOTIFY_ATTEMPT,
                schedule_to_close_timeout=NOTIFY_BUDGET,
                retry_policy=NOTIFY_RETRY,
                summary=f"notify: {record.kind}",
            )
        except ActivityError as exc:
            record.outcome = "failed"
            record.error = str(exc.cause or exc)
        except asyncio.CancelledError:
            record.outcome = "cancelled"
            self._mark(self._status.step, f"notify {record.kind}: cancelled")
            raise
        else:
            record.outcome = "sent" if attempt else "not_sent"
            record.attempts = attempt
        self._mark(self._status.step, f"notify {record.kind}: {record.outcome}", record.error)

    async def _flush_notifications(self) -> None:
        """Let messages in flight finish (each is bounded by NOTIFY_BUDGET) before the run ends."""
        while self._deliveries:
            pending, self._deliveries = self._deliveries, []
            await asyncio.gather(*pending)

    async def _release_unused_claim(self) -> None:
        """A spare claimed but never brought into service goes back to the pool."""
        if self._status.spare is not None or not self._claim_attempted or self._dry:
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

    def _lead(self) -> XidEvent:
        """The event that decided the action: the first of the most disruptive ones (pure policy,
        so the same on replay)."""
        policy = self._policy
        if policy is None:
            return self._events[0]
        return max(self._events, key=lambda event: policy.action_for(event).severity)

    def _seen(self) -> str:
        return seen(self._status)

    def _enter(self, step: Step) -> None:
        self._status.step = step
        self._mark(step, "started")
        # What the Temporal UI shows for the incident while it runs, and once it is over.
        workflow.set_current_details(
            f"{self._input.node} {self._seen()}: {step.value}, outcome {self._status.outcome.value}"
        )
        if self._input.search_attributes:
            workflow.upsert_search_attributes([SA_STEP.value_set(step.value)])

    def _done(self, step: Step, detail: str = "") -> None:
        self._mark(step, "finished", detail)

    def _mark(self, step: Step, event: str, detail: str = "") -> None:
        at = workflow.now()
        if event in ("started", "finished"):
            self._measure_step(step, event, at)
        self._status.timeline.append(TimelineEntry(step=step, event=event, at=at, detail=detail))

    # -- metrics (workflow.metric_meter(): nothing is recorded while a history is replayed) ----------

    def _open_steps(self) -> dict[Step, datetime]:
        """The steps started and not finished, each with the first start of its span (a continued
        run's wait for a spare keeps the start of the first run's)."""
        opened: dict[Step, datetime] = {}
        for entry in self._status.timeline:
            if entry.step is Step.CLOSED:
                continue
            if entry.event == "started":
                opened.setdefault(entry.step, entry.at)
            elif entry.event == "finished":
                opened.pop(entry.step, None)
                if entry.step is Step.CLAIM_SPARE:  # a spare claimed ends the wait for one
                    opened.pop(Step.WAIT_FOR_SPARE, None)
        return opened

    def _measure_step(self, step: Step, event: str, at: datetime) -> None:
        """A step's start (its gauge) or end (its duration, the gauge back to 0); dry runs not."""
        if self._dry or step is Step.CLOSED or workflow.unsafe.is_replaying():
            return
        opened = self._open_steps()
        meter = workflow.metric_meter()
        started = meter.create_gauge_float(STEP_STARTED, STEP_STARTED_HELP, "s")
        # By node, not by incident: a node has one open incident at a time, and the series stay
        # as many as the nodes that ever failed (incident IDs would grow without bound).
        labels = {"cluster": self._input.cluster, "node": self._input.node}
        if event == "started":
            started.set(opened.get(step, at).timestamp(), {**labels, "step": step.value})
            return
        durations = meter.create_histogram_float(STEP_DURATION, STEP_DURATION_HELP, "s")
        for ended in (step, Step.WAIT_FOR_SPARE) if step is Step.CLAIM_SPARE else (step,):
            since = opened.get(ended)
            if since is None:
                continue
            seconds = max(0.0, (at - since).total_seconds())
            durations.record(seconds, {"cluster": self._input.cluster, "step": ended.value})
            started.set(0.0, {**labels, "step": ended.value})

    def _count_closed(self) -> None:
        """The incident in gpufleet_incidents_total, once; every step it left open back to 0."""
        if self._counted or self._dry:
            return
        self._counted = True
        if workflow.unsafe.is_replaying():
            return
        status, meter = self._status, workflow.metric_meter()
        started = meter.create_gauge_float(STEP_STARTED, STEP_STARTED_HELP, "s")
        for step in self._open_steps():
            started.set(0.0, {"cluster": self._input.cluster, "node": self._input.node, "step": step.value})
        if self._events:
            lead = self._lead()
            xid = str(lead.gpu_xid) if lead.gpu_xid is not None else lead.kind.value
        else:
            xid = "none"
        meter.create_counter(INCIDENTS, INCIDENTS_HELP).add(
            1,
            {
                "cluster": self._input.cluster,
                "xid": xid,
                "action": status.action.value if status.action else "none",
                "outcome": status.outcome.value,
            },
        )

    async def _close(self) -> None:
        await self._quarantine()
        await self._release_slot(self._status.outcome.value)
        await self._give_back_node()
        self._enter(Step.CLOSED)
        self._mark(Step.CLOSED, self._status.outcome.value)
        self._count_closed()
        await self._flush_notifications()
        late = self._events[self._classified :]
        if late and self._classified:
            # Xids that arrived after the last classification (while messages were still going
            # out) would be lost with this run: they open the node's next incident instead.
            workflow.continue_as_new(
                RemediationInput(
                    cluster=self._input.cluster,
                    node=self._input.node,
                    search_attributes=self._input.search_attributes,
                    pending_events=late,
                    dry_run=self._dry,
                )
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

    def _who(self) -> str:
        return f"[{self._status.incident_id}] {self._input.node}"

    def _unrequeued_text(self, failed: dict[int, str]) -> str:
        owners = {job.job_id: job.user for job in self._status.jobs}
        lines = [f"job {job_id} (owner {owners.get(job_id, '?')}): {why}" for job_id, why in failed.items()]
        return f"{self._who()}: these jobs could not be requeued; please resubmit them:\n" + "\n".join(lines)
