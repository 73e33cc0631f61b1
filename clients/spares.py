"""The warm spare pool: Kubernetes nodes labelled as spares that are Slurm nodes outside the partition."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import socket
import zlib
from datetime import UTC, datetime
from typing import Protocol

from clients.errors import Conflict, InvalidInput, LastNodeOfPartition, NotFound, NotOwned
from clients.kube import KubeClient, KubeNode, checked_namespace, lease_name, retry_conflicts
from clients.slurm import SlurmClient, owned_reason
from models.constants import (
    CLAIM_LABEL,
    CLAIM_PARTITION_ANNOTATION,
    CLAIMED_BY_ANNOTATION,
    CLUSTER_LABEL,
    INCIDENT_ANNOTATION,
    NODE_LEASE_ANNOTATION,
    POOL_INFERENCE,
    POOL_LABEL,
    POOL_RETIRED,
    POOL_SINCE_ANNOTATION,
    POOL_SPARE,
    POOL_TRAINING,
    QUARANTINE_LABEL,
    QUARANTINE_REASON_ANNOTATION,
    RETIRED_FROM_ANNOTATION,
    RETIRED_TAINT,
    UNHEALTHY_TAINT,
    claim_label_value,
    drained_by,
)
from models.names import label_value

log = logging.getLogger("gpufleet.spares")


# Conflicts (someone else wrote the Node between our read and our write) are retried this often.
_ATTEMPTS = 10
# Slurm node flags that make an idle node unfit to be a spare.
_UNFIT_FLAGS = frozenset(
    {"DRAIN", "FAIL", "NOT_RESPONDING", "MAINT", "REBOOT_REQUESTED", "POWER_DOWN", "POWERED_DOWN", "POWERING_DOWN"}
)
_OUT_OF_SERVICE = frozenset({"down", "fail"})
# A spare that fails to come in for one of these is released and the next one is tried.
_UNFIT_ERRORS = (NotOwned, NotFound, InvalidInput)


class SpareLost(NotOwned):
    """The claimed spare cannot come in (drained since by someone else, quarantined, gone from
    Slurm); its claim was released. Raised only to a claim that asked (``report_lost``)."""


class NodeProvider(Protocol):
    """Where replacement nodes come from, and where failed and repaired nodes go."""

    def claim(
        self,
        incident_id: str,
        *,
        partitions: list[str] | None = None,
        retry: bool = False,
        pool: str = POOL_TRAINING,
        report_lost: bool = False,
        node: str = "",
    ) -> str | None: ...
    def candidate(self) -> str | None: ...
    def release(self, incident_id: str, *, unused_only: bool = False) -> str | None: ...
    def retire(self, node: str, incident_id: str = "") -> None: ...
    def return_node(self, node: str, *, as_: str) -> None: ...
    def quarantine(self, node: str, *, code: str, reason: str, incident_id: str) -> None: ...
    def quarantined(self) -> list[KubeNode]: ...
    def release_quarantine(self, node: str) -> bool: ...


def default_holder() -> str:
    """This process's identity as a Lease holder: ``{hostname}-{pid}-{random}``, unique per process."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def partition_lease_name(partition: str) -> str:
    """The Lease that serialises every edit of ``partition``'s membership, in every worker process."""
    return lease_name(f"gpufleet-partition-{partition}")


class SparePool:
    """NodeProvider over a pool of warm spares.

    A claim is written on the spare itself (annotation ``gpufleet.io/claimed-by``) with a
    resourceVersion precondition: a retry finds its own claim again, and two incidents
    racing for one spare see one of them lose with a conflict and move on to the next.

    A spare is only claimed when it is ours to take: in the spare pool, of this cluster (or of
    no cluster), Ready and schedulable, unclaimed, without an open incident, not quarantined,
    and idle in Slurm (not drained, not down). A spare that then fails to come in is released
    and the next one is tried.

    Slurm's partition membership is read-modify-write (22.05 has no ``Nodes+=``), so every edit
    of it holds the partition's Lease (``gpufleet-partition-{partition}`` in ``namespace``,
    held as ``holder``), shared by every worker process, and is read back after the write: a
    change that is not there raises Conflict (the activity retries).
    """

    def __init__(
        self,
        *,
        kube: KubeClient,
        slurm: SlurmClient,
        partition: str,
        cluster: str,
        namespace: str = "gpufleet",
        holder: str | None = None,
    ) -> None:
        self._kube = kube
        self._slurm = slurm
        self._partition = partition
        self._cluster = cluster
        self._namespace = checked_namespace(namespace)
        self._holder = holder or default_holder()

    # -- partition membership -----------------------------------------------------------------------

    def add_to_partition(self, node: str, *, partition: str | None = None) -> None:
        """Put ``node`` in the partition (ours unless named), under the partition's Lease; verified."""
        self._edit_partition(partition or self._partition, node, add=True)

    def remove_from_partition(self, node: str, *, partition: str | None = None) -> None:
        """Take ``node`` out of the partition (ours unless named), under the partition's Lease; verified."""
        self._edit_partition(partition or self._partition, node, add=False)

    def _edit_partition(self, partition: str, node: str, *, add: bool) -> None:
        lease = self._kube.lease(partition_lease_name(partition), namespace=self._namespace, holder=self._holder)
        with lease:
            if add:
                self._slurm.add_to_partition(partition, node)
            else:
                self._slurm.remove_from_partition(partition, node)
            if (node in self._slurm.partition_nodes(partition)) != add:
                raise Conflict(
                    f"{node} is {'still not' if add else 'still'} in partition {partition} after the edit; retry"
                )

    # -- which spares are ours ----------------------------------------------------------------------

    def _of_this_cluster(self, node: KubeNode) -> bool:
        return node.labels.get(CLUSTER_LABEL, self._cluster) == self._cluster

    def _free_in_kube(self, node: KubeNode) -> bool:
        return (
            node.labels.get(POOL_LABEL) == POOL_SPARE
            and self._of_this_cluster(node)
            and node.ready
            and not node.unschedulable
            and CLAIMED_BY_ANNOTATION not in node.annotations
            and INCIDENT_ANNOTATION not in node.annotations
            and NODE_LEASE_ANNOTATION not in node.annotations  # held by a pool move or a reservation
            and QUARANTINE_LABEL not in node.labels
            and not any(t["key"] in (RETIRED_TAINT, UNHEALTHY_TAINT) for t in node.taints)
        )

    def _idle_in_slurm(self, name: str) -> bool:
        try:
            info = self._slurm.node(name)
        except NotFound:
            return False
        return info.state == "idle" and not info.drained and not _UNFIT_FLAGS.intersection(info.flags)

    def _own_claim(self, incident_id: str, *, wide: bool = False) -> KubeNode | None:
        """The node this incident claimed, found by its claim label.

        ``wide``: also among every spare and training node, for a claim written before the label
        existed (a release, rare, may afford reading them all; a claim in a burst may not: it
        finds such a claim among the spares it lists anyway).
        """
        found = self._kube.list_nodes(label_selector=f"{CLAIM_LABEL}={claim_label_value(incident_id)}")
        own = self._claimed_by(incident_id, found)
        if own is None and wide:
            pools = f"{POOL_LABEL} in ({POOL_SPARE},{POOL_TRAINING},{POOL_INFERENCE})"
            own = self._claimed_by(incident_id, self._kube.list_nodes(label_selector=pools))
        return own

    def _claimed_by(self, incident_id: str, nodes: list[KubeNode]) -> KubeNode | None:
        for node in nodes:
            if node.annotations.get(CLAIMED_BY_ANNOTATION) == incident_id and self._of_this_cluster(node):
                return node
        return None

    def _take_one(self, incident_id: str, *, skip: set[str]) -> KubeNode | None:
        """Claim a free spare: None only when a fresh listing shows none free.

        Many incidents claim at once in a burst. Each starts at its own place in the list (from
        its ID) and, when it loses a spare to another, tries the next one in the same listing:
        a burst of a thousand claims is not a thousand rounds of re-reading the pool.
        """
        for _ in range(_ATTEMPTS):
            spares = self._kube.list_nodes(label_selector=f"{POOL_LABEL}={POOL_SPARE}")
            own = self._claimed_by(incident_id, spares)
            if own is not None:
                return own
            candidates = sorted(
                (node for node in spares if node.name not in skip and self._free_in_kube(node)),
                key=lambda node: node.name,
            )
            if not candidates:
                return None
            start = zlib.crc32(incident_id.encode()) % len(candidates)
            lost_a_race = False
            for spare in candidates[start:] + candidates[:start]:
                if not self._idle_in_slurm(spare.name):
                    continue
                try:
                    return self._kube.update_metadata(
                        spare.name,
                        labels={CLAIM_LABEL: claim_label_value(incident_id)},
                        annotations={CLAIMED_BY_ANNOTATION: incident_id},
                        resource_version=spare.resource_version,
                    )
                except NotFound:
                    continue  # the Node went away since we listed it
                except Conflict:
                    # Someone wrote it first. It may be another attempt of this same incident
                    # (a retry overlapping a slow one): then that claim is ours, and the only one.
                    own = self._own_claim(incident_id)
                    if own is not None:
                        return own
                    lost_a_race = True
            if not lost_a_race:
                return None
        raise Conflict(f"every free spare was taken by another incident before {incident_id} could claim it; retry")

    # -- claim and release --------------------------------------------------------------------------

    def _joins(self, partitions: list[str] | None) -> str:
        """The partition a spare replacing a node of ``partitions`` joins: ours when the failed
        node was in it (or its partitions are unknown), else the first of them."""
        if not partitions or self._partition in partitions:
            return self._partition
        return partitions[0]

    def _bring_in(
        self, spare: KubeNode, partition: str, incident_id: str, pool: str = POOL_TRAINING, failed: str = ""
    ) -> None:
        """Resume the claimed spare in Slurm, put it in ``partition`` and the training pool; or,
        for ``pool`` inference, label it for inference and leave Slurm as it is.

        The spare was idle and undrained when it was claimed. A drain found now is someone
        else's (a person's, or another incident's after an Xid on the spare) unless it names
        this incident: that one is resumed, any other is theirs to keep (NotOwned).
        """
        name = spare.name
        if QUARANTINE_LABEL in spare.labels:
            raise NotOwned(f"{name} was quarantined after it was claimed")
        info = self._slurm.node(name)  # NotFound: gone from Slurm
        if info.drained or info.state in _OUT_OF_SERVICE:
            if drained_by(info.reason) != incident_id:
                raise NotOwned(
                    f"{name} was taken out of service after it was claimed ({info.state}, {info.reason!r}); "
                    "not resuming it"
                )
            self._slurm.resume(name)
            info = self._slurm.node(name)
            if info.drained or info.state in _OUT_OF_SERVICE:
                raise NotOwned(f"{name} is out of service in Slurm ({info.state}, {info.reason!r})")
        if pool == POOL_INFERENCE:
            if spare.labels.get(POOL_LABEL) != POOL_INFERENCE:
                spare = self._kube.update_metadata(
                    name,
                    labels={POOL_LABEL: POOL_INFERENCE},
                    annotations={POOL_SINCE_ANNOTATION: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
                )
            if any(t["key"] == POOL_LABEL for t in spare.taints):  # the training taint keeps inference off
                self._kube.remove_taint(name, key=POOL_LABEL)
            return
        partition = spare.annotations.get(CLAIM_PARTITION_ANNOTATION) or partition  # a retry keeps its first
        if partition not in info.partitions:
            if CLAIM_PARTITION_ANNOTATION not in spare.annotations:
                # Recorded before the change, so that a release knows to undo it.
                spare = self._kube.update_metadata(name, annotations={CLAIM_PARTITION_ANNOTATION: partition})
            self.add_to_partition(name, partition=partition)
        if spare.labels.get(POOL_LABEL) != POOL_TRAINING:
            self._kube.update_metadata(name, labels={POOL_LABEL: POOL_TRAINING})

    def candidate(self) -> str | None:
        """The spare a claim would take now (reads only: a dry run's answer), or None."""
        for node in sorted(self._kube.list_nodes(label_selector=f"{POOL_LABEL}={POOL_SPARE}"), key=lambda n: n.name):
            if self._free_in_kube(node) and self._idle_in_slurm(node.name):
                return node.name
        return None

    def claim(
        self,
        incident_id: str,
        *,
        partitions: list[str] | None = None,
        retry: bool = False,
        pool: str = POOL_TRAINING,
        report_lost: bool = False,
        node: str = "",
    ) -> str | None:
        """Claim a spare for the incident and bring it into the partition and the training pool
        (``pool`` inference: into the inference pool, for an inference node's replacement).

        ``partitions``: the failed node's; the spare joins ours when the node was in it, else
        the first of them (a cluster with several partitions). ``retry``: an attempt after one
        that may have claimed already; its claim is looked for among every spare, training and
        inference node too (one written by an earlier release carries no label). A claimed
        spare that cannot come in is released; then, with ``report_lost``, SpareLost says which
        and why, else the next spare is tried.

        Returns:
            The spare's name (the same one on every retry), or None when no spare is free.
        """
        tried: set[str] = set()
        while True:
            spare = self._own_claim(incident_id, wide=retry) or self._take_one(incident_id, skip=tried)
            if spare is None:
                return None
            if spare.name in tried:
                raise Conflict(f"the claim of {spare.name} for {incident_id} could not be released; retry")
            try:
                self._bring_in(spare, self._joins(partitions), incident_id, pool, failed=node)
            except _UNFIT_ERRORS as exc:
                log.warning("spare %s did not come in for %s (%s); releasing it", spare.name, incident_id, exc)
                tried.add(spare.name)
                self._release_node(spare.name, incident_id)
                if report_lost:
                    raise SpareLost(f"{spare.name}: {exc}; its claim is released") from exc
                continue
            return spare.name

    def _release_node(self, name: str, incident_id: str, *, unused_only: bool = False) -> bool:
        """Undo ``incident_id``'s claim on ``name``; False when it holds no claim there (or, with
        ``unused_only``, when the node already serves: it is no longer labelled a spare). The
        write is made at the resourceVersion read, so a node brought in meanwhile is not touched."""
        for _ in range(_ATTEMPTS):
            try:
                node = self._kube.get_node(name)
            except NotFound:
                return False
            if node.annotations.get(CLAIMED_BY_ANNOTATION) != incident_id:
                return False
            if unused_only and node.labels.get(POOL_LABEL) != POOL_SPARE:
                return False
            partition = node.annotations.get(CLAIM_PARTITION_ANNOTATION)
            if partition:
                self.remove_from_partition(name, partition=partition)
            try:
                self._kube.update_metadata(
                    name,
                    labels={POOL_LABEL: POOL_SPARE, CLAIM_LABEL: None},
                    annotations={CLAIMED_BY_ANNOTATION: None, CLAIM_PARTITION_ANNOTATION: None},
                    resource_version=node.resource_version,
                )
            except NotFound:
                return False
            except Conflict:
                continue
            return True
        raise Conflict(f"could not release {name} from {incident_id}: the Node kept changing")

    def release(self, incident_id: str, *, unused_only: bool = False) -> str | None:
        """Give back the spare claimed by an incident that did not use it.

        The claim is removed, the spare leaves the partition if the claim had put it there and
        is labelled a spare again. Idempotent. ``unused_only`` (the reaper, which cannot ask the
        incident): only a claimed node still labelled a spare, never one already serving.

        Returns:
            The released spare's name, or None when the incident holds no claim.
        """
        spare = self._own_claim(incident_id, wide=True)
        if spare is None or not self._release_node(spare.name, incident_id, unused_only=unused_only):
            return None
        return spare.name

    # -- failed and repaired nodes ------------------------------------------------------------------

    def retire(self, node: str, incident_id: str = "") -> None:
        """Take the failed node out of the partition and keep its Node cordoned, tainted and retired.

        The Node is not deleted: a kubelet restart would register a deleted node again, clean and
        schedulable. A node Kubernetes does not know is still taken out of the partition.
        """
        for partition in self._retired_from(node):
            try:
                self.remove_from_partition(node, partition=partition)
            except LastNodeOfPartition as exc:
                # Slurm keeps a partition's last node; drained (by the incident), it runs nothing there.
                state = self._slurm.node(node)
                log.warning("%s stays in partition %s (%s; drained: %s)", node, partition, exc, state.drained)
        self._retire_in_kube(node, incident_id)

    def _retire_in_kube(self, node: str, incident_id: str) -> None:
        """The Node kept cordoned, tainted gpufleet.io/retired and labelled retired (not deleted)."""
        with contextlib.suppress(NotFound):
            self._kube.set_unschedulable(node, True)
            value = label_value(incident_id or POOL_RETIRED)  # a taint's value is a label value
            retry_conflicts(lambda: self._kube.add_taint(node, key=RETIRED_TAINT, value=value), attempts=_ATTEMPTS)
            current = self._kube.get_node(node)
            if (
                current.labels.get(POOL_LABEL) != POOL_RETIRED
                or CLAIMED_BY_ANNOTATION in current.annotations
                or CLAIM_LABEL in current.labels
            ):
                # A spare that failed in service is no longer anyone's claim: it is retired.
                self._kube.update_metadata(
                    node,
                    labels={POOL_LABEL: POOL_RETIRED, CLAIM_LABEL: None},
                    annotations={CLAIMED_BY_ANNOTATION: None},
                )

    def _retired_from(self, node: str) -> list[str]:
        """The partitions the failed node leaves: those Slurm has it in, recorded on the Node the
        first time (a retry finds it out of them already and keeps the record), else ours."""
        try:
            recorded = self._kube.get_node(node).annotations.get(RETIRED_FROM_ANNOTATION)
        except NotFound:
            recorded, known = None, False
        else:
            known = True
        try:
            current = self._slurm.node(node).partitions
        except NotFound:
            current = []
        if recorded:
            return sorted(set(recorded.split(",")) | set(current))
        partitions = sorted(set(current)) or [self._partition]
        if known:
            with contextlib.suppress(NotFound):
                self._kube.update_metadata(node, annotations={RETIRED_FROM_ANNOTATION: ",".join(partitions)})
        return partitions

    def quarantine(self, node: str, *, code: str, reason: str, incident_id: str) -> None:
        """Label the node ``gpufleet.io/quarantine=<code>`` (never a spare, never returned until
        released), with the reason in words beside it. A node with no Kubernetes side (Slurm
        only) has nowhere to carry the label: its Slurm drain keeps it out, and the log says so."""
        try:
            self._kube.update_metadata(
                node,
                labels={QUARANTINE_LABEL: code},
                annotations={QUARANTINE_REASON_ANNOTATION: f"{reason} (incident {incident_id})"},
            )
        except NotFound:
            log.warning("%s has no Kubernetes Node to label quarantined (%s); it stays drained in Slurm", node, reason)

    def quarantined(self) -> list[KubeNode]:
        """The nodes of this cluster that are quarantined."""
        return [n for n in self._kube.list_nodes(label_selector=QUARANTINE_LABEL) if self._of_this_cluster(n)]

    def release_quarantine(self, node: str) -> bool:
        """Take the quarantine off a node (False when it had none); it may then be returned."""
        current = self._kube.get_node(node)
        if QUARANTINE_LABEL not in current.labels:
            return False
        self._kube.update_metadata(
            node, labels={QUARANTINE_LABEL: None}, annotations={QUARANTINE_REASON_ANNOTATION: None}
        )
        return True

    def return_node(self, node: str, *, as_: str) -> None:
        """Bring a repaired node back, as a warm spare (``as_="spare"``) or for training (``"training"``).

        In Slurm the node is resumed only when gpufleet took it out; a node drained or down for
        someone else's reason raises NotOwned and is left exactly as it is.
        """
        if as_ not in (POOL_SPARE, POOL_TRAINING):
            raise InvalidInput(f"a node returns as {POOL_SPARE!r} or {POOL_TRAINING!r}, not {as_!r}")
        with contextlib.suppress(NotFound):
            labels = self._kube.get_node(node).labels
            if QUARANTINE_LABEL in labels:
                raise NotOwned(
                    f"{node} is quarantined ({QUARANTINE_LABEL}={labels[QUARANTINE_LABEL]}): not returning it; "
                    f"`gpufleet nodes release {node}` first, once it is really repaired"
                )
        info = self._slurm.node(node)
        if (info.drained or info.state in _OUT_OF_SERVICE) and not owned_reason(info.reason):
            raise NotOwned(
                f"{node} was taken out of Slurm by someone else ({info.state}, reason {info.reason!r}); "
                "not returning it: resume it by hand once its owner is done"
            )
        try:
            recorded = self._kube.get_node(node).annotations.get(RETIRED_FROM_ANNOTATION)
        except NotFound:
            recorded = None
        partitions = recorded.split(",") if recorded else [self._partition]
        if as_ == POOL_SPARE:
            for partition in sorted(set(partitions) | set(info.partitions)):
                try:
                    self.remove_from_partition(node, partition=partition)
                except LastNodeOfPartition:
                    # A spare belongs to no partition, but Slurm keeps a partition's last node:
                    # it stays drained there, and is no spare until the partition has another.
                    raise NotOwned(
                        f"{node} is the last node of partition {partition}: it cannot leave it to be a spare; "
                        "return it for training instead"
                    ) from None
            self._slurm.resume(node)
        else:
            self._slurm.resume(node)
            for partition in partitions:  # back where it was taken out of
                self.add_to_partition(node, partition=partition)
        with contextlib.suppress(NotFound):
            for taint in (RETIRED_TAINT, UNHEALTHY_TAINT):
                retry_conflicts(functools.partial(self._kube.remove_taint, node, key=taint), attempts=_ATTEMPTS)
            self._kube.update_metadata(
                node,
                labels={POOL_LABEL: as_, CLAIM_LABEL: None},
                annotations={
                    INCIDENT_ANNOTATION: None,
                    CLAIMED_BY_ANNOTATION: None,
                    CLAIM_PARTITION_ANNOTATION: None,
                    RETIRED_FROM_ANNOTATION: None,
                    NODE_LEASE_ANNOTATION: None,  # an incident that ended without letting go
                },
            )
            self._kube.set_unschedulable(node, False)
