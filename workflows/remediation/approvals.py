"""The incident's gates: where it waits for a person's `gpufleet approve|reject`.

- a node someone else drained is theirs until they say otherwise (nothing changed yet);
- the fleet guard grants a slot, or holds the incident (breaker tripped, paused) until it frees
  one or a person approves the incident past it (nothing changed yet);
- an action the policy names waits for approval, reminding the owner (the node is drained and
  its jobs requeued already; a rejection leaves it so).

Every gate waits the same way (`_wait_for_answer`); an answer counts for the wait it was given
to only, so a second `approve` never passes a later gate.

From v0.3.0 (patch approval-follow-up) a wait follows up on itself (`_follow_up`): the gates a
person must answer (an owner's node, the policy's) remind the owner in one line on a backing-off
schedule and, once `approval_expiry_seconds` pass unanswered, raise the request again to the
owner and the operators (`approval_expired`), again at each such period, never approving by
default. The fleet guard's hold reminds nobody: the guard pages the operators once for all the
incidents it holds. At every gate an Xid that joins is classified and the owner told; one that
calls for a more disruptive action raises the incident's action and starts a new wait, so an
answer given for the old action does not count for the new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from temporalio import workflow

from workflows.patches import APPROVAL_FOLLOW_UP
from workflows.remediation.close import Closing
from workflows.remediation.jobs import Jobs
from workflows.remediation.slot import GUARD_ASK_WHILE_WAITING

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from models.constants import GUARD_ADMIT_SIGNAL
    from models.guard import GuardCommand
    from models.incident import Approval, Outcome, Step


def how_long(span: timedelta) -> str:
    """A wait as people say it: 45s, 20m, 2h, 2h 30m, 1d 4h."""
    seconds = max(int(span.total_seconds()), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h {minutes}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m"
    return f"{seconds}s"


@dataclass(frozen=True)
class Asking:
    """What a gate asks a person, in the words its follow-ups use (patch approval-follow-up).

    ``why`` is the wait's reason as the status shows it and ``what`` the thing waited for, each
    made again when the action is raised; ``remind``: reminders and expiry (False where the fleet
    guard pages the operators once for all the incidents it holds)."""

    why: Callable[[], str]
    what: Callable[[], str]
    remind: bool = True


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
        asking: Asking | None = None,
    ) -> None:
        """Wait for `gpufleet approve|reject` on ``why``, or until ``or_until`` holds: the owner
        is told ``notice`` first (when there is one), and ``meanwhile`` is done every ``every``.
        With ``asking`` (and the patch), the wait follows up on itself: `_follow_up`."""
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
            if asking is not None and self._following_up():
                await self._follow_up(asking, every=every, meanwhile=meanwhile, or_until=or_until)
                return
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

    def _following_up(self) -> bool:
        """Waits follow up on themselves (reminders, expiry, Xids that join): not in a wait that
        began before v0.3.0, which replays as it was."""
        return workflow.patched(APPROVAL_FOLLOW_UP)

    async def _follow_up(
        self,
        asking: Asking,
        *,
        every: timedelta | None,
        meanwhile: Callable[[], Awaitable[None]] | None,
        or_until: Callable[[], bool],
    ) -> None:
        """Wait for the answer (or ``or_until``), on timers only (deterministic):

        - an Xid that joins is classified first, before any answer is taken (`_xids_while_waiting`);
          one that raises the action starts a new wait, and the schedule below starts again;
        - reminders (``asking.remind``): one line to the owner (`approval_reminder`), the first
          after `approval_reminder_seconds`, each next one twice as long after the one before,
          while the request has not expired;
        - expiry (``asking.remind``): after `approval_expiry_seconds` unanswered, and at each such
          period again, the request goes again to the owner (`approval_needed`) and to the
          operators (`approval_expired`); the incident keeps waiting;
        - ``meanwhile`` every ``every``, as before."""
        status = self._status
        guard = self._policy.guard if self._policy is not None else None
        remind = asking.remind and guard is not None
        first_gap = timedelta(seconds=guard.approval_reminder_seconds) if guard else timedelta(0)
        period = timedelta(seconds=guard.approval_expiry_seconds) if guard else timedelta(0)
        asked = workflow.now()
        gap, next_reminder, next_expiry = first_gap, asked + first_gap, asked + period
        next_meanwhile = asked + every if every is not None and meanwhile is not None else None
        while True:
            if self._unclassified():
                if await self._xids_while_waiting(asking):
                    asked = workflow.now()  # a new request: its own reminders and expiry
                    gap, next_reminder, next_expiry = first_gap, asked + first_gap, asked + period
                continue
            if self._answer is not None or or_until():
                return
            due: list[datetime] = [t for t in (next_meanwhile,) if t is not None]
            if remind:
                due.append(next_expiry)
                if next_reminder < asked + period:
                    due.append(next_reminder)
            timeout = max(min(due) - workflow.now(), timedelta(milliseconds=1)) if due else None
            try:
                await workflow.wait_condition(
                    lambda: self._answer is not None or or_until() or self._unclassified(), timeout=timeout
                )
                continue
            except TimeoutError:
                pass
            now = workflow.now()
            if remind and now >= next_expiry:
                status.approval_expired += 1
                self._approval_expired(asking, now - asked)
                next_expiry += period
            elif remind and next_reminder < asked + period and now >= next_reminder:
                self._notify(
                    "approval_reminder",
                    f"{self._message_prefix()}: waiting {how_long(now - asked)} for {asking.what()}: "
                    f"{self._answer_commands()}.",
                )
                gap *= 2
                next_reminder += gap
            if next_meanwhile is not None and now >= next_meanwhile and meanwhile is not None:
                await meanwhile()
                next_meanwhile = workflow.now() + (every or timedelta(0))

    def _answer_commands(self) -> str:
        incident = self._status.incident_id
        return f"`gpufleet approve {incident}` or `gpufleet reject {incident}`"

    def _approval_expired(self, asking: Asking, waited: timedelta) -> None:
        """The request expired unanswered: raised again, to the owner and to the operators."""
        status = self._status
        self._mark(
            Step.AWAITING_APPROVAL,
            "approval expired",
            f"no answer in {how_long(waited)} (wait {status.approval_wait}); the owner and the operators are "
            "told again; still waiting, never approved by default",
        )
        self._notify(
            "approval_needed",
            f"{self._message_prefix()}: no answer in {how_long(waited)}: still waiting for {asking.what()}, "
            f"never approved by default; the operators are told too. {self._answer_commands()}.",
        )
        self._notify(
            "approval_expired",
            f"{self._message_prefix()}: no answer in {how_long(waited)} to: {status.waiting_for_approval}. "
            f"The node stays drained and the incident waits for {asking.what()}: {self._answer_commands()}; "
            f"`gpufleet incidents show {workflow.info().workflow_id}` has its timeline.",
        )

    async def _xids_while_waiting(self, asking: Asking) -> bool:
        """Classify the Xids that joined while the incident waits, and tell the owner in one line.
        One that calls for a more disruptive action raises the incident's action and starts a new
        wait for it: an answer given for the old action, pending or on its way, is dropped (the
        person is asked again, naming the new action). True when the action was raised."""
        status = self._status
        assert status.action is not None
        events, calls_for = await self._classify_new()
        before = status.action
        after = self._raised_to_least_action(calls_for if calls_for.severity > before.severity else before)
        names = ", ".join(event.label for event in events)
        if after.severity <= before.severity:
            self._mark(Step.AWAITING_APPROVAL, "xid while waiting", f"{names} -> {calls_for}, which {before} covers")
            self._notify(
                "new_xid",
                f"{self._message_prefix()}: {names} came while waiting; it calls for {calls_for}, which {before} "
                f"covers. Still waiting for {asking.what()}: {self._answer_commands()}.",
            )
            return False
        status.action = after
        dropped = self._answer
        self._mark(
            Step.AWAITING_APPROVAL,
            "action raised",
            f"{names} -> {calls_for}: {before} -> {after}; a new wait for approval"
            + (
                f" ({'approval' if dropped.approved else 'rejection'} by {dropped.by or '?'} for {before} dropped)"
                if dropped is not None
                else ""
            ),
        )
        self._start_approval_wait(asking.why())
        self._notify(
            "action_raised",
            f"{self._message_prefix()}: {names} came while waiting and calls for {calls_for}, more severe than "
            f"{before}: the incident will now {after}. An answer given for {before} does not count: "
            f"waiting for {asking.what()}: {self._answer_commands()}.",
        )
        return True

    def _start_approval_wait(self, why: str) -> None:
        """A new wait for `gpufleet approve|reject`: answers to earlier ones do not count."""
        status = self._status
        self._answer = None
        status.approval_wait += 1
        status.waiting_for_approval = why
        status.approval_asked_at = workflow.now()
        status.approval_expired = 0

    def _take_answer(self) -> Approval:
        """Record the answer to the current wait: the incident's approval and outcome, the verdict
        in the timeline, nothing waiting any more (a later wait needs its own answer)."""
        approval, self._answer = self._answer, None
        assert approval is not None
        status = self._status
        status.approval = approval
        status.waiting_for_approval = None
        status.approval_asked_at = None
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
        following_up = self._following_up()
        go_on = f"to go on ({status.action})" if following_up else "to go on"
        await self._wait_for_answer(
            why,
            notice=f"{self._message_prefix()}: {why}. gpufleet has left the node as it is"
            + (
                f" (it requeued job(s) {', '.join(map(str, status.ended))}, which the failure ended)"
                if status.ended
                else ""
            )
            + " and waits: "
            f"`gpufleet approve {status.incident_id}` {go_on}, `gpufleet reject {status.incident_id}` to leave it.",
            asking=Asking(why=lambda: why, what=lambda: f"a go-ahead to {status.action} a node someone else drained")
            if following_up
            else None,
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
        if decision is not None and decision.domain_released:
            # The node's domain incident was released (its shared cause fixed): validated and returned.
            self._domain_fixed = decision.domain_released
            self._done(Step.GUARD, decision.why)
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
            or_until=lambda: (
                self._guard_decision is not None
                and (self._guard_decision.granted or bool(self._guard_decision.domain_released))
            ),
            # No reminders or expiry here: the guard paged the operators once for all it holds.
            asking=Asking(
                why=lambda: status.waiting_for_approval or why,
                what=lambda: f"the fleet guard, or an approval past it, for {status.action}",
                remind=False,
            ),
        )
        status.waiting_for_approval = None
        status.approval_asked_at = None
        status.outcome = Outcome.OPEN
        if self._answer is None:
            decision = self._guard_decision
            if decision is not None and decision.domain_released and not decision.granted:
                # The domain's shared cause is fixed: no slot, the node is validated and returned.
                self._domain_fixed = decision.domain_released
                self._done(Step.AWAITING_APPROVAL, decision.why)
                return True
            granted = decision.why if decision else ""
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
        notice = f"{self._message_prefix()}: {why}. The node is drained and its jobs are requeued; {ask}."
        if self._following_up():
            # Reminders, expiry and Xids that join: _follow_up (a raised action is asked for anew).
            await self._wait_for_answer(
                why,
                notice=notice,
                asking=Asking(
                    why=lambda: f"{status.action} needs approval in cluster {status.cluster}",
                    what=lambda: f"approval of {status.action}",
                ),
            )
        else:

            async def remind() -> None:
                self._notify("approval_reminder", f"{self._message_prefix()}: still waiting: {why}; {ask}.")

            await self._wait_for_answer(
                why,
                notice=notice,
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
