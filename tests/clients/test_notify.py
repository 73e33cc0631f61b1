"""The webhook notifier over real HTTP to the lab's receiver: one bounded attempt per call, typed
errors (a refusal is final, a 429 carries its Retry-After), and the secret URL never in a message."""

from __future__ import annotations

import logging

import httpx
import pytest

from clients.errors import InvalidInput, TooManyRequests, Unavailable
from clients.notify import WebhookNotifier
from lab.procs import free_port
from lab.webhook import WebhookReceiver
from models.incident import IncidentStatus, Notification

SECRET = "T000/B000/XXXXsecretXXXX"


def note(kind: str) -> Notification:
    return Notification(
        kind=kind, text=f"gpu1: {kind}", incident=IncidentStatus(incident_id="i", cluster="lab", node="gpu1", xids=[79])
    )


def behave(webhook: WebhookReceiver, **behaviour: object) -> None:
    httpx.put(webhook.url.replace("/hook", "/behaviour"), json=behaviour).raise_for_status()


def secret_url(webhook: WebhookReceiver) -> str:
    return webhook.url.replace("/hook", f"/services/{SECRET}")


def test_message_has_text_and_the_incident(webhook: WebhookReceiver) -> None:
    assert WebhookNotifier(url=webhook.url).send(note("opened")) is True
    [message] = webhook.messages()
    assert message["text"] == "gpu1: opened"
    assert message["kind"] == "opened"
    assert message["incident"]["xids"] == [79]


def test_unreachable_webhook_is_unavailable_and_names_no_secret() -> None:
    notifier = WebhookNotifier(url=f"http://127.0.0.1:{free_port()}/services/{SECRET}", timeout_seconds=1)
    with pytest.raises(Unavailable, match="did not answer") as failure:
        notifier.send(note("opened"))
    assert SECRET not in str(failure.value)


def test_a_refusal_is_invalid_input_and_names_no_secret(webhook: WebhookReceiver) -> None:
    behave(webhook, status=403)
    with pytest.raises(InvalidInput, match="HTTP 403") as failure:
        WebhookNotifier(url=secret_url(webhook)).send(note("opened"))
    assert SECRET not in str(failure.value)
    assert webhook.messages() == []


def test_429_carries_retry_after(webhook: WebhookReceiver) -> None:
    behave(webhook, status=429, retry_after=7)
    with pytest.raises(TooManyRequests) as failure:
        WebhookNotifier(url=webhook.url).send(note("opened"))
    assert failure.value.retry_after == 7.0


def test_a_hanging_webhook_costs_one_bounded_attempt(webhook: WebhookReceiver) -> None:
    behave(webhook, hang_seconds=600)
    # The receiver would answer in ten minutes: the attempt gives up on its own timeout instead.
    with pytest.raises(Unavailable, match="ReadTimeout"):
        WebhookNotifier(url=webhook.url, timeout_seconds=1).send(note("opened"))
    assert webhook.attempts == 1
    assert webhook.messages() == []


def test_the_url_stays_out_of_the_log(webhook: WebhookReceiver, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    WebhookNotifier(url=secret_url(webhook)).send(note("opened"))
    assert webhook.messages()
    assert SECRET not in caplog.text


def test_no_url_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    assert WebhookNotifier(url=None).send(note("opened")) is False
    assert "gpu1: opened" in caplog.text


def test_408_is_tried_again_but_other_4xx_are_final(webhook: WebhookReceiver) -> None:
    behave(webhook, status=408)
    with pytest.raises(Unavailable, match="HTTP 408"):
        WebhookNotifier(url=webhook.url).send(note("opened"))
    behave(webhook, status=404)
    with pytest.raises(InvalidInput, match="HTTP 404"):
        WebhookNotifier(url=webhook.url).send(note("opened"))


def test_a_malformed_url_is_invalid_and_not_quoted() -> None:
    with pytest.raises(InvalidInput, match="not a valid URL") as failure:
        WebhookNotifier(url=f"http://[::1/{SECRET}").send(note("opened"))
    assert SECRET not in str(failure.value)
