"""An incident reads the worker's settings and classifies its Xids in the worker's own process, by
local activities: a marker each in its history, not an activity's events and a workflow task
(``policy-local``). Its history stays within the scale bench's target, it replays, and a worker
of the wrong cluster still stops the incident with the error that says so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from activities.policy import PolicyActivities
from models.incident import IncidentStatus, Outcome
from models.requests import WorkerConfig
from tests.workflows.test_remediation import Fleet, start, worker
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import LOCAL_POLICY_PATCH, NodeRemediationWorkflow

POLICY_READS = {"worker_config", "classify_xids"}
# `make bench-scale`'s target for the history of one incident.
EVENTS_TARGET = 150


async def test_the_policy_is_read_by_local_activities_and_the_history_stays_small(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
        history = await handle.fetch_history()
    assert status.outcome == Outcome.RESOLVED
    # Read once at the start, classified at the start and again before the spare is taken.
    assert fleet.calls.count("worker_config") == 1 and fleet.calls.count("classify_xids") == 2
    scheduled = [
        event.activity_task_scheduled_event_attributes.activity_type.name
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert not POLICY_READS & set(scheduled), scheduled
    markers = [
        event.marker_recorded_event_attributes.marker_name
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
    ]
    assert markers.count("core_local_activity") == 3, markers
    assert LOCAL_POLICY_PATCH.encode() in b"".join(
        payload.data
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
        for payload in event.marker_recorded_event_attributes.details["patch-data"].payloads
    )
    assert len(history.events) <= EVENTS_TARGET, len(history.events)
    replayer = Replayer(workflows=[NodeRemediationWorkflow, FleetGuardWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None


async def test_a_worker_of_another_cluster_stops_the_incident_and_says_so(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    # The real activity, over a worker configured for another cluster than the incident's.
    wrong = PolicyActivities(lambda: WorkerConfig(cluster="elsewhere", settings=fleet.settings, policy=fleet.policy))
    activities = [
        wrong.worker_config if getattr(a, "__name__", "") == "worker_config" else a for a in fleet.activities()
    ]
    with ThreadPoolExecutor(max_workers=2) as executor:
        async with worker(env, fleet, activities=activities, activity_executor=executor):
            handle = await start(env.client, fleet)
            with pytest.raises(WorkflowFailureError) as failure:
                await handle.result()
    assert "this worker serves cluster 'elsewhere'" in str(failure.value.cause)
    assert "check GPUFLEET_CLUSTER" in str(failure.value.cause)
    assert not fleet.drained  # nothing was changed
