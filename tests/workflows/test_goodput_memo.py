"""What a closed incident leaves for `gpufleet report`, on the Temporal dev server (the time-skipping
test server knows no search attributes, and the memo is upserted only beside them): its ledger
and a summary in its memo, and its GPU-seconds in gpufleet_gpu_seconds_lost_total."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import BufferedMetricUpdate, MetricBuffer, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment

from models.constants import SEARCH_ATTRIBUTES
from models.goodput import IncidentLedger, Phase
from models.incident import IncidentStatus, Outcome
from models.metrics import GPU_SECONDS_LOST
from models.xid import XidEvent
from starters.temporal import report_xid
from tests.conftest import start_dev_server
from tests.workflows.test_remediation import Fleet, worker


@pytest.fixture(scope="module")
def metrics() -> MetricBuffer:
    return MetricBuffer(100_000)


@pytest.fixture(scope="module")
async def env(temporal_cli: str, metrics: MetricBuffer) -> AsyncIterator[WorkflowEnvironment]:
    runtime = Runtime(telemetry=TelemetryConfig(metrics=metrics))
    environment = await start_dev_server(
        temporal_cli, data_converter=pydantic_data_converter, runtime=runtime, search_attributes=SEARCH_ATTRIBUTES
    )
    yield environment
    await environment.shutdown()


async def test_a_closed_incident_keeps_its_ledger_in_its_memo_and_counts_it(
    env: WorkflowEnvironment, metrics: MetricBuffer
) -> None:
    fleet = Fleet()
    for job in fleet.jobs:
        job.gpus = 4
    async with worker(env, fleet):
        event = XidEvent(node="gpu1", xid=79, source="test")
        handle = await report_xid(env.client, event, cluster=fleet.cluster)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.ledger is not None
    described = await handle.describe()
    memo = await described.memo()
    assert set(memo) == {"ledger", "incident"}
    ledger = await described.memo_value("ledger", type_hint=IncidentLedger)
    assert ledger == status.ledger and ledger.gpus == 4
    assert memo["incident"] == {
        "incident_id": status.incident_id,
        "cluster": fleet.cluster,
        "node": "gpu1",
        "outcome": "resolved",
        "action": "REPLACE_NODE",
        "spare": "spare1",
        "dry_run": False,
        "node_gpus": 8,
    }
    updates: list[BufferedMetricUpdate] = list(metrics.retrieve_updates())
    counted = {
        str(update.attributes["phase"]): int(update.value)
        for update in updates
        if update.metric.name == GPU_SECONDS_LOST and update.attributes.get("cluster") == fleet.cluster
    }
    assert counted, "no GPU-seconds counted"
    assert {str(u.attributes["cause"]) for u in updates if u.metric.name == GPU_SECONDS_LOST} == {"Xid 79"}
    for phase, seconds in counted.items():
        assert seconds == round(ledger.cost(Phase(phase)).gpu_seconds or 0)
    assert Phase.LOST_WORK.value not in counted  # the job reported no checkpoint: unknown, not counted
