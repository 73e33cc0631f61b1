"""The intake between a real emulated Kubernetes API (TokenRequest, TokenReview) and a real Temporal:
a detector speaks only for its own node, its own cluster, at its own rate."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from temporalio.client import Client

from clients.kubeauth import Unauthenticated
from gateway.intake import Intake, IntakeTlsError, TokenBuckets, server_tls
from lab.procs import wait_for
from models.auth import POD_NAME_EXTRA, POD_UID_EXTRA, Identity
from models.intake import IntakeSettings
from models.xid import XidEvent
from tests.conftest import gpufleet_cli
from tests.gateway.world import World, start_world
from tests.gateway.world import workflow_exists as exists

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    started = start_world(tmp_path_factory.mktemp("intake"), rate=6, burst=3)
    yield started
    started.stop()


def post(world: World, body: Any, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(
        f"{world.intake.url}/v1/events", json=body, headers=headers, verify=world.intake.tls(), timeout=30
    )


def event(node: str, *, cluster: str = "lab", dry_run: bool = False, xid: int = 79) -> dict[str, Any]:
    return {
        "cluster": cluster,
        "dry_run": dry_run,
        "event": XidEvent(node=node, xid=xid, source="test").model_dump(mode="json"),
    }


def workflow_exists(world: World, workflow_id: str) -> bool:
    return exists(world.temporal_address, workflow_id)


def delta(world: World, before: dict[str, float]) -> dict[str, float]:
    after = world.intake.metrics()
    return {name: value - before.get(name, 0) for name, value in after.items() if value != before.get(name, 0)}


def test_a_token_for_one_node_cannot_report_another(world: World) -> None:
    before = world.intake.metrics()
    answer = post(world, event("gpu2"), world.token("gpu1"))
    assert answer.status_code == 403
    assert answer.json() == {"error": "this token does not speak for node gpu2"}
    assert not workflow_exists(world, "remediate-lab-gpu2")
    assert delta(world, before) == {
        'gpufleet_intake_events_total{result="refused"}': 1,
        'gpufleet_intake_refused_total{reason="wrong_node"}': 1,
    }
    log = world.intake.log.read_text()
    assert "refused (wrong_node): system:serviceaccount:gpufleet:gpufleet-detector claimed node gpu2" in log
    assert "its token speaks for gpu1" in log


def test_a_pod_of_another_service_account_cannot_report_even_its_own_node(world: World) -> None:
    # Any pod may project a token of its own ServiceAccount for audience gpufleet: a job's pod on
    # gpu1 holds one, bound to gpu1. Only the detectors' account is believed.
    before = world.intake.metrics()
    answer = post(world, event("gpu1"), world.token("gpu1", pod="job"))
    assert answer.status_code == 403
    assert answer.json() == {"error": "system:serviceaccount:gpufleet:job-runner is not a detector's ServiceAccount"}
    assert not workflow_exists(world, "remediate-lab-gpu1")
    assert delta(world, before) == {
        'gpufleet_intake_events_total{result="refused"}': 1,
        'gpufleet_intake_refused_total{reason="wrong_service_account"}': 1,
    }
    log = world.intake.log.read_text()
    assert (
        "refused (wrong_service_account): system:serviceaccount:gpufleet:job-runner claimed node 'gpu1'; "
        "only system:serviceaccount:gpufleet:gpufleet-detector may report"
    ) in log


def test_the_accepted_service_accounts_are_checked_at_start() -> None:
    assert IntakeSettings(service_accounts=" gpufleet:prod-gpufleet-detector, ops:d ").reporters == {
        "system:serviceaccount:gpufleet:prod-gpufleet-detector",
        "system:serviceaccount:ops:d",
    }
    for wrong in ("gpufleet-detector", "gpufleet:", ":x", "Gpufleet:x", " , "):
        with pytest.raises(ValidationError, match="NAMESPACE:NAME"):
            IntakeSettings(service_accounts=wrong)


def test_an_event_for_another_cluster_is_refused(world: World) -> None:
    answer = post(world, event("gpu1", cluster="other"), world.token("gpu1"))
    assert answer.status_code == 403
    assert answer.json() == {"error": "this intake serves cluster lab, not other"}
    assert not workflow_exists(world, "remediate-other-gpu1")


def test_no_token_another_audience_or_an_expired_one_is_refused(world: World) -> None:
    before = world.intake.metrics()
    assert post(world, event("gpu1"), None).status_code == 401
    assert post(world, event("gpu1"), "not-a-token").status_code == 401
    wrong_audience = post(world, event("gpu1"), world.token("gpu1", audience="https://kubernetes.default.svc"))
    assert wrong_audience.status_code == 401
    assert "audience 'gpufleet'" in wrong_audience.json()["error"]
    assert wrong_audience.headers["WWW-Authenticate"].startswith("Bearer")

    expiring = world.token("gpu1", seconds=1)

    def expired() -> bool:
        try:
            world.auth.review_token(expiring, audiences=["gpufleet"])
        except Unauthenticated:
            return True
        return False

    wait_for(expired, timeout=30, what="the one-second token to expire")
    assert post(world, event("gpu1"), expiring).status_code == 401
    assert not workflow_exists(world, "remediate-lab-gpu1")
    assert delta(world, before) == {
        'gpufleet_intake_events_total{result="refused"}': 4,
        'gpufleet_intake_refused_total{reason="no_token"}': 1,
        'gpufleet_intake_refused_total{reason="unauthenticated"}': 3,
    }


def test_malformed_bodies_are_refused_saying_what_is_wrong(world: World) -> None:
    token = world.token("gpu1")
    no_event = post(world, {"cluster": "lab"}, token)
    assert no_event.status_code == 400
    assert no_event.json() == {"error": "not an event: event: Field required"}
    bad_xid = event("gpu1")
    bad_xid["event"]["xid"] = "seventy-nine"
    answer = post(world, bad_xid, token)
    assert answer.status_code == 400
    assert "event.xid: Input should be a valid integer" in answer.json()["error"]
    assert world.intake.metrics()['gpufleet_intake_events_total{result="malformed"}'] == 2


def test_the_right_node_opens_its_incident(world: World) -> None:
    answer = post(world, event("gpu1"), world.token("gpu1"))
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"incident": "remediate-lab-gpu1"}
    assert workflow_exists(world, "remediate-lab-gpu1")


def test_a_node_over_its_rate_is_told_when_to_come_back(world: World) -> None:
    token = world.token("gpu2")
    answers = [post(world, event("gpu2", dry_run=True, xid=xid), token) for xid in (79, 48, 64, 63)]
    assert [a.status_code for a in answers] == [202, 202, 202, 429]  # a burst of 3, then 6 a minute
    assert 1 <= int(answers[3].headers["Retry-After"]) <= 10
    assert workflow_exists(world, "dryrun-lab-gpu2")
    assert world.intake.metrics()['gpufleet_intake_events_total{result="limited"}'] == 1
    # Another node's bucket is its own.
    assert post(world, event("gpu1", dry_run=True), world.token("gpu1")).status_code == 202


def test_token_buckets_refill_at_the_rate() -> None:
    now = [0.0]
    buckets = TokenBuckets(rate_per_minute=60, burst=2, clock=lambda: now[0])
    assert [buckets.take("a"), buckets.take("a")] == [0.0, 0.0]
    assert buckets.take("a") == pytest.approx(1.0)
    assert buckets.take("b") == 0.0
    now[0] = 0.5
    assert buckets.take("a") == pytest.approx(0.5)
    now[0] = 10.0
    assert [buckets.take("a"), buckets.take("a"), buckets.take("a") > 0] == [0.0, 0.0, True]


def test_the_intake_will_not_start_without_its_certificate(tmp_path: Path) -> None:
    done = gpufleet_cli("intake", env={"GPUFLEET_CLUSTER": "lab"}, unset=("GPUFLEET_INTAKE_TLS_CERT",))
    assert done.returncode == 2
    assert "GPUFLEET_INTAKE_TLS_CERT and GPUFLEET_INTAKE_TLS_KEY not set: the intake serves HTTPS only" in done.stderr
    missing = tmp_path / "missing.crt"
    done = gpufleet_cli(
        "intake",
        env={
            "GPUFLEET_CLUSTER": "lab",
            "GPUFLEET_INTAKE_TLS_CERT": str(missing),
            "GPUFLEET_INTAKE_TLS_KEY": str(missing),
        },
    )
    assert done.returncode == 2
    assert f"GPUFLEET_INTAKE_TLS_CERT={missing}: cannot be read (No such file or directory)" in done.stderr


class _Pods:
    """A reviewer whose pod lookups are recorded (only ``pod_node`` is asked here)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, str]] = []

    def review_token(self, token: str, *, audiences: list[str]) -> Identity:
        raise AssertionError("not asked")

    def pod_node(self, namespace: str, name: str, uid: str = "") -> str | None:
        self.asked.append((namespace, name, uid))
        return "gpu1"


def test_a_pod_is_looked_up_only_by_its_name_and_uid() -> None:
    # Without the node-name extra the node is the bound pod's; a token that names no pod UID
    # speaks for no node (a pod of that name now may be another one, on another node).
    pods = _Pods()

    async def go() -> None:
        intake = Intake(cluster="lab", kube=pods, connect_temporal=_no_temporal, settings=IntakeSettings())
        account = "system:serviceaccount:gpufleet:gpufleet-detector"
        no_uid = Identity(name=account, groups=[], extra={POD_NAME_EXTRA: ["d-gpu1"]}, audiences=["gpufleet"])
        assert await intake._node_of(no_uid) is None
        both = no_uid.model_copy(update={"extra": {POD_NAME_EXTRA: ["d-gpu1"], POD_UID_EXTRA: ["u1"]}})
        assert await intake._node_of(both) == "gpu1"

    asyncio.run(go())
    assert pods.asked == [("gpufleet", "d-gpu1", "u1")]


async def _no_temporal() -> Client:
    raise AssertionError("Temporal is not reached")


def test_an_encrypted_key_is_named_not_prompted_for(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    argv = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-days", "1", "-subj", "/CN=localhost"]
    subprocess.run(
        [*argv, "-keyout", str(key), "-out", str(cert), "-passout", "pass:secret"],
        check=True,
        capture_output=True,
    )
    with pytest.raises(IntakeTlsError, match=f"GPUFLEET_INTAKE_TLS_KEY={key}: the key is encrypted"):
        server_tls(cert, key)
