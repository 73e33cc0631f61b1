"""Notifications to a Slack-compatible webhook over httpx."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import httpx

from clients.errors import InvalidInput, Unavailable
from models.incident import Notification

log = logging.getLogger(__name__)


class Notifier(Protocol):
    def send(self, notification: Notification) -> None: ...


class WebhookNotifier:
    """Posts ``{"text": ..., "incident": {...}}``; with no URL it only logs."""

    def __init__(self, *, url: str | None, timeout_seconds: float = 5.0, attempts: int = 3) -> None:
        self._url = url
        self._timeout = timeout_seconds
        self._attempts = attempts

    def send(self, notification: Notification) -> None:
        if not self._url:
            log.info("notification (no webhook configured): %s", notification.text)
            return
        payload = {
            "text": notification.text,
            "kind": notification.kind,
            "incident": notification.incident.model_dump(mode="json"),
        }
        error = ""
        for attempt in range(self._attempts):
            try:
                response = httpx.post(self._url, json=payload, timeout=self._timeout)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 300:
                    return
                if 400 <= response.status_code < 500 and response.status_code != 429:
                    raise InvalidInput(f"webhook {self._url} refused the message: HTTP {response.status_code}")
                error = f"HTTP {response.status_code}"
            time.sleep(min(0.2 * 2**attempt, 2.0))
        raise Unavailable(f"webhook {self._url} unreachable after {self._attempts} attempts: {error}")
