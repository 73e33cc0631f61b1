"""What a caller reads when the API cannot check them, or fails on its own: no address, no
traceback, nothing of the API's internals; the API's log has the details."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import grpc
import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.query.v1 import WorkflowQuery
from temporalio.api.workflowservice import v1 as ws
from temporalio.client import Client

from clients.errors import Unavailable
from gateway.api import Gateway
from lab.procs import free_port
from models.auth import API_GROUP, Identity
from starters.temporal import connect_temporal

INTERNAL_DETAIL = "review a token: HTTPSConnectionPool(host='10.96.0.1', port=443): timed out"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Call:
    """A call's context as the server hands it to the handler: its metadata, its abort."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer a-token"),)

    def time_remaining(self) -> float:
        return 5.0

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: Any = ()) -> None:
        raise Aborted(code, message)


class Authority:
    """A Kubernetes API that cannot answer a review (``failing``), or whose client breaks."""

    def __init__(self, failing: Exception, *, on: str) -> None:
        self._failing = failing
        self._on = on

    def review_token(self, token: str, *, audiences: list[str]) -> Identity:
        if self._on == "review":
            raise self._failing
        return Identity(name="alice", groups=[], extra={}, audiences=[])

    def allowed(
        self,
        identity: Identity,
        *,
        verb: str,
        resource: str,
        name: str = "",
        namespace: str = "",
        group: str = API_GROUP,
    ) -> tuple[bool, str]:
        if self._on == "nothing":
            return True, "allowed"
        raise self._failing


class Temporal:
    namespace = "default"


def _query() -> ws.QueryWorkflowRequest:
    return ws.QueryWorkflowRequest(
        namespace="default",
        execution=WorkflowExecution(workflow_id="guard-lab"),
        query=WorkflowQuery(query_type="status"),
    )


@pytest.mark.parametrize("on", ["review", "access"])
def test_a_kubernetes_api_that_does_not_answer_is_unavailable_without_its_details(
    on: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = Gateway(cast(Client, Temporal()), Authority(Unavailable(INTERNAL_DETAIL), on=on))
    with caplog.at_level(logging.WARNING, "gpufleet.api"), pytest.raises(Aborted) as aborted:
        asyncio.run(gateway.call("QueryWorkflow", _query(), cast(Any, Call())))
    assert aborted.value.code == grpc.StatusCode.UNAVAILABLE
    assert "did not answer" in str(aborted.value) and "10.96.0.1" not in str(aborted.value)
    assert "10.96.0.1" in caplog.text


def test_a_fault_of_the_api_is_internal_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    gateway = Gateway(cast(Client, Temporal()), Authority(KeyError(INTERNAL_DETAIL), on="access"))
    with caplog.at_level(logging.ERROR, "gpufleet.api"), pytest.raises(Aborted) as aborted:
        asyncio.run(gateway.call("QueryWorkflow", _query(), cast(Any, Call())))
    assert aborted.value.code == grpc.StatusCode.INTERNAL
    assert str(aborted.value) == "QueryWorkflow: the gpufleet API failed (its log says why)"
    assert "10.96.0.1" in caplog.text


def test_temporal_away_is_unavailable_and_the_api_is_still_up(caplog: pytest.LogCaptureFixture) -> None:
    """The API connects to Temporal lazily (``gpufleet api`` starts while Temporal is away): a call
    then is UNAVAILABLE, said as such, and the API goes on serving."""

    async def go() -> Aborted:
        temporal = await connect_temporal(address=f"127.0.0.1:{free_port()}", lazy=True)
        gateway = Gateway(temporal, Authority(KeyError("unused"), on="nothing"))
        with pytest.raises(Aborted) as aborted:
            await gateway.call("QueryWorkflow", _query(), cast(Any, Call()))
        return aborted.value

    with caplog.at_level(logging.WARNING, "gpufleet.api"):
        aborted = asyncio.run(go())
    assert aborted.code == grpc.StatusCode.UNAVAILABLE, aborted
    assert str(aborted) == "QueryWorkflow: Temporal is unreachable now; retry later"
