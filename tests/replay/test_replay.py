"""Histories recorded from real lab incidents replay against today's workflow code.

A change that would break incidents in flight (a step added, removed or reordered without
``workflow.patched``) makes the replayer raise a non-determinism error here, in CI.
Record new ones with ``GPUFLEET_RECORD_HISTORIES=DIR`` (see record.py) and keep them here named after
what they show (resolved, awaiting-repair, no-spare-then-returned, unknown-node, and, since the fleet
guard, guarded-resolved, guarded-no-spare-then-returned, rebooted-in-place, dry-run, the guard's own
history so far and a node return, and the shared pool's: moving nodes both ways with a budget
refusing, and as the release before the ``pool-settle`` patch ran it); the ``operator-drained``
and ``worker-killed`` ones come from a `make chaos` run's Temporal database, and
``burst-asked-guard-eight-times`` from a 1,000-Xid `make bench-scale` run's, an incident that asked the
guard eight times a minute apart before the ``guard-ask-backoff`` patch (with nine workflow-task
timeouts on the way). A replay compares commands, not timer durations: it shows that such a history
still replays, not which intervals the code would choose.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.guard import FleetGuardWorkflow
from workflows.nodes import ReturnNodeWorkflow
from workflows.pool import PoolRebalanceWorkflow
from workflows.remediation import NodeRemediationWorkflow

HISTORIES = sorted(Path(__file__).parent.glob("*.json"))


def test_there_are_recorded_histories_of_each_outcome() -> None:
    kinds = {path.stem.rsplit("-", 1)[1] for path in HISTORIES}
    assert {"completed", "failed"} <= kinds, [path.name for path in HISTORIES]


@pytest.mark.parametrize("path", HISTORIES, ids=[path.stem for path in HISTORIES])
async def test_recorded_history_replays(path: Path) -> None:
    # The file's name stands in for the workflow's ID: the code reads it only into activity
    # inputs (a pool's move IDs), which a replay does not compare.
    history = WorkflowHistory.from_json(path.stem.rsplit("-", 1)[0], json.loads(path.read_text()))
    replayer = Replayer(
        workflows=[NodeRemediationWorkflow, FleetGuardWorkflow, ReturnNodeWorkflow, PoolRebalanceWorkflow],
        data_converter=pydantic_data_converter,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
