"""The benchmark's split of an incident's time, over a small synthetic workflow history; where a
Slinky cluster's lab home may be, and the Slurm nodes a pool move watches."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta

import yaml
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from bench.bench import CLUSTERS_HOME, bench_folder, breakdown, cluster_home_problem, slurm_nodes_on
from clients.kube import PodRef
from tests.conftest import REPO

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


def test_a_slinky_clusters_lab_home_must_be_short_and_reachable_by_its_users() -> None:
    spec = yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text())
    folder = bench_folder()
    try:
        assert cluster_home_problem(folder / CLUSTERS_HOME, spec) == ""
        # Deep enough that a job step's socket of research-train-9 cannot fit in 108 bytes.
        deep = folder / ("d" * 40)
        deep.mkdir(mode=0o755)
        problem = cluster_home_problem(deep, spec)
        assert "is too deep: a job step's socket there" in problem and "use a shorter GPUFLEET_HOME" in problem
        # A private folder on the way: the cluster's users cannot reach their jobs' spool.
        private = folder / "p"
        private.mkdir(mode=0o700)
        assert cluster_home_problem(private / "c", spec) == (
            f"{private} is not reachable by other users: the cluster's users run their jobs from under it"
        )
    finally:
        shutil.rmtree(folder)


def test_the_slurm_nodes_of_a_kubernetes_node_are_itself_or_its_nodeset_pods() -> None:
    assert slurm_nodes_on("gpu1", None) == ["gpu1"]
    pods = [
        PodRef(namespace="slurm-lab", name="lab-train-1", owner_kind="NodeSet", owner_name="lab-train"),
        PodRef(namespace="slurm-lab", name="lab-train-0", owner_kind="NodeSet", owner_name="lab-train"),
        PodRef(namespace="slurm-lab", name="lab-train-2", owner_kind="NodeSet", terminating=True),
        PodRef(namespace="serving", name="vllm-abc", owner_kind="ReplicaSet"),
    ]
    assert slurm_nodes_on("gpu1", pods) == ["lab-train-0", "lab-train-1"]
    assert slurm_nodes_on("inf1", []) == []
