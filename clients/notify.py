"""Notifications to a Slack-compatible webhook over httpx.

The webhook URL carries a secret token (Slack's do), so it never appears in a message,
an error or a log line: errors name the receiver by its host only.
"""

from __future__ import annotations

import logging
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from clients.errors import InvalidInput, TooManyRequests, Unavailable
from models.incident import Notification

log = logging.getLogger(__name__)
# httpx logs every request's full URL at INFO: that would put the token in the worker's log.
logging.getLogger("httpx").setLevel(logging.WARNING)


class Notifier(Protocol):
    def send(self, notification: Notification) -> bool:
        """Deliver once; True when sent, False when there is nowhere to send. Raises a ClientError."""
        ...


# Request Timeout and Too Early: the receiver asks for another try, unlike other 4xx refusals.
_TRY_AGAIN = {408, 425}


def _host(url: str) -> str:
    try:
        return urlsplit(url).hostname or "?"
    except ValueError:
        return "?"


def retry_after_seconds(value: str | None) -> float | None:
    """An HTTP ``Retry-After`` in seconds (the delta-seconds form; a date is ignored)."""
    if not value:
        return None
    try:
        return max(float(value.strip()), 0.0)
    except ValueError:
        return None


class WebhookNotifier:
    """Posts ``{"text": ..., "kind": ..., "incident": {...}}`` (a page from the fleet guard:
    ``"incident": null`` and ``"guard": {...}``); with no URL it only logs.

    One attempt per call, bounded by ``timeout_seconds`` in all (connect, send, answer):
    the caller's retries (Temporal's) decide how often to try again.
    """

    def __init__(self, *, url: str | None, timeout_seconds: float = 6.0) -> None:
        self._url = url
        self._timeout = timeout_seconds
        self._where = f"the webhook at {_host(url)}" if url else "no webhook"
        # Each phase bounded so that one attempt stays well inside the activity's 10 s.
        self._timeouts = httpx.Timeout(timeout_seconds, connect=min(3.0, timeout_seconds), pool=1.0)

    def send(self, notification: Notification) -> bool:
        if not self._url:
            log.info("notification (no webhook configured): %s", notification.text)
            return False
        payload = {
            "text": notification.text,
            "kind": notification.kind,
            "incident": notification.incident.model_dump(mode="json") if notification.incident else None,
        }
        if notification.guard is not None:
            payload["guard"] = notification.guard.model_dump(mode="json")
        try:
            response = httpx.post(self._url, json=payload, timeout=self._timeouts)
        except httpx.InvalidURL:
            raise InvalidInput(f"{self._where}: GPUFLEET_WEBHOOK_URL is not a valid URL") from None
        except httpx.HTTPError as exc:
            # The exception's text may quote the URL: keep only its kind.
            raise Unavailable(f"{self._where} did not answer ({type(exc).__name__})") from None
        if response.status_code < 300:
            return True
        if response.status_code == 429:
            raise TooManyRequests(
                f"{self._where} asked us to slow down (HTTP 429)",
                retry_after=retry_after_seconds(response.headers.get("retry-after")),
            )
        if response.status_code in _TRY_AGAIN:
            raise Unavailable(f"{self._where} answered HTTP {response.status_code}; trying again")
        if 400 <= response.status_code < 500:
            raise InvalidInput(f"{self._where} refused the message: HTTP {response.status_code}")
        raise Unavailable(f"{self._where} answered HTTP {response.status_code}")
