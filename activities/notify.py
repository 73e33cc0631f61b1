"""Notification step."""

from __future__ import annotations

from temporalio import activity

from activities.errors import client_errors
from clients.notify import Notifier
from models.incident import Notification
from models.requests import NotifyRequest


class NotifyActivities:
    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier

    @activity.defn(name="notify")
    def notify(self, request: NotifyRequest) -> None:
        with client_errors():
            self._notifier.send(Notification(kind=request.kind, text=request.text, incident=request.incident))
