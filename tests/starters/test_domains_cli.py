"""`gpufleet domains` as an operator uses it, against the Temporal dev server with the real fleet
guard, domain incident and incidents (their activities the workflow tests' stand-ins): a rack's
storm listed and shown, a bad domain refused in one line, the release that returns the nodes, a
second decision refused."""

from __future__ import annotations

import asyncio
import os
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from models.incident import Outcome
from tests.conftest import start_dev_server
from tests.starters.test_cli_every_command import Ran
from tests.workflows.test_domains import A_NODES, held, racked
from tests.workflows.test_guard import until
from tests.workflows.test_remediation import start, worker
from workflows.remediation import NodeRemediationWorkflow

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
async def dev(temporal_cli: str) -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server(temporal_cli, data_converter=pydantic_data_converter)
    try:
        yield env
    finally:
        await env.shutdown()


async def test_a_racks_domain_incident_listed_shown_and_released(dev: WorkflowEnvironment) -> None:
    fleet = racked()
    address = dev.client.service_client.config.target_host

    async def cli(*args: str) -> Ran:
        """`gpufleet ARGS` in a process of its own (the worker runs in this one's event loop)."""
        env = {**os.environ, "TEMPORAL_ADDRESS": address, "GPUFLEET_CLUSTER": fleet.cluster, "COLUMNS": "200"}
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workers.entry", *args, env=env, stdout=PIPE, stderr=PIPE
        )
        out, err = await done.communicate()
        assert done.returncode is not None
        return Ran(done.returncode, out.decode(), err.decode())

    async with worker(dev, fleet):
        rack = [await start(dev.client, fleet, node=node) for node in A_NODES[:3]]
        for handle in rack:
            await until(handle, NodeRemediationWorkflow.status, held, "held by its rack's domain incident")

        listed = await cli("domains", "list")
        shown = await cli("domains", "show", "rack/a")
        breaker = await cli("breaker", "status")
        typo = await cli("domains", "show", "rak/a")
        none = await cli("domains", "release", "switch/leaf-b")
        released = await cli("domains", "release", "rack/a", "--reason", "PDU replaced")
        results = [await handle.result() for handle in rack]
        again = await cli("domains", "confirm", "rack/a")
        after = await cli("domains", "show", "rack/a")

    assert listed.code == 0, listed.err
    assert "rack/a: open; 3 of 4 failed" in listed.out and "gpu1, gpu2, gpu3" in listed.out
    assert shown.code == 0, shown.err
    assert "rack/a in cluster" in shown.out and "open" in shown.out
    assert all(f"{node}: Xid 79" in shown.out for node in A_NODES[:3])
    assert "gpufleet domains confirm rack/a" in " ".join(shown.out.split())
    assert breaker.code == 0 and "held by rack/a" in breaker.out
    assert typo.code == 2 and "KIND one of rack, zone, nvlink, switch" in typo.error_line()
    assert none.code == 2 and "no domain incident for switch/leaf-b" in none.error_line()
    assert released.code == 0, released.err
    assert "rack/a: released; its 3 failed node(s) are validated and returned" in " ".join(released.out.split())
    assert all(r.outcome == Outcome.RESOLVED and not r.spare for r in results)
    assert sorted(fleet.resumed_nodes) == A_NODES[:3]
    assert again.code == 2 and "released already" in again.error_line()
    assert after.code == 0 and "released by" in after.out and "PDU replaced" in after.out
