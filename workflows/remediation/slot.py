"""The incident's slot at the cluster's fleet guard (workflows/guard.py): asked for before the
first destructive step, asked for again while the guard is silent, given back at the close.

The guard's answer also says what it knows of the node: a lemon is replaced (and quarantined at
the close), a repeat failure after a repair in place escalates a level.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

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
