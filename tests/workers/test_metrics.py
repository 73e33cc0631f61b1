"""The worker's Prometheus endpoint: the SDK's temporal_* metrics and gpufleet's own, scraped over HTTP.

The time-skipping test server runs with a Temporal runtime of our own that serves Prometheus (the
SDK lets a test environment take a runtime), so its client, its worker and the workflows' meters
export there, as the worker's do on GPUFLEET_METRICS_PORT.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime
from temporalio.testing import WorkflowEnvironment

from clients.kube import KubeNode
from clients.spares import SparePool
from models.constants import CLAIMED_BY_ANNOTATION, CLUSTER_LABEL, GUARD_PAUSE_SIGNAL, guard_workflow_id
from models.guard import GuardCommand
from models.incident import IncidentStatus, NodeInfo, Outcome
from models.metrics import STEP_DURATION_BUCKETS
from models.settings import Settings
from tests.workflows.test_remediation import Fleet, start, worker
from workers.metrics import bind_address, free_spares, install_metrics, prometheus_runtime, report_spares
from workflows.remediation import NodeRemediationWorkflow

Sample = tuple[dict[str, str], float]
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> tuple[Runtime, str]:
    """A runtime serving /metrics on a free port, and the endpoint's URL."""
    port = free_port()
    return prometheus_runtime(f"127.0.0.1:{port}"), f"http://127.0.0.1:{port}/metrics"


@pytest.fixture(scope="module")
async def env(temporal_test_server: str, served: tuple[Runtime, str]) -> AsyncIterator[WorkflowEnvironment]:
    environment = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=temporal_test_server,
        test_server_startup_timeout=timedelta(seconds=60),
        runtime=served[0],
    )
    yield environment
    await environment.shutdown()


def scrape(url: str) -> str:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    return response.text


def samples(text: str, name: str, **labels: str) -> list[Sample]:
    """The samples of ``name`` (exactly) whose labels include ``labels``."""
    found = []
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        have = dict(LABEL.findall(rest))
        if all(have.get(key) == want for key, want in labels.items()):
            found.append((have, float(value)))
    return found


def one(text: str, name: str, **labels: str) -> float:
    found = samples(text, name, **labels)
    assert len(found) == 1, f"{name} {labels}: {found}\n{text}"
    return found[0][1]


async def scraped_until(url: str, check: Any, timeout: float = 30) -> str:
    """The endpoint's text once ``check(text)`` holds (metrics are exported as they are recorded,
    but the workflow's last task may still be completing when its result arrives)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = await asyncio.to_thread(scrape, url)
        if check(text) or asyncio.get_running_loop().time() > deadline:
            return text
        await asyncio.sleep(0.1)


async def test_a_closed_incident_shows_in_gpufleets_metrics_and_the_sdks(
    env: WorkflowEnvironment, served: tuple[Runtime, str]
) -> None:
    _, url = served
    fleet = Fleet(drain_failures=1)  # one failed attempt: the SDK's activity-failure counter moves
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    cluster = fleet.cluster
    text = await scraped_until(url, lambda t: samples(t, "gpufleet_incidents_total", cluster=cluster))

    # One incident, with the labels the dashboards and alerts group by.
    closed = samples(text, "gpufleet_incidents_total", cluster=cluster)
    assert [(labels["xid"], labels["action"], labels["outcome"], value) for labels, value in closed] == [
        ("79", "REPLACE_NODE", "resolved", 1.0)
    ]
    assert closed[0][0]["workflow_type"] == "NodeRemediationWorkflow"  # the workflow meter's own labels

    # Each step's duration as a histogram, in seconds, with gpufleet's buckets (up to a day).
    steps = {labels["step"] for labels, _ in samples(text, "gpufleet_step_duration_seconds_count", cluster=cluster)}
    assert {"classify", "guard", "drain_slurm", "checkpoint", "requeue", "claim_spare", "resume"} <= steps
    assert one(text, "gpufleet_step_duration_seconds_count", cluster=cluster, step="drain_slurm") == 1
    buckets = {
        float(labels["le"])
        for labels, _ in samples(text, "gpufleet_step_duration_seconds_bucket", cluster=cluster, step="drain_slurm")
    }
    assert buckets == {*map(float, STEP_DURATION_BUCKETS), float("inf")}
    assert "# TYPE gpufleet_step_duration_seconds histogram" in text

    # Every step it entered is back to 0: nothing is left looking stuck.
    started = samples(text, "gpufleet_incident_step_started_timestamp_seconds", cluster=cluster, node=status.node)
    assert started and all(value == 0 for _, value in started)

    # The fleet guard granted the slot and took it back.
    assert one(text, "gpufleet_guard_breaker_state", cluster=cluster) == 0
    assert one(text, "gpufleet_guard_in_flight", cluster=cluster) == 0
    assert one(text, "gpufleet_guard_waiting", cluster=cluster) == 0
    assert one(text, "gpufleet_guard_updated_timestamp_seconds", cluster=cluster) > 1.7e9

    # The SDK's own metrics on the same endpoint: the ones the alert rules read among them.
    queue = f"gpufleet-{cluster}"
    completed = samples(text, "temporal_workflow_completed", task_queue=queue, workflow_type="NodeRemediationWorkflow")
    assert completed and completed[0][1] >= 1
    failed = samples(text, "temporal_activity_execution_failed", task_queue=queue, activity_type="drain_slurm_node")
    assert failed and failed[0][1] >= 1


async def test_a_step_in_flight_shows_its_start_until_it_ends(
    env: WorkflowEnvironment, served: tuple[Runtime, str]
) -> None:
    _, url = served
    fleet = Fleet(spare_free=False)
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        for _ in range(200):
            if "notify:no_spare" in fleet.calls:
                break
            await asyncio.sleep(0.05)
        waiting: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        where = {"cluster": fleet.cluster, "node": waiting.node}
        text = await scraped_until(
            url,
            lambda t: samples(t, "gpufleet_incident_step_started_timestamp_seconds", **where, step="wait_for_spare"),
        )
        started = {
            labels["step"]: value
            for labels, value in samples(text, "gpufleet_incident_step_started_timestamp_seconds", **where)
        }
        # Waiting for a spare (and so in claim_spare), since the time the timeline says.
        wait_began = next(e.at for e in waiting.timeline if e.step == "wait_for_spare" and e.event == "started")
        assert started["wait_for_spare"] == pytest.approx(wait_began.timestamp())
        assert started["claim_spare"] > 0
        assert started["drain_slurm"] == 0  # done
        assert one(text, "gpufleet_guard_in_flight", cluster=fleet.cluster) == 0  # a spare wait holds no slot

        fleet.spare_free = True
        await handle.signal(NodeRemediationWorkflow.spare_available)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED
    text = await scraped_until(url, lambda t: samples(t, "gpufleet_incidents_total", cluster=fleet.cluster))
    started_after = samples(text, "gpufleet_incident_step_started_timestamp_seconds", **where)
    assert all(value == 0 for _, value in started_after)
    assert one(text, "gpufleet_step_duration_seconds_count", cluster=fleet.cluster, step="wait_for_spare") == 1


async def test_a_paused_guard_reports_2(env: WorkflowEnvironment, served: tuple[Runtime, str]) -> None:
    _, url = served
    fleet = Fleet()
    async with worker(env, fleet):
        await (await start(env.client, fleet)).result()
        guard = env.client.get_workflow_handle(guard_workflow_id(fleet.cluster))
        await guard.signal(GUARD_PAUSE_SIGNAL, GuardCommand(by="test", reason="driver roll-out"))
        text = await scraped_until(
            url, lambda t: samples(t, "gpufleet_guard_breaker_state", cluster=fleet.cluster)[0][1] == 2
        )
    assert one(text, "gpufleet_guard_breaker_state", cluster=fleet.cluster) == 2


# -- the free spares, counted by the worker ---------------------------------------------------------


class StandInKube:
    def __init__(self, nodes: list[KubeNode]) -> None:
        self.nodes = nodes
        self.selectors: list[str] = []

    def list_nodes(self, *, label_selector: str = "") -> list[KubeNode]:
        self.selectors.append(label_selector)
        return list(self.nodes)


class StandInSlurm:
    def __init__(self, nodes: dict[str, NodeInfo]) -> None:
        self.nodes = nodes

    def node(self, name: str) -> NodeInfo:
        return self.nodes[name]


def spare(name: str, **fields: Any) -> KubeNode:
    labels = {"gpufleet.io/pool": "spare", **fields.pop("labels", {})}
    return KubeNode(name=name, labels=labels, **{"ready": True, **fields})


@pytest.fixture
def pool() -> Iterator[tuple[StandInKube, SparePool]]:
    kube = StandInKube(
        [
            spare("spare1"),  # free
            spare("spare2", labels={CLUSTER_LABEL: "c1"}),  # free, ours by its label
            spare("spare3", annotations={CLAIMED_BY_ANNOTATION: "remediate-c1-gpu1"}),  # claimed
            spare("spare4"),  # drained in Slurm
            spare("spare5", labels={CLUSTER_LABEL: "other"}),  # another cluster's
            spare("spare6", ready=False),  # not Ready
        ]
    )
    idle = NodeInfo(name="x", state="idle")
    slurm = StandInSlurm(
        {
            **{f"spare{i}": idle for i in (1, 2, 3, 5, 6)},
            "spare4": NodeInfo(name="spare4", state="idle", flags=["DRAIN"], reason="ops"),
        }
    )
    yield kube, SparePool(kube=kube, slurm=slurm, partition="train", cluster="c1")  # type: ignore[arg-type]


def test_free_spares_are_those_a_claim_would_take(pool: tuple[StandInKube, SparePool]) -> None:
    kube, spares = pool
    assert free_spares(kube, spares) == 2  # type: ignore[arg-type]
    assert kube.selectors == ["gpufleet.io/pool=spare"]


async def test_the_worker_reports_the_free_spares_on_its_endpoint(
    pool: tuple[StandInKube, SparePool], served: tuple[Runtime, str]
) -> None:
    kube, spares = pool
    runtime, url = served
    stop = asyncio.Event()
    counting = asyncio.create_task(
        report_spares(kube, spares, runtime.metric_meter, cluster="c1", stop=stop, every_seconds=0.05)  # type: ignore[arg-type]
    )
    text = await scraped_until(url, lambda t: samples(t, "gpufleet_spares_free", cluster="c1"))
    assert one(text, "gpufleet_spares_free", cluster="c1") == 2
    kube.nodes = kube.nodes[1:]  # spare1 is claimed and gone from the pool
    text = await scraped_until(url, lambda t: one(t, "gpufleet_spares_free", cluster="c1") == 1)
    assert one(text, "gpufleet_spares_free", cluster="c1") == 1
    stop.set()
    await asyncio.wait_for(counting, timeout=5)


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_port", "env_bind", "address"),
    [
        (None, None, "0.0.0.0:9464"),
        ("9100", "127.0.0.1", "127.0.0.1:9100"),
        ("9100", "::", "[::]:9100"),
        ("0", None, None),
        ("", None, None),
    ],
)
def test_the_endpoints_address_comes_from_the_settings(
    monkeypatch: pytest.MonkeyPatch, env_port: str | None, env_bind: str | None, address: str | None
) -> None:
    for name, value in (("GPUFLEET_METRICS_PORT", env_port), ("GPUFLEET_METRICS_BIND", env_bind)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert bind_address(Settings()) == address


def test_a_taken_port_leaves_the_worker_running_without_an_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="gpufleet.worker"):
            runtime = install_metrics(Settings(metrics_port=port, metrics_bind="127.0.0.1"))
    assert runtime is None
    assert "no metrics endpoint" in caplog.text and "GPUFLEET_METRICS_PORT" in caplog.text


def test_a_port_of_0_serves_nothing() -> None:
    assert install_metrics(Settings(metrics_port=0)) is None
