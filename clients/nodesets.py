"""The Kubernetes side of replacing a failed node on Slinky (slurm-operator 1.x, NodeSets in
StatefulSet mode): which Slurm nodes a Kubernetes node hosts, its cordon with gpufleet's reason,
one eviction of a NodeSet pod, a spare made eligible for a NodeSet (and the failed node not),
and whether a pod is back.

A Slurm node there is a NodeSet pod: its slurmd registers under the pod's name, and a pod
deleted or evicted comes back under the same name (on the node recorded for it with
``pinToNode``, while that node still matches the NodeSet's template). One Kubernetes node can
host several of them, of one NodeSet or of several.

**What an incident is keyed on.** A hardware fault is the Kubernetes node's: every Slurm node on
it fails with it, and the cordon and its reason (``node-cordon-reason``) are the Kubernetes
node's too. So an incident is keyed on the Kubernetes node; ``nodeset_pods_on(node)`` is what it
covers (each pod, with its NodeSet and Slurm node name), read at its start and kept in its
record. A pod is then followed by namespace and name (its Slurm node's name), never by where it
runs now: once evicted it comes back, under that name, on another node.

Each call is safe to repeat (a retry after a timeout finds its own write and does nothing more),
and writes with the resourceVersion it read wherever it replaces what someone else may have set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from clients.errors import ClientError, InvalidInput, TooManyRequests
from clients.kube import KubeNode, KubernetesApi, PodRef, retry_conflicts
from models.constants import POOL_LABEL

PREFIX = "nodeset.slinky.slurm.net/"
# Read by the operator when it drains the Slurm nodes of a cordoned Kubernetes node (their reason
# becomes ``slurm-operator: <this>``).
NODE_CORDON_REASON = PREFIX + "node-cordon-reason"
# Set by the operator on a busy pod; its PodDisruptionBudget (maxUnavailable 0) selects it.
POD_PROTECT = PREFIX + "pod-protect"
# Set by the operator on each pod: the pod's hostname, which is its Slurm node's name.
POD_HOSTNAME = PREFIX + "pod-hostname"
# On a node: the labels (and taint) gpufleet set to make it eligible, by NodeSet, as JSON
# ``{"<namespace>/<nodeset>": {"labels": {key: value}, "taint": bool}}``; only these are undone.
ELIGIBLE_ANNOTATION = "gpufleet.io/nodeset-eligibility"
# The shared pool's taint (clients/poolmoves.py): keeps inference off a node of training. A spare
# gets it when the NodeSet's pods tolerate it, so that it is kept for them as a partition node is.
POOL_TAINT = POOL_LABEL
POOL_TAINT_VALUE = "training"
_CONFLICT_RETRIES = 5
# Labels other controllers keep on a node (the GPU operator, node feature discovery, the kubelet,
# the cloud): never taken off, even by ``also_unrecorded`` (they would come back, and the GPU
# detector's DaemonSet selects on one). The failed node's cordon and untolerated taint keep the
# NodeSet's pods off it all the same.
FOREIGN_LABEL_PREFIXES = (
    "nvidia.com/",
    "feature.node.kubernetes.io/",
    "kubernetes.io/",
    "node.kubernetes.io/",
    "topology.kubernetes.io/",
    "beta.kubernetes.io/",
    "node-role.kubernetes.io/",
)


_CORDON_REASON_PREFIX = "gpufleet: incident "


def cordon_reason(incident_id: str) -> str:
    """gpufleet's cordon reason: it names the incident (and comes back in Slurm's drain reason)."""
    if not incident_id:
        raise InvalidInput("a cordon for an incident needs the incident's ID")
    return f"{_CORDON_REASON_PREFIX}{incident_id}"


def ours_cordon_reason(reason: str) -> bool:
    """Whether a ``node-cordon-reason`` is one gpufleet wrote (for any incident)."""
    return reason.startswith(_CORDON_REASON_PREFIX)


class NotEligible(ClientError):
    """The node cannot take the NodeSet's pods whatever its labels (a taint they do not tolerate,
    a cordon, not Ready): labelling it would leave them Pending."""


@dataclass(frozen=True)
class NodeSetName:
    namespace: str
    name: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class NodeSetPod(PodRef):
    """A NodeSet's pod: a Slurm node of the same name."""

    @property
    def nodeset(self) -> NodeSetName:
        return NodeSetName(self.namespace, self.owner_name)

    @property
    def slurm_node(self) -> str:
        """Its slurmd's node name: the pod's hostname, which the operator labels it with (the
        pod's name unless the NodeSet's template names a hostname, then that and the ordinal)."""
        return self.labels.get(POD_HOSTNAME, "") or self.name

    @property
    def protected(self) -> bool:
        """Busy in Slurm: its PodDisruptionBudget refuses an eviction."""
        return self.labels.get(POD_PROTECT) == "true"

    @property
    def back(self) -> bool:
        """Running (and Ready) on a node, not on its way out."""
        return self.phase == "Running" and self.ready and bool(self.node) and not self.terminating


@dataclass(frozen=True)
class CordonResult:
    node: str
    reason: str  # the node-cordon-reason the node has now ("" when none)
    ours: bool  # gpufleet's for this incident; False: someone else's, left as it was
    changed: bool  # this call wrote something (False on a retry)


EvictionOutcome = Literal["evicted", "already gone", "blocked", "not found"]


@dataclass(frozen=True)
class EvictionResult:
    pod: str  # namespace/name
    outcome: EvictionOutcome
    message: str


@dataclass(frozen=True)
class EligibilityResult:
    node: str
    nodeset: str  # namespace/name
    labels: dict[str, str]  # the NodeSet's nodeSelector
    changed: dict[str, str | None] = field(default_factory=dict)  # labels this call set (None: removed)
    taint: str = ""  # "added" / "removed" when this call changed the pool taint
    kept: dict[str, str] = field(default_factory=dict)  # selector labels left, not gpufleet's to remove


def _as_nodeset_pod(pod: PodRef) -> NodeSetPod:
    return NodeSetPod.model_validate(pod.model_dump())


def _records(node: KubeNode) -> dict[str, dict[str, Any]]:
    raw = node.annotations.get(ELIGIBLE_ANNOTATION)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ClientError(f"{node.name}: annotation {ELIGIBLE_ANNOTATION} is not JSON: {raw[:200]!r}") from None
    if not isinstance(data, dict):
        raise ClientError(f"{node.name}: annotation {ELIGIBLE_ANNOTATION} is not a JSON object")
    return data


def _dumped(records: dict[str, dict[str, Any]]) -> str | None:
    return json.dumps(records, sort_keys=True, separators=(",", ":")) if records else None


class NodeSets:
    """The primitives, over a KubernetesApi; the caller loops, waits and decides."""

    def __init__(self, kube: KubernetesApi) -> None:
        self._kube = kube

    # -- what a node hosts --------------------------------------------------------------------------

    def nodeset_pods_on(self, node: str) -> list[NodeSetPod]:
        """The NodeSet pods bound to ``node`` (terminating ones included), by namespace and name."""
        pods = [p for p in self._kube.pods_on_node(node) if p.owner_kind == "NodeSet" and p.owner_name]
        return sorted((_as_nodeset_pod(p) for p in pods), key=lambda p: p.key)

    # -- the cordon -----------------------------------------------------------------------------------

    def cordon_for_incident(self, node: str, incident_id: str) -> CordonResult:
        """The node cordoned, its ``node-cordon-reason`` naming the incident.

        The reason goes on first: the operator drains the node's Slurm nodes as soon as it sees
        the cordon, with the reason it finds then, and keeps that reason. A reason someone else
        set (another incident's, a person's) is never replaced: the node is cordoned all the
        same, and the result says whose reason it has (``ours`` False).
        """
        wanted = cordon_reason(incident_id)
        changed = False

        def annotate() -> KubeNode:
            nonlocal changed
            current = self._kube.get_node(node)
            if current.annotations.get(NODE_CORDON_REASON):
                return current
            changed = True
            return self._kube.update_metadata(
                node, annotations={NODE_CORDON_REASON: wanted}, resource_version=current.resource_version
            )

        current = retry_conflicts(annotate, attempts=_CONFLICT_RETRIES)
        if not current.unschedulable:
            current = self._kube.set_unschedulable(node, True)
            changed = True
        found = current.annotations.get(NODE_CORDON_REASON, "")
        return CordonResult(node=node, reason=found, ours=found == wanted, changed=changed)

    # -- one eviction ---------------------------------------------------------------------------------

    def evict_nodeset_pod(self, pod: PodRef) -> EvictionResult:
        """One eviction through the eviction API, never a delete and never forced past the pod's
        PodDisruptionBudget: ``blocked`` then, and the caller waits (bounded) and asks again.

        ``already gone``: the pod is on its way out (an earlier eviction, a retry of this one), or
        only a successor of that name is there (another UID, or another node than ``pod.node``):
        that one is never evicted. ``not found``: no pod of that name at all.
        """
        now = self._kube.find_pod(pod.namespace, pod.name)
        if now is None:
            return EvictionResult(pod.key, "not found", f"no pod {pod.key}")
        if (pod.uid and now.uid != pod.uid) or (not pod.uid and pod.node and now.node != pod.node):
            where = f"on {now.node}" if now.node else "Pending"
            return EvictionResult(pod.key, "already gone", f"{pod.key} was replaced: a new one is {where}")
        if now.terminating:
            return EvictionResult(pod.key, "already gone", f"{pod.key} is terminating")
        try:
            said = self._kube.evict(now, timeout_seconds=0, force=False)
        except TooManyRequests:
            return EvictionResult(
                pod.key,
                "blocked",
                f"evicting {pod.key} is blocked by its disruption budget (its Slurm node is busy); wait and retry",
            )
        if said == "gone":
            return EvictionResult(pod.key, "already gone", f"{pod.key} went while it was evicted")
        return EvictionResult(pod.key, "evicted", f"evicted {pod.key}")

    # -- eligibility ----------------------------------------------------------------------------------

    def _template(self, nodeset: NodeSetName) -> dict[str, Any]:
        found = self._kube.get_nodeset(nodeset.namespace, nodeset.name)
        spec = (((found.get("spec") or {}).get("template") or {}).get("spec")) or {}
        return spec if isinstance(spec, dict) else {}

    def _selector(self, nodeset: NodeSetName, template: dict[str, Any]) -> dict[str, str]:
        selector = template.get("nodeSelector") or {}
        if not selector:
            raise InvalidInput(
                f"NodeSet {nodeset.key} has no nodeSelector: its pods may go to any node, so no label makes one "
                "eligible or not"
            )
        return {str(k): str(v) for k, v in selector.items()}

    def make_eligible(self, spare: str, nodeset: NodeSetName) -> EligibilityResult:
        """The NodeSet's nodeSelector labels on ``spare``, each one gpufleet added recorded in
        ``gpufleet.io/nodeset-eligibility``; and the pool taint when the NodeSet's pods tolerate it.

        Raises:
            NotEligible: before any write, when the pods could not run there anyway (a taint they
                do not tolerate, cordoned, not Ready), or a label the selector needs has another
                value there (someone else's: never overwritten).
        """
        template = self._template(nodeset)
        selector = self._selector(nodeset, template)
        tolerant = PodRef(namespace=nodeset.namespace, name=nodeset.name, tolerations=template.get("tolerations") or [])
        wants_taint = tolerant.tolerates(key=POOL_TAINT, value=POOL_TAINT_VALUE, effect="NoSchedule", by_name=True)
        added: dict[str, str | None] = {}
        taint_said = ""

        def label() -> KubeNode:
            nonlocal added
            current = self._kube.get_node(spare)
            problems = []
            if not current.ready:
                problems.append("not Ready")
            if current.unschedulable:
                problems.append("cordoned")
            records = _records(current)
            for taint in current.taints:
                if taint["effect"] not in ("NoSchedule", "NoExecute"):
                    continue
                if not tolerant.tolerates(key=taint["key"], value=taint["value"], effect=taint["effect"]):
                    problems.append(f"tainted {taint['key']}={taint['value']}:{taint['effect']}, not tolerated")
            for key, value in selector.items():
                if key in current.labels and current.labels[key] != value:
                    problems.append(f"labelled {key}={current.labels[key]} (the NodeSet selects {value})")
            if problems:
                raise NotEligible(f"{spare} cannot take NodeSet {nodeset.key}'s pods: {'; '.join(problems)}")
            added = {k: v for k, v in selector.items() if current.labels.get(k) != v}
            record = records.get(nodeset.key) or {"labels": {}, "taint": False}
            # Also gpufleet's: a label another NodeSet's record holds, so that undoing that one
            # leaves it while this NodeSet still needs it.
            shared = {k: v for r in records.values() for k, v in (r.get("labels") or {}).items() if k in selector}
            new_record = {**record, "labels": {**record.get("labels", {}), **shared, **added}}
            if wants_taint and not any(t["key"] == POOL_TAINT for t in current.taints):
                new_record["taint"] = True
            if not added and new_record == record:
                return current
            # The record first (with the labels, in one write): a retry after a timeout finds both.
            records = {**records, nodeset.key: new_record}
            return self._kube.update_metadata(
                spare,
                labels=dict(added),
                annotations={ELIGIBLE_ANNOTATION: _dumped(records)},
                resource_version=current.resource_version,
            )

        current = retry_conflicts(label, attempts=_CONFLICT_RETRIES)
        if wants_taint and not any(t["key"] == POOL_TAINT for t in current.taints):
            retry_conflicts(
                lambda: self._kube.add_taint(spare, key=POOL_TAINT, value=POOL_TAINT_VALUE), attempts=_CONFLICT_RETRIES
            )
            taint_said = "added"
        return EligibilityResult(spare, nodeset.key, selector, changed=added, taint=taint_said)

    def make_ineligible(
        self,
        node: str,
        nodeset: NodeSetName,
        *,
        also_unrecorded: bool = False,
        keep: frozenset[str] = frozenset(),
    ) -> EligibilityResult:
        """The NodeSet's labels gpufleet set on ``node`` (its record) taken off, but those another
        NodeSet's record still needs; the pool taint too when gpufleet added it and no record
        needs it any more. With the selector's labels off, the node no longer matches the
        template and a ``pinToNode`` pin on it lets go.

        ``also_unrecorded``: the failed node, made eligible before gpufleet kept records (at the
        cluster's creation, or by a person): every selector label it carries comes off, recorded
        as gpufleet's act in the result, but those other controllers keep (FOREIGN_LABEL_PREFIXES).
        Without it, such labels stay and are named in ``kept``.

        ``keep``: labels left on the node as long as another of the selector's comes off (which is
        enough for the node not to match): a node that stays in the cluster keeps its cluster's label.
        """
        selector = self._selector(nodeset, self._template(nodeset))
        removed: dict[str, str | None] = {}
        kept: dict[str, str] = {}
        drop_taint = False

        def unlabel() -> KubeNode:
            nonlocal removed, kept, drop_taint
            current = self._kube.get_node(node)
            records = _records(current)
            record = records.get(nodeset.key) or {}
            others = {k: r for k, r in records.items() if k != nodeset.key}
            still_needed = {k for r in others.values() for k in (r.get("labels") or {})}
            ours = set(record.get("labels") or {})
            gone = sorted(
                k
                for k, v in selector.items()
                if current.labels.get(k) == v
                and (k in ours or (also_unrecorded and not k.startswith(FOREIGN_LABEL_PREFIXES)))
                and k not in still_needed
            )
            if any(k not in keep for k in gone):
                gone = [k for k in gone if k not in keep]
            kept = {k: v for k, v in selector.items() if current.labels.get(k) == v and k not in gone}
            removed = dict.fromkeys(gone)
            tainted = any(t["key"] == POOL_TAINT for t in current.taints)
            drop_taint = bool(record.get("taint")) and tainted and not any(r.get("taint") for r in others.values())
            if drop_taint:
                others[nodeset.key] = {"labels": {}, "taint": True}  # kept until the taint is off
            annotation = _dumped(others)
            if not gone and annotation == current.annotations.get(ELIGIBLE_ANNOTATION):
                return current
            return self._kube.update_metadata(
                node,
                labels=dict(removed),
                annotations={ELIGIBLE_ANNOTATION: annotation},
                resource_version=current.resource_version,
            )

        retry_conflicts(unlabel, attempts=_CONFLICT_RETRIES)
        taint_said = ""
        if drop_taint:
            self._kube.remove_taint(node, key=POOL_TAINT)
            taint_said = "removed"

            def forget() -> KubeNode:
                current = self._kube.get_node(node)
                records = _records(current)
                if records.pop(nodeset.key, None) is None:
                    return current
                return self._kube.update_metadata(
                    node,
                    annotations={ELIGIBLE_ANNOTATION: _dumped(records)},
                    resource_version=current.resource_version,
                )

            retry_conflicts(forget, attempts=_CONFLICT_RETRIES)
        return EligibilityResult(node, nodeset.key, selector, changed=removed, taint=taint_said, kept=kept)

    # -- coming back ----------------------------------------------------------------------------------

    def pod_back(self, pod: PodRef, *, on: str | None = None) -> NodeSetPod | None:
        """One read: the pod of that name when it is back (a new one if ``pod.uid`` is known),
        Running and Ready, on ``on`` when given; None while it is not (yet). The caller loops."""
        now = self._kube.find_pod(pod.namespace, pod.name)
        if now is None or (pod.uid and now.uid == pod.uid):
            return None
        back = _as_nodeset_pod(now)
        if not back.back or (on is not None and back.node != on):
            return None
        return back
