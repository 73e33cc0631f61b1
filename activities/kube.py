"""Kubernetes steps: cordon, taint and drain the failed node."""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio import activity

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from activities.validation import probation_end
from clients import nodelease
from clients.dryrun import dry_run
from clients.errors import NotFound
from clients.kube import KubeClient
from clients.onslinky import SlinkyDrain
from models.constants import INCIDENT_ANNOTATION, POOL_LABEL, QUARANTINE_LABEL, REMEDIATION_LABEL, UNHEALTHY_TAINT
from models.names import label_value
from models.requests import KubeDrainRequest, KubeDrainResult, NodeFacts, NodeLeaseRequest


class KubeActivities:
    def __init__(self, kube: KubeClient, *, slinky: SlinkyDrain | None = None) -> None:
        self._kube = kube
        # On Slinky: a node hosting NodeSet pods is drained the operator's way (clients/onslinky.py).
        self._slinky = slinky

    @activity.defn(name="kube_node_facts")
    @heartbeating
    def node_facts(self, node: str) -> NodeFacts:
        """The node's pool, opt-out, quarantine and probation labels (found False without a Kubernetes node)."""
        with client_errors():
            try:
                found = self._kube.get_node(node)
            except NotFound:
                return NodeFacts(found=False)
        labels = found.labels
        return NodeFacts(
            pool=labels.get(POOL_LABEL, ""),
            remediation=labels.get(REMEDIATION_LABEL, ""),
            quarantine=labels.get(QUARANTINE_LABEL, ""),
            probation_until=probation_end(found, datetime.now(UTC)),
        )

    @activity.defn(name="take_node_lease")
    @heartbeating
    def take_node_lease(self, request: NodeLeaseRequest) -> str:
        """Hold the node for the incident, whoever held it: a pool move that held it stops at
        its next step. Returns who held it before ('' when nobody or no Kubernetes node)."""
        with client_errors():
            held = nodelease.take_over(self._kube, request.node, request.holder)
        return "" if held == request.holder else held

    @activity.defn(name="give_back_node_lease")
    @heartbeating
    def give_back_node_lease(self, request: NodeLeaseRequest) -> bool:
        """Let go of the node if the incident holds it (a node back in service)."""
        with client_errors():
            return nodelease.give_back(self._kube, request.node, request.holder)

    @activity.defn(name="cordon_and_drain_node")
    @heartbeating
    def cordon_and_drain(self, request: KubeDrainRequest) -> KubeDrainResult:
        """Cordon, taint and evict every pod but DaemonSet pods; force past the eviction deadline
        (on Slinky, never a NodeSet pod). A dry run answers with the pods it would evict."""
        result = KubeDrainResult()
        with client_errors(), dry_run(request.dry_run):
            if request.dry_run:
                try:
                    self._kube.get_node(request.node)
                except NotFound:
                    return KubeDrainResult(node_found=False)
                pods = self._kube.pods_on_node(request.node)
                return KubeDrainResult(evicted=[pod.key for pod in pods if pod.owner_kind != "DaemonSet"])
            if self._slinky is not None and self._slinky.stands_for_slurm_nodes(request.node):
                # Cordoned with the incident's reason, out of its NodeSets; NodeSet pods evicted
                # once they may go, never forced (PodStillProtected ends the incident, saying so).
                evicted, forced = self._slinky.cordon_and_drain(
                    request.node,
                    request.incident_id,
                    timeout_seconds=request.eviction_timeout_seconds,
                    progress=activity.heartbeat,
                )
                return KubeDrainResult(evicted=evicted, forced=forced)
            try:
                self._kube.set_unschedulable(request.node, True)
            except NotFound:
                # A Slurm-only node has no Kubernetes side to drain.
                return KubeDrainResult(node_found=False)
            # A taint's value is a label value (63 characters): the whole ID is in the annotation.
            self._kube.add_taint(request.node, key=UNHEALTHY_TAINT, value=label_value(request.incident_id))
            self._kube.update_metadata(request.node, annotations={INCIDENT_ANNOTATION: request.incident_id})
            for pod in self._kube.pods_on_node(request.node):
                if pod.owner_kind == "DaemonSet":
                    continue
                activity.heartbeat(f"evicting {pod.key}")
                outcome = self._kube.evict(
                    pod,
                    timeout_seconds=request.eviction_timeout_seconds,
                    progress=activity.heartbeat,
                    # A Slurm node's pod (Slinky) is never forced past its disruption budget.
                    force=pod.owner_kind != "NodeSet",
                )
                (result.forced if outcome == "deleted" else result.evicted).append(pod.key)
        return result
