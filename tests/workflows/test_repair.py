"""Repairs in place on the time-skipping server: a GPU reset or a reboot through a Job pinned
to the node, a settle period, the node back in service; escalation, a level at a time, when a
Job fails, when the node reports again while settling, or when it fails again soon after a
repair (the fleet guard remembers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from models.guard import GuardStatus
from models.incident import Outcome, Step
from models.policy import Action, RepairSettings
from models.xid import XidEvent
from starters.temporal import report_xid
from tests.workflows.test_guard import guard, guarded, running, until
from tests.workflows.test_remediation import start
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow


async def test_a_gpu_reset_in_place_puts_the_node_back_and_the_jobs_run_again(env: WorkflowEnvironment) -> None:
    fleet = guarded()
    async with running(env, fleet):
        status = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.RESET_GPU
    assert [(r.action, r.attempt) for r in fleet.repairs] == [(Action.RESET_GPU, 1)]
    assert fleet.resumed_nodes == ["gpu1"] and status.spare is None and "claim_spare" not in fleet.calls
    steps = [e.step for e in status.timeline if e.event == "finished"]
    assert steps.index(Step.REQUEUE) < steps.index(Step.REPAIR) < steps.index(Step.SETTLE) < steps.index(Step.RESUME)
    assert status.jobs and status.jobs[0].job_id == 7  # running again
    [resolved] = [n for n in fleet.notifications if n.kind == "resolved"]
    assert "resolved by RESET_GPU in place" in resolved.text


@pytest.mark.parametrize(
    ("outcomes", "final", "spare"),
    [
        ([False], Action.REBOOT_NODE, None),  # the reset Job fails: a reboot
        ([False, False], Action.REPLACE_NODE, "spare1"),  # so does the reboot: replaced
    ],
)
async def test_a_repair_that_fails_escalates_a_level(
    env: WorkflowEnvironment, outcomes: list[bool], final: Action, spare: str | None
) -> None:
    fleet = guarded()
    fleet.repair_succeeds = outcomes
    async with running(env, fleet):
        status = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert status.outcome == Outcome.RESOLVED and status.action == final and status.spare == spare
    # The reboot is started and its slot given back: the node's return is waited for without one.
    assert fleet.calls.count("start_reboot") == 1
    released = [e.detail for e in state.state.log if e.event == "released"]
    assert "reboot issued" in released
    escalations = [e.detail for e in status.timeline if e.event == "escalated"]
    assert escalations[0].startswith("RESET_GPU -> REBOOT_NODE: Job job-1 failed")
    assert len([n for n in fleet.notifications if n.kind == "escalated"]) == len(outcomes)


async def test_an_xid_while_settling_escalates(env: WorkflowEnvironment) -> None:
    fleet = guarded()
    async with running(env, fleet):
        handle = await start(env.client, fleet, node="gpu1", xid=48)
        await until(handle, NodeRemediationWorkflow.status, lambda s: s.step == Step.SETTLE, "settling")
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=48, source="test"))
        status = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REBOOT_NODE
    assert [(r.action, r.attempt) for r in fleet.repairs] == [(Action.RESET_GPU, 1), (Action.REBOOT_NODE, 2)]
    assert any(e.event == "escalated" and "while settling" in e.detail for e in status.timeline)


async def test_the_same_event_posted_again_while_settling_is_folded(env: WorkflowEnvironment) -> None:
    # A detector that never got the answer to its post (a timeout, a reset connection) posts the
    # same event again, possibly much later: a copy, not the node failing again.
    fleet = guarded()
    event = XidEvent(node="gpu1", xid=48, source="test")
    async with running(env, fleet):
        handle = await report_xid(env.client, event, cluster=fleet.cluster, search_attributes=False)
        await until(handle, NodeRemediationWorkflow.status, lambda s: s.step == Step.SETTLE, "settling")
        await report_xid(env.client, event, cluster=fleet.cluster, search_attributes=False)
        status = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.RESET_GPU
    assert [(r.action, r.attempt) for r in fleet.repairs] == [(Action.RESET_GPU, 1)]
    assert not [e for e in status.timeline if e.event == "escalated"]
    assert [e.detail for e in status.timeline if e.event == "xid"] == ["Xid 48 from test"]  # the first only
    assert status.events == [event.label]


# Recorded from the workflow code before `duplicate-events-folded` (the test above, in the test
# server, with its stand-ins): the copy escalated the reset to a reboot. It must replay as it ran.
BEFORE_THE_FOLD = Path(__file__).parent / "histories-folded" / "duplicate-while-settling-escalated.json"


async def test_a_history_from_before_the_fold_replays_as_it_ran() -> None:
    history = WorkflowHistory.from_json(BEFORE_THE_FOLD.stem, json.loads(BEFORE_THE_FOLD.read_text()))
    reports = [
        e
        for e in history.events
        if e.HasField("workflow_execution_signaled_event_attributes")
        and e.workflow_execution_signaled_event_attributes.signal_name == "report_xid"
    ]
    assert len(reports) == 2  # the event, and its copy
    replayer = Replayer(workflows=[NodeRemediationWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure


async def test_a_node_failing_again_soon_after_a_repair_starts_one_level_up(env: WorkflowEnvironment) -> None:
    # The escalation window is measured on the server's clock: it moves only as the test says
    # (a one-second settle, so that nothing waits long for real).
    fleet = guarded()
    fleet.policy = fleet.policy.model_copy(update={"repair": RepairSettings(settle_seconds=1)})
    async with running(env, fleet, manual_clock=True):
        first = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
        second = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
    assert first.action == Action.RESET_GPU and second.action == Action.REBOOT_NODE
    assert second.escalated_by_guard.startswith("REBOOT_NODE: reported again")
    # Drained at once for what the event called for; the guard's word raised it afterwards.
    assert "RESET_GPU" in fleet.drain_reasons[1]
    assert [r.action for r in fleet.repairs] == [Action.RESET_GPU, Action.REBOOT_NODE]
