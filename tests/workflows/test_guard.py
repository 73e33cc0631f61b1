"""The fleet guard on the time-skipping test server, with the incidents it guards.

Every incident drains its node at once, whatever the guard says. The breaker trips at exactly
the configured share of nodes drained within the window and holds until a reset; a request past
the in-flight limit waits in line for a slot without tripping it; a slot is held only while a
destructive step acts (incidents waiting for spares hold none); a person may approve one past
the breaker or reject it; pause holds new incidents without a page; a terminated incident's slot
comes back; the guard's state survives a worker restart and its own continue-as-new; an opted-out
node is only recorded; an action the policy gates waits for approval, reminding meanwhile.

The window is measured on the server's clock, so the tests that depend on it move time only
when they say so (auto time skipping off).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from models.constants import (
    GUARD_FORGIVE_SIGNAL,
    GUARD_PAUSE_SIGNAL,
    GUARD_REQUEST_SIGNAL,
    GUARD_RESET_SIGNAL,
    GUARD_RESUME_SIGNAL,
    GUARD_RETURNED_SIGNAL,
    GUARD_WORKFLOW,
    REMEDIATION_DISABLED,
    REMEDIATION_LABEL,
    guard_task_queue,
    guard_workflow_id,
    remediation_workflow_id,
)
from models.guard import GuardCommand, GuardInput, GuardStatus, SlotRequest
from models.incident import Approval, IncidentStatus, JobInfo, Outcome, Step
from models.policy import Action, GuardSettings, Policy, RemediationSettings
from tests.workflows.test_remediation import Fleet, start, worker
from workflows.guard import MESSAGES_PER_RUN, FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow

NODES = {"gpu1", "gpu2", "gpu3", "gpu4"}


@contextlib.asynccontextmanager
async def running(
    env: WorkflowEnvironment, fleet: Fleet, *, manual_clock: bool = False, end_guard: bool = True, **options: Any
) -> AsyncIterator[None]:
    """A worker for the fleet; with ``manual_clock``, time moves only on ``env.sleep``."""
    with env.auto_time_skipping_disabled() if manual_clock else contextlib.nullcontext():
        async with worker(env, fleet, **options):
            yield
    # The guard runs for ever: end this test's, so the shared test server carries only its own.
    if end_guard:
        with contextlib.suppress(Exception):
            await guard(env.client, fleet).terminate("test over")


def guarded(**limits: Any) -> Fleet:
    return Fleet(nodes=set(NODES), partition_size=4, policy=Policy(guard=GuardSettings(**limits)))


async def until(handle: WorkflowHandle[Any, Any], query: Any, check: Callable[[Any], bool], what: str) -> Any:
    """Query until ``check`` holds (the incident or guard got there), or fail after a while."""
    deadline = time.monotonic() + 60
    while True:
        try:
            value = await handle.query(query)
        except Exception:  # not started yet, or between runs
            value = None
        if value is not None and check(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never got to: {what} (last: {value})")
        await asyncio.sleep(0.1)


async def waiting(handle: WorkflowHandle[Any, Any]) -> IncidentStatus:
    return await until(  # type: ignore[no-any-return]
        handle, NodeRemediationWorkflow.status, lambda s: s.waiting_for_approval is not None, "awaiting approval"
    )


async def paused_guard(client: Client, fleet: Fleet, *, reason: str = "") -> WorkflowHandle[Any, Any]:
    """Start the fleet's guard paused by ops, as `gpufleet pause` does."""
    return await client.start_workflow(
        GUARD_WORKFLOW,
        GuardInput(cluster=fleet.cluster),
        id=guard_workflow_id(fleet.cluster),
        task_queue=guard_task_queue(fleet.cluster),
        start_signal=GUARD_PAUSE_SIGNAL,
        start_signal_args=[GuardCommand(by="ops", reason=reason)],
    )


def guard(client: Client, fleet: Fleet) -> WorkflowHandle[Any, Any]:
    return client.get_workflow_handle(guard_workflow_id(fleet.cluster))


async def tell(client: Client, fleet: Fleet, signal: str, *, by: str = "ops") -> None:
    await guard(client, fleet).signal(signal, GuardCommand(by=by))


def pages(fleet: Fleet) -> list[str]:
    return [n.text for n in fleet.notifications if n.kind == "breaker_tripped"]


@pytest.mark.parametrize(("share", "granted"), [(0.5, 2), (0.75, 3)])
async def test_the_breaker_trips_at_exactly_the_share_and_holds_until_reset(
    env: WorkflowEnvironment, share: float, granted: int
) -> None:
    fleet = guarded(max_in_flight=10, max_share=share)
    order = ["gpu1", "gpu2", "gpu3", "gpu4"]
    # Time moves only when the test says so: the window is ten minutes of it.
    async with running(env, fleet, manual_clock=True):
        for node in order[:granted]:
            assert (await (await start(env.client, fleet, node=node)).result()).outcome == Outcome.RESOLVED
        held = [await start(env.client, fleet, node=node) for node in order[granted:]]
        statuses = [await waiting(handle) for handle in held]
        assert all("breaker tripped" in s.waiting_for_approval for s in statuses if s.waiting_for_approval)
        # Drained at once (no new work on a failed GPU), their running jobs untouched.
        assert all(s.step == Step.AWAITING_APPROVAL and not s.signalled for s in statuses)
        assert sorted(fleet.drained) == order
        assert len(pages(fleet)) == 1  # once, however many wait
        # Past the share from the first incident over it (the later drains may have been counted too).
        assert any(f"{n} of the partition's 4 nodes" in pages(fleet)[0] for n in range(granted + 1, 5))
        # It holds: the window passes, the incidents that had slots are long closed. The odd
        # seconds keep the reset off the instant a waiting incident's 30-minute re-ask timer fires:
        # the test server cannot take a timer cancelled in the task it fires during.
        await env.sleep(timedelta(hours=2, seconds=17))
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        assert state.state.tripped and sorted(r.node for r in state.state.waiting) == order[granted:]
        await tell(env.client, fleet, GUARD_RESET_SIGNAL)
        results = [await handle.result() for handle in held]
    assert all(r.outcome == Outcome.RESOLVED for r in results)
    assert sorted(fleet.drained) == order
    assert len(pages(fleet)) == 1


async def test_a_reset_lets_a_storm_through_every_step_of_its_incidents(env: WorkflowEnvironment) -> None:
    """Four nodes fail at once, each with a running job, two slots: the breaker trips once and a
    reset lets the four through. Each incident asks for a slot per step (killing its jobs, then
    the retirement), the later ones in line as slots free up; the reset's incidents are not
    counted again in the window it starts (patch guard-reset-lets-through), so the second step's
    asks never trip it again (make chaos's storm was held a second time, for ever)."""
    fleet = guarded(max_in_flight=2, max_share=0.5)
    order = ["gpu1", "gpu2", "gpu3", "gpu4"]
    async with running(env, fleet, manual_clock=True):
        held = [await start(env.client, fleet, node=node) for node in order]
        await until(
            guard(env.client, fleet),
            FleetGuardWorkflow.status,
            lambda s: s.state.tripped and len(s.state.waiting) == 4,
            "all four held by the tripped breaker",
        )
        await tell(env.client, fleet, GUARD_RESET_SIGNAL)
        # (Held again, they would wait for ever: each is given a minute, not the test's timeout.)
        resolved = lambda s: s.outcome == Outcome.RESOLVED  # noqa: E731
        results = [await until(h, NodeRemediationWorkflow.status, resolved, f"{h.id} resolved") for h in held]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        # Let through for the reset's window only, as any incident's entry ages out.
        assert sorted(state.state.let_through) == sorted(r.incident_id for r in results)
        window = timedelta(seconds=state.limits.window_seconds)
        assert state.state.let_through_until == state.state.window_since + window
        await env.sleep(window + timedelta(seconds=17))
        await tell(env.client, fleet, GUARD_RESUME_SIGNAL)  # any message: the guard prunes after it
        lapsed: GuardStatus = await until(
            guard(env.client, fleet), FleetGuardWorkflow.status, lambda s: not s.state.let_through, "it to lapse"
        )
    assert all(r.signalled for r in results)  # each killed its jobs under a slot of its own
    assert len(pages(fleet)) == 1 and not state.state.tripped
    assert [e.event for e in state.state.log].count("tripped") == 1
    assert state.nodes_in_window == []  # the reset's four are not counted again
    assert lapsed.state.let_through_until is None


async def test_a_reset_during_a_pause_lets_nothing_past_the_limits(env: WorkflowEnvironment) -> None:
    """Four nodes fail while remediation is paused: a reset (the breaker not tripped) lets none of
    them through; at the resume the share limit applies to what the pause held, and the breaker
    trips on the third (two of four is the limit), paging once."""
    fleet = guarded(max_in_flight=10, max_share=0.5)
    async with running(env, fleet, manual_clock=True):
        await paused_guard(env.client, fleet, reason="driver roll-out")
        held = [await start(env.client, fleet, node=node) for node in ("gpu1", "gpu2", "gpu3", "gpu4")]
        for handle in held:
            await waiting(handle)
        await tell(env.client, fleet, GUARD_RESET_SIGNAL)
        await tell(env.client, fleet, GUARD_RESUME_SIGNAL)
        state: GuardStatus = await until(
            guard(env.client, fleet), FleetGuardWorkflow.status, lambda s: s.state.tripped, "the breaker to trip"
        )
        assert state.state.let_through == [] and len(state.state.waiting) == 2
        deadline = time.monotonic() + 60
        while not pages(fleet) and time.monotonic() < deadline:  # sent beside the guard's work
            await asyncio.sleep(0.1)
    assert len(pages(fleet)) == 1


async def test_incidents_waiting_for_spares_hold_no_slot_and_a_new_node_is_drained_at_once(
    env: WorkflowEnvironment,
) -> None:
    """Two incidents wait for spares, every slot of the guard once taken: a third Xid's node is
    drained at once and the job its failure ended is requeued before anything waits; the spare
    waits hold no slot, so the third goes on too, and nothing trips."""
    fleet = guarded(max_in_flight=2, max_share=1.0)
    fleet.spare_free = False
    async with running(env, fleet):
        waiting_for_spares = [await start(env.client, fleet, node=node) for node in ("gpu1", "gpu2")]
        for handle in waiting_for_spares:
            await until(handle, NodeRemediationWorkflow.status, lambda s: s.waiting_for_spare, "waiting for a spare")
        # A wait for a spare holds no slot: the retirement's comes back as the wait begins (the
        # guard hears of it a moment later).
        state: GuardStatus = await until(
            guard(env.client, fleet), FleetGuardWorkflow.status, lambda s: not s.state.in_flight, "no slot held"
        )
        # The third node's job crashed with its GPU before the incident looked.
        fleet.jobs = [JobInfo(job_id=7, user="alice", state="RUNNING"), JobInfo(job_id=8, user="bob", state="FAILED")]
        third = await start(env.client, fleet, node="gpu3")
        status = await until(third, NodeRemediationWorkflow.status, lambda s: s.waiting_for_spare, "waiting too")
        drained = next(e.at for e in status.timeline if e.step == Step.DRAIN_SLURM and e.event == "finished")
        requeued_ended = next(e for e in status.timeline if e.step == Step.REQUEUE_ENDED and e.event == "finished")
        first_guard = next(e.at for e in status.timeline if e.step == Step.GUARD)
        assert drained <= requeued_ended.at <= first_guard  # drained and requeued before any wait
        assert status.ended == [8] and 8 in status.requeued and status.requeued.index(8) == 0
        fleet.spare_free = True
        for handle in (*waiting_for_spares, third):
            await handle.signal(NodeRemediationWorkflow.spare_available)
        statuses = [await handle.result() for handle in (*waiting_for_spares, third)]
        state = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert sorted(fleet.drained) == ["gpu1", "gpu2", "gpu3"]
    assert all(s.outcome == Outcome.RESOLVED for s in statuses)
    assert not state.state.tripped and not pages(fleet)
    assert sorted(statuses[2].ran_again) == [7, 8]


async def test_a_request_past_the_in_flight_limit_waits_in_line_without_tripping(env: WorkflowEnvironment) -> None:
    """One slot, held by an incident whose job takes its whole grace to checkpoint: the next
    incident drains its node, then waits for the slot (no breaker, no page) and goes on as soon
    as the first gives it back; each slot's life is one step."""
    fleet = guarded(max_in_flight=1, max_share=1.0)
    fleet.jobs_exit_on_sigterm = False
    fleet.settings = RemediationSettings(grace_seconds=3600)
    async with running(env, fleet, manual_clock=True):
        first = await start(env.client, fleet, node="gpu1")
        await until(first, NodeRemediationWorkflow.status, lambda s: s.step == Step.CHECKPOINT, "in its grace")
        second = await start(env.client, fleet, node="gpu2")
        status = await waiting(second)
        assert status.waiting_for_approval == "every slot is taken (1 of 1); next in line"
        assert fleet.drained == ["gpu1", "gpu2"]
        fleet.jobs_exit_on_sigterm = True  # the second's job will not take its whole grace
        await first.signal(NodeRemediationWorkflow.checkpoint_done, 7)
        statuses = [await handle.result() for handle in (first, second)]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert all(s.outcome == Outcome.RESOLVED for s in statuses)
    assert not state.state.tripped and not pages(fleet)
    slots = [(e.event, e.node) for e in state.state.log if e.event in ("granted", "released")]
    # gpu2 is granted the slot only once gpu1 gave back the slot it held to kill its jobs.
    assert slots.index(("granted", "gpu2")) > slots.index(("released", "gpu1"))
    assert all(s.count(("granted", n)) == 2 for s, n in [(slots, "gpu1"), (slots, "gpu2")])


async def test_approve_lets_one_past_the_breaker_and_reject_closes_one_changing_nothing_more(
    env: WorkflowEnvironment,
) -> None:
    fleet = guarded(max_in_flight=10, max_share=0.25)
    async with running(env, fleet):
        assert (await (await start(env.client, fleet, node="gpu1")).result()).outcome == Outcome.RESOLVED
        approved = await start(env.client, fleet, node="gpu2")
        await waiting(approved)  # 2 of 4 nodes within the window: the breaker trips
        rejected = await start(env.client, fleet, node="gpu3")
        await waiting(rejected)
        await approved.signal(NodeRemediationWorkflow.decide, Approval(approved=True, by="ops", reason="checked"))
        assert (await approved.result()).outcome == Outcome.RESOLVED
        await rejected.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="ops", reason="rack work"))
        closed = await rejected.result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    # Rejected: drained as soon as it failed, nothing more (its job was left to run).
    assert closed.outcome == Outcome.REJECTED and not closed.signalled and not closed.requeued
    assert fleet.drained == ["gpu1", "gpu2", "gpu3"]
    [message] = [n for n in fleet.notifications if n.kind == "rejected"]
    assert "stays drained" in message.text
    assert state.state.tripped  # approving one does not close the breaker for the others
    assert not state.state.waiting
    assert any(e.event == "approved" and e.node == "gpu2" for e in state.state.log)


async def test_pause_holds_new_incidents_without_a_page_and_resume_lets_them_go(env: WorkflowEnvironment) -> None:
    fleet = guarded()
    async with running(env, fleet):
        # As `gpufleet pause` does: the guard may not run yet.
        await paused_guard(env.client, fleet, reason="driver roll-out")
        handle = await start(env.client, fleet, node="gpu1")
        status = await waiting(handle)
        assert status.waiting_for_approval == "remediation is paused by ops (driver roll-out)"
        await tell(env.client, fleet, GUARD_RESUME_SIGNAL)
        assert (await handle.result()).outcome == Outcome.RESOLVED
    assert not pages(fleet)


async def test_a_terminated_incident_gives_its_slot_back(env: WorkflowEnvironment) -> None:
    fleet = guarded(max_in_flight=1, max_share=1.0)
    fleet.jobs_exit_on_sigterm = False
    fleet.settings = RemediationSettings(grace_seconds=3600)
    async with running(env, fleet, manual_clock=True):
        first = await start(env.client, fleet, node="gpu1")
        await until(first, NodeRemediationWorkflow.status, lambda s: s.step == Step.CHECKPOINT, "holding its slot")
        await first.terminate("a person ended it by hand")
        fleet.jobs_exit_on_sigterm = True
        status = await (await start(env.client, fleet, node="gpu2")).result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert status.outcome == Outcome.RESOLVED and not pages(fleet)
    assert any(e.event == "reaped" and e.node == "gpu1" for e in state.state.log)


async def test_the_guards_state_survives_a_worker_restart(env: WorkflowEnvironment) -> None:
    fleet = guarded(max_in_flight=10, max_share=0.25)
    # No workflow cache: the second worker gets the guard from its history, not from the first.
    async with running(env, fleet, manual_clock=True, end_guard=False, max_cached_workflows=0):
        assert (await (await start(env.client, fleet, node="gpu1")).result()).outcome == Outcome.RESOLVED
        held = await start(env.client, fleet, node="gpu2")
        await waiting(held)
    async with running(env, fleet, manual_clock=True, max_cached_workflows=0):  # a new worker
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        assert state.state.tripped and [r.node for r in state.state.waiting] == ["gpu2"]
        await tell(env.client, fleet, GUARD_RESET_SIGNAL)
        assert (await held.result()).outcome == Outcome.RESOLVED


SIGNALS_AT_ONCE = 50


async def test_the_guard_continues_as_new_with_its_state(env: WorkflowEnvironment) -> None:
    fleet = guarded()
    async with running(env, fleet):
        handle = await paused_guard(env.client, fleet)
        first_run = (await handle.describe()).run_id
        signals = [GUARD_RESUME_SIGNAL if index % 2 == 0 else GUARD_PAUSE_SIGNAL for index in range(MESSAGES_PER_RUN)]
        # Sent a batch at a time, the guard taking several in one workflow task (as it does a burst),
        # not one round trip and task each; the last alone, so that it is the last handled.
        for first in range(0, len(signals) - 1, SIGNALS_AT_ONCE):
            batch = signals[first : min(first + SIGNALS_AT_ONCE, len(signals) - 1)]
            await asyncio.gather(*(tell(env.client, fleet, signal) for signal in batch))
        await tell(env.client, fleet, signals[-1])
        state = await until(
            guard(env.client, fleet),
            FleetGuardWorkflow.status,
            lambda s: s.state.handled == MESSAGES_PER_RUN + 1,
            "every message handled",
        )
        run = (await guard(env.client, fleet).describe()).run_id
    assert run != first_run  # continued as new...
    assert state.state.paused and state.state.paused_by == "ops"  # ... with its state


async def test_an_opted_out_node_is_recorded_and_nothing_changes(env: WorkflowEnvironment) -> None:
    fleet = guarded()
    fleet.labels = {"gpu1": {REMEDIATION_LABEL: REMEDIATION_DISABLED}}
    async with running(env, fleet):
        status = await (await start(env.client, fleet, node="gpu1")).result()
    assert status.outcome == Outcome.OPTED_OUT and status.action == Action.REPLACE_NODE
    assert not fleet.drained and "claim_spare" not in fleet.calls
    [message] = [n for n in fleet.notifications if n.kind == "opted_out"]
    assert "gpufleet.io/remediation=disabled" in message.text and "changed nothing" in message.text


@pytest.mark.parametrize("approved", [True, False])
async def test_a_gated_action_waits_for_approval_reminding_meanwhile(env: WorkflowEnvironment, approved: bool) -> None:
    fleet = guarded(require_approval=[Action.REPLACE_NODE], approval_reminder_seconds=1)
    async with running(env, fleet):
        handle = await start(env.client, fleet, node="gpu1")
        status = await waiting(handle)
        assert status.step == Step.AWAITING_APPROVAL and status.requeued == [7]  # drained, jobs requeued
        assert "REPLACE_NODE needs approval" in (status.waiting_for_approval or "")
        await until(
            handle,
            NodeRemediationWorkflow.status,
            lambda s: sum(n.kind == "approval_reminder" for n in s.notifications) >= 2,
            "two reminders",
        )
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=approved, by="ops"))
        status = await handle.result()
    reminders = [n for n in fleet.notifications if n.kind == "approval_reminder"]
    assert len(reminders) >= 2 and "waiting 1s for approval of REPLACE_NODE" in reminders[0].text
    assert fleet.drained == ["gpu1"]
    if approved:
        assert status.outcome == Outcome.RESOLVED and status.spare == "spare1"
    else:
        assert status.outcome == Outcome.REJECTED and status.spare is None
        assert "claim_spare" not in fleet.calls and "cordon_and_drain_node" not in fleet.calls
        [rejected] = [n for n in fleet.notifications if n.kind == "rejected"]
        assert "stays drained" in rejected.text


async def test_a_dry_run_records_every_step_and_asks_each_activity_to_change_nothing(
    env: WorkflowEnvironment,
) -> None:
    fleet = guarded(require_approval=[Action.REPLACE_NODE])
    fleet.jobs_exit_on_sigterm = False  # a real grace would wait 120 s: a dry run does not
    async with running(env, fleet):
        handle = await start(env.client, fleet, node="gpu1", dry_run=True)
        assert handle.id == f"dryrun-{fleet.cluster}-gpu1"  # never the real incident's ID
        status = await handle.result()
    assert status.dry_run and status.incident_id.startswith(f"dryrun-{fleet.cluster}-gpu1-")
    assert status.outcome == Outcome.RESOLVED and status.spare == "spare1" and status.requeued == [7]
    assert fleet.writes and all(request.dry_run for request in fleet.writes)
    assert {type(request).__name__ for request in fleet.writes} == {
        "DrainRequest",
        "SignalJobRequest",
        "RequeueJobRequest",
        "KubeDrainRequest",
        "RetireRequest",
        "ClaimRequest",
    }
    assert not fleet.notifications  # nobody is told...
    assert [n.outcome for n in status.notifications] == ["dry_run", "dry_run"]  # ... what would be said is kept
    assert "jobs_still_running" not in fleet.calls and "jobs_resumed" not in fleet.calls  # waits simulated
    details = [e.detail for e in status.timeline]
    assert "dry run: would wait up to 120s for checkpoints" in details
    assert "would wait for approval: REPLACE_NODE needs approval in cluster " + fleet.cluster in details
    assert not any(e.step == Step.GUARD and e.event == "finished" for e in status.timeline)  # no slot taken
    with pytest.raises(RPCError, match="not found"):
        await guard(env.client, fleet).describe()  # a dry run never starts (or asks) the fleet guard


async def test_a_node_with_repeated_incidents_is_quarantined_and_released(env: WorkflowEnvironment) -> None:
    fleet = guarded(quarantine_after=2, cooldown_seconds=0)
    async with running(env, fleet, manual_clock=True):  # the window is on the server's clock
        first = await (await start(env.client, fleet, node="gpu1")).result()
        await env.sleep(timedelta(seconds=2))  # an incident's ID has its start to the second
        second = await (await start(env.client, fleet, node="gpu1")).result()
        await tell(env.client, fleet, GUARD_FORGIVE_SIGNAL)  # no node: nothing to forgive
        await guard(env.client, fleet).signal(GUARD_FORGIVE_SIGNAL, GuardCommand(node="gpu1", by="ops"))
        third = await (await start(env.client, fleet, node="gpu1")).result()
    assert not first.quarantine and not first.quarantined
    assert second.quarantined and "2 incidents within 7 days" in second.quarantine
    assert fleet.quarantined == {"gpu1": "repeat-failures"}
    [message] = [n for n in fleet.notifications if n.kind == "quarantined"]
    assert "gpufleet nodes release gpu1" in message.text
    assert not third.quarantined  # released: its record starts again


async def test_a_node_failing_again_within_its_cooldown_is_quarantined(env: WorkflowEnvironment) -> None:
    fleet = guarded(quarantine_after=0, cooldown_seconds=3600)
    async with running(env, fleet, manual_clock=True):
        await (await start(env.client, fleet, node="gpu1")).result()
        await guard(env.client, fleet).signal(GUARD_RETURNED_SIGNAL, GuardCommand(node="gpu1"))  # as `nodes return`
        again = await (await start(env.client, fleet, node="gpu1")).result()
        other = await (await start(env.client, fleet, node="gpu2")).result()
    assert again.quarantined and again.quarantine.startswith("failed again 0.0 h after it was returned")
    assert fleet.quarantined == {"gpu1": "failed-in-cooldown"}
    assert not other.quarantined


async def test_a_burst_of_requests_is_answered_together_not_one_task_after_another(env: WorkflowEnvironment) -> None:
    """Thirty incidents at once, the limits wide open: every one gets its slot and resolves, and the
    guard answers the requests it has together, a batch per activity that signals the incidents
    straight (one round trip per answer made a burst of a thousand wait minutes, and incidents
    left unanswered asked again)."""
    nodes = [f"gpu{i}" for i in range(1, 31)]
    fleet = Fleet(
        nodes=set(nodes), partition_size=30, policy=Policy(guard=GuardSettings(max_in_flight=100, max_share=0))
    )
    async with running(env, fleet, end_guard=False):
        handles = await asyncio.gather(*(start(env.client, fleet, node=node) for node in nodes))
        statuses = [await handle.result() for handle in handles]
        history = await guard(env.client, fleet).fetch_history()
        await guard(env.client, fleet).terminate("test over")
    assert all(status.outcome == Outcome.RESOLVED for status in statuses)
    assert sorted(fleet.drained) == sorted(nodes)
    # The answers each batch sent (one activity each): one per batch when each waited for the last.
    batches = [
        len(json.loads(event.activity_task_scheduled_event_attributes.input.payloads[0].data))
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == "guard_answer"
    ]
    assert sum(batches) >= 30
    assert max(batches) > 1
    # Sent straight to the incidents, not as the guard's own signals through the server.
    signalled = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
    assert not [event for event in history.events if event.event_type == signalled]


@pytest.mark.parametrize("ended", [False, True], ids=["never-ran", "closed"])
async def test_an_answer_to_an_incident_that_is_gone_gives_its_slot_back(env: WorkflowEnvironment, ended: bool) -> None:
    """A request whose incident no longer runs when the answer is sent (never started, or closed
    in between): the answer finds nobody, the slot is given back, and a real incident then gets
    the only slot."""
    fleet = guarded(max_in_flight=1, max_share=1.0)
    ghost = SlotRequest(incident_id="lab-gpu9-1", workflow_id="remediate-lab-gpu9", node="gpu9", action="REPLACE_NODE")
    async with running(env, fleet):
        if ended:  # an incident that ran to its end, then a late request in its name
            assert (await (await start(env.client, fleet, node="gpu3")).result()).outcome == Outcome.RESOLVED
            ghost = ghost.model_copy(update={"workflow_id": remediation_workflow_id(fleet.cluster, "gpu3")})
        await env.client.start_workflow(
            GUARD_WORKFLOW,
            GuardInput(cluster=fleet.cluster),
            id=guard_workflow_id(fleet.cluster),
            task_queue=guard_task_queue(fleet.cluster),
            start_signal=GUARD_REQUEST_SIGNAL,
            start_signal_args=[ghost],
        )
        state = await until(
            guard(env.client, fleet),
            FleetGuardWorkflow.status,
            lambda s: any(e.event == "released" and e.incident_id == ghost.incident_id for e in s.state.log),
            "the ghost's slot given back",
        )
        assert not state.state.in_flight
        status = await (await start(env.client, fleet, node="gpu2")).result()
    assert status.outcome == Outcome.RESOLVED and not pages(fleet)
    released = [e.detail for e in state.state.log if e.event == "released" and e.incident_id == ghost.incident_id]
    assert released == ["its incident is gone"]
