"""Waits for `gpufleet approve|reject` that follow up on themselves (patch approval-follow-up).

On the time-skipping test server with the stand-in activities of test_remediation.py: time moves
only when a test says so (``env.sleep``), so each reminder and expiry is seen at its own time. A
wait reminds the owner in one line on a backing-off schedule, raises the request again to the
owner and the operators when it expires (and never approves), and an Xid that joins meanwhile is
classified and reported; a more severe one raises the action and asks anew, so an approval given
for the old action does not pass the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from activities.notify import NotifyActivities
from clients.notify import WebhookNotifier
from lab.webhook import WebhookReceiver
from models.constants import GUARD_RESUME_SIGNAL
from models.incident import Approval, IncidentStatus, Outcome, Step
from models.policy import Action, GuardSettings, Policy
from models.xid import XidEvent
from tests.workflows.test_guard import guarded, paused_guard, running, tell, until, waiting
from tests.workflows.test_remediation import Fleet, start
from workflows.remediation import NodeRemediationWorkflow
from workflows.remediation.jobs import ENDED_RECHECK

MINUTE = 60


def kinds(status: IncidentStatus, kind: str) -> list[float]:
    """When each message of ``kind`` was sent, in seconds after the current wait began."""
    assert status.approval_asked_at is not None
    return [(n.at - status.approval_asked_at).total_seconds() for n in status.notifications if n.kind == kind]


async def replays(env: WorkflowEnvironment, handle: Any) -> None:
    """The incident's history, with its follow-ups, replays against the same code (deterministic)."""
    history = await env.client.get_workflow_handle(handle.id, run_id=handle.result_run_id).fetch_history()
    replayer = Replayer(workflows=[NodeRemediationWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)


def count(kind: str) -> Callable[[int], Callable[[IncidentStatus], bool]]:
    """``count(kind)(n)``: the incident has sent at least ``n`` messages of ``kind``."""
    return lambda n: lambda status: sum(m.kind == kind for m in status.notifications) >= n


async def test_a_policy_wait_reminds_in_one_line_backing_off_then_expires_to_owner_and_operators(
    env: WorkflowEnvironment, webhook: WebhookReceiver
) -> None:
    """The messages go out through the worker's own notify activity to a webhook receiver, which
    shows what the owner and the operators get."""
    fleet = Fleet(
        policy=Policy(
            guard=GuardSettings(
                require_approval=[Action.REPLACE_NODE],
                approval_reminder_seconds=10 * MINUTE,
                approval_expiry_seconds=60 * MINUTE,
            )
        )
    )
    status_of = NodeRemediationWorkflow.status
    notify = NotifyActivities(WebhookNotifier(url=webhook.url)).notify
    activities = [fn for fn in fleet.activities() if getattr(fn, "__name__", "") != "notify"] + [notify]
    with ThreadPoolExecutor(2) as executor:
        async with running(env, fleet, manual_clock=True, activities=activities, activity_executor=executor):
            handle = await start(env.client, fleet, node="gpu1")
            asked = await waiting(handle)
            incident = asked.incident_id
            # Reminders 10 and 30 minutes in (each gap twice the one before; the next, at 70, is past
            # the expiry), the expiry at 60 minutes.
            await env.sleep(timedelta(minutes=11))
            await until(handle, status_of, count("approval_reminder")(1), "the first reminder")
            await env.sleep(timedelta(minutes=20))
            await until(handle, status_of, count("approval_reminder")(2), "the second reminder")
            await env.sleep(timedelta(minutes=30))
            expired = await until(handle, status_of, count("approval_expired")(1), "the request expired")
            assert expired.approval_expired == 1
            # Never approved by default: still waiting for the same answer, nothing more done.
            assert expired.outcome == Outcome.AWAITING_APPROVAL and expired.step == Step.AWAITING_APPROVAL
            assert expired.approval_wait == asked.approval_wait and expired.approval is None
            assert "claim_spare" not in fleet.calls and "cordon_and_drain_node" not in fleet.calls
            assert any(e.event == "approval expired" and "no answer in 1h" in e.detail for e in expired.timeline)
            await env.sleep(timedelta(minutes=60))  # raised again at each period; no hourly reminders after
            again = await until(handle, status_of, count("approval_expired")(2), "expired again")
            assert again.approval_expired == 2
            await handle.signal(
                NodeRemediationWorkflow.decide, Approval(approved=True, by="ops", wait=again.approval_wait)
            )
            status = await handle.result()
            await replays(env, handle)

    assert [round(t) for t in kinds(again, "approval_reminder")] == [10 * MINUTE, 30 * MINUTE]
    assert [round(t) for t in kinds(again, "approval_expired")] == [60 * MINUTE, 120 * MINUTE]
    received = webhook.messages()
    sent = [m["kind"] for m in received]

    def texts(kind: str) -> list[str]:
        return [m["text"] for m in received if m["kind"] == kind]

    assert sent.count("approval_reminder") == 2 and sent.count("approval_expired") == 2
    # Each page carries the incident for machines: which wait, how many times it expired.
    assert [m["incident"]["approval_expired"] for m in received if m["kind"] == "approval_expired"] == [1, 2]
    reminders = texts("approval_reminder")
    assert reminders[0] == (
        f"[{incident}] gpu1: waiting 10m for approval of REPLACE_NODE: "
        f"`gpufleet approve {incident}` or `gpufleet reject {incident}`."
    )
    assert "waiting 30m" in reminders[1]
    # The owner is asked again (the first ask, then one per expiry), the operators paged each time.
    asks = texts("approval_needed")
    assert len(asks) == 3 and "no answer in 1h" in asks[1] and "never approved by default" in asks[1]
    pages = texts("approval_expired")
    assert "no answer in 1h to: REPLACE_NODE needs approval" in pages[0] and "no answer in 2h" in pages[1]
    assert f"gpufleet approve {incident}" in pages[0] and "incidents show" in pages[0]
    assert all("\n" not in text for text in reminders + asks + pages)
    assert status.outcome == Outcome.RESOLVED and status.spare == "spare1"
    assert status.approval_asked_at is None and status.waiting_for_approval is None


async def test_a_node_its_owner_drained_is_reminded_about_too(env: WorkflowEnvironment) -> None:
    fleet = Fleet(
        node_drained=True,
        node_reason="bob: swapping the NIC",
        policy=Policy(guard=GuardSettings(approval_reminder_seconds=5 * MINUTE)),
    )
    async with running(env, fleet, manual_clock=True):
        handle = await start(env.client, fleet, node="gpu1")
        asked = await waiting(handle)
        # Past the reminder at 5 minutes, and half a look short of the next timer: the wait's watch
        # for ended jobs looks every ENDED_RECHECK, and a skip that ends on one of its looks lets the
        # answer below race that timer (the time-skipping server then refuses the workflow task that
        # cancels a timer it has just fired, and strands the run: temporalio/sdk-java#3088).
        skip = ENDED_RECHECK * 3.5
        assert skip > timedelta(minutes=5)
        await env.sleep(skip)
        reminded = await until(
            handle, NodeRemediationWorkflow.status, count("approval_reminder")(1), "a reminder to the owner"
        )
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="bob"))
        status = await handle.result()
    [reminder] = [n.text for n in fleet.notifications if n.kind == "approval_reminder"]
    assert reminder.startswith(f"[{asked.incident_id}] gpu1: waiting 5m for a go-ahead to REPLACE_NODE")
    assert f"`gpufleet approve {asked.incident_id}` or `gpufleet reject {asked.incident_id}`" in reminder
    assert [round(t) for t in kinds(reminded, "approval_reminder")] == [5 * MINUTE]
    assert status.outcome == Outcome.REJECTED and "drain_slurm_node" not in fleet.calls


async def test_an_xid_while_waiting_is_classified_and_a_more_severe_one_needs_its_own_approval(
    env: WorkflowEnvironment,
) -> None:
    fleet = Fleet(policy=Policy(guard=GuardSettings(require_approval=[Action.RESET_GPU, Action.REPLACE_NODE])))
    status_of = NodeRemediationWorkflow.status
    async with running(env, fleet, manual_clock=True):
        handle = await start(env.client, fleet, node="gpu1", xid=48)  # a GPU reset
        first = await waiting(handle)
        assert first.action == Action.RESET_GPU and "RESET_GPU needs approval" in (first.waiting_for_approval or "")
        incident = first.incident_id

        # One that the action already covers: reported, the same wait goes on.
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=48, source="test"))
        same = await until(handle, status_of, count("new_xid")(1), "the Xid reported")
        assert same.action == Action.RESET_GPU and same.approval_wait == first.approval_wait

        # A more severe one, and on its heels the approval a person gave for the reset.
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=79, source="test"))
        await handle.signal(
            NodeRemediationWorkflow.decide,
            Approval(approved=True, by="ops", wait=first.approval_wait, incident_id=incident),
        )
        raised = await until(handle, status_of, count("action_raised")(1), "the raised action reported")
        assert raised.action == Action.REPLACE_NODE
        assert raised.waiting_for_approval == f"REPLACE_NODE needs approval in cluster {fleet.cluster}"
        assert raised.approval_wait == first.approval_wait + 1
        # The approval for the reset passes nothing: still waiting, nothing repaired or replaced.
        await handle.signal(
            NodeRemediationWorkflow.decide,
            Approval(approved=True, by="ops", wait=first.approval_wait, incident_id=incident),
        )
        await env.sleep(timedelta(seconds=5))
        still = await handle.query(status_of)
        assert still.outcome == Outcome.AWAITING_APPROVAL and still.approval is None
        assert not fleet.repairs and "claim_spare" not in fleet.calls

        await handle.signal(
            NodeRemediationWorkflow.decide,
            Approval(approved=True, by="ops", wait=still.approval_wait, incident_id=incident),
        )
        status = await handle.result()
        await replays(env, handle)

    [reported] = [n.text for n in fleet.notifications if n.kind == "new_xid"]
    assert reported.startswith(f"[{incident}] gpu1: Xid 48 came while waiting; it calls for RESET_GPU")
    [notice] = [n.text for n in fleet.notifications if n.kind == "action_raised"]
    assert "Xid 79" in notice and "calls for REPLACE_NODE, more severe than RESET_GPU" in notice
    assert "will now REPLACE_NODE" in notice and "An answer given for RESET_GPU does not count" in notice
    assert f"`gpufleet approve {incident}`" in notice and "\n" not in notice
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE
    assert status.spare == "spare1" and not fleet.repairs  # replaced, never reset
    assert any(e.event == "action raised" and "RESET_GPU -> REPLACE_NODE" in e.detail for e in status.timeline)


async def test_a_wait_at_the_fleet_guard_reminds_nobody_but_reports_a_worse_xid(env: WorkflowEnvironment) -> None:
    """The guard pages the operators once for all the incidents it holds: no reminder or expiry
    per incident. An Xid that joins is still classified and reported, and a worse one raises the
    action the incident goes on with once the guard lets it."""
    fleet = guarded(approval_reminder_seconds=MINUTE, approval_expiry_seconds=10 * MINUTE)
    async with running(env, fleet, manual_clock=True):
        await paused_guard(env.client, fleet, reason="driver roll-out")
        handle = await start(env.client, fleet, node="gpu1", xid=48)
        held = await waiting(handle)
        assert held.waiting_for_approval == "remediation is paused by ops (driver roll-out)"
        # Twenty minutes (off the guard's 30-minute re-ask): past two expiries, many reminder times.
        await env.sleep(timedelta(minutes=20, seconds=17))
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=79, source="test"))
        raised = await until(
            handle, NodeRemediationWorkflow.status, count("action_raised")(1), "the raised action reported"
        )
        assert raised.action == Action.REPLACE_NODE and raised.approval_wait == held.approval_wait + 1
        assert raised.waiting_for_approval == "remediation is paused by ops (driver roll-out)"
        await tell(env.client, fleet, GUARD_RESUME_SIGNAL)
        status = await handle.result()
    assert not [n for n in fleet.notifications if n.kind in ("approval_reminder", "approval_expired")]
    [notice] = [n.text for n in fleet.notifications if n.kind == "action_raised"]
    assert "more severe than RESET_GPU: the incident will now REPLACE_NODE" in notice
    assert "the fleet guard, or an approval past it, for REPLACE_NODE" in notice
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE
    assert status.spare == "spare1" and not fleet.repairs
