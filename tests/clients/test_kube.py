"""KubernetesApi (the official client) over HTTP against the emulated API server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.errors import Conflict, InvalidInput, NotFound, Unavailable
from clients.kube import KubernetesApi, PodRef
from lab.kubeapi import node_object
from lab.procs import free_port
from tests.conftest import KubeApiProcess


def pod(name: str, node: str, labels: dict[str, str], *, owner: str | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "namespace": "default", "labels": labels}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner, "name": "x", "uid": "u"}]
    return {
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running"},
    }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    seed: dict[str, object] = {
        "nodes": [
            node_object("gpu1", pool="training"),
            node_object("gpu2", pool="training"),
            node_object("spare1", pool="spare"),
        ],
        "pods": [
            pod("web-a", "gpu1", {"app": "web"}),
            pod("web-b", "gpu2", {"app": "web"}),
            pod("batch", "gpu1", {"app": "batch"}),
            pod("agent", "gpu1", {"app": "agent"}, owner="DaemonSet"),
        ],
        "pdbs": [
            {
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
            }
        ],
    }
    process = KubeApiProcess(tmp_path / "kube", seed)
    yield process
    process.stop()


@pytest.fixture
def kube(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)


def test_label_selectors(kube: KubernetesApi) -> None:
    assert [n.name for n in kube.list_nodes(label_selector="gpufleet.io/pool=spare")] == ["spare1"]
    assert [n.name for n in kube.list_nodes(label_selector="gpufleet.io/pool!=spare")] == ["gpu1", "gpu2"]
    assert [n.name for n in kube.list_nodes(label_selector="gpufleet.io/pool in (spare,retired)")] == ["spare1"]
    assert len(kube.list_nodes(label_selector="gpufleet.io/pool")) == 3
    assert kube.list_nodes(label_selector="!gpufleet.io/pool") == []


def test_field_selector_lists_the_pods_of_one_node(kube: KubernetesApi) -> None:
    assert sorted(p.name for p in kube.pods_on_node("gpu1")) == ["agent", "batch", "web-a"]
    assert [p.name for p in kube.pods_on_node("gpu2")] == ["web-b"]
    assert kube.pods_on_node("spare1") == []


def test_cordon_and_taint_are_idempotent(kube: KubernetesApi) -> None:
    assert kube.set_unschedulable("gpu1", True).unschedulable
    assert kube.set_unschedulable("gpu1", True).unschedulable
    kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    node = kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    assert node.taints == [{"key": "gpufleet.io/unhealthy", "value": "i1", "effect": "NoSchedule"}]


def test_stale_resource_version_is_a_conflict(kube: KubernetesApi) -> None:
    before = kube.get_node("spare1")
    kube.update_metadata(
        "spare1", annotations={"gpufleet.io/claimed-by": "a"}, resource_version=before.resource_version
    )
    with pytest.raises(Conflict):
        kube.update_metadata(
            "spare1", annotations={"gpufleet.io/claimed-by": "b"}, resource_version=before.resource_version
        )
    assert kube.get_node("spare1").annotations["gpufleet.io/claimed-by"] == "a"


def test_eviction_refused_by_a_budget_then_allowed(kube: KubernetesApi) -> None:
    web_a = PodRef(namespace="default", name="web-a")
    web_b = PodRef(namespace="default", name="web-b")
    progress: list[str] = []
    # Two web pods, minAvailable 1: the first eviction goes through...
    assert kube.evict(web_a, timeout_seconds=1, progress=progress.append) == "evicted"
    # ...the second would break the budget: 429 until the deadline, then a forced delete.
    assert kube.evict(web_b, timeout_seconds=0.5, progress=progress.append) == "deleted"
    assert any("PodDisruptionBudget" in line for line in progress)
    assert kube.pods_on_node("gpu2") == []
    assert kube.evict(web_b, timeout_seconds=0.5) == "gone"


def test_missing_node_and_bad_names(kube: KubernetesApi) -> None:
    with pytest.raises(NotFound):
        kube.get_node("nosuch")
    with pytest.raises(InvalidInput):
        kube.get_node("gpu1/../../namespaces")
    kube.delete_node("gpu2")
    kube.delete_node("gpu2")  # already gone: a no-op
    with pytest.raises(NotFound):
        kube.get_node("gpu2")


def test_unreachable_api_server_is_unavailable(tmp_path: Path) -> None:
    from lab.kubeapi import write_kubeconfig

    config = write_kubeconfig(tmp_path / "kubeconfig", server=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Unavailable):
        KubernetesApi(kubeconfig=config).list_nodes()


def test_remove_taint_is_idempotent_and_keeps_the_others(kube: KubernetesApi) -> None:
    kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    kube.add_taint("gpu1", key="gpufleet.io/retired", value="i1")
    kube.add_taint("gpu1", key="gpufleet.io/retired", value="i1", effect="NoExecute")
    node = kube.remove_taint("gpu1", key="gpufleet.io/retired", effect="NoExecute")
    assert [(t["key"], t["effect"]) for t in node.taints] == [
        ("gpufleet.io/unhealthy", "NoSchedule"),
        ("gpufleet.io/retired", "NoSchedule"),
    ]
    kube.remove_taint("gpu1", key="gpufleet.io/retired")
    node = kube.remove_taint("gpu1", key="gpufleet.io/retired")
    assert node.taints == [{"key": "gpufleet.io/unhealthy", "value": "i1", "effect": "NoSchedule"}]
    assert kube.remove_taint("gpu1", key="gpufleet.io/unhealthy").taints == []
    assert kube.get_node("gpu1").taints == []
    with pytest.raises(NotFound):
        kube.remove_taint("nosuch", key="gpufleet.io/retired")
