"""The warm spare pool: Kubernetes nodes labelled as spares that are Slurm nodes outside the partition."""

from __future__ import annotations

import contextlib
from typing import Protocol

from clients.errors import Conflict, NotFound
from clients.kube import KubeClient, KubeNode
from clients.slurm import SlurmClient
from models.constants import CLAIMED_BY_ANNOTATION, POOL_LABEL, POOL_RETIRED, POOL_SPARE, POOL_TRAINING


class NodeProvider(Protocol):
    """Where replacement nodes come from."""

    def claim(self, incident_id: str) -> str | None: ...
    def retire(self, node: str) -> None: ...


class SparePool:
    """NodeProvider over a pool of warm spares.

    A claim is written on the spare itself (annotation ``gpufleet.io/claimed-by``) with a
    resourceVersion precondition: a retry finds its own claim again, and two incidents
    racing for one spare see one of them lose with a conflict and move on to the next.
    """

    def __init__(self, *, kube: KubeClient, slurm: SlurmClient, partition: str) -> None:
        self._kube = kube
        self._slurm = slurm
        self._partition = partition

    def _own_claim(self, incident_id: str) -> KubeNode | None:
        for node in self._kube.list_nodes(label_selector=POOL_LABEL):
            if node.annotations.get(CLAIMED_BY_ANNOTATION) == incident_id:
                return node
        return None

    def _take_one(self, incident_id: str) -> KubeNode | None:
        for _ in range(10):
            candidates = [
                node
                for node in self._kube.list_nodes(label_selector=f"{POOL_LABEL}={POOL_SPARE}")
                if node.ready and not node.unschedulable and CLAIMED_BY_ANNOTATION not in node.annotations
            ]
            if not candidates:
                return None
            spare = sorted(candidates, key=lambda node: node.name)[0]
            try:
                return self._kube.update_metadata(
                    spare.name,
                    annotations={CLAIMED_BY_ANNOTATION: incident_id},
                    resource_version=spare.resource_version,
                )
            except Conflict:
                continue  # someone else got there first; look again
        return None

    def claim(self, incident_id: str) -> str | None:
        """Claim a spare for the incident and bring it into the partition and the training pool.

        Returns:
            The spare's name, or None when no spare is free.
        """
        spare = self._own_claim(incident_id) or self._take_one(incident_id)
        if spare is None:
            return None
        self._slurm.resume(spare.name)
        self._slurm.add_to_partition(self._partition, spare.name)
        if spare.labels.get(POOL_LABEL) != POOL_TRAINING:
            self._kube.update_metadata(spare.name, labels={POOL_LABEL: POOL_TRAINING})
        return spare.name

    def retire(self, node: str) -> None:
        """Take the failed node out of the partition and the pool, and delete its Node."""
        self._slurm.remove_from_partition(self._partition, node)
        with contextlib.suppress(NotFound):
            self._kube.update_metadata(node, labels={POOL_LABEL: POOL_RETIRED})
        self._kube.delete_node(node)
