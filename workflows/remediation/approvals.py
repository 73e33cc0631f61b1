"""The incident's gates: where it waits for a person's `gpufleet approve|reject`.

- a node someone else drained is theirs until they say otherwise (nothing changed yet);
- the fleet guard grants a slot, or holds the incident (breaker tripped, paused) until it frees
  one or a person approves the incident past it (nothing changed yet);
- an action the policy names waits for approval, reminding the owner (the node is drained and
  its jobs requeued already; a rejection leaves it so).

Every gate waits the same way (`_wait_for_answer`); an answer counts for the wait it was given
to only, so a second `approve` never passes a later gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import workflow

from workflows.remediation.close import Closing
from workflows.remediation.jobs import Jobs
from workflows.remediation.slot import GUARD_ASK_WHILE_WAITING

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from models.constants import GUARD_ADMIT_SIGNAL
    from models.guard import GuardCommand
    from models.incident import Approval, Outcome, Step


class Approvals(Closing, Jobs):
    """The gates that wait for `gpufleet approve|reject`."""

    async def _wait_for_answer(
        self,
        why: str,
        *,
        notice: str = "",
        every: timedelta | None = None,
        meanwhile: Callable[[], Awaitable[None]] | None = None,
        or_until: Callable[[], bool] = lambda: False,
    ) -> None:
        """Wait for `gpufleet approve|reject` on ``why``, or until ``or_until`` holds: the owner
        is told ``notice`` first (when there is one), and ``meanwhile`` is done every ``every``."""
        status = self._status
        self._enter(Step.AWAITING_APPROVAL)
        status.outcome = Outcome.AWAITING_APPROVAL
        self._start_approval_wait(why)
        if notice:
            self._notify("approval_needed", notice)
        answered = False
        # v0.3.0: a job the failure ends while this waits is requeued before slurmctld forgets it.
        watch = asyncio.create_task(self._watch_ended_jobs(lambda: answered)) if self._slot_per_step else None
        try:
            while True:
                try:
                    await workflow.wait_condition(lambda: self._answer is not None or or_until(), timeout=every)
                    return
                except TimeoutError:
                    if meanwhile is not None:
                        await meanwhile()
        finally:
            answered = True
            if watch is not None and not watch.done():
                await watch

    def _start_approval_wait(self, why: str) -> None:
        """A new wait for `gpufleet approve|reject`: answers to earlier ones do not count."""
        status = self._status
        self._answer = None
        status.approval_wait += 1
        status.waiting_for_approval = why

    def _take_answer(self) -> Approval:
        """Record the answer to the current wait: the incident's approval and outcome, the verdict
        in the timeline, nothing waiting any more (a later wait needs its own answer)."""
        approval, self._answer = self._answer, None
        assert approval is not None
        status = self._status
        status.approval = approval
        status.waiting_for_approval = None
        verdict = "approved" if approval.approved else "rejected"
        self._done(Step.AWAITING_APPROVAL, f"{verdict} by {approval.by or '?'}: {approval.reason}".strip())
        status.outcome = Outcome.OPEN if approval.approved else Outcome.REJECTED
        return approval

    async def _owner_drained_gate(self, why: str) -> bool:
        """Wait for `gpufleet approve|reject`; True to go on. Nothing has been changed yet."""
        status = self._status
        if self._dry_run:
            self._mark(Step.AWAITING_APPROVAL, "dry run", f"would wait for approval: {why}")
            return True
        await self._wait_for_answer(
            why,
            notice=f"{self._message_prefix()}: {why}. gpufleet has left the node as it is"
            + (
                f" (it requeued job(s) {', '.join(map(str, status.ended))}, which the failure ended)"
                if status.ended
                else ""
            )
            + " and waits: "
            f"`gpufleet approve {status.incident_id}` to go on, `gpufleet reject {status.incident_id}` to leave it.",
        )
        approval = self._take_answer()
        if approval.approved:
            return True
        self._notify("rejected", f"{self._message_prefix()}: rejected by {approval.by or '?'}; nothing was changed.")
        await self._close()
        return False

    async def _guard_gate(self) -> bool:
        """Ask the cluster's fleet guard for a slot; wait while it holds (breaker tripped, paused),
        unless a person approves this incident past it. True to go on; nothing changed yet."""
        decision = await self._ask_for_slot()
        if decision is not None and decision.granted:
            self._hold_slot(Step.GUARD, f"slot granted: {decision.why}")
            return True
        why = decision.why if decision is not None else "the fleet guard has not answered"
        self._mark(Step.GUARD, "waiting", why)
        return await self._held_by_guard(why)

    async def _held_by_guard(self, why: str) -> bool:
        """Wait until the guard grants the slot or a person answers. The guard pages the operator
        once for all of them: no message per incident here. It is asked again now and then, in
        case it was terminated and started afresh without us."""
        status = self._status
        await self._wait_for_answer(
            why,
            every=GUARD_ASK_WHILE_WAITING,
            meanwhile=self._ask_guard,
            or_until=lambda: self._guard_decision is not None and self._guard_decision.granted,
        )
        status.waiting_for_approval = None
        status.outcome = Outcome.OPEN
        if self._answer is None:
            granted = self._guard_decision.why if self._guard_decision else ""
            self._hold_slot(Step.AWAITING_APPROVAL, f"slot granted: {granted}")
            return True
        approval, self._answer = self._answer, None
        status.approval = approval
        command = GuardCommand(incident_id=status.incident_id, by=approval.by, reason=approval.reason)
        if approval.approved:
            await self._activity(GuardActivities.tell, GUARD_ADMIT_SIGNAL, command, summary="tell the guard: approved")
            self._approved_past_guard = True
            self._hold_slot(
                Step.AWAITING_APPROVAL, f"approved past the guard by {approval.by or '?'}: {approval.reason}"
            )
            return True
        status.outcome = Outcome.REJECTED
        self._done(Step.AWAITING_APPROVAL, f"rejected by {approval.by or '?'}: {approval.reason}".strip())
        changed = (
            "the node stays drained (no new work on the failed GPU) and nothing else was done"
            if self._took_node_out
            else "nothing was changed"
        )
        self._notify("rejected", f"{self._message_prefix()}: rejected by {approval.by or '?'}; {changed}.")
        await self._close()
        return False

    async def _policy_gate(self) -> bool:
        """An action the policy names waits for `gpufleet approve|reject`, reminding the owner.
        The node is drained and its jobs requeued already; a rejection leaves it so."""
        status = self._status
        assert self._policy is not None and status.action is not None
        if status.action not in self._policy.guard.require_approval:
            return True
        why = f"{status.action} needs approval in cluster {status.cluster}"
        if self._dry_run:
            self._mark(Step.APPROVE, "dry run", f"would wait for approval: {why}")
            return True
        await self._end_slot("waiting for approval")  # a wait holds no slot
        ask = (
            f"`gpufleet approve {status.incident_id}` to go on, `gpufleet reject {status.incident_id}` "
            "to leave the node drained"
        )

        async def remind() -> None:
            self._notify("approval_reminder", f"{self._message_prefix()}: still waiting: {why}; {ask}.")

        await self._wait_for_answer(
            why,
            notice=f"{self._message_prefix()}: {why}. The node is drained and its jobs are requeued; {ask}.",
            every=timedelta(seconds=self._policy.guard.approval_reminder_seconds),
            meanwhile=remind,
        )
        approval = self._take_answer()
        if approval.approved:
            return True
        self._notify(
            "rejected",
            f"{self._message_prefix()}: {status.action} rejected by {approval.by or '?'}. The node stays drained "
            "and its jobs stay requeued; `gpufleet nodes return NODE` once it is repaired.",
        )
        await self._close()
        return False
