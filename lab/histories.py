"""Recording a lab's workflow histories for the replay test (tests/replay).

Run a lab (its end-to-end tests, ``make chaos``) with ``GPUFLEET_RECORD_HISTORIES=DIR`` and every
closed workflow of the lab is written there as ``{workflow id}-{end of run id}-{outcome}.json``
(Temporal's JSON form; one workflow id can have several runs), with the fleet guard's and the
shared pool's histories so far (``...-running.json``: they never close). Keep the ones worth
keeping in ``tests/replay/vX.Y.Z/``, renamed after what they show.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter

from models.clusterops import CLUSTER_CREATION_WORKFLOW, CLUSTER_DELETION_WORKFLOW
from models.constants import GUARD_WORKFLOW, RELEASE_NODE_WORKFLOW, REMEDIATION_WORKFLOW, RETURN_NODE_WORKFLOW
from models.poolops import POOL_WORKFLOW

RECORD_ENV = "GPUFLEET_RECORD_HISTORIES"
RECORDED = (
    REMEDIATION_WORKFLOW,
    RETURN_NODE_WORKFLOW,
    RELEASE_NODE_WORKFLOW,
    GUARD_WORKFLOW,
    POOL_WORKFLOW,
    CLUSTER_CREATION_WORKFLOW,
    CLUSTER_DELETION_WORKFLOW,
)
# Workflows that run for ever: recorded as far as they got.
NEVER_CLOSED = (GUARD_WORKFLOW, POOL_WORKFLOW)


def record_histories(temporal_address: str, *, folder: str | None = None) -> list[Path]:
    """Write the lab's closed workflows (and its guard's and pool's so far) into ``folder``, by
    default $GPUFLEET_RECORD_HISTORIES; nothing when neither says where."""
    return asyncio.run(record_histories_async(temporal_address, folder=folder))


async def record_histories_async(temporal_address: str, *, folder: str | None = None) -> list[Path]:
    """record_histories, from inside an event loop."""
    folder = folder or os.environ.get(RECORD_ENV)
    if not folder:
        return []
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
    written = []
    executions = []
    for kind in RECORDED:
        async for execution in client.list_workflows(f"WorkflowType='{kind}'"):
            executions.append(execution)
    for execution in executions:
        running = execution.status == WorkflowExecutionStatus.RUNNING
        if running and execution.workflow_type not in NEVER_CLOSED:
            continue
        outcome = (execution.status.name if execution.status else "unknown").lower()
        history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
        path = target / f"{execution.id}-{execution.run_id[-12:]}-{outcome}.json"
        path.write_text(history.to_json())
        written.append(path)
    return written
