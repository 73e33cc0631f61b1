"""The benchmark's split of an incident's time, over a small synthetic workflow history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from bench.bench import breakdown

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def event(event_id: int, kind: EventType.ValueType, seconds: float, **attributes: object) -> HistoryEvent:
    stamp = Timestamp()
    stamp.FromDatetime(T0 + timedelta(seconds=seconds))
    built = HistoryEvent(event_id=event_id, event_type=kind, event_time=stamp)
    for field, values in attributes.items():
        for key, value in values.items():  # type: ignore[attr-defined]
            target = getattr(built, field)
            if key == "activity_type":
                target.activity_type.name = value
            else:
                setattr(target, key, value)
    return built


def test_overhead_is_queue_waits_plus_polling_and_the_rest_is_apart() -> None:
    E = EventType
    history = [
        event(1, E.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, 0.0),
        event(
            2,
            E.EVENT_TYPE_WORKFLOW_TASK_STARTED,
            0.01,
            workflow_task_started_event_attributes={"scheduled_event_id": 1},
        ),
        event(
            3,
            E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
            0.03,
            workflow_task_completed_event_attributes={"scheduled_event_id": 1},
        ),
        event(
            4,
            E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
            0.03,
            activity_task_scheduled_event_attributes={"activity_type": "jobs_still_running"},
        ),
        event(
            5,
            E.EVENT_TYPE_ACTIVITY_TASK_STARTED,
            0.05,
            activity_task_started_event_attributes={"scheduled_event_id": 4},
        ),
        event(
            6,
            E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            0.15,
            activity_task_completed_event_attributes={"scheduled_event_id": 4},
        ),
        event(7, E.EVENT_TYPE_TIMER_STARTED, 0.2),
        event(8, E.EVENT_TYPE_TIMER_FIRED, 0.6, timer_fired_event_attributes={"started_event_id": 7}),
        event(
            9,
            E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
            0.7,
            activity_task_scheduled_event_attributes={"activity_type": "requeue_job"},
        ),
        event(
            10,
            E.EVENT_TYPE_ACTIVITY_TASK_STARTED,
            0.71,
            activity_task_started_event_attributes={"scheduled_event_id": 9},
        ),
        event(
            11,
            E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            0.8,
            activity_task_completed_event_attributes={"scheduled_event_id": 9},
        ),
        event(
            12,
            E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
            0.9,
            activity_task_scheduled_event_attributes={"activity_type": "jobs_resumed"},
        ),
        event(
            13,
            E.EVENT_TYPE_ACTIVITY_TASK_STARTED,
            0.9,
            activity_task_started_event_attributes={"scheduled_event_id": 12},
        ),
        event(
            14,
            E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            6.9,
            activity_task_completed_event_attributes={"scheduled_event_id": 12},
        ),
    ]
    result = breakdown(history, poll_seconds=0.25)
    assert result["activity_queue_wait_s"] == 0.03
    assert result["workflow_task_queue_wait_s"] == 0.01
    assert result["polling_delay_bound_s"] == 0.65  # the 0.4 s check interval, then one 0.25 s poll
    assert result["control_plane_overhead_s"] == 0.69
    assert result["workflow_task_processing_s"] == 0.02
    assert result["activity_running_s"] == {"jobs_still_running": 0.1, "requeue_job": 0.09, "jobs_resumed": 6.0}


def test_the_parse_benchmark_log_holds_what_it_says() -> None:
    """The throughput figure is over real parsing: every event in the mixed log is found, and
    the chatter alone yields nothing."""
    from bench.parse_bench import parse_throughput

    figures = parse_throughput(20_000)
    assert figures["non_driver"]["events"] == 0
    assert figures["mixed_1_in_1000"]["events"] == figures["mixed_1_in_1000"]["events_expected"] > 0
