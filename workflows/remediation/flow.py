"""NodeRemediationWorkflow: one incident on one node, from Xid to resumed jobs (docs/remediation.md).

The flow, in the order of the recovery: classify, notify, drain in Slurm at once, requeue the
jobs the failure already ended, SIGTERM the others and wait for their checkpoints, requeue them,
approve, then the failed node's cordon/drain/retire side by side with the spare's claim (or a
repair in place), and finally watch the jobs run again. Each part lives in a
module of its own beside this one, and the workflow is built from them.

What keeps it safe away from the happy path:
- notifications run beside the flow, each attempt bounded, and never block or fail it;
- the worker's configuration (grace, timeouts, policy) is read once, through an activity;
- every activity is short or heartbeats, so a killed worker costs seconds;
- jobs are signalled and requeued one by one, guarded by their state and restart count;
- a node someone else drained waits for `gpufleet approve|reject`;
- the cluster's fleet guard (workflows/guard.py) grants a slot around each destructive step
  (killing the jobs, a repair, the retirement; never the drain), so a storm of Xids cannot take
  the whole cluster down; a node labelled
  gpufleet.io/remediation=disabled is only recorded; actions the policy names wait for approval;
- a long wait for a spare continues as new, so the history stays small.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from workflows.patches import (
    DRAIN_AFTER_JOBS_WAITS,
    DRAIN_FIRST,
    DUPLICATES_FOLDED,
    HOOK_DRAINS_TAKEN,
    INPUTS_CHECKED,
    VALIDATION_LADDER,
)
from workflows.remediation.approvals import Approvals
from workflows.remediation.drainafter import DrainAfterJobs
from workflows.remediation.replace import Replacement
from workflows.remediation.validate import Validation

with workflow.unsafe.imports_passed_through():
    from activities.kube import KubeActivities
    from activities.policy import PolicyActivities
    from activities.slurm import SlurmActivities
    from models.constants import (
        GUARD_DECISION_SIGNAL,
        POOL_RETIRED,
        REMEDIATION_DISABLED,
        REMEDIATION_LABEL,
        REMEDIATION_WORKFLOW,
        SA_CLUSTER,
        SA_EVENT_KIND,
        SA_GPU_NODE,
        SA_XID,
        drain_reason,
        drained_by_hook,
        drained_for,
        held_by_someone_else,
    )
    from models.guard import GuardDecision
    from models.incident import Approval, CancelRequest, IncidentStatus, NodeInfo, Outcome, RemediationInput, Step
    from models.policy import Action, OwnerDrained
    from models.requests import DrainRequest, NodeFacts, NodeLeaseRequest, WorkerConfig
    from models.trust import answer_problem
    from models.xid import GpuEventKind, XidEvent


@workflow.defn(name=REMEDIATION_WORKFLOW)
class NodeRemediationWorkflow(DrainAfterJobs, Approvals, Validation, Replacement):
    @workflow.init
    def __init__(self, params: RemediationInput) -> None:
        super().__init__(params)

    # -- signals and query --------------------------------------------------------------------------

    @workflow.signal
    def report_xid(self, event: XidEvent) -> None:
        """Another Xid on this node joins the open incident; the same event posted again (its
        answer lost on the way back to the detector) is folded into the one it repeats."""
        if event in self._events and workflow.patched(DUPLICATES_FOLDED):
            return
        self._events.append(event)
        self._count_event(event)
        self._mark(self._status.step, "xid", f"{event.label} from {event.source}")

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
        problem = answer_problem(by=approval.by, reason=approval.reason)
        if problem and workflow.patched(INPUTS_CHECKED):  # taken as it came before the patch
            self._refuse("approval" if approval.approved else "rejection", problem)
            return
        if status.waiting_for_approval is None:
            return
        if approval.wait and approval.wait != status.approval_wait:
            return
        if approval.incident_id and approval.incident_id != status.incident_id:
            return  # read from an earlier incident of the same node
        if self._answer is None:
            self._answer = approval

    @workflow.signal
    def cancel_requested(self, request: CancelRequest) -> None:
        """Who is about to cancel the incident and why (`gpufleet incidents cancel`, just before
        Temporal's cancel): the close says so. One meant for an earlier incident is dropped."""
        if request.incident_id and request.incident_id != self._status.incident_id:
            return
        problem = answer_problem(by=request.by, reason=request.reason)
        if problem and workflow.patched(INPUTS_CHECKED):  # taken as it came before the patch
            self._refuse("cancel request", problem)
            return
        self._cancel_request = request

    def _refuse(self, what: str, problem: str) -> None:
        """A signal whose text fails models/trust.py's checks: ignored, logged and noted in the
        timeline (the text itself is not repeated), nothing else changed."""
        workflow.logger.warning("%s ignored: %s", what, problem)
        self._mark(self._status.step, "refused", f"{what} ignored: {problem}")

    @workflow.signal(name=GUARD_DECISION_SIGNAL)
    def guard_decision(self, decision: GuardDecision) -> None:
        """The fleet guard's answer: a slot, or wait (and why); and whether the node is a lemon."""
        # An answer to an earlier ask (this incident asks before each destructive step) is old news.
        if decision.incident_id == self._status.incident_id and decision.ask == self._slot_asks:
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
        self._run_task = asyncio.current_task()
        try:
            if params.carried is not None:
                await self._continue_carried(params)
            else:
                await self._remediate(params)
        except asyncio.CancelledError:
            # Cancelled by a person (`gpufleet incidents cancel`, the Temporal UI, `cluster delete`).
            await self._cancelled()
            raise
        except (ActivityError, ApplicationError) as exc:
            if isinstance(exc, ActivityError) and isinstance(exc.cause, CancelledError) and self._cancel_asked():
                # Cancelled while an activity ran: the activity's cancel is what reached the flow.
                await self._cancelled()
                raise asyncio.CancelledError from exc
            # It cannot go on (a permanent error, or a step's retry budget ran out): it fails at
            # its step, gives back what it holds, tells the owner and pages the operators.
            raise await self._fail(exc) from exc
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
        status.pool = pool or ""
        status.action = await self._classify()
        self._done(Step.CLASSIFY, f"{status.action} for {self._events_seen()}")
        if pool == POOL_RETIRED:
            await self._record_only(
                Outcome.ALREADY_RETIRED,
                "recorded",
                f"{self._events_seen()} on a retired node; recorded, nothing to do.",
            )
            return
        earlier = drained_for(node.reason) if node.drained or node.state in {"down", "drained"} else None
        if earlier is not None and earlier in Action.__members__ and status.action.severity <= Action(earlier).severity:
            await self._record_only(
                Outcome.AWAITING_REPAIR,
                "recorded",
                f"{self._events_seen()} recorded; the node is already drained for {earlier} ({node.reason}), "
                f"which covers {status.action}.",
            )
            return
        if status.action is Action.OBSERVE:
            await self._record_only(Outcome.OBSERVED, "observed", f"{self._events_seen()} recorded; no action needed.")
            return
        if facts.remediation == REMEDIATION_DISABLED:
            await self._record_only(
                Outcome.OPTED_OUT,
                "opted_out",
                f"{self._events_seen()} -> {status.action}, but the node is labelled "
                f"{REMEDIATION_LABEL}={REMEDIATION_DISABLED}: gpufleet recorded it and changed nothing.",
            )
            return
        if workflow.patched(VALIDATION_LADDER):
            self._on_probation(facts)  # failing again on probation: replaced and quarantined

        # The node is this incident's from now on, before any wait (an owner's approval, the
        # fleet guard): a pool move that held it stops at its next step, and none starts.
        if not self._dry_run:
            taken_from: str = await self._activity(
                KubeActivities.take_node_lease,
                NodeLeaseRequest(node=params.node, holder=status.incident_id),
                summary=f"hold {params.node} (gpufleet.io/lease)",
                on_result=lambda _: setattr(status, "node_leased", True),
            )
            status.node_leased = True
            if taken_from:
                self._mark(Step.CLASSIFY, "took the node", f"from {taken_from}, which stops where it is")

        # 2. notify, beside the flow: the drain never waits for the webhook
        self._enter(Step.NOTIFY)
        doing = (
            "draining the node; its jobs run on to their end, then the node is dealt with"
            if status.action is Action.DRAIN_AFTER_JOBS
            else "draining the node, checkpointing and requeueing its jobs"
        )
        self._notify(
            "opened",
            f"{self._message_prefix()}: {self._deciding_event().label} -> {status.action}. gpufleet is {doing}. "
            "No action is needed from you.",
        )
        self._done(Step.NOTIFY, "sent beside the flow")

        if workflow.patched(DRAIN_FIRST):
            await self._drain_first(params, node)
            return

        # A node someone else took out of service is theirs until they say otherwise.
        if (
            self._held(node.reason)
            and self._settings.owner_drained is OwnerDrained.ASK
            and not await self._owner_drained_gate(f"{params.node} is held by someone else: {node.reason!r}")
        ):
            return

        # Incidents started before v0.3.0: the cluster's fleet guard lets this incident take the
        # node down, or makes it wait; the slot is held until the close.
        if self._dry_run:
            self._mark(Step.GUARD, "dry run", "the fleet guard is not asked: a dry run takes no slot")
        elif not await self._guard_gate():
            return

        # 3. drain in Slurm
        node = await self._drain_in_slurm(params)
        # Someone else drained it since we looked: theirs until they say otherwise, as above.
        if (
            self._held(node.reason)
            and status.approval is None
            and self._settings.owner_drained is OwnerDrained.ASK
            and not await self._owner_drained_gate(f"{params.node} was drained by someone else: {node.reason!r}")
        ):
            return

        # 4. SIGTERM each job once, and wait for checkpoints
        jobs = await self._checkpoint_jobs()

        # 5. requeue, one job at a time, each guarded by its state and restart count
        await self._requeue_jobs(jobs)
        await self._approve_and_act(params)

    async def _drain_first(self, params: RemediationInput, found: NodeInfo) -> None:
        """From v0.3.0: no new work reaches the failed GPU, whatever waits. The drain comes first
        (the guard is told, beside the flow), then the jobs the failure already ended are
        requeued, then the waits (an owner's approval, the guard); killing the running jobs, a
        repair and the retirement each hold a guard slot only while they act."""
        self._slot_per_step = True
        ask = self._settings.owner_drained is OwnerDrained.ASK
        # A node someone else drained takes no new work already, and stays theirs until they say.
        held = ask and self._held(found.reason)
        node = None if held else await self._drain_in_slurm(params)
        if not held:
            self._tell_guard_drained()  # an owner's drain is theirs: not counted as a failure
        running = await self._requeue_ended_jobs()
        if held:
            if not await self._owner_drained_gate(f"{params.node} is held by someone else: {found.reason!r}"):
                return
            node = await self._drain_in_slurm(params)
            self._tell_guard_drained()
        elif (
            node is not None
            and self._held(node.reason)
            and ask
            and not await self._owner_drained_gate(f"{params.node} was drained by someone else: {node.reason!r}")
        ):
            return
        if self._status.action is Action.DRAIN_AFTER_JOBS and workflow.patched(DRAIN_AFTER_JOBS_WAITS):
            await self._drain_after_jobs(params, running)  # drainafter.py: nothing signalled
            return
        if running:
            if not await self._slot_for(Step.CHECKPOINT):
                return
            jobs = await self._checkpoint_jobs()
            await self._requeue_jobs(jobs)
            await self._end_slot("the node's jobs are requeued")
        await self._approve_and_act(params)

    def _held(self, reason: str) -> bool:
        """Whether the node's drain ``reason`` is someone else's hold. Slurm's drain after a failed
        Prolog or Epilog is not, when this incident was decided by the health_check event of
        gpufleet's own check in that same hook: that drain is the incident's (its drain takes the
        reason over). One from the HealthCheckProgram did not make a hook fail: the drain is another's."""
        if not held_by_someone_else(reason):
            return False
        deciding = self._deciding_event()
        # Slurm runs the Epilog after a failed Prolog: both hooks' events reach the incident, in
        # either order. The drain is ours when one of them comes from the hook Slurm names.
        ours = deciding.kind is GpuEventKind.HEALTH_CHECK and any(
            event.kind is GpuEventKind.HEALTH_CHECK and drained_by_hook(reason, event.message) for event in self._events
        )
        if ours and workflow.patched(HOOK_DRAINS_TAKEN):
            self._mark(
                self._status.step, "took the drain", f"Slurm's {reason.strip()!r} follows gpufleet's health check"
            )
            return False
        return True

    def _reason_word(self) -> str:
        """How the drain reason names the incident's event: the deciding one's word; for a failed
        health check, the prolog's when the prolog failed (its Epilog's event may come first), so
        that the drain written over Slurm's "Prolog error" names the hook that made it."""
        deciding = self._deciding_event()
        if deciding.kind is GpuEventKind.HEALTH_CHECK:
            checks = [event for event in self._events if event.kind is GpuEventKind.HEALTH_CHECK]
            prolog = [event for event in checks if event.message.startswith("prolog:")]
            if prolog:
                return prolog[0].reason_word
        return deciding.reason_word

    async def _drain_in_slurm(self, params: RemediationInput) -> NodeInfo:
        status = self._status
        assert status.action is not None
        self._enter(Step.DRAIN_SLURM)
        node: NodeInfo = await self._activity(
            SlurmActivities.drain_node,
            DrainRequest(
                node=params.node,
                reason=drain_reason(
                    event=self._reason_word(), action=status.action.value, incident_id=status.incident_id
                ),
                dry_run=self._dry_run,
            ),
            summary=f"drain {params.node} in Slurm",
            on_result=lambda _: setattr(self, "_took_node_out", not self._dry_run),
        )
        self._done(Step.DRAIN_SLURM, f"state={node.state} reason={node.reason!r}")
        self._took_node_out = not self._dry_run
        return node

    async def _approve_and_act(self, params: RemediationInput) -> None:
        """The action, approved where the policy says so: a repair in place, else the replacement."""
        status = self._status
        # 6. approve: later Xids may have made it worse
        self._enter(Step.APPROVE)
        status.action = self._raised_to_least_action(await self._classify())
        if not await self._policy_gate():
            return
        self._done(Step.APPROVE, f"{status.action} by policy")
        if status.action is not Action.REPLACE_NODE:
            # RESET_GPU or REBOOT_NODE, in place; escalating, up to REPLACE_NODE, if it does not hold.
            if await self._repair() and (not workflow.patched(VALIDATION_LADDER) or await self._validated()):
                await self._return_to_service()
                return
            if status.step is Step.CLOSED or not await self._policy_gate():
                return

        # 7 and 8, side by side: the failed node is retired while the spare joins, and the
        # jobs may run again as soon as the spare is in (9), whatever the retirement still does.
        while True:
            if self._slot_per_step and not await self._slot_for(Step.RETIRE_NODE):
                return
            if not self._domain_fixed:
                break
            # Its domain incident was released: the node is validated and returned, not replaced.
            if not workflow.patched(VALIDATION_LADDER) or await self._validated():
                await self._return_to_service()
                return
        await self._side_by_side(self._retire(params), self._replace_and_resume(params))
        await self._close_resolved(params)
