"""The incident's timeline, what the Temporal UI shows of it, and its metrics.

The timeline is the incident's record (`gpufleet status` prints it); metrics go through
workflow.metric_meter(), so nothing is recorded while a history is replayed.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from workflows.patches import GOODPUT_LEDGER
from workflows.remediation.state import IncidentState

with workflow.unsafe.imports_passed_through():
    from models.constants import SA_STEP
    from models.goodput import IncidentLedger, ledger_for
    from models.incident import Step, TimelineEntry, seen
    from models.metrics import (
        GPU_SECONDS_LOST,
        GPU_SECONDS_LOST_HELP,
        INCIDENTS,
        INCIDENTS_HELP,
        STEP_DURATION,
        STEP_DURATION_HELP,
        STEP_STARTED,
        STEP_STARTED_HELP,
    )
    from models.policy import Policy
    from models.xid import XidEvent


def deciding_event(events: list[XidEvent], policy: Policy | None) -> XidEvent:
    """The event that decided the action: the first of the most disruptive ones (pure policy,
    so the same on replay)."""
    if policy is None:
        return events[0]
    return max(events, key=lambda event: policy.action_for(event).severity)


def open_steps(timeline: list[TimelineEntry]) -> dict[Step, datetime]:
    """The steps started and not finished, each with the first start of its span (a continued
    run's wait for a spare keeps the start of the first run's)."""
    opened: dict[Step, datetime] = {}
    for entry in timeline:
        if entry.step is Step.CLOSED:
            continue
        if entry.event == "started":
            opened.setdefault(entry.step, entry.at)
        elif entry.event == "finished":
            opened.pop(entry.step, None)
            if entry.step is Step.CLAIM_SPARE:  # a spare claimed ends the wait for one
                opened.pop(Step.WAIT_FOR_SPARE, None)
    return opened


class Timeline(IncidentState):
    """The incident's record: timeline entries, what the Temporal UI shows, its metrics."""

    def _enter(self, step: Step) -> None:
        self._status.step = step
        self._mark(step, "started")
        # What the Temporal UI shows for the incident while it runs, and once it is over.
        workflow.set_current_details(
            f"{self._input.node} {self._events_seen()}: {step.value}, outcome {self._status.outcome.value}"
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

    def _events_seen(self) -> str:
        return seen(self._status)

    def _message_prefix(self) -> str:
        return f"[{self._status.incident_id}] {self._input.node}"

    def _deciding_event(self) -> XidEvent:
        return deciding_event(self._events, self._policy)

    def _measure_step(self, step: Step, event: str, at: datetime) -> None:
        """A step's start (its gauge) or end (its duration, the gauge back to 0); dry runs not."""
        if self._dry_run or step is Step.CLOSED or workflow.unsafe.is_replaying():
            return
        opened = open_steps(self._status.timeline)
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
        if self._counted_in_metrics or self._dry_run:
            return
        self._counted_in_metrics = True
        if workflow.unsafe.is_replaying():
            return
        status, meter = self._status, workflow.metric_meter()
        started = meter.create_gauge_float(STEP_STARTED, STEP_STARTED_HELP, "s")
        for step in open_steps(self._status.timeline):
            started.set(0.0, {"cluster": self._input.cluster, "node": self._input.node, "step": step.value})
        if self._events:
            deciding = self._deciding_event()
            xid = str(deciding.gpu_xid) if deciding.gpu_xid is not None else deciding.kind.value
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

    def _settle_ledger(self) -> None:
        """What the failure cost (models/goodput.py), computed as the incident closes, whichever
        way: into its status (the workflow's result), gpufleet_gpu_seconds_lost_total (once; dry
        runs not) and, since patch goodput-ledger, its memo. Never raises: a ledger that cannot be
        computed is logged and left out, and the close goes on."""
        status = self._status
        try:
            ledger = ledger_for(
                status,
                self._events,
                node_gpus=(status.settings or self._settings).node_gpus,
                now=workflow.now(),
                cause=self._deciding_event().label if self._events else "",
                jobs=self._jobs_at_failure,
            )
        except Exception:  # a record of the cost must never stop the close
            workflow.logger.exception("incident %s: its goodput ledger could not be computed", status.incident_id)
            return
        status.ledger = ledger
        self._count_ledger(ledger)
        if self._input.search_attributes and workflow.patched(GOODPUT_LEDGER):
            workflow.upsert_memo(
                {
                    "ledger": ledger,
                    "incident": {
                        "incident_id": status.incident_id,
                        "cluster": status.cluster,
                        "node": status.node,
                        "outcome": status.outcome.value,
                        "action": status.action.value if status.action else None,
                        "spare": status.spare,
                        "dry_run": status.dry_run,
                        # For the report's training GPUs (its guard counts nodes, not GPUs).
                        "node_gpus": (status.settings or self._settings).node_gpus,
                    },
                }
            )

    def _count_ledger(self, ledger: IncidentLedger) -> None:
        """The ledger's GPU-seconds in gpufleet_gpu_seconds_lost_total, by phase and cause (once)."""
        if self._ledger_counted or self._dry_run:
            return
        self._ledger_counted = True
        if workflow.unsafe.is_replaying():
            return
        counter = workflow.metric_meter().create_counter(GPU_SECONDS_LOST, GPU_SECONDS_LOST_HELP, "s")
        labels = {"cluster": self._input.cluster, "cause": ledger.cause or "none"}
        for cost in ledger.phases:
            seconds = round(cost.gpu_seconds or 0.0)
            if seconds > 0:
                counter.add(seconds, {**labels, "phase": cost.phase.value})
