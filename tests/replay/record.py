"""Recording real lab incidents for the replay test.

Run the lab's end-to-end tests with ``GPUFLEET_RECORD_HISTORIES=DIR`` and every closed
incident (and node return) of the lab is written there as ``{workflow id}-{run id prefix}-{outcome}.json``
(Temporal's JSON form; one workflow id can have several runs), with the fleet guard's and the shared
pool's histories so far (``...-running.json``: they never close). Rename the ones worth keeping after what they show.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter

from models.constants import GUARD_WORKFLOW, REMEDIATION_WORKFLOW, RETURN_NODE_WORKFLOW
from models.poolops import POOL_WORKFLOW

RECORD_ENV = "GPUFLEET_RECORD_HISTORIES"


def record_histories(temporal_address: str) -> list[Path]:
    """Write the lab's closed incidents where $GPUFLEET_RECORD_HISTORIES says; nothing when unset."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return []

    async def go() -> list[Path]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        written = []
        executions = []
        for kind in (REMEDIATION_WORKFLOW, RETURN_NODE_WORKFLOW, GUARD_WORKFLOW, POOL_WORKFLOW):
            async for execution in client.list_workflows(f"WorkflowType='{kind}'"):
                executions.append(execution)
        for execution in executions:
            if execution.status == WorkflowExecutionStatus.RUNNING and execution.workflow_type not in (
                GUARD_WORKFLOW,
                POOL_WORKFLOW,
            ):
                continue
            outcome = (execution.status.name if execution.status else "unknown").lower()
            history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
            path = Path(folder) / f"{execution.id}-{execution.run_id[:8]}-{outcome}.json"
            path.write_text(history.to_json())
            written.append(path)
        return written

    return asyncio.run(go())
