"""Messages to the node's owner, sent beside the flow: each attempt bounded, never blocking or
failing the incident; their outcomes land in the timeline and the status."""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.remediation.timeline import Timeline
from workflows.retries import NOTIFY_ATTEMPT, NOTIFY_BUDGET, NOTIFY_RETRY

with workflow.unsafe.imports_passed_through():
    from activities.notify import NotifyActivities
    from models.incident import NotificationRecord
    from models.requests import NotifyRequest


class Notifications(Timeline):
    """Messages to the node's owner, beside the flow."""

    def _notify(self, kind: str, text: str) -> None:
        """Send a message beside the flow; its outcome lands in the timeline and the status."""
        record = NotificationRecord(kind=kind, at=workflow.now())
        self._status.notifications.append(record)
        if self._dry_run:
            record.outcome = "dry_run"
            self._mark(self._status.step, f"dry run: would notify {kind}", text)
            return
        request = NotifyRequest(kind=kind, text=text, incident=self._status.model_copy(deep=True))
        self._notifications_in_flight.append(asyncio.create_task(self._send_notification(record, request)))

    async def _send_notification(self, record: NotificationRecord, request: NotifyRequest) -> None:
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
        while self._notifications_in_flight:
            pending, self._notifications_in_flight = self._notifications_in_flight, []
            await asyncio.gather(*pending)
