"""Histories recorded from real lab runs replay against today's workflow code.

A change that would break workflows in flight (a step added, removed or reordered without
``workflow.patched``) makes the replayer raise a non-determinism error here, in CI. Each release
keeps its histories in ``tests/replay/vX.Y.Z/``, recorded from the lab as that release ran them
(``GPUFLEET_RECORD_HISTORIES=DIR``, see lab/histories.py) and named after what they show; every
release's histories keep replaying until the patches they need are deleted (docs/upgrading.md).
A replay compares commands, not timer durations: it shows that such a history still replays,
not which intervals the code would choose.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workers.main import CLUSTER_WORKFLOWS, CREATION_WORKFLOWS, GUARD_WORKFLOWS

HERE = Path(__file__).parent
HISTORIES = sorted(HERE.glob("v*/*.json"))
# Every workflow a worker runs, as it registers them.
WORKFLOWS = [*CLUSTER_WORKFLOWS, *GUARD_WORKFLOWS, *CREATION_WORKFLOWS]


# What v0.2.0 was recorded doing (from the lab at the commit that removed the patches, before
# anything was split): none of these may go missing.
V0_2_0 = {
    "resolved-completed",
    "awaiting-repair-completed",
    "no-spare-then-resolved-completed",
    "unknown-node-failed",
    "owner-drained-then-approved-completed",
    "worker-killed-at-checkpoint-completed",
    "held-by-guard-then-resolved-completed",
    "fleet-guard-tripped-and-reset-running",
    "quarantined-lemon-replaced-completed",
    "quarantine-released-completed",
    "pool-both-ways-running",
    "cluster-created-completed",
    "cluster-deleted-completed",
}


def test_there_are_recorded_histories_of_each_outcome() -> None:
    kinds = {path.stem.rsplit("-", 1)[1] for path in HISTORIES}
    assert {"completed", "failed", "running"} <= kinds, [path.name for path in HISTORIES]
    assert {path.stem for path in HISTORIES if path.parent.name == "v0.2.0"} >= V0_2_0


@pytest.mark.parametrize("path", HISTORIES, ids=[f"{path.parent.name}/{path.stem}" for path in HISTORIES])
async def test_recorded_history_replays(path: Path) -> None:
    # The file's name stands in for the workflow's ID: the code reads it only into activity
    # inputs (a pool's move IDs), which a replay does not compare.
    history = WorkflowHistory.from_json(path.stem.rsplit("-", 1)[0], json.loads(path.read_text()))
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
