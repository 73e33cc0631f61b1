"""Every retry is bounded: an incident that cannot go on fails at its step, visibly.

On the Temporal dev server rather than the time-skipping one: the test server's skipping around
an activity's retry timers can stall, and these tests wait for real retries (a second or two
each). The incident runs as QuickBudgets (tests/workflows/quick_budgets.py), the workflow with
every call's budget cut to seconds (the production budgets are a quarter of an hour:
workflows/retries.py); its commands are the workflow's own. Stand-in activities
(tests/workflows/test_remediation.py) answer for Slurm and Kubernetes, the guard's plumbing is
the real one, and the worker's policy activities are the real ones where the policy file is
what is tested.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, ApplicationError, RetryState, TimeoutError, TimeoutType
from temporalio.runtime import BufferedMetricUpdate, MetricBuffer, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.policy import PolicyActivities
from models.constants import GUARD_RELEASE_SIGNAL, guard_task_queue, guard_workflow_id, task_queue
from models.incident import IncidentStatus, Outcome, Step
from models.metrics import INCIDENTS_FAILED
from models.requests import FailureJobsRequest, NodeLeaseRequest, ResumeNodeRequest
from models.settings import Settings
from tests.conftest import start_dev_server
from tests.workflows.quick_budgets import QUICK, QuickBudgets
from tests.workflows.test_remediation import Fleet, start
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow
from workflows.remediation.close import failure_text, failure_type


@pytest.fixture(scope="module")
def metrics() -> MetricBuffer:
    return MetricBuffer(100_000)


@pytest.fixture(scope="module")
async def env(temporal_cli: str, metrics: MetricBuffer) -> AsyncIterator[WorkflowEnvironment]:
    runtime = Runtime(telemetry=TelemetryConfig(metrics=metrics))
    environment = await start_dev_server(temporal_cli, data_converter=pydantic_data_converter, runtime=runtime)
    yield environment
    await environment.shutdown()


def name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__temporal_activity_definition").name)


def replaced(fleet: Fleet, *instead: Callable[..., Any]) -> list[Any]:
    """The fleet's stand-in activities, with ``instead`` in place of those of the same names."""
    names = {name_of(fn) for fn in instead}
    return [fn for fn in fleet.activities() if name_of(fn) not in names] + list(instead)


@contextlib.asynccontextmanager
async def workers(
    env: WorkflowEnvironment, fleet: Fleet, activities: list[Any], incident: type = QuickBudgets
) -> AsyncIterator[None]:
    """The cluster's worker (running ``incident``) and its guard's, as `gpufleet worker` runs them."""
    with ThreadPoolExecutor(4) as executor:
        async with (
            Worker(
                env.client,
                task_queue=task_queue(fleet.cluster),
                workflows=[incident],
                activities=activities,
                activity_executor=executor,
            ),
            Worker(
                env.client,
                task_queue=guard_task_queue(fleet.cluster),
                workflows=[FleetGuardWorkflow],
                activities=activities,
                activity_executor=executor,
            ),
        ):
            yield


async def failed(handle: Any) -> tuple[ApplicationError, IncidentStatus]:
    """The incident's failure and its status (a closed workflow still answers its query)."""
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError), failure.value
    status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
    return cause, status


def failures_counted(metrics: MetricBuffer, cluster: str) -> list[tuple[dict[str, str], int]]:
    """gpufleet_incidents_failed_total's updates for ``cluster``: their own labels, and what each added."""
    updates: list[BufferedMetricUpdate] = list(metrics.retrieve_updates())
    return [
        ({key: str(update.attributes[key]) for key in ("step", "error")}, int(update.value))
        for update in updates
        if update.metric.name == INCIDENTS_FAILED and update.attributes.get("cluster") == cluster
    ]


def slurm_gone_after_listing(fleet: Fleet, tries: list[int]) -> Callable[..., Any]:
    """Slurm answers the listing right after the drain, and is gone once the slot is granted:
    every later listing fails (its attempts recorded in ``tries``)."""
    listed: list[int] = []

    @activity.defn(name="jobs_hit_by_failure")
    async def slurm_away(request: FailureJobsRequest) -> list[Any]:
        if not listed:
            listed.append(1)
            return fleet.jobs
        tries.append(activity.info().attempt)
        raise ApplicationError("slurmctld unreachable", type="Unavailable")

    return slurm_away


async def test_a_step_that_keeps_failing_fails_the_incident_when_its_budget_runs_out(
    env: WorkflowEnvironment, metrics: MetricBuffer
) -> None:
    fleet = Fleet()
    tries: list[int] = []
    slurm_away = slurm_gone_after_listing(fleet, tries)

    async with workers(env, fleet, replaced(fleet, slurm_away)):
        handle = await start(env.client, fleet)
        cause, status = await failed(handle)

    # Retried (1 s, then 2 s apart), and given up when the budget ran out, at the step it was at.
    assert len(tries) >= 2 and tries == list(range(1, len(tries) + 1))
    assert cause.type == "Unavailable"
    assert status.outcome == Outcome.FAILED and status.step == Step.CHECKPOINT
    assert status.error is not None
    assert "slurmctld unreachable" in status.error and "retry budget ran out" in status.error
    history = await handle.fetch_history()
    scheduled = {
        e.event_id: e.event_time.ToDatetime()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "jobs_hit_by_failure"
    }
    (scheduled_id, at) = max(scheduled.items())  # the listing at the checkpoint
    [gave_up] = [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
        and e.activity_task_failed_event_attributes.scheduled_event_id == scheduled_id
    ]
    assert gave_up.event_time.ToDatetime() - at <= QUICK
    # The node stays drained (never resumed), its lease and guard slot are given back.
    assert fleet.drained == ["gpu1"]
    assert not [w for w in fleet.writes if isinstance(w, ResumeNodeRequest)] and not fleet.resumed_nodes
    assert fleet.leases == {} and not status.node_leased
    assert not status.guard_slot
    guard = await env.client.get_workflow_handle(guard_workflow_id(fleet.cluster)).fetch_history()
    released = [
        e
        for e in guard.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        and e.workflow_execution_signaled_event_attributes.signal_name == GUARD_RELEASE_SIGNAL
    ]
    assert len(released) == 1
    # The owner is told, and the operators are paged, naming the step and what was left.
    sent = {n.kind: n for n in fleet.notifications}
    assert {"opened", "failed", "incident_failed"} <= set(sent)
    assert "stopped at checkpoint: Unavailable: slurmctld unreachable" in sent["failed"].text
    page = sent["incident_failed"].text
    assert "incident failed at checkpoint" in page and "gpu1 stays drained in Slurm" in page
    assert [(n.kind, n.outcome) for n in status.notifications if n.kind in ("failed", "incident_failed")] == [
        ("failed", "sent"),
        ("incident_failed", "sent"),
    ]
    # Counted once, with its step and the error's type.
    assert failures_counted(metrics, fleet.cluster) == [({"step": "checkpoint", "error": "Unavailable"}, 1)]


async def test_giving_back_the_lease_is_bounded_too_and_the_page_says_it_is_still_held(
    env: WorkflowEnvironment,
) -> None:
    """Slurm and Kubernetes away for good: the incident fails at its step; giving back the node's
    lease fails within its own budget, and the page tells the operators how to let go of it."""
    fleet = Fleet()
    gave_back: list[int] = []
    slurm_away = slurm_gone_after_listing(fleet, [])

    @activity.defn(name="give_back_node_lease")
    async def kube_away(request: NodeLeaseRequest) -> bool:
        gave_back.append(activity.info().attempt)
        raise ApplicationError("the API server did not answer", type="Unavailable")

    async with workers(env, fleet, replaced(fleet, slurm_away, kube_away)):
        cause, status = await failed(await start(env.client, fleet))

    assert cause.type == "Unavailable" and status.step == Step.CHECKPOINT
    assert len(gave_back) >= 2  # retried, then given up
    assert status.node_leased and fleet.leases == {"gpu1": status.incident_id}
    page = next(n.text for n in fleet.notifications if n.kind == "incident_failed")
    assert "its lease could not be given back" in page and "gpufleet.io/lease-" in page
    assert not fleet.resumed_nodes


@pytest.fixture
def undecodable_policy(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "policy.yaml"
    path.write_bytes("xids:\n  79: REPLACE_NODE  # café\n".encode("latin-1"))
    yield path


async def test_a_policy_file_that_is_not_utf8_fails_the_incident_at_classify_at_once(
    env: WorkflowEnvironment, undecodable_policy: Path
) -> None:
    """A worker with no good policy to fall back on: the permanent error is not retried."""
    fleet = Fleet()
    reads: list[int] = []

    def config() -> Any:
        reads.append(1)
        return Settings(cluster=fleet.cluster, policy_file=undecodable_policy).worker_config()

    policy = PolicyActivities(config)
    acts = replaced(fleet, policy.worker_config, policy.classify)
    # The production workflow, with its production budgets: a permanent error needs none.
    async with workers(env, fleet, acts, incident=NodeRemediationWorkflow):
        cause, status = await failed(await start(env.client, fleet))

    assert reads == [1]  # one attempt
    assert cause.type == "PolicyInvalid"
    assert status.step == Step.CLASSIFY and status.outcome == Outcome.FAILED
    assert status.error is not None and "not UTF-8" in status.error and str(undecodable_policy) in status.error
    assert fleet.writes == []  # nothing changed, not even the lease
    assert sorted(n.kind for n in fleet.notifications) == ["failed", "incident_failed"]
    page = next(n.text for n in fleet.notifications if n.kind == "incident_failed")
    assert "gpu1 was not changed" in page


async def test_every_activity_of_an_incident_and_its_guard_has_a_budget(env: WorkflowEnvironment) -> None:
    """The production workflows: each activity they schedule has a schedule-to-close timeout
    (at most an hour on this path) or a maximum of attempts."""
    fleet = Fleet()
    async with workers(env, fleet, fleet.activities(), incident=NodeRemediationWorkflow):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
        guard = env.client.get_workflow_handle(guard_workflow_id(fleet.cluster))
        histories = [await handle.fetch_history(), await guard.fetch_history()]
    assert status.outcome == Outcome.RESOLVED
    seen = set()
    for history in histories:
        for event in history.events:
            if event.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                continue
            attributes = event.activity_task_scheduled_event_attributes
            name = attributes.activity_type.name
            seen.add(name)
            budget = attributes.schedule_to_close_timeout.ToTimedelta()
            attempts = attributes.retry_policy.maximum_attempts
            assert timedelta(0) < budget <= timedelta(hours=1) or attempts > 0, (name, budget, attempts)
    assert {"worker_config", "drain_slurm_node", "take_node_lease", "guard_request_slot", "notify"} <= seen
    assert {"guard_fleet_size", "guard_answer"} <= seen


# -- how a failed incident names what stopped it -----------------------------------------------


def activity_error(retry_state: RetryState, cause: BaseException | None) -> ActivityError:
    error = ActivityError(
        "activity failed",
        scheduled_event_id=5,
        started_event_id=6,
        identity="w",
        activity_type="jobs_on_node",
        activity_id="9",
        retry_state=retry_state,
    )
    error.__cause__ = cause
    return error


def test_a_permanent_error_is_named_as_it_is() -> None:
    exc = activity_error(RetryState.NON_RETRYABLE_FAILURE, ApplicationError("no node", type="NotFound"))
    assert (failure_text(exc), failure_type(exc)) == ("NotFound: no node", "NotFound")


def test_a_budget_that_ran_out_says_so_with_the_last_attempts_error() -> None:
    between = activity_error(RetryState.TIMEOUT, ApplicationError("slurmctld unreachable", type="Unavailable"))
    assert failure_text(between) == "Unavailable: slurmctld unreachable (the step's retry budget ran out)"
    assert failure_type(between) == "Unavailable"
    # The budget ran out during an attempt: the timeout carries the attempt before's failure.
    timeout = TimeoutError(
        "activity ScheduleToClose timeout", type=TimeoutType.SCHEDULE_TO_CLOSE, last_heartbeat_details=[]
    )
    timeout.__cause__ = ApplicationError("slurmctld unreachable", type="Unavailable")
    during = activity_error(RetryState.TIMEOUT, timeout)
    assert failure_text(during) == "Unavailable: slurmctld unreachable (the step's retry budget ran out)"
    assert failure_type(during) == "Unavailable"
    # ... or nothing, when its first attempt never ended.
    alone = TimeoutError(
        "activity ScheduleToClose timeout", type=TimeoutType.SCHEDULE_TO_CLOSE, last_heartbeat_details=[]
    )
    first = activity_error(RetryState.TIMEOUT, alone)
    assert failure_text(first) == "activity ScheduleToClose timeout (the step's retry budget ran out)"
    assert failure_type(first) == "Timeout"


def test_attempts_that_ran_out_say_so() -> None:
    timeout = TimeoutError("activity StartToClose timeout", type=TimeoutType.START_TO_CLOSE, last_heartbeat_details=[])
    exc = activity_error(RetryState.MAXIMUM_ATTEMPTS_REACHED, timeout)
    assert failure_text(exc) == "activity StartToClose timeout (the step's attempts ran out)"
    assert failure_type(exc) == "Timeout"


def test_the_workflows_own_error_is_named_as_it_is() -> None:
    exc = ApplicationError("jobs did not resume within 1800s: 7", type="JobsNotResumed", non_retryable=True)
    assert failure_text(exc) == "JobsNotResumed: jobs did not resume within 1800s: 7"
    assert failure_type(exc) == "JobsNotResumed"
