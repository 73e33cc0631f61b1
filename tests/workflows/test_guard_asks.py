"""An incident whose ask the fleet guard never got asks again, less often the longer the guard is
silent; a grant the guard could not send, the guard sends again. Its own module, so its own
time-skipping server: the other guard tests leave incidents waiting behind, and their pending work keeps
the clock from skipping the minutes this one waits."""

from __future__ import annotations

import contextlib
import itertools

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from activities.guard import GuardActivities
from models.guard import GuardAnswer, GuardStatus, SlotRequest
from models.incident import IncidentStatus, Outcome
from tests.workflows.test_guard import guard, guarded
from tests.workflows.test_remediation import start, worker
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow


async def test_an_ask_the_guard_never_got_is_asked_again_less_often_each_time(env: WorkflowEnvironment) -> None:
    """The first four asks are lost (a guard terminated and started afresh without them): the
    incident asks again after 1, 2, 4 and 8 minutes, not every minute (in a burst of a thousand a
    busy guard drowned in asks again), and goes on once an ask gets through."""
    fleet = guarded(max_in_flight=4, max_share=1.0)
    real = GuardActivities(None, cluster=fleet.cluster, partition="train")  # type: ignore[arg-type]
    asks: list[SlotRequest] = []

    @activity.defn(name="guard_request_slot")
    async def lost_at_first(request: SlotRequest) -> None:
        asks.append(request)
        if len(asks) > 4:
            await real.request_slot(request)

    activities = [lost_at_first if getattr(a, "__name__", "") == "request_slot" else a for a in fleet.activities()]
    async with worker(env, fleet, activities=activities):
        handle = await start(env.client, fleet, node="gpu2")
        status: IncidentStatus = await handle.result()
        history = await handle.fetch_history()
    with contextlib.suppress(Exception):
        await guard(env.client, fleet).terminate("test over")
    assert status.outcome == Outcome.RESOLVED
    # Five asks for the slot to kill the jobs (the fifth got through), one for the retirement's.
    assert [(ask.ask, ask.step) for ask in asks] == [(1, "checkpoint")] * 5 + [(2, "retire_node")]
    asked = [
        event.event_time.ToDatetime()
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == "guard_request_slot"
    ][:5]
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(asked)]
    assert len(gaps) == 4
    for gap, minutes in zip(gaps, [1, 2, 4, 8], strict=True):
        assert minutes * 60 <= gap < minutes * 60 + 30, gaps
    assert sum(1 for entry in status.timeline if entry.event == "asking again") == 4
    # The history replays as it ran.
    await Replayer(workflows=[NodeRemediationWorkflow], data_converter=env.client.data_converter).replay_workflow(
        history
    )


async def test_a_grant_that_could_not_be_sent_is_sent_again_by_the_guard(env: WorkflowEnvironment) -> None:
    """The guard's first batch of answers is given up (as after minutes of the server refusing
    it): the guard sends it again after a pause, so the incident goes on without asking again
    (its next ask would have come a minute later, and with the backoff up to 8 minutes later)."""
    fleet = guarded(max_in_flight=4, max_share=1.0)
    real = GuardActivities(None, cluster=fleet.cluster, partition="train")  # type: ignore[arg-type]
    batches: list[int] = []
    asks: list[SlotRequest] = []

    @activity.defn(name="guard_answer")
    async def first_given_up(answers: list[GuardAnswer]) -> list[str]:
        batches.append(len(answers))
        if len(batches) == 1:
            raise ApplicationError("the server refused the batch for minutes", non_retryable=True)
        return await real.answer(answers)

    @activity.defn(name="guard_request_slot")
    async def counted(request: SlotRequest) -> None:
        asks.append(request)
        await real.request_slot(request)

    swap = {"answer": first_given_up, "request_slot": counted}
    activities = [swap.get(getattr(a, "__name__", ""), a) for a in fleet.activities()]
    async with worker(env, fleet, activities=activities):
        handle = await start(env.client, fleet, node="gpu3")
        status: IncidentStatus = await handle.result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        guard_history = await guard(env.client, fleet).fetch_history()
    with contextlib.suppress(Exception):
        await guard(env.client, fleet).terminate("test over")
    # The guard's history replays as it ran.
    await Replayer(workflows=[FleetGuardWorkflow], data_converter=env.client.data_converter).replay_workflow(
        guard_history
    )
    assert status.outcome == Outcome.RESOLVED
    # One ask per destructive step, none asked again.
    assert [ask.step for ask in asks] == ["checkpoint", "retire_node"]
    assert not any(entry.event == "asking again" for entry in status.timeline)
    assert batches[:2] == [1, 1]  # the same grant, sent again
    assert any(e.event == "answers" and "sent again in 10s" in e.detail for e in state.state.log), state.state.log
