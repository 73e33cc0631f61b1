"""The lab's ReplicaSet controller and scheduler against the emulated API, through HTTP: pods
only where they fit (inference nodes, no training taint, not cordoned), spread, replaced when
evicted, Pending when nothing fits and bound once a node does; and a PodDisruptionBudget's
count follows them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.kube import KubernetesApi
from lab.kubeapi import node_object
from lab.scheduler import fits, reconcile, tolerated
from tests.conftest import KubeApiProcess

LABELS = {"app": "vllm"}


def inference_set(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": "vllm-7d9", "namespace": "serving", "uid": "rs-uid", "labels": LABELS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "nodeSelector": {"gpufleet.io/pool": "inference"},
                    "containers": [{"name": "server", "image": "vllm/vllm-openai"}],
                },
            },
        },
    }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[httpx.Client, KubernetesApi]]:
    training = node_object("gpu1", pool="training")
    training["spec"]["taints"] = [{"key": "gpufleet.io/pool", "value": "training", "effect": "NoSchedule"}]
    seed = {
        "nodes": [training, node_object("inf1", pool="inference"), node_object("inf2", pool="inference")],
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "serving"}}],
        "replicasets": [inference_set(3)],
        "pdbs": [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "vllm", "namespace": "serving"},
                "spec": {"minAvailable": 2, "selector": {"matchLabels": LABELS}},
            }
        ],
    }
    process = KubeApiProcess(tmp_path / "kube", seed)
    with httpx.Client(base_url=process.url, timeout=10) as http:
        yield http, KubernetesApi(kubeconfig=process.kubeconfig)
    process.stop()


def placed(kube: KubernetesApi) -> dict[str, int]:
    return {n: len(kube.pods_on_node(n)) for n in ("gpu1", "inf1", "inf2")}


def test_pods_go_only_where_they_fit_spread_and_are_replaced_when_evicted(
    api: tuple[httpx.Client, KubernetesApi],
) -> None:
    http, kube = api
    assert len(reconcile(http)) == 3
    assert placed(kube) == {"gpu1": 0, "inf1": 2, "inf2": 1}  # never the tainted training node
    assert reconcile(http) == []  # the count is met: nothing more
    budget = http.get("/apis/policy/v1/namespaces/serving/poddisruptionbudgets/vllm").json()["status"]
    assert budget["currentHealthy"] == 3 and budget["disruptionsAllowed"] == 1
    # inf1 is cordoned and drained (a move to training): its pods come back on inf2.
    kube.set_unschedulable("inf1", True)
    pods = kube.pods_on_node("inf1")
    assert kube.evict(pods[0], timeout_seconds=1, force=False) == "evicted"
    [said] = reconcile(http)
    assert said.startswith("created serving/vllm-7d9-") and said.endswith(" on inf2")
    assert placed(kube) == {"gpu1": 0, "inf1": 1, "inf2": 2}


def test_a_pod_with_nowhere_to_go_waits_and_lands_on_the_next_node_that_fits(
    api: tuple[httpx.Client, KubernetesApi],
) -> None:
    http, kube = api
    for node in ("inf1", "inf2"):
        kube.set_unschedulable(node, True)
    said = reconcile(http)
    assert len(said) == 3 and all("Pending: no node fits" in line for line in said)
    # A rebalance moves gpu1 to inference: labelled, the training taint off.
    kube.update_metadata("gpu1", labels={"gpufleet.io/pool": "inference"})
    kube.remove_taint("gpu1", key="gpufleet.io/pool")
    said = reconcile(http)
    assert len(said) == 3 and all(line.endswith("to gpu1") for line in said)
    assert placed(kube)["gpu1"] == 3
    pods = http.get("/api/v1/namespaces/serving/pods").json()["items"]
    assert {p["status"]["phase"] for p in pods} == {"Running"}


def test_taints_and_tolerations() -> None:
    taint = {"key": "gpufleet.io/pool", "value": "training", "effect": "NoSchedule"}
    assert not tolerated(taint, [])
    assert tolerated(taint, [{"key": "gpufleet.io/pool", "operator": "Exists"}])
    assert tolerated(taint, [{"key": "gpufleet.io/pool", "value": "training", "effect": "NoSchedule"}])
    assert not tolerated(taint, [{"key": "gpufleet.io/pool", "value": "inference"}])
    assert tolerated({"key": "x", "effect": "PreferNoSchedule"}, [])
    node = node_object("n", pool="inference", ready=False)
    assert not fits(node, {"nodeSelector": {"gpufleet.io/pool": "inference"}})  # not Ready


def test_a_set_sized_per_node_follows_the_nodes_that_serve(api: tuple[httpx.Client, KubernetesApi]) -> None:
    http, kube = api
    http.patch(
        "/apis/apps/v1/namespaces/serving/replicasets/vllm-7d9",
        json={"metadata": {"annotations": {"lab.gpufleet.io/replicas-per-node": "true"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    ).raise_for_status()
    reconcile(http)
    assert placed(kube) == {"gpu1": 0, "inf1": 1, "inf2": 1}  # one per inference node
    kube.update_metadata("gpu1", labels={"gpufleet.io/pool": "inference"})  # a rebalance moved it
    kube.remove_taint("gpu1", key="gpufleet.io/pool")
    [said] = reconcile(http)
    assert said.endswith(" on gpu1") and placed(kube) == {"gpu1": 1, "inf1": 1, "inf2": 1}
