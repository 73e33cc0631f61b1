"""The fleet guard's answers on their way to the incidents (workflows/guard.py decides them).

Answers are sent by an activity, a batch at a time, straight to the incidents: a workflow's
signal to another goes through the server's transfer queue and then back to the sender's own
history, which makes a busy guard slow to answer. One task sends the batches one after another,
so that an incident's answers arrive in the order they were given, beside the guard's loop. An
answer that finds its incident gone gives its slot back.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.retries import ANSWER_BATCH, ANSWER_BUDGET, ANSWER_RETRY, HEARTBEAT

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from models.guard import GuardAnswer, GuardDecision, GuardState, SlotRequest

# A batch that could not be sent is sent again after these pauses before it is given up: a grant
# lost for good would hold its slot until its incident asked again.
RESEND_AFTER = (timedelta(seconds=10), timedelta(seconds=20), timedelta(seconds=40))
# At most this many answers per activity (its input stays far below the server's payload limit).
ANSWERS_PER_BATCH = 200


class GuardAnswers:
    """The answers given and not sent yet, and the task sending them; part of FleetGuardWorkflow."""

    _state: GuardState  # the guard's

    if TYPE_CHECKING:

        def _log(self, event: str, request: SlotRequest | None = None, detail: str = "") -> None:
            """The guard's log (FleetGuardWorkflow._log)."""

    def __init__(self) -> None:
        # An answer found its incident gone and gave back its slot: those waiting may go on.
        self._slot_freed = False
        # Answers waiting for the next batch, and the task sending the batches, one after another.
        self._outbox: list[tuple[SlotRequest, GuardDecision]] = []
        self._sending: asyncio.Task[None] | None = None

    async def _queue_answer(self, request: SlotRequest, *, granted: bool, why: str, domain_released: str = "") -> None:
        """Answer the incident (with what the guard knows of its node), in the next batch."""
        decision = GuardDecision(
            incident_id=request.incident_id,
            granted=granted,
            why=why,
            quarantine=request.quarantine,
            quarantine_why=request.quarantine_why,
            escalate_to=request.escalate_to,
            escalate_why=request.escalate_why,
            ask=request.ask,
            domain_released=domain_released,
        )
        self._outbox.append((request, decision))
        if self._sending is None or self._sending.done():
            self._sending = asyncio.create_task(self._send_answers())

    def _answers_being_sent(self) -> list[asyncio.Task[None]]:
        return [self._sending] if self._sending is not None else []

    async def _send_answers(self) -> None:
        """Send the answers given so far, a batch per activity, until none is left."""
        while self._outbox:
            batch, self._outbox = self._outbox[:ANSWERS_PER_BATCH], self._outbox[ANSWERS_PER_BATCH:]
            answers = [GuardAnswer(workflow_id=request.workflow_id, decision=decision) for request, decision in batch]
            gone = await self._send_batch(answers)
            if gone is None:
                continue
            for request in {request.incident_id: request for request, _ in batch}.values():
                if request.incident_id in gone:
                    self._forget_gone(request, "its incident is gone")

    async def _send_batch(self, answers: list[GuardAnswer]) -> list[str] | None:
        """Send one batch (the answers after it wait for it); the incidents found gone, or None
        when it was given up. Answers given meanwhile to the same incidents go in a later batch."""
        pauses = iter(RESEND_AFTER)
        while True:
            try:
                gone: list[str] = await workflow.execute_activity_method(
                    GuardActivities.answer,
                    answers,
                    start_to_close_timeout=ANSWER_BATCH,
                    schedule_to_close_timeout=ANSWER_BUDGET,
                    heartbeat_timeout=HEARTBEAT,
                    retry_policy=ANSWER_RETRY,
                    summary=f"answer {len(answers)} incident(s)",
                )
                return gone
            except ActivityError as exc:
                pause = next(pauses, None)
                if pause is None:  # the incidents ask again (1 to 8 min on, or 30 min while waiting)
                    self._log("answers", detail=f"{len(answers)} answer(s) not sent: {exc.cause or exc}")
                    return None
                self._log(
                    "answers",
                    detail=f"{len(answers)} answer(s) not sent, sent again in {pause.seconds}s: {exc.cause or exc}",
                )
                await workflow.sleep(pause)

    def _forget_gone(self, request: SlotRequest, why: str) -> None:
        """Forget an incident that no longer runs, and let those waiting in to its slot."""
        state = self._state
        state.in_flight = [r for r in state.in_flight if r.incident_id != request.incident_id]
        state.waiting = [r for r in state.waiting if r.incident_id != request.incident_id]
        state.domain_held = [r for r in state.domain_held if r.incident_id != request.incident_id]
        self._log("released", request, why)
        self._slot_freed = True
