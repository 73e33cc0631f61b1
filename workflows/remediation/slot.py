"""The incident's slot at the cluster's fleet guard (workflows/guard.py): asked for before each
destructive step (killing the jobs, a repair, the retirement) and given back when that step's
action ends; asked for again while the guard is silent. (Incidents started before v0.3.0 hold one
slot from before their drain to their close.) The drain itself is never held back: the guard is
told of it, beside the flow, and counts it for storms.

The guard's answer also says what it knows of the node: a lemon is replaced (and quarantined at
the close), a repeat failure after a repair in place escalates a level.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.remediation.timeline import Timeline

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from models.constants import GUARD_RELEASE_SIGNAL
    from models.guard import GuardCommand, GuardDecision, SlotRequest
    from models.incident import Outcome, Step
    from models.policy import Action

# Ask the fleet guard again when it has not answered within this (it may have been terminated),
# then twice as long each time, up to the most: each ask is one more signal in the guard's
# history and one more answer for it to send, so a busy guard is asked less and less often.
GUARD_ASK_AGAIN = timedelta(minutes=1)
GUARD_ASK_AGAIN_MOST = timedelta(minutes=8)
# While waiting at a tripped breaker, it is asked again this often.
GUARD_ASK_WHILE_WAITING = timedelta(minutes=30)


class GuardSlot(Timeline):
    """The incident's slot at the cluster's fleet guard, and what the guard knows of the node."""

    if TYPE_CHECKING:

        async def _guard_gate(self) -> bool:
            """Ask for the slot, waiting while the guard holds it (approvals.py)."""

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
                ask=self._slot_asks,
                step=self._slot_step,
            ),
            summary=f"ask the fleet guard for a slot ({self._slot_step})"
            if self._slot_step
            else "ask the fleet guard for a slot",
        )

    def _tell_guard_drained(self) -> None:
        """Tell the guard the node is drained (it counts drains for storms), beside the flow:
        nothing waits for it, and a guard that cannot be told holds nothing up."""
        status = self._status
        if self._dry_run:
            return
        command = GuardCommand(
            incident_id=status.incident_id,
            node=self._input.node,
            reason=str(status.action),
            event=status.events[0] if status.events else "",
        )

        async def tell() -> None:
            with contextlib.suppress(ActivityError):
                await self._activity(GuardActivities.drained, command, summary="tell the fleet guard: drained")

        self._guard_told = asyncio.create_task(tell())

    async def _slot_for(self, step: Step) -> bool:
        """A slot for one destructive step (kept when one is held already). False when a person
        rejected the incident while the guard held it (it is closed then)."""
        if self._dry_run:
            self._mark(Step.GUARD, "dry run", f"the fleet guard is not asked for {step}: a dry run takes no slot")
            return True
        if self._status.guard_slot:
            return True
        if self._status.approval is not None and self._status.approval.approved and self._approved_past_guard:
            # A person let the incident past the breaker: the whole incident, not one step.
            self._mark(Step.GUARD, "approved", f"{step}: let past the guard by {self._status.approval.by or '?'}")
            return True
        self._slot_asks += 1
        self._slot_step = step.value
        granted = await self._guard_gate()
        if granted and self._status.step in (Step.GUARD, Step.AWAITING_APPROVAL):
            self._status.step = step  # the step the slot is for, not the ask, is what runs now
        return granted

    async def _end_slot(self, why: str) -> None:
        """The step's action is over: its slot goes back (a wait that follows holds none)."""
        if self._slot_per_step and self._status.guard_slot:
            await self._release_slot(why)

    async def _ask_for_slot(self) -> GuardDecision | None:
        """Ask the guard for a slot and wait for its answer. A guard that was terminated (or lost
        its state) never answers: it is asked again, less often the longer it is silent."""
        self._enter(Step.GUARD)
        self._guard_decision = None
        self._asked_guard = True
        await self._ask_guard()
        again = GUARD_ASK_AGAIN
        while True:
            try:
                await workflow.wait_condition(lambda: self._guard_decision is not None, timeout=again)
                break
            except TimeoutError:
                self._mark(Step.GUARD, "asking again", "the fleet guard has not answered")
                await self._ask_guard()
                again = min(again * 2, GUARD_ASK_AGAIN_MOST)
        return self._guard_decision

    def _hold_slot(self, step: Step, detail: str) -> None:
        """The incident holds a slot now (granted, or approved past the guard)."""
        self._status.guard_slot = True
        self._done(step, detail)
        self._raise_action_by_guard()

    def _raise_action_by_guard(self) -> None:
        """What the guard knows of the node raises the action: a lemon is replaced (and
        quarantined at the close), a repeat failure after a repair in place escalates a level."""
        status = self._status
        assert status.action is not None
        least = None
        if status.quarantine_label:
            least, why = Action.REPLACE_NODE, f"a lemon: {status.quarantine}"
        elif status.escalated_by_guard:
            name, why = status.escalated_by_guard.split(": ", 1)
            least = Action(name)
        if least is not None and least.severity > status.action.severity:
            before, status.action, self._least_action = status.action, least, least
            self._mark(Step.GUARD, "escalated", f"{before} -> {least}: {why}")

    def _raised_to_least_action(self, action: Action) -> Action:
        """The action, but never below what the fleet guard escalated this node to."""
        least = self._least_action
        return action if least is None or action.severity >= least.severity else least

    async def _release_slot(self, why: str) -> None:
        """Give the fleet guard its slot back (or stop waiting for one), saying whether a repair
        in place put the node back (a repeat failure then escalates)."""
        status = self._status
        repaired = (
            not self._domain_fixed
            and status.outcome in (Outcome.RESOLVED, Outcome.JOBS_LOST)
            and status.action
            in (
                Action.RESET_GPU,
                Action.REBOOT_NODE,
            )
        )
        # A slot per step: the last was given back already, but the guard still hears of a
        # repair in place that held (a repeat failure then escalates).
        if not (status.guard_slot or self._asked_guard or (repaired and self._slot_per_step)):
            return
        command = GuardCommand(
            incident_id=status.incident_id,
            node=self._input.node,
            reason=why,
            repaired_by=status.action.value if repaired and status.action else "",
        )
        with contextlib.suppress(ActivityError):
            await self._activity(
                GuardActivities.tell, GUARD_RELEASE_SIGNAL, command, summary="give the fleet guard its slot back"
            )
        status.guard_slot = self._asked_guard = False
