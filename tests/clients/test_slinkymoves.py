"""Pool moves on Slinky (clients/slinkymoves.py) against the emulated Kubernetes API, with the
NodeSet gpufleet renders for examples/cluster.yaml. No Slurm runs: a small in-memory Slurm stands
in for slurmrestd, and each step of the operator (slurm-operator v1.2.1) is done by the test at
the moment the move says it wrote, or not at all (an operator that has not got there yet).

v1.2.1 deletes a condemned pod (StatefulSet mode) and never deletes its Slurm node: the pod's
preStop hook sets it DOWN (``slurm-operator: Pod is terminating``) and the dynamic node stays
(internal/controller/nodeset/nodeset_sync.go processCondemned; syncSlurmNodeRecords prunes in
DaemonSet mode only).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from temporalio.testing import ActivityEnvironment

from activities.guard import GuardActivities
from activities.pool import PoolActivities
from clients.errors import ClientError, InvalidInput, NotFound, Unavailable
from clients.kube import KubernetesApi
from clients.onslinky import SlinkyPool, SlinkySlurm
from clients.poolmoves import TRAINING_TAINT, OutOfPool
from clients.slinkymoves import LOWEST_COST, POD_CORDON, POD_DELETION_COST, SCALED_OUT_ANNOTATION, SlinkyPoolMover
from clients.slurm import Pending
from lab.kubeapi import node_object
from models.cluster import load_spec
from models.incident import JobInfo, NodeInfo
from models.poolops import PoolRequest, PoolSettings
from models.slinky import API, slinky_objects
from tests.conftest import REPO, KubeApiProcess

NS = "slurm-research"
NODESET = "research-train"
CLUSTER = {"gpufleet.io/cluster": "research"}
TRAIN = {**CLUSTER, "gpufleet.io/partition": "train"}
PRESTOP = "slurm-operator: Pod is terminating"


def rendered_nodeset() -> dict[str, Any]:
    spec = load_spec(yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text()))
    objects = slinky_objects(spec, {"train": ["gpu1", "gpu2"], "debug": ["gpu3"]})
    [nodeset] = [o for o in objects if o["kind"] == "NodeSet" and o["metadata"]["name"] == NODESET]
    return nodeset


def pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/name": "slurmd", "slinky.slurm.net/cluster": "research"},
            "ownerReferences": [
                {"apiVersion": API, "kind": "NodeSet", "name": NODESET, "uid": "u", "controller": True}
            ],
        },
        "spec": {"nodeName": node, "containers": [{"name": "slurmd", "image": "slurmd"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def kube_node(name: str, pool: str, labels: dict[str, str]) -> dict[str, Any]:
    node = node_object(name, pool=pool)
    node["metadata"]["labels"].update(labels)
    return node


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    """research-train as gpufleet renders it, its pods on gpu1 and gpu2 (both Running and Ready,
    as the NodeSet's status says); inf1 and inf2 serve inference."""
    seed: dict[str, object] = {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
        "nodes": [
            kube_node("gpu1", "training", TRAIN),
            kube_node("gpu2", "training", TRAIN),
            kube_node("inf1", "inference", CLUSTER),
            kube_node("inf2", "inference", CLUSTER),
        ],
        "pods": [pod("research-train-0", "gpu1"), pod("research-train-1", "gpu2")],
    }
    process = KubeApiProcess(tmp_path / "kube", seed)
    with httpx.Client(base_url=process.url, timeout=10) as http:
        http.post(f"/apis/{API}/namespaces/{NS}/nodesets", json=rendered_nodeset()).raise_for_status()
    set_status(process, replicas=2, ready=2)
    yield process
    process.stop()


def set_status(api: KubeApiProcess, *, replicas: int, ready: int) -> None:
    body = {
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "selector": f"app.kubernetes.io/instance={NODESET},app.kubernetes.io/name=slurmd",
            "nodeSetHash": "h",
        }
    }
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.patch(
            f"/apis/{API}/namespaces/{NS}/nodesets/{NODESET}/status",
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()


def scaled_in(api: KubeApiProcess, slurm: Any, pod: str) -> None:
    """What slurm-operator v1.2.1 does after a scale-in: the condemned pod deleted, its preStop
    hook leaving the Slurm node DOWN (the record stays), the NodeSet one replica fewer."""
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.delete(f"/api/v1/namespaces/{NS}/pods/{pod}").raise_for_status()
    slurm.nodes_[pod] = slurm.node(pod).model_copy(update={"state": "down", "reason": PRESTOP})
    set_status(api, replicas=1, ready=1)


@pytest.fixture
def kube(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)


class SmallSlurm:
    """Slurm nodes in a dict, no jobs anywhere."""

    def __init__(self, nodes: list[str]) -> None:
        self.nodes_ = {n: NodeInfo(name=n, state="idle", partitions=[NODESET]) for n in nodes}

    def node(self, name: str) -> NodeInfo:
        if name not in self.nodes_:
            raise NotFound(f"Slurm has no node named {name!r}")
        return self.nodes_[name]

    def nodes(self) -> list[NodeInfo]:
        return list(self.nodes_.values())

    def drain(self, name: str, *, reason: str) -> NodeInfo:
        current = self.node(name)
        if not current.drained:
            self.nodes_[name] = current.model_copy(update={"flags": ["DRAIN"], "reason": reason})
        return self.nodes_[name]

    def resume(self, name: str) -> None:
        self.nodes_[name] = self.node(name).model_copy(update={"flags": [], "reason": ""})

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        return []

    def recent_jobs_on_node(self, name: str) -> list[JobInfo]:
        return []

    def pending(self, partition: str) -> Pending:
        raise Unavailable("no pending jobs read here")


def mover(kube: KubernetesApi, slurm: SmallSlurm) -> SlinkyPoolMover:
    on = SlinkySlurm(slurm, kube)  # type: ignore[arg-type]
    pool = SlinkyPool(kube=kube, slurm=on, partition=NODESET, cluster="research", poll_seconds=0.05)
    return SlinkyPoolMover(kube, on, pool, namespace=NS, poll_seconds=0.05, scale_wait_seconds=1.0)


ARGS: dict[str, Any] = {"holder": "pool-research", "partition": NODESET, "grace_seconds": 0, "deadline_seconds": 0}


def test_a_move_to_inference_ends_once_the_operator_deleted_the_pod_though_its_slurm_node_stays_down(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """slurm-operator v1.2.1 deletes the condemned pod; the preStop hook sets its Slurm node DOWN
    and the record stays. The move must not wait for a deletion that never comes."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])

    def operator(line: str) -> None:
        if "scaled in to" in line:  # what v1.2.1 does next: the drained pod deleted, preStop run
            scaled_in(api, slurm, "research-train-0")

    assert mover(kube, slurm).to_inference("gpu1", say=operator, **ARGS) == "gpu1 serves inference"


def test_a_node_moved_back_to_training_on_a_cluster_gpufleet_created_gets_its_pod(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """inf1 to training on research (NodeSets as `cluster create --backend slinky` renders them):
    the move taints it gpufleet.io/pool=training:NoSchedule, then makes it eligible for a NodeSet
    whose pods must tolerate that taint."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])

    def operator(line: str) -> None:
        if "scaled out to" in line:  # the scheduler puts the new pod on the only eligible node
            with httpx.Client(base_url=api.url, timeout=10) as http:
                http.post(f"/api/v1/namespaces/{NS}/pods", json=pod("research-train-2", "inf1")).raise_for_status()
            slurm.nodes_["research-train-2"] = NodeInfo(name="research-train-2", state="idle", partitions=[NODESET])

    move = mover(kube, slurm)
    said = move.to_training("inf1", holder="pool-research", partition=NODESET, eviction_timeout_seconds=5, say=operator)
    assert said == "inf1 serves training"


def test_a_move_to_inference_rolled_back_leaves_no_scale_in_mark_on_the_pod_that_stays(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """The move marks gpu1's pod first for the operator's scale-in, then finds a pod of the
    NodeSet not ready (an incident's evicted pod on its way) and fails; the pool rolls it back.
    gpu1's pod stays in training: it must not stay first in the next scale-in's order (the next
    move's pod would tie with it), nor cordoned."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])

    def incident(line: str) -> None:
        if "drained in Slurm" in line:
            set_status(api, replicas=2, ready=1)

    move = mover(kube, slurm)
    with pytest.raises(ClientError, match="the move waits"):
        move.to_inference("gpu1", say=incident, **ARGS)
    set_status(api, replicas=2, ready=2)
    assert (
        move.to_training("gpu1", holder="pool-research", partition=NODESET, eviction_timeout_seconds=5)
        == "gpu1 serves training"
    )
    stays = kube.find_pod(NS, "research-train-0")
    assert stays is not None
    with httpx.Client(base_url=api.url, timeout=10) as http:
        found = http.get(f"/api/v1/namespaces/{NS}/pods/research-train-0").raise_for_status().json()
    annotations = found["metadata"].get("annotations") or {}
    assert annotations.get(POD_DELETION_COST) != LOWEST_COST, annotations
    assert annotations.get(POD_CORDON) != "true", annotations


# -- after a move that stopped halfway ---------------------------------------------------------------


def tolerating(api: KubeApiProcess) -> None:
    """research-train's pods tolerate the pool's training taint (as NodeSets made for the pool do)."""
    toleration = {"key": TRAINING_TAINT, "operator": "Equal", "value": "training", "effect": "NoSchedule"}
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.patch(
            f"/apis/{API}/namespaces/{NS}/nodesets/{NODESET}",
            json={"spec": {"template": {"spec": {"tolerations": [toleration]}}}},
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()


def pending(api: KubeApiProcess, name: str) -> None:
    """A pod of research-train waiting for a node (Pending, on none), as the NodeSet's status says."""
    waiting = pod(name, "")
    del waiting["spec"]["nodeName"]
    waiting["status"] = {"phase": "Pending"}
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.post(f"/api/v1/namespaces/{NS}/pods", json=waiting).raise_for_status()
    set_status(api, replicas=3, ready=2)


def replicas(kube: KubernetesApi) -> int:
    return int(kube.get_nodeset(NS, NODESET)["spec"]["replicas"])


def pod_annotations(api: KubeApiProcess, name: str) -> dict[str, str]:
    with httpx.Client(base_url=api.url, timeout=10) as http:
        found = http.get(f"/api/v1/namespaces/{NS}/pods/{name}").raise_for_status().json()
    return dict(found["metadata"].get("annotations") or {})


def test_a_pod_marked_for_a_scale_in_that_never_came_is_unmarked_once_its_node_is_settled_in_training(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """A move to inference that died between marking gpu1's pod first for the scale-in and the
    scale-in itself: the pool settles gpu1 back in training, and its pod is no longer first."""
    kube.update_pod_metadata(NS, "research-train-0", annotations={POD_DELETION_COST: LOWEST_COST, POD_CORDON: "true"})
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    said = mover(kube, slurm).settle("gpu1", to="training", eviction_timeout_seconds=5, **{**ARGS, "grace_seconds": 0})
    assert said == "gpu1 is wholly in training"
    annotations = pod_annotations(api, "research-train-0")
    assert POD_DELETION_COST not in annotations and POD_CORDON not in annotations, annotations


def test_a_move_to_training_tried_again_after_another_nodes_scale_out_scales_out_once(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """inf1's move scales out and fails (no pod there yet); inf2's move scales out too; inf1's
    move tried again scales out no more: one replica each, and inf1 serves once its pod is there."""
    tolerating(api)
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    move = mover(kube, slurm)
    for node in ("inf1", "inf2"):
        with pytest.raises(ClientError, match="waiting for a pod"):
            move.to_training(node, holder="pool-research", partition=NODESET, eviction_timeout_seconds=5)
    assert replicas(kube) == 4

    with pytest.raises(ClientError, match="waiting for a pod"):
        move.settle("inf1", to="training", eviction_timeout_seconds=5, **ARGS)
    assert replicas(kube) == 4  # not 5

    with httpx.Client(base_url=api.url, timeout=10) as http:  # the operator's pod for inf1 arrives
        http.post(f"/api/v1/namespaces/{NS}/pods", json=pod("research-train-2", "inf1")).raise_for_status()
    slurm.nodes_["research-train-2"] = NodeInfo(name="research-train-2", state="idle", partitions=[NODESET])
    assert move.settle("inf1", to="training", eviction_timeout_seconds=5, **ARGS) in (
        "inf1 is wholly in training",
        "inf1 serves training",
    )
    assert replicas(kube) == 4


def test_a_move_to_training_rolled_back_before_its_pod_ran_gives_the_replica_back(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """inf1's move scales out, its pod waits for a node (Pending), and the move fails; the pool
    rolls it back to inference: the NodeSet is scaled back in, so that the Pending pod goes and no
    later move to inference waits behind it. inf2's move stops the same way and inf2 then leaves
    Kubernetes: the same."""
    tolerating(api)
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    move = mover(kube, slurm)
    with pytest.raises(ClientError, match="waiting for a pod"):
        move.to_training("inf1", holder="pool-research", partition=NODESET, eviction_timeout_seconds=5)
    pending(api, "research-train-2")  # the new pod Pending
    said = move.settle("inf1", to="inference", eviction_timeout_seconds=5, **ARGS)
    assert said == "inf1 serves inference"
    assert replicas(kube) == 2
    with httpx.Client(base_url=api.url, timeout=10) as http:  # the operator takes the Pending pod
        http.delete(f"/api/v1/namespaces/{NS}/pods/research-train-2").raise_for_status()
    inf1 = kube.get_node("inf1")
    assert not inf1.unschedulable and not any(t.get("key") == TRAINING_TAINT for t in inf1.taints)

    with pytest.raises(ClientError, match="waiting for a pod"):
        move.to_training("inf2", holder="pool-research", partition=NODESET, eviction_timeout_seconds=5)
    pending(api, "research-train-2")
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.delete("/api/v1/nodes/inf2").raise_for_status()
    with pytest.raises(OutOfPool):
        move.settle("inf2", to="inference", eviction_timeout_seconds=5, **ARGS)
    assert replicas(kube) == 2


def test_a_move_to_training_with_no_nodeset_recorded_and_a_partition_naming_none_says_what_to_set(
    kube: KubernetesApi,
) -> None:
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    with pytest.raises(InvalidInput, match="GPUFLEET_PARTITION='train' names no NodeSet") as refused:
        mover(kube, slurm).to_training("inf1", holder="pool-research", partition="train", eviction_timeout_seconds=5)
    assert "research-train" in str(refused.value)
    assert replicas(kube) == 2


def test_the_pool_keeps_the_last_pod_of_the_partition_though_a_scaled_in_pods_slurm_node_stays_down(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """gpu1 went to inference; its pod's Slurm node stays DOWN (the operator's preStop). The pool's
    look counts gpu2 as the partition's last node: it stays in training."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.delete(f"/api/v1/namespaces/{NS}/pods/research-train-0").raise_for_status()
    kube.update_metadata("gpu1", labels={"gpufleet.io/pool": "inference"})
    slurm.nodes_["research-train-0"] = slurm.node("research-train-0").model_copy(
        update={"state": "down", "reason": PRESTOP}
    )
    activities = PoolActivities(kube, SlinkySlurm(slurm, kube), mover(kube, slurm), None)  # type: ignore[arg-type]
    settings = PoolSettings(name="shared", cluster="research", partition=NODESET)
    view = ActivityEnvironment().run(activities.observe, PoolRequest(settings=settings))
    assert view.training == ["gpu2"]
    assert view.busy.get("gpu2") == f"the last node of partition {NODESET} (Slurm keeps one)"


def test_a_move_to_inference_leaves_a_cordon_that_is_not_a_moves(api: KubeApiProcess, kube: KubernetesApi) -> None:
    """gpu1 cordoned by a person (no training taint): moved to inference, it stays cordoned."""
    kube.set_unschedulable("gpu1", True)
    slurm = SmallSlurm(["research-train-0", "research-train-1"])

    def operator(line: str) -> None:
        if "scaled in to" in line:
            scaled_in(api, slurm, "research-train-0")

    assert mover(kube, slurm).to_inference("gpu1", say=operator, **ARGS) == "gpu1 serves inference"
    assert kube.get_node("gpu1").unschedulable


def test_a_move_to_inference_tried_again_while_its_pod_terminates_still_waits_for_it_to_go(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """The operator deleted gpu1's pod; slurmd is still stopping (the pod terminating, its Slurm
    node not yet DOWN) when the first attempt gives up waiting. The retry must wait on too: gpu1
    is no inference node while the training pod still runs there."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.patch(
            f"/api/v1/namespaces/{NS}/pods/research-train-0",
            json={"metadata": {"finalizers": ["lab.gpufleet.io/kubelet"]}},
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()

    def operator(line: str) -> None:
        if "scaled in to" in line:  # the pod deleted; its kubelet still stopping slurmd
            with httpx.Client(base_url=api.url, timeout=10) as http:
                http.post(
                    f"/api/v1/namespaces/{NS}/pods/research-train-0/eviction",
                    json={"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "research-train-0"}},
                ).raise_for_status()
            set_status(api, replicas=1, ready=1)

    move = mover(kube, slurm)
    with pytest.raises(ClientError, match="the move waits"):
        move.to_inference("gpu1", say=operator, **ARGS)
    still = kube.find_pod(NS, "research-train-0")
    assert still is not None and still.terminating and still.node == "gpu1"
    with pytest.raises(ClientError, match="the move waits"):
        move.to_inference("gpu1", **ARGS)
    assert kube.get_node("gpu1").labels.get("gpufleet.io/pool") == "training"


class PartitionSlurm(SmallSlurm):
    """SmallSlurm that also lists a partition's nodes, as slurmrestd does: every record in it."""

    def partition_nodes(self, partition: str) -> list[str]:
        return [n.name for n in self.nodes_.values() if partition in n.partitions]


def test_the_guard_counts_no_slurm_node_a_pool_move_left_down_in_the_fleet(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """gpu1 moved to inference: its pod's Slurm node stays DOWN (v1.2.1). The breaker's share is
    of the nodes the partition has now: one (gpu2's), not two."""
    slurm = PartitionSlurm(["research-train-0", "research-train-1"])

    def operator(line: str) -> None:
        if "scaled in to" in line:
            scaled_in(api, slurm, "research-train-0")

    assert mover(kube, slurm).to_inference("gpu1", say=operator, **ARGS) == "gpu1 serves inference"
    guard = GuardActivities(SlinkySlurm(slurm, kube), cluster="research", partition=NODESET)  # type: ignore[arg-type]
    assert ActivityEnvironment().run(guard.fleet_size) == 1


def test_a_move_to_inference_rolled_back_after_its_scale_in_leaves_the_node_a_pod_in_training(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """The NodeSet was scaled in for gpu1's pod; the operator has not deleted it yet (its Slurm
    node still draining) when the move is rolled back. gpu1 is said to serve training: the
    NodeSet must still have a replica for it, else the operator takes its pod right after."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    tolerating(api)
    move = mover(kube, slurm)
    with pytest.raises(ClientError, match="the move waits"):
        move.to_inference("gpu1", **ARGS)
    assert replicas(kube) == 1  # scaled in for research-train-0, which still runs on gpu1
    said = move.to_training("gpu1", holder="pool-research", partition=NODESET, eviction_timeout_seconds=5)
    assert said == "gpu1 serves training"
    assert replicas(kube) == 2


def test_a_move_to_inference_leaves_a_cordon_a_person_made_during_the_move(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """A person cordons gpu1 while its move to inference drains it (the training taint is on
    every training node): the move ends with gpu1 serving inference, and still cordoned."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])

    def operator(line: str) -> None:
        if "drained in Slurm" in line:
            kube.set_unschedulable("gpu1", True)
        if "scaled in to" in line:
            scaled_in(api, slurm, "research-train-0")

    kube.add_taint("gpu1", key="gpufleet.io/pool", value="training", effect="NoSchedule")  # as training nodes have
    assert mover(kube, slurm).to_inference("gpu1", say=operator, **ARGS) == "gpu1 serves inference"
    assert kube.get_node("gpu1").unschedulable


def test_a_rolled_back_scale_out_leaves_the_pod_another_nodes_scale_out_waits_for(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """Moves to training scaled research-train out for inf1 and for inf2; one pod waits (Pending,
    on no node), inf2's. inf1's move is rolled back: the waiting pod is inf2's to get, so the
    NodeSet keeps its replicas and only inf1's mark goes."""
    slurm = SmallSlurm(["research-train-0", "research-train-1"])
    pending(api, "research-train-2")
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.patch(
            f"/apis/{API}/namespaces/{NS}/nodesets/{NODESET}",
            json={"metadata": {"annotations": {SCALED_OUT_ANNOTATION: '["inf1@a","inf2@b"]'}}, "spec": {"replicas": 3}},
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()
    kube.update_metadata("inf1", annotations={"gpufleet.io/pool-nodesets": json.dumps([f"{NS}/{NODESET}"])})

    assert mover(kube, slurm).to_inference("inf1", **ARGS) == "inf1 serves inference"
    assert replicas(kube) == 3
    assert kube.get_nodeset(NS, NODESET)["metadata"]["annotations"][SCALED_OUT_ANNOTATION] == '["inf2@b"]'
