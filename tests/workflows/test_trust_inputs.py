"""Inputs from outside gpufleet's services, checked inside the workflows (models/trust.py).

Whoever may start or signal a workflow could skip the CLI's own checks. Each bad value here is
sent straight to Temporal, as such a caller would: the workflow refuses it, says so, and changes
nothing: no activity runs for it and the state a person reads is as it was.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from models.clusterops import ClusterDeleteInput
from models.incident import Approval, CancelRequest, IncidentStatus, Outcome
from models.trust import MAX_BY, MAX_REASON, answer_problem, deletion_problem, move_problem
from tests.workflows.test_cluster import Cluster, delete, spec_input
from tests.workflows.test_pool import Pool, intervals, start, worker
from tests.workflows.test_remediation import Fleet, _until
from tests.workflows.test_remediation import start as start_incident
from tests.workflows.test_remediation import worker as fleet_worker
from workflows.cluster import ClusterDeletionWorkflow
from workflows.pool import PoolRebalanceWorkflow
from workflows.remediation import NodeRemediationWorkflow

BAD_ANSWERS = [
    ("", "fine"),  # nobody named
    ("   ", "fine"),
    ("ops\napproved by root", ""),  # a forged second line
    ("ops", "ok\x1b[2Jcleared"),  # a terminal escape
    ("x" * (MAX_BY + 1), ""),
    ("ops", "r" * (MAX_REASON + 1)),
]


def test_the_checks_say_what_is_wrong() -> None:
    assert answer_problem(by="ops", reason="checked the rack") is None
    assert "empty" in (answer_problem(by="", reason="") or "")
    assert "not printable" in (answer_problem(by="ops", reason="a\nb") or "")
    assert "more than" in (answer_problem(by="x" * (MAX_BY + 1), reason="") or "")
    # The longest ServiceAccount user name the API can stamp: a 63-character namespace, a 253-character name.
    longest = f"system:serviceaccount:{'n' * 63}:{'a' * 253}"
    assert answer_problem(by=longest, reason="") is None
    assert deletion_problem(force=True, requested_by=longest, reason="decommissioned") is None
    assert deletion_problem(force=False, requested_by="", reason="") is None
    assert deletion_problem(force=True, requested_by="alice", reason="decommissioned") is None
    assert "reason" in (deletion_problem(force=True, requested_by="alice", reason=" ") or "")
    assert "requested_by is empty" in (deletion_problem(force=True, requested_by="", reason="why") or "")
    assert "not true or false" in (deletion_problem(force="yes", requested_by="a", reason="b") or "")
    assert move_problem(2, total=4) is None and move_problem(-4, total=4) is None
    assert move_problem(9, total=None) is None  # the pool not counted yet: checked at the next look
    for bad in (0, 5, -5, True, 1.5, "2"):
        assert move_problem(bad, total=4), bad


@pytest.mark.parametrize(("force", "by", "reason"), [(True, "alice", ""), (True, "", "gone"), (False, "a\nb", "")])
async def test_a_deletion_with_a_bad_request_fails_at_its_start_and_changes_nothing(
    env: WorkflowEnvironment, force: bool, by: str, reason: str
) -> None:
    cluster = Cluster(running=[3])
    with pytest.raises(WorkflowFailureError) as failed:
        await delete(env, cluster, force=force, requested_by=by, reason=reason)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput" and cause.non_retryable
    assert "refused, nothing changed" in str(cause)
    assert cluster.calls == []  # not drained, no job cancelled, nothing torn down


async def test_a_forced_deletion_with_who_and_why_goes_on_and_replays(env: WorkflowEnvironment) -> None:
    cluster = Cluster(running=[1])
    status = await delete(env, cluster, force=True, requested_by="alice", reason="decommissioned")
    assert status.outcome == "deleted" and "cluster_cancel_jobs" in cluster.calls


async def test_a_refused_deletion_replays(env: WorkflowEnvironment) -> None:
    cluster = Cluster()
    workflow_id = f"cluster-research-delete-{uuid.uuid4().hex[:6]}"
    async with Worker(
        env.client, task_queue=cluster.task_queue, workflows=[ClusterDeletionWorkflow], activities=cluster.activities()
    ):
        handle = await env.client.start_workflow(
            ClusterDeletionWorkflow.run,
            ClusterDeleteInput(spec=spec_input().spec, backend="lab", force=True, requested_by="alice"),
            id=workflow_id,
            task_queue=cluster.task_queue,
        )
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    history = await handle.fetch_history()
    await Replayer(workflows=[ClusterDeletionWorkflow], data_converter=pydantic_data_converter).replay_workflow(history)


async def test_bad_approvals_and_cancel_requests_are_ignored_noted_and_change_nothing(
    env: WorkflowEnvironment,
) -> None:
    fleet = Fleet(node_drained=True, node_reason="bob: swapping the NIC")
    async with fleet_worker(env, fleet):
        handle = await start_incident(env.client, fleet)
        waiting = await _until(handle, lambda s: s.outcome == Outcome.AWAITING_APPROVAL)
        calls = list(fleet.calls)
        for by, reason in BAD_ANSWERS:
            for approved in (True, False):
                await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=approved, by=by, reason=reason))
            await handle.signal(NodeRemediationWorkflow.cancel_requested, CancelRequest(by=by, reason=reason))
        expected = 3 * len(BAD_ANSWERS)
        after: IncidentStatus = await _until(
            handle, lambda s: sum(e.event == "refused" for e in s.timeline) >= expected
        )
        # Still waiting, unanswered; nothing ran for any of them; each noted without its text.
        assert after.outcome == Outcome.AWAITING_APPROVAL and after.approval is None
        assert after.approval_wait == waiting.approval_wait
        assert [c for c in fleet.calls if not c.startswith(("notify", "guard"))] == [
            c for c in calls if not c.startswith(("notify", "guard"))
        ]
        notes = [e.detail for e in after.timeline if e.event == "refused"]
        assert sum(n.startswith("approval ignored: by is empty") for n in notes) == 2
        assert sum(n.startswith("cancel request ignored:") for n in notes) == len(BAD_ANSWERS)
        assert not any("approved by root" in n or "\x1b" in n for n in notes)
        # A good answer still passes: the refusals jammed nothing.
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="ops", reason="not now"))
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.REJECTED and status.approval is not None and status.approval.by == "ops"
    changing = {"drain_slurm_node", "signal_job:7", "requeue_job:7", "cordon_and_drain_node", "claim_spare"}
    assert not changing & set(fleet.calls)
    history = await handle.fetch_history()
    await Replayer(workflows=[NodeRemediationWorkflow], data_converter=pydantic_data_converter).replay_workflow(history)


async def test_a_move_of_a_bad_size_is_ignored_noted_and_moves_nothing(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=0.0)
    async with worker(env, pool):
        handle = await start(env, pool)
        await intervals(env, handle, 1)  # looked once: the pool's 4 nodes are known
        sizes: list[Any] = [0, 5, -5, 1000]
        for size in sizes:
            await handle.signal(PoolRebalanceWorkflow.rebalance, size)
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert pool.moves == [] and status.state.manual == 0
    assert len(status.state.refused) == len(sizes)
    assert "5 node(s) asked, the pool has 4" in status.state.refused[1]
    assert "0 nodes" in status.state.refused[0] and "1000 node(s) asked" in status.state.refused[-1]


async def test_a_move_asked_before_the_first_look_is_checked_at_it(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=0.0)
    async with worker(env, pool):
        handle = await start(env, pool)
        await handle.signal(PoolRebalanceWorkflow.rebalance, 7)
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert pool.moves == [] and status.state.manual == 0
    assert status.state.refused and "7 node(s) asked, the pool has 4" in status.state.refused[0]


# Recorded from the workflow code before `inputs-checked` (the commit before it, in the test
# server, with this module's stand-ins): an incident rejected with a reason of two lines, which
# it took then; a pool asked for -9 nodes of its 4, which it cut to its limits and moved, then for
# 0, which woke it. Today's code ignores both; a history from before must replay as it ran.
BEFORE_THE_CHECKS = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_the_histories_from_before_the_checks_are_there() -> None:
    assert [path.stem for path in BEFORE_THE_CHECKS] == [
        "approval-of-two-lines-completed",
        "rebalance-beyond-the-pool-terminated",
    ]


@pytest.mark.parametrize("path", BEFORE_THE_CHECKS, ids=[path.stem for path in BEFORE_THE_CHECKS])
async def test_a_history_from_before_the_checks_replays_as_it_ran(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, json.loads(path.read_text()))
    replayer = Replayer(
        workflows=[NodeRemediationWorkflow, PoolRebalanceWorkflow], data_converter=pydantic_data_converter
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
