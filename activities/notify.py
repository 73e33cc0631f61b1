"""Notification step: one attempt per activity attempt, so Temporal's retries bound each one."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import client_errors
from clients.errors import TooManyRequests
from clients.notify import Notifier
from models.incident import Notification
from models.requests import NotifyRequest


class NotifyActivities:
    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier

    @activity.defn(name="notify")
    def notify(self, request: NotifyRequest) -> int:
        """Send once; returns the attempt that got through (0: no webhook configured, only logged)."""
        try:
            with client_errors():
                sent = self._notifier.send(
                    Notification(kind=request.kind, text=request.text, incident=request.incident, guard=request.guard)
                )
        except ApplicationError as exc:
            cause = exc.__cause__
            if isinstance(cause, TooManyRequests) and cause.retry_after is not None:
                # Honour the receiver's Retry-After (bounded: a message is not worth an hour).
                raise ApplicationError(
                    str(exc), type=exc.type, next_retry_delay=timedelta(seconds=min(cause.retry_after, 60.0))
                ) from cause
            raise
        return activity.info().attempt if sent else 0
