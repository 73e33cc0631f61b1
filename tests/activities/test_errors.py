"""Which errors are retried and which fail at once: clients' errors as activities raise them, the
Kubernetes API's 4xx answers, the guard's refusals by the Temporal service, a policy file that
cannot be read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from activities.errors import NON_RETRYABLE, client_errors
from activities.guard import GuardActivities, refuse_for_good
from activities.policy import PolicyActivities
from clients.errors import (
    RETRYABLE_4XX,
    ClientError,
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    NotOwned,
    Refused,
    TooManyRequests,
    Unavailable,
    error_for_status,
)
from clients.kube import KubernetesApi
from models.guard import GuardCommand
from models.names import validate_node_name
from models.settings import Settings
from workers.main import LastGoodConfig


def raised(body: Callable[[], Any]) -> ApplicationError:
    with pytest.raises(ApplicationError) as caught, client_errors():
        body()
    return caught.value


def kube_answering(status: int) -> ApplicationError:
    """What an activity raises when the API server answers ``status`` to a read (through the
    client's one door, KubernetesApi._call)."""
    api = KubernetesApi.__new__(KubernetesApi)  # no configuration: the call never leaves

    def read_node(*args: Any, **kwargs: Any) -> Any:
        raise ApiException(status=status, reason="said so")

    return raised(lambda: api._call("read node gpu1", read_node))


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (NotFound("no node"), False),
        (InvalidInput("bad"), False),
        (Forbidden("rbac"), False),
        (NotOwned("theirs"), False),
        (Refused("405"), False),
        (Conflict("lost a race"), True),
        (TooManyRequests("slow down"), True),
        (Unavailable("away"), True),
        (ClientError("nobody named it"), True),
    ],
)
def test_each_client_error_is_retried_or_not_by_its_class(error: ClientError, retried: bool) -> None:
    def fail() -> None:
        raise error

    failure = raised(fail)
    assert failure.type == type(error).__name__ and failure.non_retryable is not retried
    assert (failure.type in NON_RETRYABLE) is not retried


@pytest.mark.parametrize("status", [405, 406, 410, 411, 413, 415, 418, 451])
def test_a_kubernetes_4xx_without_a_name_is_refused_for_good(status: int) -> None:
    failure = kube_answering(status)
    assert failure.type == "Refused" and failure.non_retryable
    assert f"HTTP {status}" in str(failure)


@pytest.mark.parametrize(
    ("status", "kind", "retried"),
    [
        (400, "InvalidInput", False),
        (401, "Forbidden", False),
        (403, "Forbidden", False),
        (404, "NotFound", False),
        (422, "InvalidInput", False),
        (408, "Unavailable", True),  # the server timed out waiting: ask again
        (409, "Conflict", True),  # a lost race: read again and retry
        (425, "Unavailable", True),
        (429, "TooManyRequests", True),
        (500, "Unavailable", True),
        (503, "Unavailable", True),
    ],
)
def test_kubernetes_answers_that_a_retry_may_get_past_are_retried(status: int, kind: str, retried: bool) -> None:
    failure = kube_answering(status)
    assert (failure.type, failure.non_retryable) == (kind, not retried)
    assert (status in RETRYABLE_4XX or status >= 500) is retried


def test_every_http_status_has_one_answer() -> None:
    for status in range(400, 600):
        error = error_for_status(status, "x")
        assert error.retryable is (status in RETRYABLE_4XX or status >= 500), status
    assert type(error_for_status(0, "no answer")) is Unavailable


def test_an_unsafe_name_is_bad_input_not_retried() -> None:
    failure = raised(lambda: validate_node_name("gpu1; reboot"))
    assert failure.type == "InvalidInput" and failure.non_retryable


async def test_the_guard_plumbing_refuses_a_bad_cluster_name_at_once() -> None:
    guard = GuardActivities(None, cluster="Not A Cluster", partition="train")  # type: ignore[arg-type]
    with pytest.raises(ApplicationError) as caught:
        await ActivityEnvironment().run(guard.tell, "release", GuardCommand(incident_id="i"))
    assert caught.value.type == "InvalidInput" and caught.value.non_retryable


@pytest.mark.parametrize(
    ("status", "retried"),
    [
        (RPCStatusCode.UNAVAILABLE, True),
        (RPCStatusCode.DEADLINE_EXCEEDED, True),
        (RPCStatusCode.RESOURCE_EXHAUSTED, True),
        (RPCStatusCode.INVALID_ARGUMENT, False),
        (RPCStatusCode.PERMISSION_DENIED, False),
    ],
)
def test_the_temporal_service_refusing_for_good_is_not_retried(status: RPCStatusCode, retried: bool) -> None:
    error = RPCError("said so", status, b"")
    if retried:
        refuse_for_good(error)  # left to be retried: nothing raised here
        return
    with pytest.raises(ApplicationError) as caught:
        refuse_for_good(error)
    assert caught.value.type == "Refused" and caught.value.non_retryable


# -- the policy file ---------------------------------------------------------------------------


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text("xids:\n  79: REPLACE_NODE\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("xids:\n  79: REPLACE_NODE  # café\n".encode("latin-1"), "not UTF-8"),
        (b"xids: [79: {\n", "not valid YAML"),
        (b"xids:\n  79: MELT_IT\n", "xids"),
    ],
)
async def test_a_policy_that_cannot_be_used_fails_at_once(policy_file: Path, content: bytes, said: str) -> None:
    policy_file.write_bytes(content)
    acts = PolicyActivities(lambda: Settings(cluster="c1", policy_file=policy_file).worker_config())
    with pytest.raises(ApplicationError) as caught:
        await ActivityEnvironment().run(acts.worker_config, "c1")
    assert caught.value.type == "PolicyInvalid" and caught.value.non_retryable
    assert said in str(caught.value) and str(policy_file) in str(caught.value)


def test_the_worker_keeps_its_last_good_policy_when_the_file_stops_being_utf8(policy_file: Path) -> None:
    config = LastGoodConfig(Settings(cluster="c1", policy_file=policy_file))
    good = config()
    policy_file.write_bytes("xids:\n  79: RESET_GPU  # café\n".encode("latin-1"))
    assert config() == good  # logged, and incidents go on with what the worker had
