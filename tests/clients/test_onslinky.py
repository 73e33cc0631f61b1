"""Remediation on Slinky (clients/onslinky.py) against the emulated Kubernetes API, over HTTP:
which Slurm nodes a Kubernetes node stands for, the drain of a node hosting NodeSet pods, and the
spare pool that makes a spare eligible for the failed node's NodeSets.

No Slurm runs here. The mapping and combining logic is checked over a small in-memory Slurm
(``MemorySlurm``) and nothing else; the pool and the drain never ask Slurm anything on the paths
tested here, so they get a real slurmrestd client pointed where nothing listens (a call would
fail). What Slurm itself does is tested against real daemons in test_onslinky_requeue.py.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.errors import ClientError, InvalidInput, NotFound, NotOwned, Unavailable
from clients.kube import KubernetesApi
from clients.nodesets import ELIGIBLE_ANNOTATION, NODE_CORDON_REASON, POD_HOSTNAME, POD_PROTECT, NodeSets
from clients.onslinky import (
    SCALED_IN_ANNOTATION,
    SLURM_NODES_ANNOTATION,
    PodStillProtected,
    SlinkyDrain,
    SlinkyPool,
    SlinkySlurm,
    SlurmNodesOf,
    combined,
    marks,
    slinky_unsupported,
    with_mark,
)
from clients.slinkymoves import SlinkyPoolMover
from clients.slurmrest_protocol import SlurmRest
from lab.kubeapi import node_object
from models.constants import (
    CLAIM_LABEL,
    CLAIMED_BY_ANNOTATION,
    INCIDENT_ANNOTATION,
    NODE_LEASE_ANNOTATION,
    POOL_LABEL,
    QUARANTINE_LABEL,
    RETIRED_TAINT,
    UNHEALTHY_TAINT,
    drain_reason,
)
from models.incident import JobInfo, NodeInfo
from models.slinky import API
from tests.conftest import KubeApiProcess

NS = "slurm-research"
NODESET = "research-train"
SELECTOR = {"research.example/nodeset": "train", "research.example/gpu": "h100"}
INC = "research-gpu1-20260101T000000Z"
OURS = drain_reason(event="xid 79", action="REPLACE_NODE", incident_id=INC)
OPS = "ops: PSU swap"
NO_PARTITION = "no partition is edited on Slinky"
# What a claim says while the failed node's pods are not back (it is tried again).
BACK_YET = "not back on a node of their NodeSet yet"
WAITING = "claimed, waiting for the pods"


def _node(name: str, pool: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    node = node_object(name, pool=pool)
    node["metadata"]["labels"].update(labels or {})
    return node


def nodeset_pod(name: str, node: str, *, protect: bool = False, hostname: str = "") -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "slurmd", "slinky.slurm.net/cluster": "research"}
    if protect:
        labels[POD_PROTECT] = "true"
    if hostname:
        labels[POD_HOSTNAME] = hostname
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": labels,
            "ownerReferences": [
                {"apiVersion": API, "kind": "NodeSet", "name": NODESET, "uid": "u", "controller": True}
            ],
        },
        "spec": {"nodeName": node, "hostname": hostname or name, "containers": [{"name": "slurmd", "image": "slurmd"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    """gpu1 hosts two Slurm nodes of research-train (the second with a hostname of its own,
    train-b1) beside a pod of no NodeSet; gpu2 hosts a busy one (pod-protect, under the
    PodDisruptionBudget); gpu1 and gpu2 carry the NodeSet's selector since the cluster was made
    (no record of gpufleet's); spare1 and spare2 are free spares."""
    seed: dict[str, object] = {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
        "nodes": [
            _node("gpu1", "training", SELECTOR),
            _node("gpu2", "training", SELECTOR),
            _node("spare1", "spare"),
            _node("spare2", "spare"),
        ],
        "pods": [
            nodeset_pod("research-train-0", "gpu1"),
            nodeset_pod("research-train-1", "gpu1", hostname="train-b1"),
            nodeset_pod("research-train-2", "gpu2", protect=True),
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
    body = {
        "apiVersion": API,
        "kind": "NodeSet",
        "metadata": {"name": NODESET, "namespace": NS},
        "spec": {
            "controllerRef": {"name": "research"},
            "replicas": 3,
            "template": {"spec": {"nodeSelector": SELECTOR}},
        },
    }
    with httpx.Client(base_url=process.url, timeout=10) as http:
        http.post(f"/apis/{API}/namespaces/{NS}/nodesets", json=body).raise_for_status()
    yield process
    process.stop()


@pytest.fixture
def kube(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)


def recreate(api: KubeApiProcess, name: str, node: str, **options: Any) -> None:
    """What the operator does for an evicted pod: the same name again, on ``node``."""
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.post(f"/api/v1/namespaces/{NS}/pods", json=nodeset_pod(name, node, **options)).raise_for_status()


def recorded(kube: KubernetesApi, node: str) -> list[dict[str, str]]:
    raw = kube.get_node(node).annotations.get(SLURM_NODES_ANNOTATION)
    return json.loads(raw)["pods"] if raw else []


def eligibility(kube: KubernetesApi, node: str) -> dict[str, Any]:
    raw = kube.get_node(node).annotations.get(ELIGIBLE_ANNOTATION)
    return json.loads(raw) if raw else {}


def selector_labels(kube: KubernetesApi, node: str) -> dict[str, str]:
    labels = kube.get_node(node).labels
    return {k: v for k, v in labels.items() if k in SELECTOR}


# -- an in-memory Slurm, for the mapping and combining logic only ----------------------------------


class MemorySlurm:
    """Slurm nodes in a dict, and the calls made. A drain keeps someone else's drain, as every
    real client does; resume records the name."""

    def __init__(self, nodes: dict[str, NodeInfo], *, on_drain: Any = None) -> None:
        self.nodes_ = nodes
        self.calls: list[tuple[str, str]] = []
        self._on_drain = on_drain

    def node(self, name: str) -> NodeInfo:
        if name not in self.nodes_:
            raise NotFound(f"Slurm has no node named {name!r}")
        return self.nodes_[name]

    def drain(self, name: str, *, reason: str) -> NodeInfo:
        if self._on_drain is not None:
            self._on_drain(name)
        self.calls.append(("drain", name))
        current = self.node(name)
        if not current.drained:
            self.nodes_[name] = current.model_copy(update={"flags": [*current.flags, "DRAIN"], "reason": reason})
        return self.nodes_[name]

    def resume(self, name: str) -> None:
        self.calls.append(("resume", name))

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        self.calls.append(("jobs_on_node", name))
        return [JobInfo(job_id=7, state="RUNNING", nodes="research-train-0,train-b1")]


def idle(name: str, partition: str = NODESET) -> NodeInfo:
    return NodeInfo(name=name, state="idle", partitions=[partition])


def drained(name: str, reason: str, *, state: str = "idle", partition: str = NODESET) -> NodeInfo:
    return NodeInfo(name=name, state=state, flags=["DRAIN"], reason=reason, partitions=[partition])


def on_slinky(kube: KubernetesApi, nodes: dict[str, NodeInfo]) -> tuple[SlinkySlurm, MemorySlurm]:
    memory = MemorySlurm(nodes)
    return SlinkySlurm(memory, kube), memory  # type: ignore[arg-type]


def nowhere(kube: KubernetesApi) -> SlinkySlurm:
    """A SlinkySlurm whose slurmrestd is not there: any Slurm call fails (Unavailable)."""
    return SlinkySlurm(SlurmRest("http://127.0.0.1:1", version="v0.0.44", token_file=Path("/nonexistent")), kube)


# -- which Slurm nodes a Kubernetes node stands for ------------------------------------------------


def test_a_kubernetes_node_stands_for_its_nodeset_pods_slurm_nodes(kube: KubernetesApi) -> None:
    slinky, _ = on_slinky(kube, {})
    # research-train-1's Slurm node is its pod-hostname label; the exporter is no NodeSet's.
    assert slinky.slurm_nodes("gpu1") == ["research-train-0", "train-b1"]
    assert slinky.slurm_nodes("gpu2") == ["research-train-2"]
    assert [p.nodeset.key for p in SlurmNodesOf(kube).pods("gpu1")] == [f"{NS}/{NODESET}"] * 2


def test_a_name_that_hosts_no_nodeset_pod_is_a_slurm_nodes_own(kube: KubernetesApi) -> None:
    slinky, memory = on_slinky(kube, {"research-train-0": drained("research-train-0", OURS)})
    assert slinky.slurm_nodes("research-train-0") == ["research-train-0"]  # no Kubernetes node of that name
    assert slinky.slurm_nodes("spare1") == ["spare1"]  # a Kubernetes node hosting none
    assert slinky.node("research-train-0") == drained("research-train-0", OURS)  # asked as it is
    with pytest.raises(InvalidInput):
        slinky.slurm_nodes("gpu1;reboot")
    assert memory.calls == []


def test_the_slurm_nodes_are_recorded_on_the_node_before_any_is_drained_and_known_after_they_left(
    kube: KubernetesApi,
) -> None:
    seen: list[list[dict[str, str]]] = []
    memory = MemorySlurm(
        {"research-train-0": idle("research-train-0"), "train-b1": idle("train-b1")},
        on_drain=lambda _: seen.append(recorded(kube, "gpu1")),
    )
    slinky = SlinkySlurm(memory, kube)  # type: ignore[arg-type]

    after = slinky.drain("gpu1", reason=OURS)

    assert memory.calls == [("drain", "research-train-0"), ("drain", "train-b1")]
    names = [[p["name"] for p in record] for record in seen]
    assert names == [["research-train-0", "research-train-1"]] * 2  # there before the first drain
    assert [p["slurm_node"] for p in seen[0]] == ["research-train-0", "train-b1"]
    assert (after.name, after.drained, after.reason) == ("gpu1", True, OURS)
    # The pods evicted (the operator brings them back elsewhere): gpu1 still stands for them.
    nodesets = NodeSets(kube)
    for pod in nodesets.nodeset_pods_on("gpu1"):
        assert nodesets.evict_nodeset_pod(pod).outcome == "evicted"
    assert nodesets.nodeset_pods_on("gpu1") == []
    assert slinky.slurm_nodes("gpu1") == ["research-train-0", "train-b1"]
    assert [job.job_id for job in slinky.jobs_on_node("gpu1")] == [7]  # the union, once
    assert ("jobs_on_node", "train-b1") in memory.calls


def test_an_unreadable_record_is_an_error_naming_the_annotation(kube: KubernetesApi) -> None:
    kube.update_metadata("spare1", annotations={SLURM_NODES_ANNOTATION: "not json"})
    slinky, _ = on_slinky(kube, {})
    with pytest.raises(ClientError, match=SLURM_NODES_ANNOTATION):
        slinky.slurm_nodes("spare1")


def test_combined_says_what_the_one_saying_most_says() -> None:
    ours, theirs = drained("a", OURS), drained("b", OPS, partition="debug")
    failing = NodeInfo(name="c", state="down", flags=["NOT_RESPONDING"], reason="Not responding")
    busy = NodeInfo(name="d", state="allocated", flags=["COMPLETING"], partitions=["train"])

    both = combined("gpu1", [ours, busy, theirs])
    assert (both.name, both.reason, both.drained) == ("gpu1", OPS, True)  # someone else's hold first
    assert both.partitions == ["debug", NODESET, "train"]
    assert both.flags == ["DRAIN", "COMPLETING"]
    assert combined("gpu1", [failing, ours]).reason == OURS  # gpufleet's drain over Slurm's own failure
    assert combined("gpu1", [busy, failing]).state == "down"  # any DOWN over a node in service
    assert combined("gpu1", [busy]).state == "allocated"


def test_the_node_of_a_kubernetes_node_is_its_slurm_nodes_combined(kube: KubernetesApi) -> None:
    slinky, _ = on_slinky(
        kube, {"research-train-0": drained("research-train-0", OURS), "train-b1": drained("train-b1", OPS)}
    )
    node = slinky.node("gpu1")
    assert (node.name, node.reason) == ("gpu1", OPS)

    slinky, _ = on_slinky(kube, {})  # pods there, but their slurmd not registered yet
    with pytest.raises(NotFound, match="research-train-0, train-b1"):
        slinky.node("gpu1")


def test_resume_resumes_only_the_slurm_nodes_gpufleet_took_out(kube: KubernetesApi) -> None:
    slinky, memory = on_slinky(
        kube, {"research-train-0": drained("research-train-0", OURS), "train-b1": drained("train-b1", OPS)}
    )
    slinky.resume("gpu1")
    assert memory.calls == [("resume", "research-train-0")]


def test_partition_edits_are_refused_saying_why(kube: KubernetesApi) -> None:
    slinky, memory = on_slinky(kube, {})
    for edit in (slinky.add_to_partition, slinky.remove_from_partition):
        with pytest.raises(InvalidInput, match=NO_PARTITION) as refused:
            edit(NODESET, "research-train-0")
        assert "slurm-operator makes each NodeSet's partition" in str(refused.value)
    pool = SlinkyPool(kube=kube, slurm=slinky, partition=NODESET, cluster="research")
    with pytest.raises(InvalidInput, match=NO_PARTITION):
        pool.add_to_partition("spare1")
    assert memory.calls == []
    # What a worker checks at start: both edits refused on every backend, requeue served by DOWN
    # where the API has no requeue but can set a node DOWN.
    v44 = SlurmRest("http://127.0.0.1:1", version="v0.0.44", token_file=Path("/nonexistent"))
    lacking = slinky_unsupported(v44)
    assert set(lacking) == {"add_to_partition", "remove_from_partition"}
    assert NO_PARTITION in lacking["add_to_partition"]
    v38 = SlurmRest("http://127.0.0.1:1", version="v0.0.38", token_file=Path("/nonexistent"))
    assert "requeue" in slinky_unsupported(v38)  # no node update there: no DOWN either


# -- the drain of a node hosting NodeSet pods ------------------------------------------------------


class NodeHistory:
    """Every version of one Node, as a watch streams them (what the operator sees) for a few
    seconds (the server ends the watch then)."""

    def __init__(self, api: KubeApiProcess, node: str) -> None:
        self.versions: list[dict[str, Any]] = []
        self._http = httpx.Client(base_url=api.url, timeout=40)
        params = {"watch": "true", "fieldSelector": f"metadata.name={node}", "timeoutSeconds": "3"}
        self._response = self._http.send(self._http.build_request("GET", "/api/v1/nodes", params=params), stream=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._response.iter_lines():
                if line:
                    self.versions.append(json.loads(line)["object"])
        finally:
            self._response.close()

    def wait_for(self, wanted: Any, *, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not any(wanted(v) for v in self.versions):
            assert time.monotonic() < deadline, "the watch did not show it"
            time.sleep(0.05)

    def stop(self) -> None:
        self._thread.join(10)
        self._http.close()


def test_the_drain_names_the_incident_before_the_cordon_and_evicts_the_nodeset_pods(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    history = NodeHistory(api, "gpu1")
    drain = SlinkyDrain(kube, poll_seconds=0.05)
    assert drain.stands_for_slurm_nodes("gpu1") and not drain.stands_for_slurm_nodes("spare1")

    evicted, forced = drain.cordon_and_drain("gpu1", INC, timeout_seconds=5)

    assert sorted(evicted) == [f"{NS}/exporter", f"{NS}/research-train-0", f"{NS}/research-train-1"]
    assert forced == []
    assert kube.pods_on_node("gpu1") == []
    node = kube.get_node("gpu1")
    assert node.unschedulable and node.annotations[NODE_CORDON_REASON] == f"gpufleet: incident {INC}"
    assert node.annotations[INCIDENT_ANNOTATION] == INC
    assert any(t["key"] == UNHEALTHY_TAINT for t in node.taints)
    assert selector_labels(kube, "gpu1") == {}  # out of the NodeSet: a pin to it lets go
    assert [p["slurm_node"] for p in recorded(kube, "gpu1")] == ["research-train-0", "train-b1"]
    # No version of the Node was cordoned without the incident's reason (the operator drains
    # with the reason it finds when it sees the cordon).
    history.wait_for(lambda v: v["spec"].get("unschedulable"))
    history.stop()
    cordoned = [v for v in history.versions if v["spec"].get("unschedulable")]
    assert all(NODE_CORDON_REASON in v["metadata"].get("annotations", {}) for v in cordoned)


def test_a_busy_pod_is_never_evicted_past_its_budget_and_the_drain_says_which(kube: KubernetesApi) -> None:
    drain = SlinkyDrain(kube, poll_seconds=0.05)
    [before] = NodeSets(kube).nodeset_pods_on("gpu2")
    started = time.monotonic()

    with pytest.raises(PodStillProtected) as protected:
        drain.cordon_and_drain("gpu2", INC, timeout_seconds=1)

    took = time.monotonic() - started
    assert 1 <= took < 10
    said = str(protected.value)
    assert f"{NS}/research-train-2" in said and "PodDisruptionBudget" in said and "gpu2" in said
    assert isinstance(protected.value, NotOwned)  # the incident stops there, not retried
    still = kube.find_pod(NS, "research-train-2")
    assert still is not None and still.uid == before.uid and not still.terminating and still.node == "gpu2"
    node = kube.get_node("gpu2")
    assert node.unschedulable and selector_labels(kube, "gpu2") == {}  # cordoned and out of the NodeSet all the same


def test_a_drain_tried_again_after_the_pods_left_touches_nothing(api: KubeApiProcess, kube: KubernetesApi) -> None:
    drain = SlinkyDrain(kube, poll_seconds=0.05)
    first = drain.cordon_and_drain("gpu1", INC, timeout_seconds=5)
    recreate(api, "research-train-0", "spare1")  # back, on a spare, under its name
    successor = kube.find_pod(NS, "research-train-0")
    assert successor is not None

    again = drain.cordon_and_drain("gpu1", INC, timeout_seconds=5)

    assert again[1] == [] and set(again[0]) <= set(first[0])
    now = kube.find_pod(NS, "research-train-0")
    assert now is not None and now.uid == successor.uid and not now.terminating and now.node == "spare1"
    assert [p["name"] for p in recorded(kube, "gpu1")] == ["research-train-0", "research-train-1"]
    assert kube.get_node("gpu1").annotations[NODE_CORDON_REASON] == f"gpufleet: incident {INC}"


def test_a_retry_after_some_pods_left_still_knows_every_one_the_incident_recorded(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """One pod evicted, another protected, the worker killed: the retry's record keeps the pod
    that left (the claim waits for it, its NodeSet gets the spare); another incident's record
    starts from what the node hosts then."""
    recreate(api, "research-train-5", "gpu1", protect=True)  # busy beside the two others
    with pytest.raises(PodStillProtected):
        SlinkyDrain(kube, poll_seconds=0.05).cordon_and_drain("gpu1", INC, timeout_seconds=0.5)
    assert [p.name for p in NodeSets(kube).nodeset_pods_on("gpu1")] == ["research-train-5"]

    with pytest.raises(PodStillProtected):  # the retry, with only the busy one left on gpu1
        SlinkyDrain(kube, poll_seconds=0.05).cordon_and_drain("gpu1", INC, timeout_seconds=0.2)

    everyone = ["research-train-0", "research-train-1", "research-train-5"]
    assert [p["name"] for p in recorded(kube, "gpu1")] == everyone
    assert [p.name for p in SlurmNodesOf(kube).pods("gpu1")] == everyone
    assert SlurmNodesOf(kube).record("gpu1", "another-incident") == NodeSets(kube).nodeset_pods_on("gpu1")
    assert [p["name"] for p in recorded(kube, "gpu1")] == ["research-train-5"]


# -- the spare pool --------------------------------------------------------------------------------


def pool_for(kube: KubernetesApi, *, back_wait: float = 0.3) -> SlinkyPool:
    return SlinkyPool(
        kube=kube,
        slurm=nowhere(kube),
        partition=NODESET,
        cluster="research",
        back_wait_seconds=back_wait,
        poll_seconds=0.05,
    )


def drained_out(kube: KubernetesApi, node: str, incident: str) -> None:
    """The incident's drain of ``node``, its unprotected pods evicted."""
    with contextlib.suppress(PodStillProtected):
        SlinkyDrain(kube, poll_seconds=0.05).cordon_and_drain(node, incident, timeout_seconds=0.2)


def test_a_spare_hosting_no_nodeset_pod_is_free(api: KubeApiProcess, kube: KubernetesApi) -> None:
    pool = pool_for(kube)
    assert pool.candidate() == "spare1"
    recreate(api, "research-train-9", "spare1")  # a Slurm node runs there
    assert pool.candidate() == "spare2"


def test_a_claim_makes_the_spare_eligible_for_the_failed_nodes_nodeset_and_waits_for_its_pods(
    kube: KubernetesApi,
) -> None:
    drained_out(kube, "gpu1", INC)
    pool = pool_for(kube)

    with pytest.raises(Unavailable, match="research-train-0") as waiting:
        pool.claim(INC, node="gpu1")

    assert BACK_YET in str(waiting.value)
    spare = kube.get_node("spare1")
    assert spare.annotations[CLAIMED_BY_ANNOTATION] == INC
    assert spare.labels[POOL_LABEL] == "training"
    assert selector_labels(kube, "spare1") == SELECTOR
    assert eligibility(kube, "spare1") == {f"{NS}/{NODESET}": {"labels": SELECTOR, "taint": False}}
    # Tried again: the same spare, no other claimed.
    with pytest.raises(Unavailable, match=BACK_YET):
        pool.claim(INC, node="gpu1", retry=True)
    assert CLAIMED_BY_ANNOTATION not in kube.get_node("spare2").annotations


def race(kube: KubernetesApi) -> dict[str, str | None]:
    """inc-a (for gpu1) and inc-b (for gpu2) claim at the same moment, each through a pool of its
    own (two workers); what each claim said."""
    results: dict[str, str | None] = {}
    start = threading.Barrier(2)

    def claim(incident: str, failed: str) -> None:
        start.wait()
        try:
            results[incident] = pool_for(kube).claim(incident, node=failed)
        except Unavailable as exc:
            results[incident] = WAITING if BACK_YET in str(exc) else str(exc)

    threads = [threading.Thread(target=claim, args=args) for args in (("inc-a", "gpu1"), ("inc-b", "gpu2"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def claimed_by(kube: KubernetesApi, *spares: str) -> list[str | None]:
    return [kube.get_node(name).annotations.get(CLAIMED_BY_ANNOTATION) for name in spares]


def test_two_incidents_racing_never_claim_one_spare_twice(kube: KubernetesApi) -> None:
    drained_out(kube, "gpu1", "inc-a")
    drained_out(kube, "gpu2", "inc-b")

    results = race(kube)  # two free spares: one each
    assert results == {"inc-a": WAITING, "inc-b": WAITING}
    assert sorted(str(who) for who in claimed_by(kube, "spare1", "spare2")) == ["inc-a", "inc-b"]

    for incident in ("inc-a", "inc-b"):
        pool_for(kube).release(incident)
    kube.set_unschedulable("spare2", True)
    results = race(kube)  # one free spare: one of them gets it, the other none
    [winner] = claimed_by(kube, "spare1")
    loser = "inc-b" if winner == "inc-a" else "inc-a"
    assert results == {winner: WAITING, loser: None}, results


def test_releasing_a_claim_not_used_takes_the_nodeset_labels_off(kube: KubernetesApi) -> None:
    drained_out(kube, "gpu1", INC)
    pool = pool_for(kube)
    spare1_before = kube.get_node("spare1").labels
    with pytest.raises(Unavailable, match=BACK_YET):
        pool.claim(INC, node="gpu1")

    assert pool.release(INC) == "spare1"

    spare = kube.get_node("spare1")
    assert spare.labels == spare1_before and CLAIM_LABEL not in spare.labels
    assert CLAIMED_BY_ANNOTATION not in spare.annotations and ELIGIBLE_ANNOTATION not in spare.annotations
    assert pool.release(INC) is None  # nothing left to release
    assert pool.candidate() == "spare1"


def test_the_reaper_leaves_a_spare_brought_into_service_as_it_is(kube: KubernetesApi) -> None:
    """release(unused_only) gives back only a claim still labelled a spare; one already brought in
    (labelled training, eligible, its pods on their way) is left whole, its NodeSet labels kept so
    that the evicted pods can still land there."""
    drained_out(kube, "gpu1", INC)
    pool = pool_for(kube)
    with pytest.raises(Unavailable, match=BACK_YET):
        pool.claim(INC, node="gpu1")

    assert pool.release(INC, unused_only=True) is None

    spare = kube.get_node("spare1")
    assert spare.annotations[CLAIMED_BY_ANNOTATION] == INC and spare.labels[POOL_LABEL] == "training"
    assert selector_labels(kube, "spare1") == SELECTOR
    assert set(eligibility(kube, "spare1")) == {f"{NS}/{NODESET}"}


def test_retire_takes_the_failed_nodes_nodeset_labels_off_even_those_gpufleet_did_not_set(
    kube: KubernetesApi,
) -> None:
    pool = pool_for(kube)
    assert selector_labels(kube, "gpu2") == SELECTOR and ELIGIBLE_ANNOTATION not in kube.get_node("gpu2").annotations

    pool.retire("gpu2", INC)

    node = kube.get_node("gpu2")
    assert selector_labels(kube, "gpu2") == {}
    assert node.unschedulable and node.labels[POOL_LABEL] == "retired"
    assert any(t["key"] == RETIRED_TAINT for t in node.taints)
    pool.retire("gpu2", INC)  # again: nothing more to do, no error
    assert selector_labels(kube, "gpu2") == {}


def test_a_returned_node_is_eligible_again_for_training_or_a_bare_spare(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    drained_out(kube, "gpu1", INC)
    pool = pool_for(kube)
    pool.retire("gpu1", INC)

    pool.return_node("gpu1", as_="training")

    node = kube.get_node("gpu1")
    assert selector_labels(kube, "gpu1") == SELECTOR and node.labels[POOL_LABEL] == "training"
    assert set(eligibility(kube, "gpu1")) == {f"{NS}/{NODESET}"}  # gpufleet's now, undone with it
    assert not node.unschedulable and not node.taints
    for gone in (SLURM_NODES_ANNOTATION, INCIDENT_ANNOTATION, NODE_CORDON_REASON):
        assert gone not in node.annotations

    # gpu2, retired with its busy pod still there: a spare runs no NodeSet pod.
    SlurmNodesOf(kube).record("gpu2", INC)
    pool.retire("gpu2", INC)
    with pytest.raises(NotOwned, match="still runs NodeSet pod"):
        pool.return_node("gpu2", as_="spare")

    # gpu1 again, retired by another incident; a person cordoned it meanwhile, with a reason.
    pool.retire("gpu1", INC)
    kube.update_metadata("gpu1", annotations={NODE_CORDON_REASON: OPS})
    pool.return_node("gpu1", as_="spare")
    node = kube.get_node("gpu1")
    assert selector_labels(kube, "gpu1") == {} and node.labels[POOL_LABEL] == "spare"  # a bare spare
    assert node.annotations[NODE_CORDON_REASON] == OPS  # a person's reason is theirs to take off

    kube.update_metadata("gpu2", labels={QUARANTINE_LABEL: "xid-79"})
    with pytest.raises(NotOwned, match="quarantined"):
        pool.return_node("gpu2", as_="training")
    with pytest.raises(InvalidInput):
        pool.return_node("gpu1", as_="inference")


# -- one spare pool: remediation's spares and the shared pool's moves -------------------------------


def mover_for(kube: KubernetesApi) -> SlinkyPoolMover:
    slurm = nowhere(kube)  # a move that got as far as Slurm would fail here
    return SlinkyPoolMover(kube, slurm, pool_for(kube), namespace=NS, poll_seconds=0.05)


def test_a_claimed_spare_whose_pods_are_on_their_way_is_no_training_node_to_move(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    drained_out(kube, "gpu1", INC)
    with pytest.raises(Unavailable, match=BACK_YET):
        pool_for(kube).claim(INC, node="gpu1")
    move = mover_for(kube)
    before = kube.get_node("spare1")
    assert before.labels[POOL_LABEL] == "training"  # brought in, its pods not there yet

    assert move.busy(before) == f"claimed by {INC} (its pods on their way)"
    assert move.slurm_nodes_of(["spare1"]) == {"spare1": []}  # no Slurm node: counted nowhere
    with pytest.raises(NotOwned, match=f"claimed by {INC}"):
        move.to_inference("spare1", holder="pool-lab", partition=NODESET, grace_seconds=1, deadline_seconds=1)
    after = kube.get_node("spare1")
    assert after.labels == before.labels and NODE_LEASE_ANNOTATION not in after.annotations
    assert selector_labels(kube, "spare1") == SELECTOR  # still eligible: the pods may land there

    recreate(api, "research-train-0", "spare1")  # back on the spare: a training node like any
    assert move.busy(kube.get_node("spare1")) == ""
    assert move.slurm_nodes_of(["spare1"]) == {"spare1": ["research-train-0"]}


def claim_and_move(kube: KubernetesApi) -> dict[str, object]:
    """INC's claim (gpu1 failed) and a move of spare1 to inference, at the same moment; what each said."""
    said: dict[str, object] = {}
    start = threading.Barrier(2)

    def claim() -> None:
        start.wait()
        try:
            said["claim"] = pool_for(kube).claim(INC, node="gpu1")
        except Unavailable as exc:
            said["claim"] = WAITING if BACK_YET in str(exc) else str(exc)

    def move() -> None:
        start.wait()
        try:
            said["move"] = mover_for(kube).to_inference(
                "spare1", holder="pool-lab", partition=NODESET, grace_seconds=1, deadline_seconds=1
            )
        except NotOwned as exc:  # OutOfPool (a spare), or the claim's (claimed, pods on their way)
            said["move"] = type(exc).__name__

    threads = [threading.Thread(target=claim), threading.Thread(target=move)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return said


def test_a_claim_and_a_pool_move_racing_for_one_spare_never_both_take_it(kube: KubernetesApi) -> None:
    """The claim (at the resourceVersion it read) and a move (the node lease) at the same moment,
    many times: the move never moves a spare, and never holds one the claim took."""
    drained_out(kube, "gpu1", INC)
    kube.set_unschedulable("spare2", True)  # one free spare
    for _ in range(8):
        said = claim_and_move(kube)
        node = kube.get_node("spare1")
        assert said["move"] in ("OutOfPool", "NotOwned"), said
        assert NODE_LEASE_ANNOTATION not in node.annotations  # let go, whoever came first
        assert said["claim"] in (WAITING, None), said
        if said["claim"] == WAITING:
            assert node.annotations[CLAIMED_BY_ANNOTATION] == INC and node.labels[POOL_LABEL] == "training"
            assert pool_for(kube).release(INC) == "spare1"
        else:  # the move's lease was there when the claim looked: no spare free for it
            assert CLAIMED_BY_ANNOTATION not in node.annotations and node.labels[POOL_LABEL] == "spare"
        assert kube.get_node("spare1").labels[POOL_LABEL] == "spare"


def test_a_move_to_inference_leaves_a_node_drained_by_someone_else_or_a_nodeset_with_a_pod_waiting(
    kube: KubernetesApi,
) -> None:
    """Nothing is written, and the lease is let go: gpu1's Slurm node drained by a person is
    theirs; and while the NodeSet has a pod that is not running and ready (an incident's evicted
    pod waiting for a node, say), the operator would scale that one in first."""
    slinky, memory = on_slinky(
        kube, {"research-train-0": drained("research-train-0", OPS), "train-b1": idle("train-b1")}
    )
    move = SlinkyPoolMover(kube, slinky, pool_for(kube), namespace=NS, poll_seconds=0.05)
    args: dict[str, Any] = {"holder": "pool-lab", "partition": NODESET, "grace_seconds": 1, "deadline_seconds": 1}
    before = kube.get_node("gpu1")
    with pytest.raises(NotOwned, match="drained by someone else"):
        move.to_inference("gpu1", **args)
    memory.nodes_["research-train-0"] = idle("research-train-0")
    # The NodeSet wants 3 replicas; the operator has said of none yet that it runs and is ready.
    with pytest.raises(NotOwned, match=f"stays in training for now: NodeSet {NS}/{NODESET} has 3 replica"):
        move.to_inference("gpu1", **args)
    after = kube.get_node("gpu1")
    assert after.labels == before.labels and after.annotations == before.annotations
    assert [call for call in memory.calls if call[0] == "drain"] == []


def test_a_claim_waits_for_no_pod_a_pool_move_scaled_in(api: KubeApiProcess, kube: KubernetesApi) -> None:
    """An incident took gpu1 over while a pool move was scaling research-train-0's NodeSet in for
    it: that pod is gone for good, so the claim waits only for the other one to be back."""
    pod = kube.find_pod(NS, "research-train-0")
    assert pod is not None
    found = kube.get_nodeset(NS, NODESET)
    scaled = {SCALED_IN_ANNOTATION: f"research-train-0/{pod.uid}"}
    body = {"metadata": {"annotations": scaled, "resourceVersion": found["metadata"]["resourceVersion"]}}
    kube.patch_nodeset(NS, NODESET, {**body, "spec": {"replicas": 2}})
    drained_out(kube, "gpu1", INC)  # both pods recorded, both evicted
    slinky, _ = on_slinky(kube, {"train-b1": idle("train-b1")})
    pool = SlinkyPool(
        kube=kube, slurm=slinky, partition=NODESET, cluster="research", back_wait_seconds=0.3, poll_seconds=0.05
    )
    with pytest.raises(Unavailable, match="research-train-1") as waiting:
        pool.claim(INC, node="gpu1")
    assert "research-train-0" not in str(waiting.value)  # not waited for
    recreate(api, "research-train-1", "spare1", hostname="train-b1")  # the other one, back on the spare
    assert pool.claim(INC, node="gpu1", retry=True) == "spare1"


def scale_in_for(kube: KubernetesApi, pod_name: str, uid: str, replicas: int) -> None:
    """What a pool move writes when it scales research-train in for a pod: its replicas, and the
    pod added to the NodeSet's scale-in marks, in one write."""
    found = kube.get_nodeset(NS, NODESET)
    current = marks(found["metadata"].get("annotations") or {}, SCALED_IN_ANNOTATION)
    body = {
        "metadata": {
            "annotations": {SCALED_IN_ANNOTATION: with_mark(current, f"{pod_name}/{uid}")},
            "resourceVersion": found["metadata"]["resourceVersion"],
        },
        "spec": {"replicas": replicas},
    }
    kube.patch_nodeset(NS, NODESET, body)


def test_a_claim_waits_for_no_pod_scaled_in_though_a_later_move_scaled_the_nodeset_in_again(
    api: KubeApiProcess, kube: KubernetesApi
) -> None:
    """An incident took gpu1 over after the pool's move scaled research-train in for its pod
    research-train-0; the batch's next move (gpu2) scaled it in again for its own pod. The claim
    still knows research-train-0 is gone for good, and waits only for research-train-1."""
    first = kube.find_pod(NS, "research-train-0")
    other = kube.find_pod(NS, "research-train-2")
    assert first is not None and other is not None
    scale_in_for(kube, "research-train-0", first.uid, 2)  # the move of gpu1
    drained_out(kube, "gpu1", INC)  # the incident takes gpu1 over: both its pods recorded, evicted
    scale_in_for(kube, "research-train-2", other.uid, 1)  # the pool's next move, of gpu2
    slinky, _ = on_slinky(kube, {"train-b1": idle("train-b1")})
    pool = SlinkyPool(
        kube=kube, slurm=slinky, partition=NODESET, cluster="research", back_wait_seconds=0.3, poll_seconds=0.05
    )
    with pytest.raises(Unavailable, match="research-train-1") as waiting:
        pool.claim(INC, node="gpu1")
    assert "research-train-0" not in str(waiting.value)  # gone for good: not waited for
    recreate(api, "research-train-1", "spare1", hostname="train-b1")
    assert pool.claim(INC, node="gpu1", retry=True) == "spare1"
