"""The spare pool over real Slurm and the emulated Kubernetes API: idempotent claims, no double claims,
only spares that are ours, releases, retirements that keep the Node, and repaired nodes coming back."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from clients.errors import Conflict, InvalidInput, NotOwned
from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from clients.spares import SpareLost, SparePool, partition_lease_name
from lab.procs import wait_for
from lab.slurm import SlurmLab
from models.constants import claim_label_value
from tests.conftest import KubeApiProcess

pytestmark = pytest.mark.slurm

Pool = tuple[SparePool, KubernetesApi, SlurmCli]

OPS_REASON = "dimm swap by ops"
OUR_REASON = "gpufleet: xid 79 incident remediate-lab-gpu3"


@pytest.fixture
def pool(slurm_lab: SlurmLab, kube_api: KubeApiProcess) -> Iterator[Pool]:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    slurm = SlurmCli(slurm_conf=slurm_lab.conf)
    yield SparePool(kube=kube, slurm=slurm, partition="train", cluster="lab"), kube, slurm
    # The Slurm cluster is shared by the whole session: every node back in service, the partition as it was.
    for node in slurm_lab.all_nodes:
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
            env=slurm_lab.env,
            capture_output=True,
            check=False,
        )
    subprocess.run(
        ["scontrol", "update", "PartitionName=train", f"Nodes={','.join(slurm_lab.spec.nodes)}"],
        env=slurm_lab.env,
        check=True,
    )
    # A resumed node is "not responding" until slurmctld next hears from its slurmd.
    wait_for(lambda: all(responding(slurm, n) for n in slurm_lab.all_nodes), timeout=30, what="every node idle")


def responding(slurm: SlurmCli, name: str) -> bool:
    node = slurm.node(name)
    return node.state == "idle" and not node.flags


def assert_untouched_spare(kube: KubernetesApi, slurm: SlurmCli, name: str) -> None:
    node = kube.get_node(name)
    assert "gpufleet.io/claimed-by" not in node.annotations
    assert node.labels["gpufleet.io/pool"] == "spare"
    assert name not in slurm.partition_nodes("train")


def test_claim_is_idempotent_and_brings_the_spare_in(pool: Pool) -> None:
    spares, kube, slurm = pool
    first = spares.claim("incident-a")
    again = spares.claim("incident-a")
    assert first is not None and first == again
    assert first in slurm.partition_nodes("train")
    node = kube.get_node(first)
    assert node.labels["gpufleet.io/pool"] == "training"
    assert node.annotations["gpufleet.io/claimed-by"] == "incident-a"
    other = ({"spare1", "spare2"} - {first}).pop()
    assert_untouched_spare(kube, slurm, other)


def test_two_incidents_never_share_a_spare(pool: Pool) -> None:
    spares, _, _ = pool
    claims = {spares.claim(f"incident-{i}") for i in range(3)}
    assert claims == {"spare1", "spare2", None}


def test_racing_incidents_never_share_a_spare(pool: Pool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    spares, kube, _ = pool
    with ThreadPoolExecutor(max_workers=6) as executor:
        claims = list(executor.map(spares.claim, [f"race-{i}" for i in range(6)]))
    won = [claim for claim in claims if claim is not None]
    assert sorted(won) == ["spare1", "spare2"]
    for name in won:
        owner = kube.get_node(name).annotations["gpufleet.io/claimed-by"]
        assert claims[int(owner.removeprefix("race-"))] == name


def test_a_spare_drained_by_an_operator_is_never_claimed(pool: Pool, slurm_lab: SlurmLab) -> None:
    spares, kube, slurm = pool
    slurm_lab.scontrol("update", "NodeName=spare1", "State=DRAIN", f"Reason={OPS_REASON}")
    assert spares.claim("incident-a") == "spare2"
    assert spares.claim("incident-b") is None
    assert_untouched_spare(kube, slurm, "spare1")
    spare1 = slurm.node("spare1")
    assert spare1.drained and spare1.reason == OPS_REASON


def _other_cluster(kube: KubernetesApi) -> None:
    kube.update_metadata("spare1", labels={"gpufleet.io/cluster": "other"})


def _quarantined(kube: KubernetesApi) -> None:
    kube.update_metadata("spare1", labels={"gpufleet.io/quarantine": "bad-fan"})


def _open_incident(kube: KubernetesApi) -> None:
    kube.update_metadata("spare1", annotations={"gpufleet.io/incident": "remediate-lab-spare1"})


@pytest.mark.parametrize(
    "mark", [_other_cluster, _quarantined, _open_incident], ids=["other-cluster", "quarantined", "open-incident"]
)
def test_a_spare_that_is_not_ours_to_take_is_never_claimed(pool: Pool, mark: Callable[[KubernetesApi], None]) -> None:
    spares, kube, slurm = pool
    mark(kube)
    assert spares.claim("incident-a") == "spare2"
    assert spares.claim("incident-b") is None
    assert_untouched_spare(kube, slurm, "spare1")


def test_a_spare_of_this_cluster_is_claimed(pool: Pool) -> None:
    spares, kube, _ = pool
    kube.update_metadata("spare1", labels={"gpufleet.io/cluster": "lab"})
    assert spares.claim("incident-a") == "spare1"


def test_a_claimed_spare_that_cannot_come_in_is_released_for_the_next(pool: Pool, slurm_lab: SlurmLab) -> None:
    spares, kube, slurm = pool
    # An earlier attempt claimed spare1 and stopped there; an operator drained it meanwhile.
    kube.update_metadata("spare1", annotations={"gpufleet.io/claimed-by": "incident-a"})
    slurm_lab.scontrol("update", "NodeName=spare1", "State=DRAIN", f"Reason={OPS_REASON}")
    assert spares.claim("incident-a") == "spare2"
    assert spares.claim("incident-a") == "spare2"
    assert_untouched_spare(kube, slurm, "spare1")
    assert slurm.node("spare1").reason == OPS_REASON
    assert "spare2" in slurm.partition_nodes("train")


THEIRS = "gpufleet: xid 79 REPLACE_NODE incident lab-spare1-20261205T050000Z"


def test_a_spare_drained_by_another_incident_after_the_claim_is_not_resumed(pool: Pool, slurm_lab: SlurmLab) -> None:
    """incident-a claimed spare1 and its attempt stopped there; then an Xid on spare1 opened an
    incident of its own, which drained it. The retry must not undo that drain."""
    spares, kube, slurm = pool
    kube.update_metadata("spare1", annotations={"gpufleet.io/claimed-by": "incident-a"})
    slurm_lab.scontrol("update", "NodeName=spare1", "State=DRAIN", f"Reason={THEIRS}")
    with pytest.raises(SpareLost, match="spare1 was taken out of service after it was claimed"):
        spares.claim("incident-a", retry=True, report_lost=True)
    spare1 = slurm.node("spare1")
    assert spare1.drained and spare1.reason == THEIRS  # still theirs
    assert_untouched_spare(kube, slurm, "spare1")  # the claim released
    assert spares.claim("incident-a", retry=True, report_lost=True) == "spare2"  # the next one
    assert slurm.node("spare1").reason == THEIRS


def test_a_drain_naming_the_claiming_incident_is_its_own_to_resume(pool: Pool, slurm_lab: SlurmLab) -> None:
    spares, kube, slurm = pool
    kube.update_metadata("spare1", annotations={"gpufleet.io/claimed-by": "incident-a"})
    ours = "gpufleet: claim REPLACE_NODE incident incident-a"
    slurm_lab.scontrol("update", "NodeName=spare1", "State=DRAIN", f"Reason={ours}")
    assert spares.claim("incident-a", retry=True, report_lost=True) == "spare1"
    assert not slurm.node("spare1").drained
    assert "spare1" in slurm.partition_nodes("train")


def test_an_inference_nodes_spare_joins_the_inference_pool_not_the_partition(pool: Pool) -> None:
    spares, kube, slurm = pool
    assert spares.claim("incident-a", pool="inference") == "spare1"
    assert spares.claim("incident-a", pool="inference", retry=True) == "spare1"  # the same on a retry
    node = kube.get_node("spare1")
    assert node.labels["gpufleet.io/pool"] == "inference"
    assert node.annotations["gpufleet.io/claimed-by"] == "incident-a"
    assert "gpufleet.io/pool-since" in node.annotations
    assert "spare1" not in slurm.partition_nodes("train")
    assert "gpufleet.io/claim-partition" not in node.annotations
    assert spares.release("incident-a") == "spare1"
    assert_untouched_spare(kube, slurm, "spare1")


def test_release_puts_the_spare_back(pool: Pool) -> None:
    spares, kube, slurm = pool
    assert spares.claim("incident-a") == "spare1"
    assert spares.release("incident-a") == "spare1"
    assert spares.release("incident-a") is None
    assert_untouched_spare(kube, slurm, "spare1")
    assert "gpufleet.io/claim-partition" not in kube.get_node("spare1").annotations
    assert not slurm.node("spare1").drained
    assert spares.claim("incident-b") == "spare1"  # free for the next incident


def test_release_without_a_claim_is_a_no_op(pool: Pool) -> None:
    spares, kube, slurm = pool
    assert spares.release("incident-never-claimed") is None
    assert_untouched_spare(kube, slurm, "spare1")
    assert_untouched_spare(kube, slurm, "spare2")


def test_retire_keeps_the_node_cordoned_tainted_and_out_of_the_partition(pool: Pool) -> None:
    spares, kube, slurm = pool
    spares.retire("gpu3", "remediate-lab-gpu3")
    spares.retire("gpu3", "remediate-lab-gpu3")
    assert "gpu3" not in slurm.partition_nodes("train")
    node = kube.get_node("gpu3")  # still there: a kubelet restart cannot bring it back clean
    assert node.unschedulable
    assert node.taints == [{"key": "gpufleet.io/retired", "value": "remediate-lab-gpu3", "effect": "NoSchedule"}]
    assert node.labels["gpufleet.io/pool"] == "retired"
    assert spares.claim("incident-a") == "spare1"  # a retired node is no spare


def test_retire_without_an_incident_and_of_a_slurm_only_node(pool: Pool) -> None:
    spares, kube, slurm = pool
    spares.retire("gpu3")
    assert kube.get_node("gpu3").taints == [{"key": "gpufleet.io/retired", "value": "retired", "effect": "NoSchedule"}]
    kube.delete_node("gpu2")
    spares.retire("gpu2")
    spares.retire("gpu2")
    assert slurm.partition_nodes("train") == ["gpu1"]


def _failed_and_retired(spares: SparePool, kube: KubernetesApi, slurm: SlurmCli, *, reason: str) -> None:
    """gpu3 as an incident leaves it: drained, cordoned, tainted, annotated, retired."""
    if reason.startswith("gpufleet:"):
        slurm.drain("gpu3", reason=reason)
    kube.set_unschedulable("gpu3", True)
    kube.add_taint("gpu3", key="gpufleet.io/unhealthy", value="remediate-lab-gpu3")
    kube.update_metadata("gpu3", annotations={"gpufleet.io/incident": "remediate-lab-gpu3"})
    spares.retire("gpu3", "remediate-lab-gpu3")


def test_return_node_for_training(pool: Pool) -> None:
    spares, kube, slurm = pool
    _failed_and_retired(spares, kube, slurm, reason=OUR_REASON)
    spares.return_node("gpu3", as_="training")
    spares.return_node("gpu3", as_="training")
    assert "gpu3" in slurm.partition_nodes("train")
    info = slurm.node("gpu3")
    assert not info.drained and info.state == "idle"
    node = kube.get_node("gpu3")
    assert not node.unschedulable and node.taints == []
    assert node.labels["gpufleet.io/pool"] == "training"
    assert "gpufleet.io/incident" not in node.annotations


def test_return_node_as_a_spare(pool: Pool) -> None:
    spares, kube, slurm = pool
    _failed_and_retired(spares, kube, slurm, reason=OUR_REASON)
    spares.return_node("gpu3", as_="spare")
    assert "gpu3" not in slurm.partition_nodes("train")
    assert not slurm.node("gpu3").drained
    node = kube.get_node("gpu3")
    assert not node.unschedulable and node.taints == []
    assert node.labels["gpufleet.io/pool"] == "spare"
    assert "gpufleet.io/incident" not in node.annotations
    wait_for(lambda: responding(slurm, "gpu3"), timeout=30, what="gpu3 to answer after its resume")
    claimed = {spares.claim(f"incident-{i}") for i in range(4)}  # every free spare, then None
    assert "gpu3" in claimed and None in claimed  # a spare like any other
    assert "gpu3" in slurm.partition_nodes("train")


def test_a_quarantined_node_is_never_returned_nor_a_spare_until_released(pool: Pool) -> None:
    spares, kube, slurm = pool
    _failed_and_retired(spares, kube, slurm, reason=OUR_REASON)
    spares.quarantine("gpu3", code="repeat-failures", reason="3 incidents within 7 days", incident_id="lab-gpu3-1")
    assert [node.name for node in spares.quarantined()] == ["gpu3"]
    with pytest.raises(NotOwned, match=r"quarantined.*gpufleet nodes release gpu3"):
        spares.return_node("gpu3", as_="spare")
    node = kube.get_node("gpu3")
    assert node.labels["gpufleet.io/pool"] == "retired" and node.unschedulable  # left as it was
    assert node.annotations["gpufleet.io/quarantine-reason"] == "3 incidents within 7 days (incident lab-gpu3-1)"
    assert spares.release_quarantine("gpu3") and not spares.release_quarantine("gpu3")
    spares.return_node("gpu3", as_="spare")
    assert kube.get_node("gpu3").labels["gpufleet.io/pool"] == "spare" and not spares.quarantined()


def test_return_node_leaves_a_node_drained_by_someone_else_alone(pool: Pool, slurm_lab: SlurmLab) -> None:
    spares, kube, slurm = pool
    _failed_and_retired(spares, kube, slurm, reason=OPS_REASON)
    slurm_lab.scontrol("update", "NodeName=gpu3", "State=DRAIN", f"Reason={OPS_REASON}")
    with pytest.raises(NotOwned, match="someone else"):
        spares.return_node("gpu3", as_="training")
    info = slurm.node("gpu3")
    assert info.drained and info.reason == OPS_REASON
    assert "gpu3" not in slurm.partition_nodes("train")
    node = kube.get_node("gpu3")
    assert node.unschedulable and node.labels["gpufleet.io/pool"] == "retired"


def test_return_node_refuses_an_unknown_role(pool: Pool) -> None:
    spares, _, slurm = pool
    with pytest.raises(InvalidInput):
        spares.return_node("gpu3", as_="inference")
    assert "gpu3" in slurm.partition_nodes("train")


# -- partition edits: under the partition's Lease, read back after the write ------------------------------------------


def test_a_partition_edit_waits_for_the_partition_lease(pool: Pool, kube_api: KubeApiProcess) -> None:
    spares, _, slurm = pool
    other_worker = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    held = other_worker.lease(partition_lease_name("train"), namespace="gpufleet", holder="other-worker")
    held.acquire()
    with ThreadPoolExecutor(max_workers=1) as executor:
        try:
            claim = executor.submit(spares.claim, "incident-a")
            time.sleep(1.0)
            assert not claim.done()
            assert "spare1" not in slurm.partition_nodes("train")  # claimed, but not in until the Lease is ours
        finally:
            held.release()
        assert claim.result(timeout=10) == "spare1"
    assert "spare1" in slurm.partition_nodes("train")
    lease: Any = other_worker._coordination.read_namespaced_lease(partition_lease_name("train"), "gpufleet")
    assert lease.spec.holder_identity is None  # given back after the edit


class ForgetfulSlurm(SlurmCli):
    """Real Slurm whose partition writes are lost, as when another writer's stale list lands after ours."""

    def _set_partition(self, partition: str, nodes: list[str]) -> None:
        pass


def test_a_partition_edit_that_did_not_stick_is_a_conflict(slurm_lab: SlurmLab, kube_api: KubeApiProcess) -> None:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    spares = SparePool(kube=kube, slurm=ForgetfulSlurm(slurm_conf=slurm_lab.conf), partition="train", cluster="lab")
    with pytest.raises(Conflict, match="still not in partition train"):
        spares.add_to_partition("spare1")
    with pytest.raises(Conflict, match="still in partition train"):
        spares.remove_from_partition("gpu3")


def test_the_lease_namespace_must_be_a_namespace(pool: Pool) -> None:
    _, kube, slurm = pool
    with pytest.raises(InvalidInput):
        SparePool(kube=kube, slurm=slurm, partition="train", cluster="lab", namespace="Not_A_Namespace")
    assert partition_lease_name("train") == "gpufleet-partition-train"


def test_a_spare_that_fails_in_service_is_retired_without_its_old_claim(pool: Pool) -> None:
    spares, kube, slurm = pool
    assert spares.claim("incident-a") == "spare1"
    spares.retire("spare1", "incident-b")  # the spare itself failed later, in the partition
    node = kube.get_node("spare1")
    assert node.labels["gpufleet.io/pool"] == "retired"
    assert "gpufleet.io/claimed-by" not in node.annotations
    assert "spare1" not in slurm.partition_nodes("train")
    assert spares.release("incident-a") is None  # nothing left to give back


@pytest.fixture
def debug_partition(slurm_lab: SlurmLab) -> Iterator[str]:
    """A second partition, ``debug``, holding gpu2 and gpu3, as a cluster made from a spec with
    two partitions has; gpu3 stays in ``train`` too, gpu2 leaves it."""

    def scontrol(*args: str) -> None:
        subprocess.run(["scontrol", *args], env=slurm_lab.env, capture_output=True, text=True, check=True, timeout=30)

    others = [n for n in slurm_lab.spec.nodes if n != "gpu2"]
    scontrol("update", "PartitionName=train", f"Nodes={','.join(others)}")
    scontrol("create", "PartitionName=debug", "Nodes=gpu2,gpu3", "State=UP")
    yield "debug"
    scontrol("delete", "PartitionName=debug")  # the pool fixture puts train back as it was


def test_a_spare_for_a_node_of_another_partition_joins_that_partition(pool: Pool, debug_partition: str) -> None:
    spares, kube, slurm = pool
    spare = spares.claim("incident-a", partitions=["debug"])
    assert spare == "spare1" and spares.claim("incident-a", partitions=["debug"]) == "spare1"  # a retry
    assert "spare1" in slurm.partition_nodes("debug") and "spare1" not in slurm.partition_nodes("train")
    assert kube.get_node("spare1").annotations["gpufleet.io/claim-partition"] == "debug"
    # A node in ours among others: the spare joins ours.
    assert spares.claim("incident-b", partitions=["debug", "train"]) == "spare2"
    assert "spare2" in slurm.partition_nodes("train")
    assert spares.release("incident-a") == "spare1"
    assert "spare1" not in slurm.partition_nodes("debug")
    assert_untouched_spare(kube, slurm, "spare1")


def test_a_retired_node_leaves_every_partition_and_returns_to_them(pool: Pool, debug_partition: str) -> None:
    spares, kube, slurm = pool
    slurm.drain("gpu3", reason=OUR_REASON)
    spares.retire("gpu3", "remediate-lab-gpu3")
    spares.retire("gpu3", "remediate-lab-gpu3")  # a retry finds it out already and keeps the record
    assert "gpu3" not in slurm.partition_nodes("debug") and "gpu3" not in slurm.partition_nodes("train")
    assert kube.get_node("gpu3").annotations["gpufleet.io/retired-from"] == "debug,train"
    spares.return_node("gpu3", as_="training")
    assert "gpu3" in slurm.partition_nodes("debug") and "gpu3" in slurm.partition_nodes("train")
    assert "gpufleet.io/retired-from" not in kube.get_node("gpu3").annotations


def test_a_retired_partitions_last_node_stays_in_it_drained(pool: Pool, debug_partition: str) -> None:
    spares, kube, slurm = pool
    slurm.drain("gpu3", reason=OUR_REASON)
    spares.retire("gpu3", "remediate-lab-gpu3")
    slurm.drain("gpu2", reason=OUR_REASON)
    spares.retire("gpu2", "remediate-lab-gpu2")  # debug's last node: Slurm keeps it there
    assert slurm.partition_nodes("debug") == ["gpu2"] and slurm.node("gpu2").drained
    assert kube.get_node("gpu2").labels["gpufleet.io/pool"] == "retired"  # retired all the same


def test_a_claim_carries_a_label_to_find_it_by(pool: Pool) -> None:
    spares, kube, _ = pool
    claimed = spares.claim("incident-a")
    assert claimed is not None
    label = claim_label_value("incident-a")
    assert [n.name for n in kube.list_nodes(label_selector=f"gpufleet.io/claim={label}")] == [claimed]
    assert spares.claim("incident-a") == claimed
    assert spares.release("incident-a") == claimed
    assert "gpufleet.io/claim" not in kube.get_node(claimed).labels


def test_a_claim_written_before_the_label_is_still_found(pool: Pool) -> None:
    """A claim by an earlier release (the annotation alone) is found again: among the spares by a
    claim's retry, and in the training pool by a release."""
    spares, kube, slurm = pool
    kube.update_metadata("spare2", annotations={"gpufleet.io/claimed-by": "incident-old"})
    assert spares.claim("incident-old") == "spare2"
    assert kube.get_node("spare2").labels["gpufleet.io/pool"] == "training"
    kube.update_metadata("spare2", labels={"gpufleet.io/claim": None})  # as the earlier release left it
    assert spares.claim("incident-old", retry=True) == "spare2"  # a retry after the node came in
    assert spares.release("incident-old") == "spare2"
    assert_untouched_spare(kube, slurm, "spare2")
