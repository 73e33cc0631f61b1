"""The free pool over the official client and the emulated API: reservations relabel free nodes
with resourceVersion preconditions, retry without taking more, give back what they took when the
pool runs out, and two racing for the last nodes never share one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.kube import KubernetesApi
from clients.pool import SPARES, PoolExhausted, free_nodes, holdings, release, reserve
from lab.kubeapi import node_object
from tests.conftest import KubeApiProcess

FREE = ["free1", "free2", "free3", "free4"]


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubernetesApi]:
    seed = {"nodes": [node_object("gpu1", pool="training")] + [node_object(n, pool="free") for n in FREE]}
    api = KubeApiProcess(tmp_path / "kube", seed)
    yield KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)
    api.stop()


def test_a_reservation_labels_nodes_per_partition_and_a_retry_takes_no_more(kube: KubernetesApi) -> None:
    wanted = {"train": 2, "debug": 1, SPARES: 1}
    placement = reserve(kube, "research", wanted)
    assert {k: len(v) for k, v in placement.items()} == {"train": 2, "debug": 1, SPARES: 1}
    assert sorted(n for nodes in placement.values() for n in nodes) == FREE
    spare = kube.get_node(placement[SPARES][0])
    assert spare.labels["gpufleet.io/pool"] == "spare" and spare.labels["gpufleet.io/cluster"] == "research"
    trainer = kube.get_node(placement["train"][0])
    assert trainer.labels["gpufleet.io/partition"] == "train" and trainer.labels["gpufleet.io/pool"] == "training"
    assert reserve(kube, "research", wanted) == placement  # the retry finds its own
    assert kube.get_node("gpu1").labels.get("gpufleet.io/cluster") is None  # not from the pool: untouched


def test_a_pool_too_small_keeps_nothing_and_says_how_many_are_missing(kube: KubernetesApi) -> None:
    with pytest.raises(PoolExhausted, match="still needs 2 node"):
        reserve(kube, "big", {"train": 5, SPARES: 1})
    assert free_nodes(kube) == 4 and holdings(kube, "big") == {}


def test_two_creations_racing_for_the_last_nodes_never_share_one(kube: KubernetesApi) -> None:
    outcomes: dict[str, object] = {}
    start = threading.Barrier(2)

    def create(cluster: str) -> None:
        start.wait()
        try:
            outcomes[cluster] = reserve(kube, cluster, {"train": 3})
        except PoolExhausted as exc:
            outcomes[cluster] = exc

    threads = [threading.Thread(target=create, args=(c,)) for c in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    won = [c for c, o in outcomes.items() if isinstance(o, dict)]
    lost = [c for c, o in outcomes.items() if isinstance(o, PoolExhausted)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert len(holdings(kube, won[0])["train"]) == 3
    assert holdings(kube, lost[0]) == {}  # nothing left behind
    assert free_nodes(kube) == 1


def test_release_returns_every_fit_node_to_the_free_pool_and_keeps_lemons_out(kube: KubernetesApi) -> None:
    placement = reserve(kube, "research", {"train": 2, SPARES: 1})
    lemon = placement["train"][0]
    kube.update_metadata(lemon, labels={"gpufleet.io/quarantine": "repeat-failures"})  # an incident's verdict
    freed, kept = release(kube, "research")
    assert kept == {lemon: "quarantined (repeat-failures)"} and len(freed) == 2
    assert free_nodes(kube) == 3 and holdings(kube, "research") == {}
    node = kube.get_node(freed[0])
    assert "gpufleet.io/partition" not in node.labels and "gpufleet.io/cluster" not in node.labels
    assert kube.get_node(lemon).labels["gpufleet.io/pool"] == "training"  # not free: a person decides
    # Nor is a quarantined node that is labelled free ever reserved.
    kube.update_metadata(lemon, labels={"gpufleet.io/pool": "free"})
    with pytest.raises(PoolExhausted):
        reserve(kube, "next", {"train": 4})
    assert holdings(kube, "next") == {}


def test_two_tries_of_one_reservation_take_turns_and_take_no_more(kube: KubernetesApi) -> None:
    # A retry while the first try still runs (its worker looked dead): each try holds the Lease
    # under its own name, so the second waits, then finds what the first took.
    start = threading.Barrier(2)
    placements: list[dict[str, list[str]]] = []

    def attempt() -> None:
        start.wait()
        placements.append(reserve(kube, "research", {"train": 2}))

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(placements) == 2 and placements[0] == placements[1]
    assert len(holdings(kube, "research")["train"]) == 2 and free_nodes(kube) == 2


def test_a_node_someone_holds_is_not_free(kube: KubernetesApi) -> None:
    kube.update_metadata("free1", annotations={"gpufleet.io/lease": "pool-shared"})  # mid-move
    assert free_nodes(kube) == 3
    placement = reserve(kube, "research", {"train": 3})
    assert "free1" not in placement["train"]
