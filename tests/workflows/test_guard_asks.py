"""An incident whose ask the fleet guard never got asks again, less often the longer the guard is
silent. Its own module, so its own time-skipping server: the other guard tests leave incidents
waiting behind, and their pending work keeps the clock from skipping the minutes this one waits."""

from __future__ import annotations

import contextlib
import itertools

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from activities.guard import GuardActivities
from models.guard import SlotRequest
from models.incident import IncidentStatus, Outcome
from tests.workflows.test_guard import guard, guarded
from tests.workflows.test_remediation import start, worker
from workflows.remediation import GUARD_ASK_BACKOFF_PATCH, NodeRemediationWorkflow


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
    assert len(asks) == 5
    asked = [
        event.event_time.ToDatetime()
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == "guard_request_slot"
    ]
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(asked)]
    assert len(gaps) == 4
    for gap, minutes in zip(gaps, [1, 2, 4, 8], strict=True):
        assert minutes * 60 <= gap < minutes * 60 + 30, gaps
    assert sum(1 for entry in status.timeline if entry.event == "asking again") == 4
    # The history replays as it ran: the backoff is under its patch, whose marker it carries.
    markers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    assert any(
        GUARD_ASK_BACKOFF_PATCH.encode() in e.marker_recorded_event_attributes.SerializeToString() for e in markers
    )
    await Replayer(workflows=[NodeRemediationWorkflow], data_converter=env.client.data_converter).replay_workflow(
        history
    )
