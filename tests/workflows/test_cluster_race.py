"""Two cluster creations racing for the last nodes, as workflows on the Temporal dev server with
gpufleet's own activities over the emulated Kubernetes API (the backend's Slurm steps stood in
for): one wins, the other fails at the reservation and leaves nothing behind. And a reservation
whose first try dies after taking its nodes takes no more when it is retried.

The dev server rather than the time-skipping one: the test server's skipping around an
activity's retry timer can stall (it hung a CI run for its full 10 minutes), and the retry here
waits one real second."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.cluster import ClusterActivities
from clients.kube import KubernetesApi
from clients.notify import WebhookNotifier
from clients.pool import free_nodes, holdings
from lab.kubeapi import node_object
from models.cluster import ClusterSpec, load_spec
from models.clusterops import ClusterCreateInput, ClusterOutcome, ClusterRequest, ClusterStatus, StepResult
from tests.conftest import KubeApiProcess, start_dev_server
from workflows.cluster import ClusterCreationWorkflow

FREE = ["free1", "free2", "free3", "free4"]


class StandIn:
    """The backend's Slurm side, stood in for: every step passes, nothing exists yet."""

    name = "lab"

    def __getattr__(self, method: str) -> Any:
        def step(*args: Any) -> Any:
            return (
                0
                if method in ("running_jobs", "cancel_jobs")
                else ("" if method in ("unsupported", "exists") else f"{method} ok")
            )

        return step


@pytest.fixture(scope="module")
async def env(temporal_cli: str) -> AsyncIterator[WorkflowEnvironment]:
    environment = await start_dev_server(temporal_cli, data_converter=pydantic_data_converter)
    yield environment
    await environment.shutdown()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesApi]:
    seed = {"nodes": [node_object("gpu1", pool="training")] + [node_object(n, pool="free") for n in FREE]}
    api = KubeApiProcess(tmp_path / "kube", seed)
    yield KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)
    api.stop()


def spec(name: str, nodes: int) -> ClusterSpec:
    return load_spec({"name": name, "partitions": [{"name": "train", "nodes": nodes}], "spares": 0})


async def start(env: WorkflowEnvironment, queue: str, name: str, nodes: int) -> WorkflowHandle[Any, ClusterStatus]:
    return await env.client.start_workflow(
        ClusterCreationWorkflow.run,
        ClusterCreateInput(spec=spec(name, nodes), backend="lab"),
        id=f"cluster-{name}-{uuid.uuid4().hex[:6]}",
        task_queue=queue,
        result_type=ClusterStatus,
        # A stalled creation fails its test in minutes, not at pytest's limit.
        execution_timeout=timedelta(minutes=3),
    )


def activities(
    kube: KubernetesApi, *, tries: dict[str, int] | None = None, together: threading.Barrier | None = None
) -> list[Any]:
    """gpufleet's cluster activities; with ``tries``, a reservation whose first try dies; with
    ``together``, reservations that start only once all of them have (so they truly race, and
    each creation has passed validation first)."""
    acts = ClusterActivities(kube, {"lab": StandIn()}, WebhookNotifier(url=None))
    made = acts.all()
    if together is not None:

        @activity.defn(name="cluster_reserve")
        def racing(request: ClusterRequest) -> StepResult:
            together.wait()
            return acts.reserve(request)

        made = [a for a in made if getattr(a, "__temporal_activity_definition").name != "cluster_reserve"]
        made.append(racing)
    if tries is not None:

        @activity.defn(name="cluster_reserve")
        def reserve(request: ClusterRequest) -> StepResult:
            result = acts.reserve(request)
            tries["n"] += 1
            if tries["n"] == 1:  # the nodes are taken, then the worker dies before it can say so
                raise RuntimeError("worker lost after the reservation was written")
            return result

        made = [a for a in made if getattr(a, "__temporal_activity_definition").name != "cluster_reserve"]
        made.append(reserve)
    return made


async def test_two_creations_racing_for_the_last_nodes_one_wins_the_other_leaves_nothing(
    env: WorkflowEnvironment, kube: KubernetesApi
) -> None:
    queue = f"race-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(8) as pool:
        async with Worker(
            env.client,
            task_queue=queue,
            workflows=[ClusterCreationWorkflow],
            activities=activities(kube, together=threading.Barrier(2, timeout=60)),
            activity_executor=pool,
        ):
            # Each asks 3 of the 4 free nodes: both pass validation, only one can be reserved.
            first, second = await asyncio.gather(start(env, queue, "alpha", 3), start(env, queue, "beta", 3))
            results = await asyncio.gather(first.result(), second.result())
    by_outcome = {r.outcome: r for r in results}
    assert set(by_outcome) == {ClusterOutcome.READY, ClusterOutcome.ROLLED_BACK}, results
    loser = by_outcome[ClusterOutcome.ROLLED_BACK]
    winner = by_outcome[ClusterOutcome.READY]
    assert loser.failed_step == "reserve_nodes" and "free pool" in loser.error
    assert holdings(kube, loser.name) == {}  # nothing left behind
    assert len(holdings(kube, winner.name)["train"]) == 3 and free_nodes(kube) == 1


async def test_a_reservation_retried_after_its_worker_died_takes_no_more(
    env: WorkflowEnvironment, kube: KubernetesApi
) -> None:
    queue = f"retry-{uuid.uuid4().hex[:6]}"
    tries = {"n": 0}
    with ThreadPoolExecutor(8) as pool:
        async with Worker(
            env.client,
            task_queue=queue,
            workflows=[ClusterCreationWorkflow],
            activities=activities(kube, tries=tries),
            activity_executor=pool,
        ):
            result = await (await start(env, queue, "gamma", 2)).result()
    assert result.outcome == ClusterOutcome.READY and tries["n"] == 2, result
    assert len(holdings(kube, "gamma")["train"]) == 2 and free_nodes(kube) == 2
