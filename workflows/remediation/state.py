"""What every part of an incident reads and changes: its state, and the one way it calls an activity."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.workflow import ActivityCancellationType

from workflows.patches import CANCEL_CLEANS_UP
from workflows.retries import HEARTBEAT, RELEASE_RETRY_WINDOW, SHORT_STEP, STEP_RETRY, step_budget

with workflow.unsafe.imports_passed_through():
    from activities.policy import PolicyActivities
    from models.guard import GuardDecision
    from models.incident import Approval, CancelRequest, IncidentStatus, JobInfo, Outcome, RemediationInput
    from models.policy import Action, Policy, RemediationSettings
    from models.requests import ClassifyRequest
    from models.xid import XidEvent


class IncidentState:
    """The incident's state, set up before any signal is handled (a signal may come with the start)."""

    def __init__(self, params: RemediationInput) -> None:
        self._input = params
        self._checkpointed: set[int] = set()
        self._spare_signalled = False
        self._answer: Approval | None = None
        self._notifications_in_flight: list[asyncio.Task[None]] = []
        self._retire_finished = False
        self._claim_attempted = params.carried is not None
        self._settings = RemediationSettings()
        self._policy: Policy | None = None
        self._restarts_before: dict[int, int] = {}
        self._events_classified = 0
        self._dry_run = params.dry_run
        self._asked_guard = False
        # v0.3.0 (patch drain-first): a slot per destructive step, each ask numbered.
        self._slot_per_step = False
        self._slot_asks = 0
        self._slot_step = ""
        self._approved_past_guard = False
        # The tell of the drain to the guard, beside the flow: held here so the task is not collected.
        self._guard_told: asyncio.Task[None] | None = None
        # A continued run is past the drain already.
        self._took_node_out = params.carried is not None and not params.dry_run
        # The least action this incident may take (the fleet guard's escalation of a repeat failure).
        self._least_action: Action | None = None
        self._guard_decision: GuardDecision | None = None
        # The node's domain incident was released (its shared cause fixed): the domain, and who
        # said so; the incident validates the node and returns it instead of its own fix.
        self._domain_fixed = ""
        # Who cancelled the incident and why (`gpufleet incidents cancel`), and whether a repair
        # Job may be running (a cancel stops it).
        self._cancel_request: CancelRequest | None = None
        self._repair_started = False
        # The workflow's own task (a cancel reaches it first) and whether its cancel is handled.
        self._run_task: asyncio.Task[Any] | None = None
        self._cancel_handled = False
        self._counted_in_metrics = False  # in gpufleet_incidents_total (once, whichever way the incident ends)
        # The jobs as the failure found them, kept when a resume lists them again: their Comments
        # name the checkpoints before the failure (the goodput ledger's lost work).
        self._jobs_at_failure: list[JobInfo] | None = None
        self._ledger_counted = False  # in gpufleet_gpu_seconds_lost_total (once)
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

    def _count_event(self, event: XidEvent) -> None:
        if event.gpu_xid is not None and event.gpu_xid not in self._status.xids:
            self._status.xids.append(event.gpu_xid)
        if event.label not in self._status.events:
            self._status.events.append(event.label)

    async def _activity(
        self,
        method: Any,
        *args: Any,
        summary: str,
        timeout: timedelta = SHORT_STEP,
        on_result: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run one activity: ``timeout`` per attempt, retried within the call's budget (_budget).
        ``on_result`` records what it did, before a cancel that came meanwhile stops the flow."""
        result = await self._run_activity(method, *args, summary=summary, timeout=timeout)
        if on_result is not None:
            on_result(result)
        if self._cancel_absorbed():
            raise asyncio.CancelledError
        return result

    def _cancel_absorbed(self) -> bool:
        """Whether the workflow was cancelled while an activity ran that finished anyway: the
        cancel went to the activity, which completed, and the flow would go on as if none came.
        Since v0.3.0 (patch cancel-cleans-up) the flow stops there and the cancel is handled."""
        task = self._run_task
        return (
            task is not None
            and not self._cancel_handled
            and task.cancelling() > 0
            and workflow.patched(CANCEL_CLEANS_UP)
        )

    async def _run_activity(self, method: Any, *args: Any, summary: str, timeout: timedelta) -> Any:
        return await workflow.execute_activity_method(
            method,
            args=args,
            start_to_close_timeout=timeout,
            schedule_to_close_timeout=self._budget(timeout),
            heartbeat_timeout=HEARTBEAT,
            retry_policy=STEP_RETRY,
            summary=summary,
            # A cancelled branch (the other one failed) waits for its activity to end, so that
            # nothing it was doing (a claim, a drain) goes on behind the incident's back.
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )

    def _budget(self, timeout: timedelta) -> timedelta:
        """How long a call may take, all its attempts together (workflows/retries.py): a step
        retries a service that is away for a quarter of an hour; once the incident has failed,
        giving back what it holds retries for two minutes. Workflow code: constants and the
        incident's own state only (tests run a subclass that answers seconds)."""
        if self._status.outcome in (Outcome.FAILED, Outcome.CANCELLED):
            return step_budget(timeout, RELEASE_RETRY_WINDOW)
        return step_budget(timeout)

    async def _classify(self) -> Action:
        events = list(self._events)
        action: Action = await self._activity(
            PolicyActivities.classify,
            ClassifyRequest(node=self._input.node, events=events, policy=self._policy),
            summary="classify the Xids",
        )
        self._events_classified = len(events)
        return action

    def _unclassified(self) -> bool:
        """Events joined since the last classification (a signal appends them)."""
        return len(self._events) > self._events_classified

    async def _classify_new(self) -> tuple[list[XidEvent], Action]:
        """Classify the events that joined since the last classification, on their own: what they
        call for (the incident's action is the most disruptive of its events' actions)."""
        events = self._events[self._events_classified :]
        action: Action = await self._activity(
            PolicyActivities.classify,
            ClassifyRequest(node=self._input.node, events=events, policy=self._policy),
            summary="classify the Xids that came while waiting",
        )
        self._events_classified += len(events)
        return events, action
