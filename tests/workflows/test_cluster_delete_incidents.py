"""`gpufleet cluster delete` first stops the cluster's remediation: its open incidents are cancelled
(each requeues the job it signalled and gives back what it holds) and its fleet guard ends, before
anything is removed. The deletion's own activity against the Temporal dev server (its visibility
lists the cluster's incidents), with the incident tests' stand-ins for Slurm and Kubernetes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import yaml
from temporalio.client import WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.cluster import ClusterActivities
from models.cluster import load_spec
from models.clusterops import ClusterRequest, StepResult
from models.incident import IncidentStatus, Outcome
from tests.conftest import start_dev_server
from tests.models.test_cluster_spec import EXAMPLE
from tests.workflows.test_cancel import checking_in_grace, in_grace
from tests.workflows.test_guard import guard, running, until
from tests.workflows.test_remediation import Fleet, start
from workflows.remediation import NodeRemediationWorkflow


@pytest.fixture(scope="module")
async def env(temporal_cli: str) -> AsyncIterator[WorkflowEnvironment]:
    environment = await start_dev_server(temporal_cli, data_converter=pydantic_data_converter)
    yield environment
    await environment.shutdown()


async def test_a_deletion_cancels_the_open_incidents_and_ends_the_guard_first(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["name"] = fleet.cluster
    request = ClusterRequest(spec=load_spec(spec), backend="lab")
    # The step needs no backend: only Temporal.
    stopping = ClusterActivities(None, {}, None)  # type: ignore[arg-type]
    deletion = ActivityEnvironment(client=env.client)
    async with running(env, fleet, activities=checking_in_grace(fleet), end_guard=False):
        handle = await start(env.client, fleet)
        await until(handle, NodeRemediationWorkflow.status, in_grace, "SIGTERM sent, grace running")
        listed = f"WorkflowId='{handle.id}' AND ExecutionStatus='Running'"
        await until_listed(env, listed)
        first: StepResult = await deletion.run(stopping.stop_incidents, request)
        again: StepResult = await deletion.run(stopping.stop_incidents, request)
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        guarding = await guard(env.client, fleet).describe()
    assert first.detail == f"cancelled 1 open incident(s); ended guard-{fleet.cluster}"
    assert again.detail == "cancelled 0 open incident(s); no fleet guard or reaper was running"
    assert status.outcome == Outcome.CANCELLED
    assert status.cancelled == f"by gpufleet cluster delete: cluster {fleet.cluster} is being deleted"
    assert status.requeued == [7]  # the job it had sent SIGTERM is back in the queue
    assert fleet.leases == {}
    assert guarding.status == WorkflowExecutionStatus.TERMINATED


async def until_listed(env: WorkflowEnvironment, query: str) -> None:
    """Visibility lags a moment behind a start: wait until the incident is listed."""

    async def listed() -> bool:
        return bool([w async for w in env.client.list_workflows(query)])

    for _ in range(600):
        if await listed():
            return
        await env.sleep(0.05)
    raise AssertionError(f"never listed: {query}")
