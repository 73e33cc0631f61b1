"""The webhook notifier over real HTTP to the lab's receiver."""

from __future__ import annotations

import pytest

from clients.errors import Unavailable
from clients.notify import WebhookNotifier
from lab.procs import free_port
from lab.webhook import WebhookReceiver
from models.incident import IncidentStatus, Notification


def note(kind: str) -> Notification:
    return Notification(
        kind=kind, text=f"gpu1: {kind}", incident=IncidentStatus(incident_id="i", cluster="lab", node="gpu1", xids=[79])
    )


def test_message_has_text_and_the_incident(webhook: WebhookReceiver) -> None:
    WebhookNotifier(url=webhook.url).send(note("opened"))
    [message] = webhook.messages()
    assert message["text"] == "gpu1: opened"
    assert message["kind"] == "opened"
    assert message["incident"]["xids"] == [79]


def test_unreachable_webhook_is_unavailable_after_retries() -> None:
    notifier = WebhookNotifier(url=f"http://127.0.0.1:{free_port()}/hook", attempts=2, timeout_seconds=1)
    with pytest.raises(Unavailable, match="after 2 attempts"):
        notifier.send(note("opened"))


def test_no_url_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    WebhookNotifier(url=None).send(note("opened"))
    assert "gpu1: opened" in caplog.text
