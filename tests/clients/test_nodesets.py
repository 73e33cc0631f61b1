"""The Kubernetes side of a node replacement on Slinky (clients/nodesets.py), over HTTP against the
emulated API (its Slinky CRDs, evictions under PodDisruptionBudgets); and once end to end, with
the lab's NodeSet controller and real Slurm 26.05 dynamic nodes."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.errors import InvalidInput, NotFound
from clients.kube import KubernetesApi, PodRef
from clients.nodesets import (
    ELIGIBLE_ANNOTATION,
    NODE_CORDON_REASON,
    POD_PROTECT,
    POOL_TAINT,
    NodeSetName,
    NodeSets,
    NotEligible,
)
from lab.kubeapi import node_object
from lab.operator import start as start_operator
from lab.procs import wait_for
from lab.slurmroots import root_unavailable
from models.slinky import API
from tests.conftest import KubeApiProcess

NS = "slurm-research"
SELECTOR = {"gpufleet.io/cluster": "research", "gpufleet.io/partition": "train"}
TRAIN = NodeSetName(NS, "research-train")
DEBUG = NodeSetName(NS, "research-debug")


def _node(name: str, pool: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    node = node_object(name, pool=pool)
    node["metadata"]["labels"].update(labels or {})
    node["spec"].update(spec)
    return node


def nodeset(name: str, selector: dict[str, str], **pod_spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "NodeSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "controllerRef": {"name": "research"},
            "replicas": 2,
            "template": {"spec": {"nodeSelector": selector, **pod_spec}},
        },
    }


def nodeset_pod(name: str, owner: str, node: str, *, protect: bool = False) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "slurmd", "slinky.slurm.net/cluster": "research"}
    if protect:
        labels[POD_PROTECT] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": labels,
            "ownerReferences": [{"apiVersion": API, "kind": "NodeSet", "name": owner, "uid": "u", "controller": True}],
        },
        "spec": {"nodeName": node, "hostname": name, "containers": [{"name": "slurmd", "image": "slurmd"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    """gpu1 hosts two Slurm nodes of research-train (one busy, so protected) and one of
    research-debug, beside a pod of no NodeSet; spare1 and spare2 are free spares, spare2 tainted
    the training pool's way; spare3 cordoned."""
    seed: dict[str, object] = {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
        "nodes": [
            _node("gpu1", "training", SELECTOR),
            _node("spare1", "spare"),
            _node("spare2", "spare", taints=[{"key": POOL_TAINT, "value": "training", "effect": "NoSchedule"}]),
            _node("spare3", "spare", unschedulable=True),
        ],
        "pods": [
            nodeset_pod("research-train-0", "research-train", "gpu1"),
            nodeset_pod("research-train-1", "research-train", "gpu1", protect=True),
            nodeset_pod("research-debug-0", "research-debug", "gpu1"),
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "exporter", "namespace": NS},
                "spec": {"nodeName": "gpu1", "containers": [{"name": "c", "image": "exporter"}]},
                "status": {"phase": "Running"},
            },
        ],
        "pdbs": [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "slurm-workers-pdb-research", "namespace": NS},
                "spec": {
                    "maxUnavailable": 0,
                    "selector": {"matchLabels": {POD_PROTECT: "true", "slinky.slurm.net/cluster": "research"}},
                },
            }
        ],
    }
    process = KubeApiProcess(tmp_path / "kube", seed)
    with httpx.Client(base_url=process.url, timeout=10) as http:
        for body in (
            nodeset("research-train", SELECTOR),
            nodeset(
                "research-debug",
                {"gpufleet.io/cluster": "research", "gpufleet.io/debug": "yes"},
                tolerations=[{"key": POOL_TAINT, "operator": "Equal", "value": "training", "effect": "NoSchedule"}],
            ),
        ):
            http.post(f"/apis/{API}/namespaces/{NS}/nodesets", json=body).raise_for_status()
    yield process
    process.stop()


@pytest.fixture
def kube(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)


@pytest.fixture
def nodesets(kube: KubernetesApi) -> NodeSets:
    return NodeSets(kube)


def versions(kube: KubernetesApi, node: str) -> str:
    return kube.get_node(node).resource_version


def recreate(api: KubeApiProcess, name: str, owner: str, node: str) -> None:
    """What the operator does for an evicted pod: the same name again, on ``node``."""
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.post(f"/api/v1/namespaces/{NS}/pods", json=nodeset_pod(name, owner, node)).raise_for_status()


# -- what a node hosts ----------------------------------------------------------------------------


def test_the_nodeset_pods_on_a_node_are_the_slurm_nodes_an_incident_covers(nodesets: NodeSets) -> None:
    pods = nodesets.nodeset_pods_on("gpu1")
    assert [(p.key, p.nodeset, p.slurm_node, p.node) for p in pods] == [
        (f"{NS}/research-debug-0", DEBUG, "research-debug-0", "gpu1"),
        (f"{NS}/research-train-0", TRAIN, "research-train-0", "gpu1"),
        (f"{NS}/research-train-1", TRAIN, "research-train-1", "gpu1"),
    ]  # not the exporter, owned by no NodeSet
    assert [p.protected for p in pods] == [False, False, True]
    assert all(p.uid and p.back for p in pods)
    assert nodesets.nodeset_pods_on("spare1") == []


# -- the cordon -----------------------------------------------------------------------------------


def test_cordon_for_an_incident_names_it_and_a_retry_writes_nothing(nodesets: NodeSets, kube: KubernetesApi) -> None:
    first = nodesets.cordon_for_incident("gpu1", "inc-7")
    node = kube.get_node("gpu1")
    assert node.unschedulable and node.annotations[NODE_CORDON_REASON] == "gpufleet: incident inc-7"
    assert (first.reason, first.ours, first.changed) == ("gpufleet: incident inc-7", True, True)
    before = versions(kube, "gpu1")
    again = nodesets.cordon_for_incident("gpu1", "inc-7")
    assert (again.reason, again.ours, again.changed) == (first.reason, True, False)
    assert versions(kube, "gpu1") == before  # no write on the retry


def test_another_owners_cordon_reason_is_kept_and_returned(nodesets: NodeSets, kube: KubernetesApi) -> None:
    kube.update_metadata("gpu1", annotations={NODE_CORDON_REASON: "ops: PSU swap"})
    result = nodesets.cordon_for_incident("gpu1", "inc-8")
    assert (result.reason, result.ours) == ("ops: PSU swap", False)
    node = kube.get_node("gpu1")
    assert node.unschedulable and node.annotations[NODE_CORDON_REASON] == "ops: PSU swap"
    with pytest.raises(InvalidInput):
        nodesets.cordon_for_incident("gpu1", "")


# -- one eviction ---------------------------------------------------------------------------------


def test_an_eviction_evicts_once_and_a_retry_finds_it_gone(nodesets: NodeSets, kube: KubernetesApi) -> None:
    [pod] = [p for p in nodesets.nodeset_pods_on("gpu1") if p.name == "research-train-0"]
    result = nodesets.evict_nodeset_pod(pod)
    assert (result.outcome, result.message) == ("evicted", f"evicted {NS}/research-train-0")
    assert kube.find_pod(NS, "research-train-0") is None
    assert nodesets.evict_nodeset_pod(pod).outcome == "not found"  # a retry: nothing more done
    assert nodesets.evict_nodeset_pod(PodRef(namespace=NS, name="research-train-9")).outcome == "not found"


def test_a_successor_under_the_same_name_is_never_evicted(
    nodesets: NodeSets, kube: KubernetesApi, api: KubeApiProcess
) -> None:
    [pod] = [p for p in nodesets.nodeset_pods_on("gpu1") if p.name == "research-train-0"]
    assert nodesets.evict_nodeset_pod(pod).outcome == "evicted"
    recreate(api, "research-train-0", "research-train", "spare1")
    retry = nodesets.evict_nodeset_pod(pod)  # the first attempt's answer was lost: asked again
    assert retry.outcome == "already gone" and "on spare1" in retry.message
    successor = kube.find_pod(NS, "research-train-0")
    assert successor is not None and successor.node == "spare1" and successor.uid != pod.uid
    # Without a UID, the node it was on tells the old pod from its successor.
    assert nodesets.evict_nodeset_pod(PodRef(namespace=NS, name=pod.name, node="gpu1")).outcome == "already gone"


def test_a_protected_pod_is_blocked_by_its_budget_never_forced(nodesets: NodeSets, kube: KubernetesApi) -> None:
    [pod] = [p for p in nodesets.nodeset_pods_on("gpu1") if p.protected]
    for _ in range(2):  # asked again: the same answer, and the pod still there
        result = nodesets.evict_nodeset_pod(pod)
        assert result.outcome == "blocked" and "blocked by its disruption budget" in result.message
        still = kube.find_pod(NS, pod.name)
        assert still is not None and still.uid == pod.uid and not still.terminating


# -- eligibility ----------------------------------------------------------------------------------


def records(kube: KubernetesApi, node: str) -> dict[str, Any]:
    raw = kube.get_node(node).annotations.get(ELIGIBLE_ANNOTATION)
    return json.loads(raw) if raw else {}


def test_a_spare_made_eligible_gets_exactly_the_selector_and_a_retry_writes_nothing(
    nodesets: NodeSets, kube: KubernetesApi
) -> None:
    before = dict(kube.get_node("spare1").labels)
    result = nodesets.make_eligible("spare1", TRAIN)
    assert result.changed == SELECTOR and result.labels == SELECTOR and result.taint == ""
    assert kube.get_node("spare1").labels == {**before, **SELECTOR}
    assert records(kube, "spare1") == {TRAIN.key: {"labels": SELECTOR, "taint": False}}
    version = versions(kube, "spare1")
    again = nodesets.make_eligible("spare1", TRAIN)
    assert again.changed == {} and versions(kube, "spare1") == version
    # Undone: exactly gpufleet's labels off, the record gone; then again: nothing written.
    out = nodesets.make_ineligible("spare1", TRAIN)
    assert out.changed == dict.fromkeys(sorted(SELECTOR)) and out.kept == {}
    node = kube.get_node("spare1")
    assert node.labels == before and ELIGIBLE_ANNOTATION not in node.annotations
    version = versions(kube, "spare1")
    assert nodesets.make_ineligible("spare1", TRAIN).changed == {} and versions(kube, "spare1") == version


def test_a_label_someone_else_set_is_kept_when_eligibility_is_undone(nodesets: NodeSets, kube: KubernetesApi) -> None:
    kube.update_metadata("spare1", labels={"gpufleet.io/cluster": "research"})  # there before gpufleet
    assert nodesets.make_eligible("spare1", TRAIN).changed == {"gpufleet.io/partition": "train"}
    out = nodesets.make_ineligible("spare1", TRAIN)
    assert out.changed == {"gpufleet.io/partition": None} and out.kept == {"gpufleet.io/cluster": "research"}
    assert kube.get_node("spare1").labels["gpufleet.io/cluster"] == "research"


def test_labels_two_nodesets_share_stay_until_neither_needs_them(nodesets: NodeSets, kube: KubernetesApi) -> None:
    # spare2's training taint is tolerated by research-debug's pods only.
    nodesets.make_eligible("spare2", DEBUG)
    kube.remove_taint("spare2", key=POOL_TAINT)  # so that research-train's pods may go there too
    nodesets.make_eligible("spare2", TRAIN)
    assert set(records(kube, "spare2")) == {DEBUG.key, TRAIN.key}
    out = nodesets.make_ineligible("spare2", DEBUG)
    assert out.changed == {"gpufleet.io/debug": None}  # cluster is research-train's too
    labels = kube.get_node("spare2").labels
    assert labels["gpufleet.io/cluster"] == "research" and labels["gpufleet.io/partition"] == "train"
    assert set(records(kube, "spare2")) == {TRAIN.key}
    assert nodesets.make_ineligible("spare2", TRAIN).changed == dict.fromkeys(sorted(SELECTOR))
    node = kube.get_node("spare2")
    assert not set(SELECTOR) & set(node.labels) and ELIGIBLE_ANNOTATION not in node.annotations


def test_the_pool_taint_is_added_for_pods_that_tolerate_it_and_taken_off_after(
    nodesets: NodeSets, kube: KubernetesApi
) -> None:
    result = nodesets.make_eligible("spare1", DEBUG)
    assert result.taint == "added"
    assert [t["key"] for t in kube.get_node("spare1").taints] == [POOL_TAINT]
    version = versions(kube, "spare1")
    assert nodesets.make_eligible("spare1", DEBUG).taint == "" and versions(kube, "spare1") == version
    assert nodesets.make_ineligible("spare1", DEBUG).taint == "removed"
    node = kube.get_node("spare1")
    assert node.taints == [] and ELIGIBLE_ANNOTATION not in node.annotations
    # A taint gpufleet did not add stays.
    nodesets.make_eligible("spare2", DEBUG)
    assert nodesets.make_ineligible("spare2", DEBUG).taint == ""
    assert [t["key"] for t in kube.get_node("spare2").taints] == [POOL_TAINT]


def test_a_spare_the_pods_cannot_use_is_refused_before_any_write(nodesets: NodeSets, kube: KubernetesApi) -> None:
    for spare, why in (("spare2", "not tolerated"), ("spare3", "cordoned")):
        version = versions(kube, spare)
        with pytest.raises(NotEligible, match=why):
            nodesets.make_eligible(spare, TRAIN)
        assert versions(kube, spare) == version
    kube.update_metadata("spare1", labels={"gpufleet.io/partition": "debug"})
    with pytest.raises(NotEligible, match=re.escape("gpufleet.io/partition=debug")):
        nodesets.make_eligible("spare1", TRAIN)
    with pytest.raises(NotFound):
        nodesets.make_eligible("spare1", NodeSetName(NS, "no-such"))


def test_the_failed_node_lets_go_only_when_asked_to_take_unrecorded_labels(
    nodesets: NodeSets, kube: KubernetesApi
) -> None:
    kept = nodesets.make_ineligible("gpu1", TRAIN)
    assert kept.changed == {} and kept.kept == SELECTOR  # labelled at the cluster's creation
    out = nodesets.make_ineligible("gpu1", TRAIN, also_unrecorded=True)
    assert out.changed == dict.fromkeys(sorted(SELECTOR))
    assert not set(SELECTOR) & set(kube.get_node("gpu1").labels)
    version = versions(kube, "gpu1")
    assert nodesets.make_ineligible("gpu1", TRAIN, also_unrecorded=True).changed == {}
    assert versions(kube, "gpu1") == version


def test_labels_other_controllers_keep_are_never_taken_off_the_failed_node(
    nodesets: NodeSets, kube: KubernetesApi, api: KubeApiProcess
) -> None:
    """A NodeSet selecting on the GPU operator's label: the failed node keeps it (the detector's
    DaemonSet selects on it, and the GPU operator would put it back); its own label goes."""
    gpu = {**SELECTOR, "nvidia.com/gpu.present": "true"}
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.post(f"/apis/{API}/namespaces/{NS}/nodesets", json=nodeset("research-gpu", gpu)).raise_for_status()
    kube.update_metadata("gpu1", labels={"nvidia.com/gpu.present": "true"})

    out = nodesets.make_ineligible("gpu1", NodeSetName(NS, "research-gpu"), also_unrecorded=True)

    assert out.changed == dict.fromkeys(sorted(SELECTOR))
    assert out.kept == {"nvidia.com/gpu.present": "true"}
    assert kube.get_node("gpu1").labels["nvidia.com/gpu.present"] == "true"


# -- coming back ----------------------------------------------------------------------------------


def test_a_pod_is_back_once_a_new_one_of_its_name_runs(
    nodesets: NodeSets, kube: KubernetesApi, api: KubeApiProcess
) -> None:
    [pod] = [p for p in nodesets.nodeset_pods_on("gpu1") if p.name == "research-train-0"]
    assert nodesets.pod_back(pod) is None  # the very same pod: not back, never left
    nodesets.evict_nodeset_pod(pod)
    assert nodesets.pod_back(pod) is None
    recreate(api, "research-train-0", "research-train", "spare1")
    back = nodesets.pod_back(pod, on="spare1")
    assert back is not None and (back.name, back.node, back.phase) == ("research-train-0", "spare1", "Running")
    assert back.slurm_node == "research-train-0" and back.uid != pod.uid
    assert nodesets.pod_back(pod, on="gpu1") is None  # back, but not where it was asked for


# -- end to end: the lab's operator and Slurm 26.05 --------------------------------------------


RELEASE = "26.05"


@pytest.fixture
def operated(tmp_path: Path) -> Iterator[tuple[KubernetesApi, Any, Path]]:
    """gpu1 and gpu2 selected by research-train (two replicas, one on each), spare1 a free spare;
    a 26.05 cluster and the lab's operator between them."""
    if root_unavailable(RELEASE):
        pytest.skip(root_unavailable(RELEASE))
    from lab.dynamic import DynamicSlurmLab

    seed: dict[str, object] = {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
        "nodes": [_node("gpu1", "training", SELECTOR), _node("gpu2", "training", SELECTOR), _node("spare1", "spare")],
    }
    api = KubeApiProcess(tmp_path / "kube", seed)
    cluster = DynamicSlurmLab(tmp_path / "slurm", ("research-train",), release=RELEASE)
    operator: subprocess.Popen[bytes] | None = None
    log = tmp_path / "operator.log"
    try:
        cluster.start(timeout=60)
        body = nodeset("research-train", SELECTOR)
        body["spec"]["pinToNode"] = True
        with httpx.Client(base_url=api.url, timeout=10) as http:
            http.post(f"/apis/{API}/namespaces/{NS}/nodesets", json=body).raise_for_status()
        ready = tmp_path / "operator.ready"
        operator = start_operator(api.url, cluster, ready_file=ready, log=log)
        wait_for(ready.exists, timeout=20, what="the operator to start")
        yield KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05), cluster, log
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=20)
        cluster.stop()
        api.stop()


def test_a_failed_node_is_replaced_by_the_spare_under_the_same_slurm_node_name(
    operated: tuple[KubernetesApi, Any, Path],
) -> None:
    kube, cluster, log = operated
    nodesets = NodeSets(kube)

    def idle(name: str) -> bool:
        return name in cluster.nodes() and cluster.client().node(name).state == "idle"

    for name in ("research-train-0", "research-train-1"):
        wait_for(functools.partial(idle, name), timeout=30, what=f"{name} registered and idle")
    [pod] = nodesets.nodeset_pods_on("gpu1")
    assert nodesets.cordon_for_incident("gpu1", "inc-42").ours
    wait_for(
        lambda: cluster.client().node(pod.slurm_node).reason == "slurm-operator: gpufleet: incident inc-42",
        timeout=20,
        what=f"{pod.slurm_node} drained with the incident's reason",
    )
    nodesets.make_eligible("spare1", TRAIN)
    nodesets.make_ineligible("gpu1", TRAIN, also_unrecorded=True)  # the pin lets go
    assert nodesets.evict_nodeset_pod(pod).outcome == "evicted"
    back = wait_for(lambda: nodesets.pod_back(pod, on="spare1"), timeout=30, what=f"{pod.name} back on spare1 ({log})")
    assert back is not None and back.name == pod.name and back.node == "spare1"
    wait_for(functools.partial(idle, pod.slurm_node), timeout=30, what=f"{pod.slurm_node} idle again on spare1")
