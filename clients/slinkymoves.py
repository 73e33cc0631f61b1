"""Moving one node between training and inference on Slinky (slurm-operator 1.x, NodeSets in
StatefulSet mode), with the interface of ``PoolMover`` (clients/poolmoves.py).

There a Slurm node is a NodeSet pod, and no partition is edited: the operator makes each
NodeSet's partition. Making a node ineligible does not move a pod already running there, and an
evicted pod comes back on another eligible node; so a node leaves training by the NodeSet
scaling in with its pod first, and comes back by the NodeSet scaling out onto it:

- **training -> inference**: the node's lease; its Slurm nodes (its NodeSet pods') drained with
  ``gpufleet: rebalance to inference``; the jobs waited for up to the deadline, then SIGTERM, the
  grace and the requeue, exactly as ``PoolMover`` does (its AdminComment marks, so that a retry
  signals nobody twice); the NodeSets it leaves recorded on the Node
  (``gpufleet.io/pool-nodesets``); the node's eligibility labels off (no pod comes back there);
  once every pod of the NodeSet is ready, each pod given the lowest ``pod-deletion-cost`` and
  ``pod-cordon`` and right after its NodeSet scaled in by one, the pod added in the same write to
  the NodeSet's list (``gpufleet.io/scaled-in-for``), so a retry never scales in twice; the pod
  gone, its Slurm node deleted or left DOWN by the preStop hook (slurm-operator v1.2.1 deletes no
  Slurm node in StatefulSet mode); then ``gpufleet.io/pool=inference``, a move's cordon lifted,
  the training taint off. A pod the operator still protects (``pod-protect``: its Slurm node is
  busy) is waited for, never evicted.
- **inference -> training**: cordoned and tainted, inference's pods evicted as ``PoolMover`` does
  (a PodDisruptionBudget makes the move wait or undoes it, never breaks); ``gpufleet.io/pool=training``;
  uncordoned (the taint keeps inference off); eligible for the NodeSets it left (recorded, else
  the NodeSet of the worker's partition); the NodeSet scaled out by one, the node added in the
  same write to the NodeSet's list (``gpufleet.io/scaled-out-for``); done once a pod of the
  NodeSet runs on this node and its Slurm node is registered, its mark then removed, and any
  scale-in marks of a stopped move to inference taken off its pods (a pod its NodeSet was scaled
  in for and the operator has not deleted yet kept: scaled out by one in the write that takes it
  off the list). Rolled back (or its node out of the pool) before its pod ran there, the
  scale-out is given back while more pods wait than other nodes' scale-outs wait for.

A move lifts only a cordon it recorded (``gpufleet.io/cordoned-by``): a person's stays.

**One spare pool.** Remediation's spares and the pool's nodes are the same Kubernetes nodes. A
spare claim takes only a node labelled a spare that nobody leases, with a resourceVersion
precondition, and a move only a node of the pool (labelled training or inference) under the
node lease: the two never take the same node. A claimed spare is labelled training while its
pods are on their way: until one runs there it is no training node to move (busy, "claimed"),
and while its Slurm node still carries the incident's drain it is drained by someone else.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from clients import nodelease
from clients.errors import ClientError, Conflict, InvalidInput, NotFound, NotOwned
from clients.kube import KubeNode, KubernetesApi
from clients.nodesets import ELIGIBLE_ANNOTATION, PREFIX, NodeSetName, NodeSetPod, NotEligible
from clients.onslinky import (
    PRESTOP_REASON,
    SCALED_IN_ANNOTATION,
    SlinkyPool,
    SlinkySlurm,
    SlurmNodesOf,
    left_down,
    marks,
    nodesets_of,
    with_mark,
)
from clients.poolmoves import (
    INFERENCE,
    TO_INFERENCE_REASON,
    TRAINING,
    TRAINING_TAINT,
    HandedOver,
    OutOfPool,
    PoolMover,
    Say,
    _pool_of,
)
from clients.slurm import SlurmClient
from clients.spares import SparePool
from models.constants import CLAIMED_BY_ANNOTATION, CLUSTER_LABEL, POOL_LABEL, POOL_SINCE_ANNOTATION
from models.incident import NodeInfo

# On a node moved to inference: the NodeSets it left, as a JSON list of "<namespace>/<name>".
POOL_NODESETS_ANNOTATION = "gpufleet.io/pool-nodesets"
# On a NodeSet, written with its replicas in one write: the nodes (``<node>@<pool-since>``, a JSON
# list) pool moves scaled it out for, each removed once a pod of the NodeSet runs on its node (and
# SCALED_IN_ANNOTATION, clients/onslinky.py: the pods they scaled it in for).
SCALED_OUT_ANNOTATION = "gpufleet.io/scaled-out-for"
POD_CORDON = PREFIX + "pod-cordon"
POD_DELETION_COST = PREFIX + "pod-deletion-cost"
# On a Node a move cordoned: the move's holder, written before the cordon. A move lifts only a
# cordon so recorded (a person's cordon, made before or during a move, stays), and the record with it.
CORDONED_BY_ANNOTATION = "gpufleet.io/cordoned-by"
LOWEST_COST = str(-(2**31))  # the annotation is an int32: this pod goes first
# How long a scale-in waits for the operator to delete the pod and its Slurm node, and a
# scale-out for the new pod on this node, before the step is retried from where it is.
SCALE_WAIT_SECONDS = 120.0
_GONE_STATES = {"down", "unknown", "future"}


class SlinkyPoolMover(PoolMover):
    """``PoolMover`` on Slinky: ``slurm`` is the worker's ``SlinkySlurm`` (a Kubernetes node's
    calls answered over its NodeSet pods' Slurm nodes), ``namespace`` the cluster's (its NodeSets)."""

    def __init__(
        self,
        kube: KubernetesApi,
        slurm: SlurmClient,
        spares: SparePool,
        *,
        namespace: str,
        poll_seconds: float = 0.5,
        scale_wait_seconds: float = SCALE_WAIT_SECONDS,
    ) -> None:
        super().__init__(kube, slurm, spares, poll_seconds=poll_seconds)
        self._api = kube
        self._plain: SlurmClient = slurm.inner if isinstance(slurm, SlinkySlurm) else slurm
        self.of = SlurmNodesOf(kube)
        self._namespace = namespace
        self._scale_wait = scale_wait_seconds

    # -- what the pool reads ------------------------------------------------------------------------

    def slurm_nodes_of(self, nodes: list[str]) -> dict[str, list[str]]:
        """The Slurm nodes of each Kubernetes node: its NodeSet pods' (none on a node hosting none)."""
        return {name: [p.slurm_node for p in self._pods(name)] for name in nodes}

    def busy(self, node: KubeNode) -> str:
        """A claimed spare whose pods are on their way is no training node yet: the claim's."""
        claim = node.annotations.get(CLAIMED_BY_ANNOTATION)
        if claim and node.labels.get(POOL_LABEL) == TRAINING and not self._pods(node.name):
            return f"claimed by {claim} (its pods on their way)"
        return ""

    # -- reads ----------------------------------------------------------------------------------------

    def _pods(self, node: str) -> list[NodeSetPod]:
        """The NodeSet pods on the node now, not on their way out."""
        return [p for p in self.of.nodesets.nodeset_pods_on(node) if not p.terminating]

    def _infos(self, pods: list[NodeSetPod]) -> dict[str, NodeInfo]:
        infos = {}
        for pod in pods:
            try:
                infos[pod.slurm_node] = self._plain.node(pod.slurm_node)
            except NotFound:
                continue
        return infos

    def _someone_elses_drain(self, infos: dict[str, NodeInfo]) -> str:
        """A Slurm node of the node's pods held out by someone else. The preStop hook's reason is
        nobody's hold: it replaces a drain's reason when a pod stops, and the operator undrains
        what carries its own reason once the pod is back."""
        for name, info in infos.items():
            out = info.drained or info.state in {"down", "drained"}
            ours = info.reason == TO_INFERENCE_REASON or info.reason.startswith(PRESTOP_REASON)
            if out and info.reason and not ours:
                return f"{name} ({info.reason!r})"
        return ""

    def _nodeset(self, nodeset: NodeSetName) -> dict[str, Any]:
        return self._api.get_nodeset(nodeset.namespace, nodeset.name)

    @staticmethod
    def _annotations(obj: dict[str, Any]) -> dict[str, str]:
        return dict((obj.get("metadata") or {}).get("annotations") or {})

    @staticmethod
    def _recorded_nodesets(node: KubeNode) -> list[NodeSetName]:
        """The NodeSets a node left for inference, as recorded on it (none when no record)."""
        raw = node.annotations.get(POOL_NODESETS_ANNOTATION)
        if not raw:
            return []
        try:
            keys = [str(k) for k in json.loads(raw)]
        except (ValueError, TypeError):
            raise ClientError(f"{node.name}: annotation {POOL_NODESETS_ANNOTATION} is not a JSON list") from None
        return [NodeSetName(*key.split("/", 1)) for key in keys if "/" in key]

    def _left_nodesets(self, node: KubeNode, partition: str) -> list[NodeSetName]:
        """The NodeSets a node left for inference (recorded), else the NodeSet of the worker's
        partition in the cluster's namespace (named after it); InvalidInput when there is none."""
        if found := self._recorded_nodesets(node):
            return found
        names = sorted(
            str((n.get("metadata") or {}).get("name") or "") for n in self._api.list_nodesets(self._namespace)
        )
        if not names:
            raise InvalidInput(f"no NodeSet in namespace {self._namespace}: no NodeSet for {node.name} to join")
        if partition not in names:
            raise InvalidInput(
                f"{node.name} records no NodeSet to join, and GPUFLEET_PARTITION={partition!r} names no NodeSet in "
                f"namespace {self._namespace} (there: {', '.join(names)}): set GPUFLEET_PARTITION to the name of the "
                f"NodeSet (its partition) whose pods {node.name} should run"
            )
        return [NodeSetName(self._namespace, partition)]

    # -- training -> inference ----------------------------------------------------------------------

    def to_inference(
        self,
        node: str,
        *,
        holder: str,
        partition: str,
        grace_seconds: float,
        deadline_seconds: float,
        move: str = "",
        say: Say = lambda _: None,
    ) -> str:
        current = self._take_pool_node(node, holder)
        if why := self.busy(current):
            self.give_back(node, holder)
            raise NotOwned(f"{node} is {why}")
        pods = self._pods(node)
        requeued: list[int] = []
        if pods:
            infos = self._infos(pods)
            if held := self._someone_elses_drain(infos):
                self.give_back(node, holder)
                raise NotOwned(f"{node}: {held} is drained by someone else: left to them")
            if missing := [p.slurm_node for p in pods if p.slurm_node not in infos]:
                self.give_back(node, holder)
                raise NotOwned(f"{node}: Slurm does not know {', '.join(missing)} yet (a pod just started there)")
            started = any(info.drained and info.reason == TO_INFERENCE_REASON for info in infos.values())
            nodesets = nodesets_of(pods)
            if not started and (why := self._not_ready_to_scale_in(nodesets)):
                self.give_back(node, holder)
                raise NotOwned(f"{node} stays in training for now: {why}")
            keys = json.dumps([n.key for n in nodesets])
            if current.annotations.get(POOL_NODESETS_ANNOTATION) != keys:
                self._write_if_held(node, holder, annotations={POOL_NODESETS_ANNOTATION: keys})
            for name, info in sorted(infos.items()):
                if not info.drained:
                    self._plain.drain(name, reason=TO_INFERENCE_REASON)
                    say(f"{name} (on {node}) drained in Slurm")
            requeued = self._empty(
                node,
                move=move or f"{holder}:{node}",
                holder=holder,
                grace_seconds=grace_seconds,
                deadline_seconds=deadline_seconds,
                say=say,
            )
            self._left(node, holder=holder, seconds=max(grace_seconds, 60.0), say=say)
            self._ours(node, holder)
            for nodeset in nodesets:  # its pods are here: a scale-out for it (a rolled-back move's) is spent
                self._forget_scale_out(node, nodeset)
            for nodeset in nodesets:  # no pod comes (back) here any more
                self.of.nodesets.make_ineligible(node, nodeset, also_unrecorded=True, keep=frozenset({CLUSTER_LABEL}))
            for pod in pods:
                self._scale_in(node, pod, holder=holder, say=say)
        else:  # no pod here: still, no NodeSet's pod may come here once it serves inference
            left = {n.key: n for n in [*SlinkyPool._eligible_for(current), *self._recorded_nodesets(current)]}
            self._ours(node, holder)
            for nodeset in SlinkyPool._eligible_for(current):
                self.of.nodesets.make_ineligible(node, nodeset, keep=frozenset({CLUSTER_LABEL}))
            for nodeset in sorted(left.values(), key=lambda n: n.key):
                # A move to training that scaled out for this node and stops here (rolled back).
                self._ours(node, holder)
                self._undo_scale_out(node, nodeset, say=say)
        # A pod on its way out (an earlier attempt's scale-in, the operator deleting it) still
        # runs slurmd here: the node serves no inference before it and its Slurm node are gone.
        for pod in [p for p in self.of.nodesets.nodeset_pods_on(node) if p.terminating]:
            self._await(
                lambda p=pod: self._gone(p),
                node=node,
                holder=holder,
                what=f"{pod.key} and its Slurm node {pod.slurm_node} to be deleted by the scale-in",
                say=say,
            )
        self._ours(node, holder)
        self._label(node, INFERENCE, holder)
        self._uncordon_ours(node, holder)
        self._kube.remove_taint(node, key=TRAINING_TAINT)
        self.give_back(node, holder)
        jobs = f"; requeued {', '.join(map(str, requeued))}" if requeued else ""
        return f"{node} serves inference{jobs}"

    def _not_ready_to_scale_in(self, nodesets: list[NodeSetName]) -> str:
        """Why a scale-in now could take another pod than this node's ('' when it cannot)."""
        for nodeset in nodesets:
            if why := _unready(nodeset, self._nodeset(nodeset)):
                return why
        return ""

    def _scale_in(self, node: str, pod: NodeSetPod, *, holder: str, say: Say) -> None:
        """The NodeSet scaled in by one with ``pod`` first, once: the pod named on the NodeSet in
        the same write as its replicas; then wait for the pod and its Slurm node to be gone."""
        mark = f"{pod.name}/{pod.uid}"
        self._await_unprotected(node, pod, holder=holder, say=say)
        ends = time.monotonic() + self._scale_wait
        while True:
            found = self._nodeset(pod.nodeset)
            scaled_in = marks(self._annotations(found), SCALED_IN_ANNOTATION)
            if mark in scaled_in:
                break  # by an earlier attempt
            now = self._api.find_pod(pod.namespace, pod.name)
            if now is None or now.uid != pod.uid:
                break  # gone already, by someone else's scale-in
            self._ours(node, holder)
            if why := _unready(pod.nodeset, found):
                # Written at the resourceVersion of a read that found every pod ready: a pod
                # that stops being ready meanwhile changes the NodeSet's status, and the write fails.
                if time.monotonic() >= ends:
                    raise ClientError(f"{node}: {why}; the move waits")
                say(f"{node}: {why}; waiting")
                time.sleep(self._poll)
                continue
            replicas = int((found.get("spec") or {}).get("replicas", 1))
            if replicas < 1:
                raise ClientError(f"NodeSet {pod.nodeset.key} has no replica to scale in, yet {pod.key} runs")
            # Lowest deletion cost and cordoned: first in the operator's scale-in order of running
            # pods. Written only now, right before the scale-in: a move that stops before it
            # leaves no mark on a pod that stays (to_training and settle take off any left).
            try:
                self._api.update_pod_metadata(
                    pod.namespace, pod.name, annotations={POD_DELETION_COST: LOWEST_COST, POD_CORDON: "true"}
                )
            except NotFound:
                continue  # gone meanwhile: read again
            try:
                self._api.patch_nodeset(
                    pod.nodeset.namespace,
                    pod.nodeset.name,
                    {
                        "metadata": {
                            "annotations": {SCALED_IN_ANNOTATION: with_mark(scaled_in, mark)},
                            "resourceVersion": (found.get("metadata") or {}).get("resourceVersion"),
                        },
                        "spec": {"replicas": replicas - 1},
                    },
                )
            except Conflict:
                continue  # the NodeSet changed since it was read: read it again
            say(f"NodeSet {pod.nodeset.key} scaled in to {replicas - 1}, {pod.name} first")
            break
        self._await(
            lambda: self._gone(pod),
            node=node,
            holder=holder,
            what=f"{pod.key} and its Slurm node {pod.slurm_node} to be deleted by the scale-in",
            say=say,
        )

    def _await_unprotected(self, node: str, pod: NodeSetPod, *, holder: str, say: Say) -> None:
        def free() -> bool:
            now = self._api.find_pod(pod.namespace, pod.name)
            return now is None or now.uid != pod.uid or not NodeSetPod.model_validate(now.model_dump()).protected

        self._await(free, node=node, holder=holder, what=f"{pod.key} to lose pod-protect (its jobs gone)", say=say)

    def _gone(self, pod: NodeSetPod) -> bool:
        """The pod deleted, and its Slurm node deleted or left DOWN: slurm-operator (v1.2.1, StatefulSet
        mode) never deletes the Slurm node of a pod it scaled in; its preStop hook sets it DOWN, and
        the record stays until a pod of that name registers again."""
        now = self._api.find_pod(pod.namespace, pod.name)
        if now is not None and now.uid == pod.uid:
            return False
        if now is not None:
            return True  # a new pod of that name (a scale-out elsewhere) holds the Slurm node now
        try:
            info = self._plain.node(pod.slurm_node)
        except NotFound:
            return True
        return left_down(info)

    def _await(self, done: Any, *, node: str, holder: str, what: str, say: Say) -> None:
        ends = time.monotonic() + self._scale_wait
        while not done():
            if time.monotonic() >= ends:
                raise ClientError(f"{node}: still waiting for {what} after {self._scale_wait:g}s; the move waits on")
            self._ours(node, holder)
            say(f"{node}: waiting for {what}")
            time.sleep(self._poll)

    def _write_if_held(self, node: str, holder: str, **metadata: Any) -> None:
        try:
            nodelease.update_if_held(self._kube, node, holder, **metadata)
        except NotOwned as exc:
            raise HandedOver(str(exc)) from None

    # -- inference -> training ----------------------------------------------------------------------

    def to_training(
        self,
        node: str,
        *,
        holder: str,
        partition: str,
        eviction_timeout_seconds: float,
        say: Say = lambda _: None,
    ) -> str:
        current = self._take_pool_node(node, holder)
        nodesets = self._left_nodesets(current, partition)
        moved = 0
        if _pool_of(current) != TRAINING:
            self._kube.add_taint(node, key=TRAINING_TAINT, value=TRAINING, effect="NoSchedule")
            self._cordon(current, holder)
            moved = self._vacate(node, holder=holder, deadline=time.monotonic() + eviction_timeout_seconds, say=say)
            self._ours(node, holder)
            self._label(node, TRAINING, holder)
        # Uncordoned before it is made eligible: the operator binds no pod to a cordoned node (and
        # drains the Slurm node of one there); the training taint keeps inference off.
        self._uncordon_ours(node, holder)
        since = self._kube.get_node(node).annotations.get(POOL_SINCE_ANNOTATION, "")
        for nodeset in nodesets:
            self._ours(node, holder)
            try:
                self.of.nodesets.make_eligible(node, nodeset)
            except NotEligible as exc:
                raise ClientError(str(exc)) from None
            self._scale_out(node, nodeset, mark=f"{node}@{since}", holder=holder, say=say)
        for nodeset in nodesets:
            self._await(
                lambda ns=nodeset: self._serving(node, ns),
                node=node,
                holder=holder,
                what=f"a pod of NodeSet {nodeset.key} running here and its Slurm node registered",
                say=say,
            )
        self._ours(node, holder)
        for pod in self._pods(node):  # a drain of a move to inference that never finished
            info = self._infos([pod]).get(pod.slurm_node)
            if info is not None and info.drained and info.reason == TO_INFERENCE_REASON:
                self._plain.resume(pod.slurm_node)
        self._in_training(node, nodesets)
        self._write_if_held(node, holder, annotations={POOL_NODESETS_ANNOTATION: None})
        self.give_back(node, holder)
        pods = f"; {moved} pod(s) moved away" if moved else ""
        return f"{node} serves training{pods}"

    def _scale_out(self, node: str, nodeset: NodeSetName, *, mark: str, holder: str, say: Say) -> None:
        """One more replica for this node, once: none when a pod of the NodeSet runs here already,
        or an earlier attempt's write names this node (its mark stays until its pod is here)."""
        while True:
            found = self._nodeset(nodeset)
            annotations = self._annotations(found)
            scaled_in = marks(annotations, SCALED_IN_ANNOTATION)
            here = [p for p in self._pods(node) if p.nodeset == nodeset]
            if any(f"{p.name}/{p.uid}" not in scaled_in for p in here):
                return
            replicas = int((found.get("spec") or {}).get("replicas", 1))
            if here:  # scaled in for, not yet deleted: its replica back, in the write that unmarks it
                if self._keep(here[0], found, scaled_in, replicas, say=say):
                    return
                continue
            scaled_out = marks(annotations, SCALED_OUT_ANNOTATION)
            if mark in scaled_out:
                return  # by an earlier attempt of this move (another move's mark is no scale-out for it)
            try:
                self._api.patch_nodeset(
                    nodeset.namespace,
                    nodeset.name,
                    {
                        "metadata": {
                            "annotations": {SCALED_OUT_ANNOTATION: with_mark(scaled_out, mark)},
                            "resourceVersion": (found.get("metadata") or {}).get("resourceVersion"),
                        },
                        "spec": {"replicas": replicas + 1},
                    },
                )
            except Conflict:
                continue
            say(f"NodeSet {nodeset.key} scaled out to {replicas + 1} for {node}")
            return

    def _keep(self, pod: NodeSetPod, found: dict[str, Any], scaled_in: list[str], replicas: int, *, say: Say) -> bool:
        """A pod a move's scale-in marked and the operator has not deleted yet, kept: the NodeSet
        scaled out by one and the pod's mark removed in one write (at the read's resourceVersion:
        the operator deleting the pod meanwhile changes the NodeSet, and the write fails), then
        its deletion-cost and pod-cordon off. False when the NodeSet changed: read it again."""
        mark = f"{pod.name}/{pod.uid}"
        left = [m for m in scaled_in if m != mark]
        try:
            self._api.patch_nodeset(
                pod.nodeset.namespace,
                pod.nodeset.name,
                {
                    "metadata": {
                        "annotations": {SCALED_IN_ANNOTATION: _compact(left)},
                        "resourceVersion": (found.get("metadata") or {}).get("resourceVersion"),
                    },
                    "spec": {"replicas": replicas + 1},
                },
            )
        except Conflict:
            return False
        say(f"NodeSet {pod.nodeset.key} scaled out to {replicas + 1}: {pod.name} stays")
        with contextlib.suppress(NotFound):  # gone meanwhile: nothing to take off
            self._api.update_pod_metadata(
                pod.namespace, pod.name, annotations={POD_DELETION_COST: None, POD_CORDON: None}
            )
        return True

    def _in_training(self, node: str, nodesets: list[NodeSetName]) -> None:
        """The node in training for good: the scale-out marks for it gone from its NodeSets, and
        the scale-in marks gone from its pods that no scale-in is taking away (a move to inference
        that stopped after it marked them)."""
        for nodeset in nodesets:
            self._forget_scale_out(node, nodeset)
        for pod in self._pods(node):
            if pod.annotations.get(POD_DELETION_COST) != LOWEST_COST:
                continue  # no mark of a move's (the two are written together); a pod-cordon stays its owner's
            if f"{pod.name}/{pod.uid}" in marks(self._annotations(self._nodeset(pod.nodeset)), SCALED_IN_ANNOTATION):
                continue  # its NodeSet scaled in for it: the operator's to take
            try:
                self._api.update_pod_metadata(
                    pod.namespace, pod.name, annotations={POD_DELETION_COST: None, POD_CORDON: None}
                )
            except NotFound:
                continue

    def _forget_scale_out(self, node: str, nodeset: NodeSetName) -> None:
        """The NodeSet's scale-out marks for this node removed (its pod is here)."""
        while True:
            found = self._nodeset(nodeset)
            scaled_out = marks(self._annotations(found), SCALED_OUT_ANNOTATION)
            left = [m for m in scaled_out if not m.startswith(f"{node}@")]
            if left == scaled_out:
                return
            try:
                self._api.patch_nodeset(
                    nodeset.namespace,
                    nodeset.name,
                    {
                        "metadata": {
                            "annotations": {SCALED_OUT_ANNOTATION: _compact(left)},
                            "resourceVersion": (found.get("metadata") or {}).get("resourceVersion"),
                        }
                    },
                )
            except Conflict:
                continue
            return

    def _undo_scale_out(self, node: str, nodeset: NodeSetName, *, say: Say) -> None:
        """A scale-out for this node whose pod never ran here, undone: the NodeSet scaled back in,
        with the mark removed in the same write, only while more of its pods wait (Pending, or on
        no node: the operator takes those first) than other nodes' scale-outs wait for, and its
        status is current; else the mark only removed (its pod runs, or the pod waiting is another
        node's or an incident's)."""
        while True:
            found = self._nodeset(nodeset)
            scaled_out = marks(self._annotations(found), SCALED_OUT_ANNOTATION)
            mine = [m for m in scaled_out if m.startswith(f"{node}@")]
            if not mine:
                return
            rest = [m for m in scaled_out if m not in mine]
            left = _compact(rest)
            body: dict[str, Any] = {
                "metadata": {
                    "annotations": {SCALED_OUT_ANNOTATION: left},
                    "resourceVersion": (found.get("metadata") or {}).get("resourceVersion"),
                }
            }
            replicas = int((found.get("spec") or {}).get("replicas", 1))
            spare = not any(p.nodeset == nodeset for p in self._pods(node)) and self._waiting(nodeset) > len(rest)
            if spare and replicas > 0 and _current(found):
                body["spec"] = {"replicas": replicas - 1}
            try:
                self._api.patch_nodeset(nodeset.namespace, nodeset.name, body)
            except Conflict:
                continue
            if "spec" in body:
                say(f"NodeSet {nodeset.key} scaled back in to {replicas - 1}: its pod for {node} never ran there")
            return

    def _waiting(self, nodeset: NodeSetName) -> int:
        """How many of the NodeSet's pods wait for a node: Pending or on none, not on their way out."""
        return sum(
            1
            for p in self._api.pods_in(nodeset.namespace)
            if p.owner_kind == "NodeSet"
            and p.owner_name == nodeset.name
            and not p.terminating
            and (not p.node or p.phase == "Pending")
        )

    def _undo_scale_outs(self, node: str) -> None:
        """A node that left the pool mid-move: each NodeSet's scale-out for it that never ran there undone."""
        for found in self._api.list_nodesets(self._namespace):
            if any(m.startswith(f"{node}@") for m in marks(self._annotations(found), SCALED_OUT_ANNOTATION)):
                name = str((found.get("metadata") or {}).get("name") or "")
                self._undo_scale_out(node, NodeSetName(self._namespace, name), say=lambda _: None)

    def _stay_inference(self, node: str, holder: str) -> None:
        """Undo the start of a move to training: its cordon lifted (before the taint goes: a cordon
        without the taint reads as someone else's), the taint off, let go."""
        self._uncordon_ours(node, holder)
        self._kube.remove_taint(node, key=TRAINING_TAINT)
        self.give_back(node, holder)

    def _cordon(self, current: KubeNode, holder: str) -> None:
        """Cordoned by this move, recorded first (``CORDONED_BY_ANNOTATION``): a node someone
        else cordoned already is left as it is, their cordon never recorded as a move's."""
        if current.unschedulable and not current.annotations.get(CORDONED_BY_ANNOTATION):
            return
        if not current.annotations.get(CORDONED_BY_ANNOTATION):
            self._write_if_held(current.name, holder, annotations={CORDONED_BY_ANNOTATION: holder})
        self._kube.set_unschedulable(current.name, True)

    def _uncordon_ours(self, node: str, holder: str) -> None:
        """Uncordoned, when a move recorded the cordon as its own, and the record then removed; a
        cordon with no record is someone else's and stays."""
        self._ours(node, holder)
        current = self._kube.get_node(node)
        if not current.annotations.get(CORDONED_BY_ANNOTATION):
            return
        if current.unschedulable:
            self._kube.set_unschedulable(node, False)
        self._write_if_held(node, holder, annotations={CORDONED_BY_ANNOTATION: None})

    def _serving(self, node: str, nodeset: NodeSetName) -> bool:
        pods = [p for p in self._pods(node) if p.nodeset == nodeset and p.back]
        if not pods:
            return False
        infos = self._infos(pods)
        return any(info.state not in _GONE_STATES and "NOT_RESPONDING" not in info.flags for info in infos.values())

    # -- after a hand-over --------------------------------------------------------------------------

    def settle(
        self,
        node: str,
        *,
        to: str,
        holder: str,
        partition: str,
        grace_seconds: float,
        deadline_seconds: float,
        eviction_timeout_seconds: float,
        move: str = "",
        say: Say = lambda _: None,
    ) -> str:
        """As ``PoolMover.settle``, with "in training" meaning: the node hosts a NodeSet pod that
        no scale-in of a move is taking away, and still matches its NodeSet."""
        current = self._settle_current(node, holder)
        pods = self._pods(node)
        if held := self._someone_elses_drain(self._infos(pods)):
            raise NotOwned(f"{node} waits for whoever drained {held} in Slurm")
        pool = _pool_of(current)
        in_training = bool(pods) and not any(self._leaving(pod, current) for pod in pods)
        tainted = any(t.get("key") == TRAINING_TAINT for t in current.taints)
        self._take_pool_node(node, holder)
        if pool == TRAINING and in_training:
            for name, info in self._infos(pods).items():
                if info.drained and info.reason == TO_INFERENCE_REASON:
                    self._plain.resume(name)
            self._in_training(node, nodesets_of(pods))
            self._uncordon_ours(node, holder)  # a move's cordon (recorded); someone else's stays
            self.give_back(node, holder)
            return f"{node} is wholly in training"
        if pool == INFERENCE and not pods and not current.annotations.get(ELIGIBLE_ANNOTATION):
            self._uncordon_ours(node, holder)
            if tainted:
                self._kube.remove_taint(node, key=TRAINING_TAINT)
            self.give_back(node, holder)
            return f"{node} is wholly in inference"
        say(f"{node} is between pools: its move to {to} is finished")
        return self._finish(
            node,
            to=to,
            holder=holder,
            partition=partition,
            grace_seconds=grace_seconds,
            deadline_seconds=deadline_seconds,
            eviction_timeout_seconds=eviction_timeout_seconds,
            move=move,
            say=say,
        )

    def _leaving(self, pod: NodeSetPod, node: KubeNode) -> bool:
        """A pod a move to inference has begun to take away: its NodeSet scaled in for it, or the
        node no longer eligible for its NodeSet."""
        found = self._nodeset(pod.nodeset)
        if f"{pod.name}/{pod.uid}" in marks(self._annotations(found), SCALED_IN_ANNOTATION):
            return True
        selector = ((((found.get("spec") or {}).get("template") or {}).get("spec") or {}).get("nodeSelector")) or {}
        return any(node.labels.get(k) != v for k, v in selector.items())

    def _settle_current(self, node: str, holder: str) -> KubeNode:
        """The Node, once nobody else has it (as ``PoolMover.settle`` waits)."""
        try:
            current = self._kube.get_node(node)
        except NotFound:
            self._undo_scale_outs(node)
            raise OutOfPool(f"{node} is no longer a Kubernetes node: it has left the shared pool") from None
        pool = _pool_of(current)
        if pool not in (TRAINING, INFERENCE):
            self._undo_scale_outs(node)
            raise OutOfPool(f"{node} is no longer in the shared pool (gpufleet.io/pool={pool or 'none'})")
        if waiting := self._waiting_for(current, holder):
            raise NotOwned(f"{node} waits for {waiting}")
        return current


def _compact(left: list[str]) -> str | None:
    """A mark list as ``with_mark`` writes it (compact JSON); none left, the annotation removed."""
    return json.dumps(left, separators=(",", ":")) if left else None


def _current(found: dict[str, Any]) -> bool:
    """Whether the NodeSet's status is of its spec as read (the operator has seen its last change)."""
    observed = (found.get("status") or {}).get("observedGeneration")
    generation = (found.get("metadata") or {}).get("generation")
    return observed is None or generation is None or int(observed) >= int(generation)


def _unready(nodeset: NodeSetName, found: dict[str, Any]) -> str:
    """Why a scale-in of the NodeSet as read (``found``) could take another pod than the one
    given the lowest deletion cost ('' when it cannot): the operator scales in unassigned,
    Pending and not-ready pods before any running one."""
    wanted = int((found.get("spec") or {}).get("replicas", 1))
    status = found.get("status") or {}
    ready, have = int(status.get("readyReplicas") or 0), int(status.get("replicas") or 0)
    if wanted == have == ready:
        return ""
    return (
        f"NodeSet {nodeset.key} has {wanted} replica(s), {have} pod(s), {ready} ready: a pod waiting for a node "
        "(an incident's?) would be scaled in before this node's"
    )
