"""The free pool: Kubernetes nodes labelled ``gpufleet.io/pool=free``, reserved for a new cluster.

A reservation relabels free nodes for one cluster: ``gpufleet.io/cluster=<name>`` and
``gpufleet.io/partition=<partition>`` (its spares ``gpufleet.io/pool=spare`` instead of a
partition), each write guarded by the resourceVersion the node was read at, so two creations
never take one node: the loser of a race moves on to the next free node. It is idempotent: a
retry counts what the cluster holds already and takes only the rest. When the pool runs out
the reservation gives back what it took in that call and fails, naming how many were missing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from clients.errors import Conflict, InvalidInput
from clients.kube import KubeClient, KubeNode
from models.constants import (
    CLAIMED_BY_ANNOTATION,
    CLUSTER_LABEL,
    NODE_LEASE_ANNOTATION,
    POOL_LABEL,
    QUARANTINE_LABEL,
    RETIRED_TAINT,
)

PARTITION_LABEL = "gpufleet.io/partition"
FREE = "free"
SPARE = "spare"
TRAINING = "training"
SPARES = "(spares)"
POOL_LEASE = "gpufleet-free-pool"  # the placement key under which a cluster's spares are listed


class PoolExhausted(InvalidInput):
    """The free pool holds fewer nodes than the spec asks for."""


def _marks(node: KubeNode) -> str:
    """Why a node may not serve a new cluster ('' when it may): quarantined, retired, claimed,
    held by someone's lease, cordoned or not Ready."""
    if node.labels.get(QUARANTINE_LABEL):
        return f"quarantined ({node.labels[QUARANTINE_LABEL]})"
    if any(t.get("key") == RETIRED_TAINT for t in node.taints):
        return "retired"
    if node.annotations.get(CLAIMED_BY_ANNOTATION):
        return f"claimed by {node.annotations[CLAIMED_BY_ANNOTATION]}"
    if node.annotations.get(NODE_LEASE_ANNOTATION):
        return f"held by {node.annotations[NODE_LEASE_ANNOTATION]}"
    if node.unschedulable:
        return "cordoned"
    if not node.ready:
        return "not Ready"
    return ""


def _free(kube: KubeClient) -> list[KubeNode]:
    """The free pool: labelled free, and fit (no quarantine, retirement, claim or cordon; Ready)."""
    nodes = kube.list_nodes(label_selector=f"{POOL_LABEL}={FREE}")
    return sorted((n for n in nodes if not _marks(n)), key=lambda n: n.name)


def free_nodes(kube: KubeClient) -> int:
    return len(_free(kube))


def holdings(kube: KubeClient, cluster: str) -> dict[str, list[str]]:
    """The cluster's nodes by partition (spares under ``SPARES``)."""
    placed: dict[str, list[str]] = {}
    for node in sorted(kube.list_nodes(label_selector=f"{CLUSTER_LABEL}={cluster}"), key=lambda n: n.name):
        where = SPARES if node.labels.get(POOL_LABEL) == SPARE else node.labels.get(PARTITION_LABEL, "")
        placed.setdefault(where, []).append(node.name)
    return placed


def reserve(
    kube: KubeClient,
    cluster: str,
    wanted: dict[str, int],
    *,
    namespace: str = "gpufleet",
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[str]]:
    """Give the cluster ``wanted[partition]`` nodes per partition (``SPARES``: its spares) from
    the free pool; returns the whole placement. PoolExhausted (nothing of this call kept) when
    the pool runs out.

    Reservations take turns under one Lease (``gpufleet-free-pool`` in ``namespace``): two
    creations racing for the last nodes would otherwise each take some and both fail; in turn,
    the first gets all it asks for and the second fails cleanly.
    """
    # A holder of its own for each try: two tries of one reservation (a retry while the first
    # still runs elsewhere) take turns too, and the second finds what the first took.
    holder = f"cluster-{cluster}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with kube.lease(POOL_LEASE, namespace=namespace, holder=holder):
        return _reserve(kube, cluster, wanted, progress)


def _reserve(
    kube: KubeClient, cluster: str, wanted: dict[str, int], progress: Callable[[str], None] | None
) -> dict[str, list[str]]:
    placed = holdings(kube, cluster)
    taken: list[str] = []
    try:
        for where, count in wanted.items():
            have = placed.setdefault(where, [])
            while len(have) < count:
                node = _take_one(kube, cluster, where)
                if node is None:
                    short = sum(max(0, n - len(placed.get(w, []))) for w, n in wanted.items())
                    raise PoolExhausted(
                        f"the free pool ran out: cluster {cluster} still needs {short} node(s) "
                        f"(label more nodes {POOL_LABEL}={FREE}, or ask for fewer)"
                    )
                taken.append(node)
                have.append(node)
                if progress:
                    progress(f"{node} -> {cluster} {where}")
    except BaseException:
        for node in taken:
            release_node(kube, node)
        raise
    return {where: sorted(nodes) for where, nodes in placed.items() if nodes}


def _take_one(kube: KubeClient, cluster: str, where: str) -> str | None:
    """Relabel one free node for the cluster; None when none is left. A node someone else took
    between our read and our write (a 409) is skipped."""
    while True:
        free = _free(kube)
        if not free:
            return None
        for node in free:
            labels: dict[str, str | None] = {CLUSTER_LABEL: cluster}
            if where == SPARES:
                labels[POOL_LABEL] = SPARE
            else:
                labels[POOL_LABEL] = TRAINING
                labels[PARTITION_LABEL] = where
            try:
                kube.update_metadata(node.name, labels=labels, resource_version=node.resource_version)
            except Conflict:
                continue  # taken (or changed) since we read it: the next one
            return node.name


def release_node(kube: KubeClient, node: str) -> str:
    """Back to the free pool, the cluster's labels off, if fit: a node that is quarantined,
    retired, claimed by an incident, cordoned or not Ready leaves the cluster but not for the
    free pool (its pool label stays, for a person or its incident). Returns why it was kept
    out ('' when freed). Written at the version read, so a change meanwhile is not lost."""
    current = kube.get_node(node)
    why = _marks(current)
    labels: dict[str, str | None] = {CLUSTER_LABEL: None, PARTITION_LABEL: None}
    if not why:
        labels[POOL_LABEL] = FREE
    kube.update_metadata(node, labels=labels, resource_version=current.resource_version)
    return why


def release(kube: KubeClient, cluster: str) -> tuple[list[str], dict[str, str]]:
    """Every node the cluster holds leaves it; returns those back in the free pool, and those
    kept out of it with why."""
    freed: list[str] = []
    kept: dict[str, str] = {}
    for node in sorted(name for names in holdings(kube, cluster).values() for name in names):
        while True:
            try:
                why = release_node(kube, node)
                break
            except Conflict:
                continue  # changed since we read it: read again
        if why:
            kept[node] = why
        else:
            freed.append(node)
    return freed, kept
