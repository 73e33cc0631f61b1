"""The lab's NodeSet controller (lab/operator.py) between the emulated API and real Slurm 26.05
dynamic nodes, each behaviour named after the section of slurm-operator v1.2.1's
docs/concepts/nodeset-controller.md or docs/usage/nodeset-operations.md it follows; and its
decisions on their own."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from lab.dynamic import PRESTOP_REASON, DynamicSlurmLab
from lab.kubeapi import node_object
from lab.operator import (
    CORDONED_BY,
    NODE_CORDON_REASON,
    POD_CORDON,
    POD_DELETION_COST,
    POD_PROTECT,
    condemned,
    cordon_action,
    is_busy,
    is_drained,
    pin_affinity,
    pinned_node,
    place,
    slurm_conditions,
)
from lab.operator import start as start_operator
from lab.procs import wait_for
from lab.slurmroots import root_unavailable
from models.incident import NodeInfo
from models.slinky import API
from tests.conftest import KubeApiProcess

RELEASE = "26.05"
NS = "slurm"
MERGE = {"Content-Type": "application/merge-patch+json"}
SLURM_NODES = ["k1", "k2", "k3"]
BY_HAND = "slurm-operator: by hand"

# How long Slurm may take to mark a stopped slurmd's node DOWN (its SlurmdTimeout, and a ping).
SLURMD_GONE_TIMEOUT = 60


def _node(name: str, pool: str) -> dict[str, Any]:
    return node_object(name, pool=pool)


def _nodeset(name: str, replicas: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "NodeSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "controllerRef": {"name": "research"},
            "replicas": replicas,
            "template": {"spec": {"nodeSelector": {"gpufleet.io/pool": "slurm"}}},
            **spec,
        },
    }


@dataclass
class Env:
    http: httpx.Client
    cluster: DynamicSlurmLab
    log: Path

    def pod(self, name: str) -> dict[str, Any]:
        response = self.http.get(f"/api/v1/namespaces/{NS}/pods/{name}")
        response.raise_for_status()
        pod: dict[str, Any] = response.json()
        return pod

    def pods(self) -> dict[str, dict[str, Any]]:
        items = self.http.get(f"/api/v1/namespaces/{NS}/pods").raise_for_status().json()["items"]
        return {p["metadata"]["name"]: p for p in items}

    def patch(self, path: str, body: dict[str, Any]) -> None:
        self.http.patch(path, json=body, headers=MERGE).raise_for_status()

    def cordon(self, node: str, on: bool) -> None:
        self.patch(f"/api/v1/nodes/{node}", {"spec": {"unschedulable": on or None}})

    def evict(self, pod: str, *, dry_run: bool = False) -> httpx.Response:
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": NS}}
        params = {"dryRun": "All"} if dry_run else {}
        return self.http.post(f"/api/v1/namespaces/{NS}/pods/{pod}/eviction", json=body, params=params)

    def slurm(self, name: str) -> NodeInfo:
        return self.cluster.client().node(name)

    def start_time(self, name: str) -> str:
        out = self.cluster.scontrol("show", "-o", "node", name)
        return out.split("SlurmdStartTime=")[1].split()[0]


def conditions(pod: dict[str, Any]) -> dict[str, str]:
    """The pod's True SlurmNodeState* conditions: type (prefix dropped) -> message."""
    return {
        c["type"].removeprefix("SlurmNodeState"): c.get("message", "")
        for c in (pod.get("status") or {}).get("conditions") or []
        if c["type"].startswith("SlurmNodeState") and c.get("status") == "True"
    }


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The emulated API (k1-k3 for Slurm, k4 another pool, k5 Slurm's but tainted), a 26.05
    cluster with the NodeSets ``slinky`` and ``pinned``, and the operator running between them."""
    if root_unavailable(RELEASE):
        pytest.skip(root_unavailable(RELEASE))
    base = tmp_path_factory.mktemp("operator")
    tainted = _node("k5", "slurm")
    tainted["spec"]["taints"] = [{"key": "maintenance", "value": "bios", "effect": "NoSchedule"}]
    seed: dict[str, object] = {
        "nodes": [*(_node(n, "slurm") for n in SLURM_NODES), _node("k4", "other"), tainted],
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
    }
    api = KubeApiProcess(base / "kube", seed)
    cluster = DynamicSlurmLab(base / "slurm", ("slinky", "pinned"), release=RELEASE)
    operator: subprocess.Popen[bytes] | None = None
    log = base / "operator.log"
    try:
        cluster.start(timeout=60)
        with httpx.Client(base_url=api.url, timeout=10) as http:
            for body in (_nodeset("slinky", 2), _nodeset("pinned", 1, pinToNode=True)):
                http.post(f"/apis/{API}/namespaces/{NS}/nodesets", json=body).raise_for_status()
            ready = base / "operator.ready"
            operator = start_operator(api.url, cluster, ready_file=ready, log=log)
            wait_for(ready.exists, timeout=20, what="the operator to start")
            yield Env(http, cluster, log)
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=20)
        cluster.stop()
        api.stop()


def _idle(env: Env, name: str) -> bool:
    return name in env.cluster.nodes() and env.slurm(name).state == "idle"


def _running_on(env: Env, name: str) -> str | None:
    pod = env.pods().get(name)
    if pod is None or (pod.get("status") or {}).get("phase") != "Running":
        return None
    node: str | None = pod["spec"].get("nodeName")
    return node


# -- end to end, against real Slurm 26.05 --------------------------------------------------------


def test_statefulset_mode_pods_on_eligible_nodes_each_with_its_slurmd(env: Env) -> None:
    """Node Identity > StatefulSet Mode: ``<nodeset>-<ordinal>`` pods on the nodes the template
    selects, cordon-free and with no taint it does not tolerate; a slurmd per pod, its name."""
    for name in ("slinky-0", "slinky-1", "pinned-0"):
        wait_for(functools.partial(_idle, env, name), timeout=30, what=f"{name} registered and idle")
    pods = env.pods()
    assert {p for p in pods} == {"slinky-0", "slinky-1", "pinned-0"}
    for name, pod in pods.items():
        assert pod["spec"]["nodeName"] in SLURM_NODES  # never k4 (other pool) nor k5 (tainted)
        assert pod["spec"]["hostname"] == name and pod["status"]["phase"] == "Running"
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "NodeSet"
    assert pods["slinky-0"]["spec"]["nodeName"] != pods["slinky-1"]["spec"]["nodeName"]  # spread
    assert env.slurm("slinky-0").partitions == ["slinky"]


def test_slurm_node_states_become_pod_conditions(env: Env) -> None:
    """Slurm Node State Visibility: the base state and each flag as a True ``SlurmNodeState*``
    condition; the Drain condition's message is the drain reason."""
    wait_for(lambda: conditions(env.pod("slinky-0")) == {"Idle": ""}, timeout=15, what="slinky-0 Idle")
    env.cluster.scontrol("update", "nodename=slinky-0", "state=drain", f"reason={BY_HAND}")
    wait_for(
        lambda: (
            conditions(env.pod("slinky-0")) == {"Idle": "slurm-operator: by hand", "Drain": "slurm-operator: by hand"}
        ),
        timeout=15,
        what="slinky-0's Drain condition",
    )
    # The operator's own reason, and slinky-0 not cordoned: the operator undrains it.
    wait_for(lambda: conditions(env.pod("slinky-0")) == {"Idle": ""}, timeout=15, what="slinky-0 undrained")


def _job(env: Env, tmp: Path, node: str, partition: str = "slinky") -> int:
    script = tmp / f"job-{node}.sh"
    script.write_text("#!/bin/sh\nexec sleep 300\n")
    return env.cluster.sbatch(script, "-p", partition, "-w", node, "-o", "/dev/null")


def _scancel(env: Env, job_id: int) -> None:
    subprocess.run(env.cluster.argv(["scancel", str(job_id)]), env=env.cluster.env, check=True, timeout=30)


def test_a_busy_pod_is_protected_from_eviction(env: Env, tmp_path: Path) -> None:
    """Workload Disruption Protection: a busy pod carries ``pod-protect``, the workers' PDB
    selects it and refuses its eviction; once idle the label goes and eviction is allowed."""
    pdb = env.http.get(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/slurm-workers-pdb-research").json()
    assert pdb["spec"]["selector"]["matchLabels"] == {POD_PROTECT: "true", "slinky.slurm.net/cluster": "research"}
    job_id = _job(env, tmp_path, "slinky-1")
    pod = wait_for(
        lambda: (p := env.pod("slinky-1"))["metadata"]["labels"].get(POD_PROTECT) == "true" and p,
        timeout=20,
        what="slinky-1 protected",
    )
    assert "Allocated" in conditions(pod) and "Idle" not in conditions(pod)
    refused = env.evict("slinky-1")
    assert refused.status_code == 429 and "disruption budget" in refused.json()["message"]
    _scancel(env, job_id)
    wait_for(lambda: POD_PROTECT not in env.pod("slinky-1")["metadata"]["labels"], timeout=20, what="protection lifted")
    assert conditions(env.pod("slinky-1")) == {"Idle": ""}
    assert env.evict("slinky-1", dry_run=True).status_code == 201


def test_the_pod_cordon_annotation_drains_its_node(env: Env) -> None:
    """Cordoning Pods: ``pod-cordon=true`` drains the pod's Slurm node; removing it undrains."""
    env.patch(f"/api/v1/namespaces/{NS}/pods/slinky-1", {"metadata": {"annotations": {POD_CORDON: "true"}}})
    reason = f"slurm-operator: Pod ({NS}/slinky-1) was cordoned"
    wait_for(lambda: env.slurm("slinky-1").reason == reason, timeout=15, what="slinky-1 drained")
    assert "DRAIN" in env.slurm("slinky-1").flags
    wait_for(lambda: conditions(env.pod("slinky-1")).get("Drain") == reason, timeout=15, what="Drain condition")
    env.patch(f"/api/v1/namespaces/{NS}/pods/slinky-1", {"metadata": {"annotations": {POD_CORDON: None}}})
    wait_for(lambda: "DRAIN" not in env.slurm("slinky-1").flags, timeout=15, what="slinky-1 undrained")


def test_a_cordoned_node_drains_its_pods_nodes_with_its_reason(env: Env) -> None:
    """Drain and Cordon Design, Custom Drain Reasons > Override with Node Annotation: cordoning
    the Kubernetes node cordons its NodeSet pods and drains their Slurm nodes with
    ``slurm-operator: <node-cordon-reason>``; uncordoning undoes both."""
    node = env.pod("slinky-1")["spec"]["nodeName"]
    env.patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {NODE_CORDON_REASON: "GPU ECC error detected"}}})
    env.cordon(node, True)
    wait_for(
        lambda: env.slurm("slinky-1").reason == "slurm-operator: GPU ECC error detected",
        timeout=15,
        what="slinky-1 drained for its node",
    )
    assert env.pod("slinky-1")["metadata"]["annotations"][POD_CORDON] == "true"
    env.cordon(node, False)
    env.patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {NODE_CORDON_REASON: None}}})
    wait_for(lambda: "DRAIN" not in env.slurm("slinky-1").flags, timeout=15, what="slinky-1 undrained")
    wait_for(
        lambda: POD_CORDON not in (env.pod("slinky-1")["metadata"].get("annotations") or {}),
        timeout=15,
        what="slinky-1 uncordoned",
    )


def _passes(env: Env) -> None:
    """Returns once the operator has made a whole pass that began after the call: ``slinky-0``'s
    pod-cordon set and removed, seen through Slurm and then through the pod's conditions."""
    path = f"/api/v1/namespaces/{NS}/pods/slinky-0"
    env.patch(path, {"metadata": {"annotations": {POD_CORDON: "true"}}})
    wait_for(lambda: "DRAIN" in env.slurm("slinky-0").flags, timeout=15, what="the probe's drain")
    env.patch(path, {"metadata": {"annotations": {POD_CORDON: None}}})
    # Pod conditions are written last in a pass, from Slurm as it was when the pass began.
    wait_for(lambda: "Drain" not in conditions(env.pod("slinky-0")), timeout=15, what="the probe's undrain")


def test_an_external_drain_is_never_changed(env: Env) -> None:
    """External Drain Preservation: a reason without ``slurm-operator:`` is left as it is, by a
    cordon and by an uncordon; the pod is not cordoned for it."""
    reason = "gpufleet: xid 79 incident op-1"
    env.cluster.scontrol("update", "nodename=slinky-1", "state=drain", f"reason={reason}")
    node = env.pod("slinky-1")["spec"]["nodeName"]
    for cordoned in (True, False):
        env.cordon(node, cordoned)
        _passes(env)
        current = env.slurm("slinky-1")
        assert "DRAIN" in current.flags and current.reason == reason
        assert POD_CORDON not in (env.pod("slinky-1")["metadata"].get("annotations") or {})
        assert conditions(env.pod("slinky-1")).get("Drain") == reason
    env.cluster.scontrol("update", "nodename=slinky-1", "state=resume")


def test_an_evicted_pod_comes_back_under_its_name_on_another_node(env: Env) -> None:
    """Node Identity > StatefulSet Mode: evicted from a cordoned node, ``slinky-0`` is recreated
    under its name on another eligible node; its slurmd restarts through the preStop hook and
    registers again under the same name, and, no longer cordoned, its node is undrained."""
    before = env.pod("slinky-0")
    node = before["spec"]["nodeName"]
    started = env.start_time("slinky-0")
    env.cordon(node, True)
    wait_for(lambda: "DRAIN" in env.slurm("slinky-0").flags, timeout=15, what="slinky-0 drained")
    assert env.evict("slinky-0").status_code == 201
    after = wait_for(
        lambda: (p := env.pods().get("slinky-0")) and p["metadata"]["uid"] != before["metadata"]["uid"] and p,
        timeout=15,
        what="slinky-0 recreated",
    )
    assert after["spec"]["nodeName"] in set(SLURM_NODES) - {node}
    wait_for(lambda: env.start_time("slinky-0") > started, timeout=30, what="slinky-0's slurmd restarted")
    wait_for(lambda: (n := env.slurm("slinky-0")).state == "idle" and not n.flags, timeout=20, what="slinky-0 back")
    assert "slinky-0" in env.cluster.nodes() and env.cluster.running("slinky-0")
    env.cordon(node, False)


def test_a_pinned_pod_comes_back_to_its_node_until_it_no_longer_matches(env: Env) -> None:
    """Node Pinning: ``status.ordinalToNode`` records the node; the recreated pod returns there,
    stays Pending while that node is unavailable, and goes elsewhere once the node no longer
    matches the template."""
    nodeset_path = f"/apis/{API}/namespaces/{NS}/nodesets/pinned"
    node = env.pod("pinned-0")["spec"]["nodeName"]
    assert wait_for(
        lambda: env.http.get(nodeset_path).json()["status"].get("ordinalToNode"), timeout=10, what="the pin"
    ) == {"0": node}

    env.cordon(node, True)
    env.http.delete(f"/api/v1/namespaces/{NS}/pods/pinned-0").raise_for_status()
    pending = wait_for(lambda: env.pods().get("pinned-0"), timeout=10, what="pinned-0 recreated")
    assert not pending["spec"].get("nodeName") and pending["status"]["phase"] == "Pending"
    wait_for(lambda: not env.cluster.running("pinned-0"), timeout=20, what="pinned-0's slurmd stopped")
    env.cordon(node, False)
    assert wait_for(lambda: _running_on(env, "pinned-0"), timeout=10, what="pinned-0 bound") == node
    wait_for(lambda: env.cluster.running("pinned-0"), timeout=20, what="pinned-0's slurmd started")

    env.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {"gpufleet.io/pool": "other"}}})
    env.http.delete(f"/api/v1/namespaces/{NS}/pods/pinned-0").raise_for_status()
    moved = wait_for(lambda: (n := _running_on(env, "pinned-0")) and n != node and n, timeout=10, what="moved")
    wait_for(
        lambda: env.http.get(nodeset_path).json()["status"]["ordinalToNode"] == {"0": moved},
        timeout=5,
        what="the pin moved",
    )
    wait_for(lambda: env.slurm("pinned-0").state == "idle", timeout=30, what="pinned-0 idle on its new node")
    env.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {"gpufleet.io/pool": "slurm"}}})


def test_scale_in_drains_first_and_deletes_once_drained(env: Env, tmp_path: Path) -> None:
    """Scale-in Lifecycle, Influencing Scale-in Order: the pod with the lowest
    ``pod-deletion-cost`` goes (not the highest ordinal); its node is drained and the pod kept
    while its job runs, deleted once drained. As v1.2.1 in StatefulSet mode, its Slurm node stays,
    DOWN by the preStop hook, and a later scale-out's pod of that name registers under it again."""
    nodeset_path = f"/apis/{API}/namespaces/{NS}/nodesets/slinky"
    env.patch(nodeset_path, {"spec": {"replicas": 3}})
    wait_for(
        lambda: "slinky-2" in env.cluster.nodes() and env.slurm("slinky-2").state == "idle", timeout=30, what="slinky-2"
    )
    env.patch(f"/api/v1/namespaces/{NS}/pods/slinky-0", {"metadata": {"annotations": {POD_DELETION_COST: "-100"}}})
    job_id = _job(env, tmp_path, "slinky-0")
    wait_for(lambda: env.slurm("slinky-0").state == "allocated", timeout=20, what="the job on slinky-0")

    env.patch(nodeset_path, {"spec": {"replicas": 2}})
    reason = f"slurm-operator: Pod ({NS}/slinky-0) is pending termination for scale-in"
    wait_for(lambda: env.slurm("slinky-0").reason == reason, timeout=15, what="slinky-0 draining")
    pod = wait_for(lambda: (p := env.pod("slinky-0")) and "Drain" in conditions(p) and p, timeout=15, what="cond")
    assert is_busy(pod["status"]["conditions"]) and not is_drained(pod["status"]["conditions"])  # Draining
    assert pod["metadata"]["annotations"][POD_CORDON] == "true"
    assert set(env.pods()) == {"slinky-0", "slinky-1", "slinky-2", "pinned-0"}  # kept while busy

    _scancel(env, job_id)
    wait_for(lambda: "slinky-0" not in env.pods(), timeout=20, what="slinky-0 deleted")
    assert set(env.pods()) == {"slinky-1", "slinky-2", "pinned-0"}
    wait_for(lambda: not env.cluster.running("slinky-0"), timeout=20, what="slinky-0's slurmd stopped")
    # The record stays (v1.2.1 prunes none in StatefulSet mode), DOWN by the preStop hook: Slurm
    # may show it IDLE+DRAIN for a moment, until it sees the slurmd gone.
    left = wait_for(
        lambda: (node := env.slurm("slinky-0")).state.startswith("down") and node,
        timeout=SLURMD_GONE_TIMEOUT,
        what="slinky-0 DOWN by its preStop hook",
    )
    assert left.reason.startswith(PRESTOP_REASON), left

    env.patch(nodeset_path, {"spec": {"replicas": 3}})
    wait_for(lambda: "slinky-0" in env.pods(), timeout=20, what="slinky-0 again")
    wait_for(lambda: env.slurm("slinky-0").state == "idle", timeout=30, what="slinky-0 registered again, idle")


# -- the decisions, without Slurm ----------------------------------------------------------------


def _pod(
    name: str,
    *,
    node: str = "k1",
    phase: str = "Running",
    ready: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": annotations or {}, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_scale_in_order_follows_the_documented_sort() -> None:
    """Influencing Scale-in Order: unassigned, Pending, not ready, lower cost, earlier deadline,
    cordoned, higher ordinal."""

    def names(pods: list[dict[str, Any]], replicas: int) -> list[str]:
        return [p["metadata"]["name"] for p in condemned(pods, replicas)]

    plain = [_pod(f"s-{i}") for i in range(4)]
    assert names(plain, 2) == ["s-3", "s-2"]
    assert names([*plain[:3], _pod("s-3", node="")], 3) == ["s-3"]
    assert names([_pod("s-0", phase="Pending"), _pod("s-1")], 1) == ["s-0"]
    assert names([_pod("s-0", ready=False), _pod("s-1")], 1) == ["s-0"]
    cost = {POD_DELETION_COST: "-5"}
    cordon = {POD_CORDON: "true"}
    assert names([_pod("s-0", annotations=cost), _pod("s-1"), _pod("s-2", annotations=cordon)], 1) == ["s-0", "s-2"]
    assert names([_pod("s-0", annotations=cordon), _pod("s-1"), _pod("s-2")], 2) == ["s-0"]
    deadline = "nodeset.slinky.slurm.net/pod-deadline"
    early = _pod("s-0", annotations={deadline: "2026-01-01T00:00:00Z"})
    late = _pod("s-1", annotations={deadline: "2027-01-01T00:00:00Z"})
    assert names([late, early], 1) == ["s-0"]
    # The cost weighs before the cordon.
    assert names([_pod("s-0", annotations=cordon), _pod("s-1", annotations=cost)], 1) == ["s-1"]


def test_slurm_states_map_to_the_documented_conditions() -> None:
    """Slurm Node State Visibility's tables and conceptual states."""
    draining = NodeInfo(name="n", state="mixed", flags=["DRAIN", "COMPLETING"], reason="slurm-operator: x")
    conds = slurm_conditions(draining)
    assert [c["type"] for c in conds] == ["SlurmNodeStateMixed", "SlurmNodeStateCompleting", "SlurmNodeStateDrain"]
    assert {c["message"] for c in conds} == {"slurm-operator: x"} and {c["status"] for c in conds} == {"True"}
    assert is_busy(conds) and not is_drained(conds)
    drained = slurm_conditions(NodeInfo(name="n", state="idle", flags=["DRAIN"], reason="r"))
    assert is_drained(drained) and not is_busy(drained)
    flags = ["NOT_RESPONDING", "FAIL", "MAINT", "INVALID_REG", "UNDRAIN", "DRAIN"]
    odd = slurm_conditions(NodeInfo(name="n", state="down", flags=flags))
    assert {c["type"].removeprefix("SlurmNodeState") for c in odd} == {
        "Down",
        "NotResponding",
        "Fail",
        "Maintenance",
        "InvalidReg",
        "Undrain",
        "Drain",
    }
    assert not is_drained(odd)  # Undrain set
    assert slurm_conditions(None) == []


def test_cordon_decisions_follow_the_flowchart() -> None:
    """Drain and Cordon Design: external reason or unresponsive first, then node cordon, then pod cordon."""

    def act(**given: Any) -> str:
        return cordon_action(
            **{"node_cordoned": False, "pod_cordoned": False, "reason": "", "unresponsive": False, **given}
        )

    assert act() == "undrain"
    assert act(node_cordoned=True) == "cordon"
    assert act(pod_cordoned=True) == "drain"
    assert act(node_cordoned=True, reason="admin: bad dimm") == "keep"
    assert act(reason="slurm-operator: Pod is terminating") == "undrain"
    assert act(node_cordoned=True, unresponsive=True) == "keep"
    assert act(reason=PRESTOP_REASON, pod_cordoned=True) == "drain"
    assert CORDONED_BY.startswith("lab.gpufleet.io/")


def test_pins_hold_until_the_node_is_gone_or_no_longer_matches() -> None:
    """Node Pinning: the pinned node while it exists and matches; affinity keeps the pod there."""
    spec = {"nodeSelector": {"gpufleet.io/pool": "slurm"}}
    nodes = [_node("k1", "slurm"), _node("k2", "slurm"), _node("k3", "other")]
    assert pinned_node("k2", nodes, spec) == "k2"
    assert pinned_node("k3", nodes, spec) is None  # no longer matches
    assert pinned_node("gone", nodes, spec) is None
    pinned = pin_affinity(spec, "k2")
    assert place(nodes, pinned, {"k2": 5}) == "k2"
    assert place(nodes, spec, {"k1": 1}) == "k2"
    nodes[1]["spec"]["unschedulable"] = True
    assert place(nodes, pinned, {}) is None  # Pending until k2 comes back
