"""`gpufleet nodes show` as a person uses it: the real NodeDomainsWorkflow on a worker of cluster
`lab`, reading the policy's `domains:` through the real PolicyActivities and the node's labels
through the real TopologyActivities over the emulated Kubernetes API, against Temporal's
time-skipping test server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.policy import PolicyActivities
from activities.topology import TopologyActivities
from clients.kube import KubernetesApi
from lab.kubeapi import node_object
from models.constants import task_queue
from models.policy import Policy, RemediationSettings
from models.requests import WorkerConfig
from models.topology import DomainKind, DomainSettings
from tests.conftest import KubeApiProcess
from tests.starters.test_cli_every_command import Ran, gpufleet
from workflows.nodes import NodeDomainsWorkflow

pytestmark = pytest.mark.timeout(120)

# The site's own rack label, and only racks group failures: nodes show reads every kind anyway.
POLICY = Policy(domains=DomainSettings(rack_label="example.com/rack", kinds=[DomainKind.RACK]))


def labelled(name: str, **labels: str) -> dict[str, Any]:
    node = node_object(name, pool="training")
    node["metadata"]["labels"].update(labels)
    return node


@dataclass
class Server:
    address: str
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def gpufleet(self, *args: str) -> Ran:
        return gpufleet(*args, env={"TEMPORAL_ADDRESS": self.address, "GPUFLEET_CLUSTER": "lab"})


@pytest.fixture(scope="module")
def server(temporal_test_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    seed = {
        "nodes": [
            labelled("gpu1", **{"example.com/rack": "r12", "topology.kubernetes.io/zone": "eu-west-1a"}),
            labelled("gpu2", **{"example.com/rack": "r 12"}),  # no domain name
            labelled("gpu3"),
        ]
    }
    api = KubeApiProcess(tmp_path_factory.mktemp("kube"), seed)
    kube = KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)
    config = WorkerConfig(cluster="lab", settings=RemediationSettings(), policy=POLICY)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> WorkflowEnvironment:
        return await WorkflowEnvironment.start_time_skipping(
            data_converter=pydantic_data_converter,
            test_server_existing_path=temporal_test_server,
            test_server_startup_timeout=timedelta(seconds=60),
        )

    env = asyncio.run_coroutine_threadsafe(start(), loop).result(90)
    found = Server(env.client.service_client.config.target_host, loop)
    topology = TopologyActivities(kube, None)
    policy = PolicyActivities(lambda: config)
    executor = ThreadPoolExecutor(max_workers=4)

    async def make() -> Worker:  # in the loop it runs in
        return Worker(
            env.client,
            task_queue=task_queue("lab"),
            workflows=[NodeDomainsWorkflow],
            activities=[policy.worker_config, topology.node_domains, topology.domain_nodes],
            activity_executor=executor,
        )

    worker: Worker = found.run(make())
    running = asyncio.run_coroutine_threadsafe(worker.run(), loop)
    try:
        yield found
    finally:
        found.run(worker.shutdown())
        running.result(30)
        found.run(env.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        executor.shutdown()
        api.stop()


def test_a_nodes_domains_and_where_each_was_read(server: Server) -> None:
    ran = server.gpufleet("nodes", "show", "gpu1")
    assert ran.code == 0, (ran.out, ran.err)
    out = " ".join(ran.out.split())
    assert "gpu1 (cluster lab)" in out
    assert "rack │ r12 │ label example.com/rack" in out
    # A kind the policy does not group failures by is shown all the same.
    assert "zone │ eu-west-1a │ label topology.kubernetes.io/zone" in out


def test_json_for_scripts(server: Server) -> None:
    ran = server.gpufleet("nodes", "show", "gpu1", "--cluster", "lab", "--json")
    assert ran.code == 0, (ran.out, ran.err)
    shown = json.loads(ran.out)
    assert shown["cluster"] == "lab" and shown["node"] == "gpu1"
    assert shown["domains"] == [{"kind": "rack", "name": "r12"}, {"kind": "zone", "name": "eu-west-1a"}]
    assert shown["sources"]["rack/r12"] == "label example.com/rack"
    assert shown["notes"] == []


def test_a_label_that_is_no_domain_name_is_a_note(server: Server) -> None:
    ran = server.gpufleet("nodes", "show", "gpu2")
    assert ran.code == 0, (ran.out, ran.err)
    out = " ".join(ran.out.split())
    assert "gpu2 (cluster lab): in no failure domain" in out
    assert "note: label example.com/rack='r 12' on gpu2 is no domain name" in out


def test_an_unknown_node_is_one_line_and_exit_1(server: Server) -> None:
    ran = server.gpufleet("nodes", "show", "gpu99")
    assert ran.code == 1
    assert "no node gpu99: neither Kubernetes nor Slurm knows it" in ran.error_line()


def test_an_unsafe_node_name_is_exit_2_before_anything_starts(server: Server) -> None:
    ran = server.gpufleet("nodes", "show", "gpu1;reboot")
    assert ran.code == 2
    assert "invalid node name" in ran.error_line()
