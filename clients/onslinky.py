"""Remediation on Slinky (slurm-operator 1.x): the same incident, with the Slurm nodes of a failed
Kubernetes node being NodeSet pods.

**What an incident is keyed on.** The Kubernetes node: the detector runs there, and a hardware
fault takes down every Slurm node it hosts. ``SlinkySlurm`` answers the incident's Slurm calls for
that node over the Slurm nodes of the NodeSet pods on it (one Kubernetes node may host several):
their drain, their jobs, their state taken together. The pods are recorded on the Node
(``gpufleet.io/slurm-nodes``) when the incident drains them, so that once they have been evicted
and come back elsewhere under their names, the incident still knows which Slurm nodes were its own.
A name that is not a Kubernetes node hosting (or recording) NodeSet pods is a Slurm node's own name.

**Replacing the node, with no partition edited.** The operator makes partitions from NodeSets; a
Slurm node joins one by its pod landing on a node the NodeSet may use. So:

- the failed node is cordoned with a ``node-cordon-reason`` naming the incident (the operator's
  drain keeps gpufleet's earlier one, which is external to it and stays), its eligibility labels
  come off (a ``pinToNode`` pin lets go), and each NodeSet pod on it is evicted once it may go:
  never forced past the pod-protect PodDisruptionBudget; a pod still protected after the
  eviction timeout ends the incident, saying so (``SlinkyDrain``);
- a spare is a Kubernetes node with no Slurm node. Claiming one makes it eligible for the failed
  node's NodeSets (their ``nodeSelector`` labels, the pool taint where the pods tolerate it), then
  waits for the evicted pods to come back Running under their names and their Slurm nodes to
  register; a Slurm node whose drain is still this incident's is resumed, any other drain (the
  operator's after its preStop hook, a person's) is left to its owner (``SlinkyPool``);
- the retired node keeps no eligibility label; a returned node gets them back (``training``) or
  stays a bare spare.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import datetime

from clients.errors import ClientError, InvalidInput, NotFound, NotOwned, Unavailable, checked_node_name
from clients.kube import KubeClient, KubeNode, KubernetesApi
from clients.nodesets import (
    ELIGIBLE_ANNOTATION,
    NODE_CORDON_REASON,
    POD_HOSTNAME,
    NodeSetName,
    NodeSetPod,
    NodeSets,
    NotEligible,
    ours_cordon_reason,
)
from clients.slurm import Pending, SlurmClient, SlurmTopology
from clients.slurmrest_protocol import PENDING, REQUEUED, unsupported_methods
from clients.spares import SparePool
from models.constants import (
    CLAIM_LABEL,
    CLAIMED_BY_ANNOTATION,
    INCIDENT_ANNOTATION,
    NODE_LEASE_ANNOTATION,
    POOL_INFERENCE,
    POOL_LABEL,
    POOL_SPARE,
    POOL_TRAINING,
    QUARANTINE_LABEL,
    RETIRED_TAINT,
    UNHEALTHY_TAINT,
    drained_by,
    held_by_someone_else,
    owned_reason,
)
from models.incident import JobInfo, NodeInfo
from models.names import label_value

log = logging.getLogger(__name__)

# On a Kubernetes node: the NodeSet pods an incident drained there, as JSON
# ``[{"namespace": ..., "name": ..., "uid": ..., "nodeset": ...}]`` (a pod's name is its Slurm node's).
SLURM_NODES_ANNOTATION = "gpufleet.io/slurm-nodes"
# On a NodeSet: the pods (``<name>/<uid>``) pool moves scaled it in for, a JSON list, the latest
# last, written with its replicas in one write (clients/slinkymoves.py). One move's mark is not
# overwritten by the next move's: an incident that took a node over after its scale-in still
# knows its pod is gone for good.
SCALED_IN_ANNOTATION = "gpufleet.io/scaled-in-for"
# The most marks such a list keeps (the oldest go first).
MARKS_KEPT = 64
# The reason the operator's preStop hook gives the Slurm node of a pod it deletes; in StatefulSet
# mode (slurm-operator v1.2.1) the node then stays in Slurm, DOWN, until a pod of its name is back.
PRESTOP_REASON = "slurm-operator: Pod is terminating"
# How long a claim waits for the failed node's pods to be back on the spare before it is tried
# again (its step is 3 minutes; a retry finds its own claim and waits on).
BACK_WAIT_SECONDS = 150.0
POLL_SECONDS = 0.5
# Partition edits: the operator makes a NodeSet's partition; gpufleet never edits one there.
_NO_PARTITION_EDITS = (
    "no partition is edited on Slinky: slurm-operator makes each NodeSet's partition, and a Slurm node "
    "joins it by its pod landing on a node the NodeSet may use"
)
_GONE_STATES = {"down", "unknown", "future"}

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- which Slurm nodes a Kubernetes node stands for -------------------------------------------------


def _recorded(node: KubeNode) -> tuple[str, list[NodeSetPod]]:
    """The incident that recorded the node's pods, and the pods ("" and none when no record)."""
    raw = node.annotations.get(SLURM_NODES_ANNOTATION)
    if not raw:
        return "", []
    try:
        data = json.loads(raw)
        pods = [
            NodeSetPod(
                namespace=p["namespace"],
                name=p["name"],
                uid=p.get("uid", ""),
                owner_kind="NodeSet",
                owner_name=p["nodeset"],
                labels={POD_HOSTNAME: p.get("slurm_node") or p["name"]},
            )
            for p in data["pods"]
        ]
        return str(data.get("incident") or ""), pods
    except (ValueError, KeyError, TypeError):
        raise ClientError(
            f"{node.name}: annotation {SLURM_NODES_ANNOTATION} is not what gpufleet wrote: {raw[:200]!r}"
        ) from None


def _record(incident_id: str, pods: list[NodeSetPod]) -> str:
    entries = [
        {"namespace": p.namespace, "name": p.name, "uid": p.uid, "nodeset": p.owner_name, "slurm_node": p.slurm_node}
        for p in sorted(pods, key=lambda p: p.key)
    ]
    return json.dumps({"incident": incident_id, "pods": entries}, sort_keys=True, separators=(",", ":"))


def nodesets_of(pods: list[NodeSetPod]) -> list[NodeSetName]:
    """The NodeSets the pods belong to, each once, in order."""
    return sorted({pod.nodeset for pod in pods}, key=lambda n: n.key)


def _joined(first: list[NodeSetPod], then: list[NodeSetPod]) -> list[NodeSetPod]:
    """``first``, and each of ``then`` not among them by namespace and name (the first UID kept)."""
    known = {p.key for p in first}
    return [*first, *(p for p in then if p.key not in known)]


def marks(annotations: dict[str, str], key: str) -> list[str]:
    """The marks a NodeSet's annotation holds (a JSON list; a single mark as written before)."""
    raw = annotations.get(key)
    if not raw:
        return []
    try:
        found = json.loads(raw)
    except ValueError:
        return [raw]
    return [str(m) for m in found] if isinstance(found, list) else [raw]


def with_mark(current: list[str], mark: str) -> str:
    """The annotation's value with ``mark`` added last (at most MARKS_KEPT marks)."""
    return json.dumps([*(m for m in current if m != mark), mark][-MARKS_KEPT:], separators=(",", ":"))


def left_down(info: NodeInfo) -> bool:
    """Whether a Slurm node is only the record a deleted pod left: DOWN by the operator's preStop
    hook, or not responding (its slurmd gone)."""
    if info.state in {"unknown", "future"}:
        return True
    return info.state.startswith("down") and (prestop_down(info) or "NOT_RESPONDING" in info.flags)


def prestop_down(info: NodeInfo) -> bool:
    """DOWN by the operator's preStop hook (Slurm adds ' : Not responding' to the reason once the
    gone slurmd misses its timeout)."""
    return info.state.startswith("down") and info.reason.startswith(PRESTOP_REASON)


def leftover(info: NodeInfo, *, hosted: bool = False) -> bool:
    """Whether a Slurm node is only the record of a pod that is gone (no member of its partition):
    DOWN by the operator's preStop hook (slurm-operator v1.2.1 keeps it until a pod of its name
    registers again), and no pod of its name ``hosted`` on a node now."""
    return not hosted and prestop_down(info)


class SlurmNodesOf:
    """The NodeSet pods (so the Slurm nodes) a Kubernetes node stands for: those on it now, and
    those an incident recorded there before they left (evicted, back elsewhere under their names).

    The record names its incident: a later incident's record replaces it, the same incident's
    (a retry after some pods left) only adds to it, so a pod once recorded is never forgotten
    until the node is returned (``return_node`` removes the record)."""

    def __init__(self, kube: KubernetesApi) -> None:
        self._kube = kube
        self.nodesets = NodeSets(kube)

    def pods(self, node: str) -> list[NodeSetPod]:
        node = checked_node_name(node)
        live = self.nodesets.nodeset_pods_on(node)
        try:
            _, recorded = _recorded(self._kube.get_node(node))
        except NotFound:
            recorded = []
        return _joined(recorded, live)

    def record(self, node: str, incident_id: str) -> list[NodeSetPod]:
        """Record the pods on ``node`` now for ``incident_id`` (beside those it recorded before);
        returns every pod the node stands for."""
        live = self.nodesets.nodeset_pods_on(checked_node_name(node))
        try:
            current = self._kube.get_node(node)
        except NotFound:
            return live
        by, recorded = _recorded(current)
        pods = _joined(recorded, live) if by == incident_id else live
        if not pods:
            return recorded  # nothing here to record (someone else's record, if any, stays)
        wanted = _record(incident_id, pods)
        if current.annotations.get(SLURM_NODES_ANNOTATION) != wanted:
            self._kube.update_metadata(node, annotations={SLURM_NODES_ANNOTATION: wanted})
        return pods


# The Slurm methods a worker on Slinky never calls: the NodeSets' partitions are the operator's.
PARTITION_EDITS = frozenset({"add_to_partition", "remove_from_partition"})


def slinky_unsupported(slurm: object) -> dict[str, str]:
    """Method -> why it is not served on Slinky over ``slurm``: its own gaps, but ``requeue``
    where DOWN serves it (API before v0.0.45), and the partition edits."""
    lacking = dict(unsupported_methods(slurm))
    if "requeue" in lacking and "down" not in lacking and hasattr(slurm, "requeue_by_down"):
        lacking.pop("requeue")  # served by DOWN (running jobs; an ended one is reported)
    lacking["add_to_partition"] = lacking["remove_from_partition"] = _NO_PARTITION_EDITS
    return lacking


def combined(name: str, infos: list[NodeInfo]) -> NodeInfo:
    """The Slurm nodes of one Kubernetes node as one: the state and reason of the one that says
    most (someone else's hold, then gpufleet's drain, then any drain or DOWN, then the first), the
    partitions and flags of all of them."""

    def weight(info: NodeInfo) -> int:
        out = info.drained or info.state in {"down", "drained"}
        if out and held_by_someone_else(info.reason):
            return 0
        if out and owned_reason(info.reason):
            return 1
        return 2 if out else 3

    first = sorted(infos, key=weight)[0]
    flags = list(dict.fromkeys(flag for info in infos for flag in info.flags))
    partitions = sorted({p for info in infos for p in info.partitions})
    return first.model_copy(update={"name": name, "flags": flags, "partitions": partitions})


class SlinkySlurm:
    """SlurmClient for incidents keyed on Kubernetes nodes of a Slinky cluster (see the module's
    docstring); every other call goes to ``slurm`` (slurmrestd) unchanged.

    Over an API before v0.0.45 (no requeue), a running job is requeued by setting DOWN the node
    gpufleet drained under it, which requeues every requeue-able batch job there at once; a job
    that has ended cannot be requeued there and is reported so (its owner is told).
    """

    def __init__(self, slurm: SlurmClient, kube: KubernetesApi) -> None:
        self._slurm = slurm
        self.of = SlurmNodesOf(kube)

    @property
    def inner(self) -> SlurmClient:
        return self._slurm

    @property
    def version(self) -> str:
        return str(getattr(self._slurm, "version", ""))

    def unsupported(self) -> dict[str, str]:
        return slinky_unsupported(self._slurm)

    def slurm_nodes(self, name: str) -> list[str]:
        """The Slurm nodes ``name`` stands for: its NodeSet pods' (now or recorded), else itself."""
        pods = self.of.pods(name)
        return [pod.slurm_node for pod in pods] if pods else [checked_node_name(name)]

    def _each(self, name: str, *, incident_id: str | None = None) -> list[str]:
        if incident_id is not None:
            pods = self.of.record(name, incident_id)
            return [pod.slurm_node for pod in pods] if pods else [checked_node_name(name)]
        return self.slurm_nodes(name)

    # -- nodes ----------------------------------------------------------------------------------------

    def node(self, name: str) -> NodeInfo:
        names = self.slurm_nodes(name)
        if names == [name]:
            return self._slurm.node(name)
        infos = []
        for slurm_node in names:
            try:
                infos.append(self._slurm.node(slurm_node))
            except NotFound:
                continue
        if not infos:
            raise NotFound(f"{name} hosts NodeSet pod(s) {', '.join(names)}, and Slurm knows none of their nodes yet")
        return combined(name, infos)

    def nodes(self) -> list[NodeInfo]:
        return self._slurm.nodes()

    def drain(self, name: str, *, reason: str) -> NodeInfo:
        """Each Slurm node drained with ``reason`` (one drained by someone else keeps theirs); the
        pods are recorded on the Node first."""
        for slurm_node in self._each(name, incident_id=drained_by(reason) or reason):
            self._slurm.drain(slurm_node, reason=reason)
        return self.node(name)

    def down(self, name: str, *, reason: str) -> None:
        for slurm_node in self._each(name):
            self._slurm.down(slurm_node, reason=reason)

    def resume(self, name: str) -> None:
        """Each Slurm node gpufleet took out (none that someone else holds)."""
        names = self._each(name)
        if names == [name]:
            self._slurm.resume(name)
            return
        for slurm_node in names:
            try:
                info = self._slurm.node(slurm_node)
            except NotFound:
                continue
            if owned_reason(info.reason):
                self._slurm.resume(slurm_node)

    # -- jobs -----------------------------------------------------------------------------------------

    @staticmethod
    def _union(lists: list[list[JobInfo]]) -> list[JobInfo]:
        jobs = {job.job_id: job for jobs in lists for job in jobs}
        return [jobs[job_id] for job_id in sorted(jobs)]

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        return self._union([self._slurm.jobs_on_node(n) for n in self._each(name)])

    def recent_jobs_on_node(self, name: str) -> list[JobInfo]:
        return self._union([self._slurm.recent_jobs_on_node(n) for n in self._each(name)])

    def accounted_jobs(self, name: str, since: datetime) -> list[JobInfo] | None:
        found = [self._slurm.accounted_jobs(n, since) for n in self._each(name)]
        if all(jobs is None for jobs in found):
            return None
        return self._union([jobs for jobs in found if jobs is not None])

    def pending(self, partition: str) -> Pending:
        return self._slurm.pending(partition)

    def partition_jobs(self, partition: str) -> list[JobInfo]:
        return self._slurm.partition_jobs(partition)

    def hostnames(self, hostlist: str) -> list[str]:
        return self._slurm.hostnames(hostlist)

    def jobs_by_id(self, job_ids: list[int]) -> dict[int, JobInfo]:
        return self._slurm.jobs_by_id(job_ids)

    def topology(self) -> SlurmTopology:
        """Slurm's switches as Slurm names them (a NodeSet pod's Slurm node, not its Kubernetes node)."""
        return self._slurm.topology()

    def job(self, job_id: int) -> JobInfo:
        return self._slurm.job(job_id)

    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None:
        self._slurm.signal_job(job_id, signal=signal)

    def job_marks(self, job_id: int) -> list[str]:
        return self._slurm.job_marks(job_id)

    def mark_job(self, job_id: int, mark: str) -> bool:
        return self._slurm.mark_job(job_id, mark)

    def requeue(self, job_id: int) -> None:
        if "requeue" not in unsupported_methods(self._slurm):
            self._slurm.requeue(job_id)
            return
        self._requeue_by_down(job_id)

    def _requeue_by_down(self, job_id: int) -> None:
        """API before v0.0.45: DOWN on the node gpufleet drained under the running job."""
        job = self._slurm.job(job_id)
        if job.state in {"PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING"}:
            return
        if job.state not in {"RUNNING", "SUSPENDED", "COMPLETING"}:
            raise InvalidInput(
                f"job {job_id} has ended ({job.state}) and slurmrestd {self.version} cannot requeue an ended job "
                "(v0.0.45, Slurm 26.05, can): its owner resubmits it"
            )
        if not job.requeue:
            raise InvalidInput(f"job {job_id} was submitted with --no-requeue")
        by_down = getattr(self._slurm, "requeue_by_down")  # noqa: B009 - present (see unsupported)
        for slurm_node in self._slurm.hostnames(job.nodes) if job.nodes else []:
            info = self._slurm.node(slurm_node)
            if owned_reason(info.reason) and (info.drained or info.state == "down"):
                # DOWN ends every job there: none may be one that would be lost rather than requeued.
                lost = [
                    other.job_id
                    for other in self._slurm.jobs_on_node(slurm_node)
                    if other.job_id != job_id and other.state in {"RUNNING", "SUSPENDED"} and not other.requeue
                ]
                if lost:
                    raise InvalidInput(
                        f"setting {slurm_node} DOWN to requeue it would also end job(s) "
                        f"{', '.join(map(str, sorted(lost)))} there, which may not be requeued; left running: "
                        "resubmit it once it ends, or requeue it by hand"
                    )
                outcome = by_down(slurm_node, reason=info.reason, job_ids=[job_id]).get(job_id, "")
                if outcome in (REQUEUED, PENDING):
                    return
                raise InvalidInput(
                    f"job {job_id}: setting {slurm_node} DOWN left it {outcome or 'unknown'}, not requeued"
                )
        raise InvalidInput(f"job {job_id} runs on no node gpufleet drained ({job.nodes or 'none'}): not requeued")

    # -- partitions -----------------------------------------------------------------------------------

    def partition_nodes(self, partition: str) -> list[str]:
        """The partition's nodes, less the records of pods a scale-in took away (``leftover``)."""
        names = self._slurm.partition_nodes(partition)
        gone = {info.name for info in self._slurm.nodes() if leftover(info)}
        return [name for name in names if name not in gone]

    def add_to_partition(self, partition: str, node: str) -> None:
        raise InvalidInput(_NO_PARTITION_EDITS)

    def remove_from_partition(self, partition: str, node: str) -> None:
        raise InvalidInput(_NO_PARTITION_EDITS)


# -- cordon and drain in Kubernetes -----------------------------------------------------------------


class PodStillProtected(NotOwned):
    """A NodeSet pod could not be evicted within the deadline: its disruption budget protects it."""


class SlinkyDrain:
    """The failed node cordoned with the incident's reason, out of its NodeSets, its NodeSet pods
    evicted (never forced); other pods evicted as on any node."""

    def __init__(self, kube: KubernetesApi, *, poll_seconds: float = POLL_SECONDS) -> None:
        self._kube = kube
        self.of = SlurmNodesOf(kube)
        self._poll = poll_seconds

    def stands_for_slurm_nodes(self, node: str) -> bool:
        return bool(self.of.pods(node))

    def cordon_and_drain(
        self, node: str, incident_id: str, *, timeout_seconds: float, progress: Progress = _quiet
    ) -> tuple[list[str], list[str]]:
        """Returns (evicted, forced) pod keys; forced holds only pods no NodeSet owns.

        Raises:
            PodStillProtected: a NodeSet pod still protected at the deadline (not forced; the node
                stays cordoned, its Slurm nodes drained).
        """
        recorded = self.of.record(node, incident_id)
        self.of.nodesets.cordon_for_incident(node, incident_id)
        self._kube.add_taint(node, key=UNHEALTHY_TAINT, value=label_value(incident_id))
        self._kube.update_metadata(node, annotations={INCIDENT_ANNOTATION: incident_id})
        for nodeset in nodesets_of(recorded):
            self.of.nodesets.make_ineligible(node, nodeset, also_unrecorded=True)
        evicted: list[str] = []
        forced: list[str] = []
        others = [p for p in self._kube.pods_on_node(node) if p.owner_kind not in ("DaemonSet", "NodeSet")]
        for pod in others:
            progress(f"evicting {pod.key}")
            said = self._kube.evict(pod, timeout_seconds=timeout_seconds, progress=progress)
            (forced if said == "deleted" else evicted).append(pod.key)
        deadline = time.monotonic() + timeout_seconds
        waiting = [p for p in recorded if p.node == node or not p.node]
        while waiting:
            still: list[tuple[NodeSetPod, str]] = []
            for pod in waiting:
                result = self.of.nodesets.evict_nodeset_pod(pod)
                if result.outcome == "blocked":
                    still.append((pod, result.message))
                else:
                    evicted.append(pod.key)
            if not still:
                break
            if time.monotonic() >= deadline:
                names = ", ".join(pod.key for pod, _ in still)
                raise PodStillProtected(
                    f"{names} did not leave {node} within {timeout_seconds:g} s: a PodDisruptionBudget protects "
                    f"{'them' if len(still) > 1 else 'it'} (pod-protect: the Slurm node is busy) and gpufleet never "
                    f"forces past it. {node} stays cordoned and drained in Slurm; once its Slurm node is idle, evict "
                    "the pod (kubectl drain) and return the node, or end the job holding it."
                )
            progress(f"waiting for {', '.join(p.key for p, _ in still)} (protected)")
            time.sleep(self._poll)
            waiting = [pod for pod, _ in still]
        return evicted, forced


# -- spares -----------------------------------------------------------------------------------------


class SlinkyPool(SparePool):
    """The spare pool on Slinky: a claim makes a spare eligible for the failed node's NodeSets and
    waits for their pods to come back there; no partition is edited (see the module's docstring)."""

    def __init__(
        self,
        *,
        kube: KubernetesApi,
        slurm: SlurmClient,
        partition: str,
        cluster: str,
        namespace: str = "gpufleet",
        holder: str | None = None,
        back_wait_seconds: float = BACK_WAIT_SECONDS,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        super().__init__(
            kube=kube, slurm=slurm, partition=partition, cluster=cluster, namespace=namespace, holder=holder
        )
        # The Slurm nodes by their own names (pod names), not through a Kubernetes node.
        self._plain = slurm.inner if isinstance(slurm, SlinkySlurm) else slurm
        self.of = SlurmNodesOf(kube)
        self._back_wait = back_wait_seconds
        self._poll_seconds = poll_seconds

    # A spare hosts no Slurm node until a pod lands there: free in Slurm is hosting none.
    def _idle_in_slurm(self, name: str) -> bool:
        return not self.of.nodesets.nodeset_pods_on(name)

    def _edit_partition(self, partition: str, node: str, *, add: bool) -> None:
        raise InvalidInput(_NO_PARTITION_EDITS)

    def _nodesets_of(self, failed: str) -> list[NodeSetName]:
        pods = self.of.pods(failed) if failed else []
        if not pods:
            raise InvalidInput(
                f"{failed or 'the failed node'} hosts no NodeSet pod and records none: no NodeSet to make a spare "
                "eligible for"
            )
        return nodesets_of(pods)

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
        if pool == POOL_INFERENCE:
            log.info("no spare for inference on Slinky (%s): the shared pool makes up its capacity", incident_id)
            return None
        self._nodesets_of(node)  # no NodeSet to serve is the incident's error, not a spare's (tried one by one)
        return super().claim(
            incident_id, partitions=partitions, retry=retry, pool=pool, report_lost=report_lost, node=node
        )

    def _bring_in(
        self, spare: KubeNode, partition: str, incident_id: str, pool: str = POOL_TRAINING, failed: str = ""
    ) -> None:
        if QUARANTINE_LABEL in spare.labels:
            raise NotOwned(f"{spare.name} was quarantined after it was claimed")
        for nodeset in self._nodesets_of(failed):
            try:
                self.of.nodesets.make_eligible(spare.name, nodeset)
            except NotEligible as exc:
                raise NotOwned(str(exc)) from None
        if spare.labels.get(POOL_LABEL) != POOL_TRAINING:
            self._kube.update_metadata(spare.name, labels={POOL_LABEL: POOL_TRAINING})
        self._await_back(failed, incident_id)

    def _await_back(self, failed: str, incident_id: str) -> None:
        """Each pod the failed node recorded back, Running elsewhere under its name, and its Slurm
        node registered; one still drained for this incident is resumed (any other drain is its
        owner's). Unavailable (the claim is tried again) while one is not back yet."""
        pods = [pod for pod in self.of.pods(failed) if pod.uid]
        deadline = time.monotonic() + self._back_wait
        waiting = list(pods)
        while waiting:
            left = []
            for pod in waiting:
                if not self._back(pod, failed, incident_id):
                    left.append(pod)
            if not left:
                return
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"{', '.join(p.key for p in left)} not back on a node of their NodeSet yet "
                    f"(evicted from {failed}?); looking again"
                )
            time.sleep(self._poll_seconds)
            waiting = left

    def _back(self, pod: NodeSetPod, failed: str, incident_id: str) -> bool:
        back = self.of.nodesets.pod_back(pod)
        if back is None and self._scaled_in(pod):
            log.info("%s is not coming back: a pool move scaled its NodeSet in for it", pod.key)
            return True
        if back is None or back.node == failed:
            return False
        try:
            info = self._plain.node(pod.slurm_node)
        except NotFound:
            return False
        if info.state in _GONE_STATES or "NOT_RESPONDING" in info.flags:
            return False
        if (info.drained or info.state == "drained") and drained_by(info.reason) == incident_id:
            self._plain.resume(pod.slurm_node)
            log.info("resumed %s (its drain was %s's) on %s", pod.slurm_node, incident_id, back.node)
        return True

    def _scaled_in(self, pod: NodeSetPod) -> bool:
        """Whether a pool move scaled the pod's NodeSet in for this very pod and it is gone: an
        incident that took the node over mid-move waits for no such pod to come back."""
        if not pod.uid or self._kube.find_pod(pod.namespace, pod.name) is not None:
            return False
        try:
            found = self._kube.get_nodeset(pod.nodeset.namespace, pod.nodeset.name)
        except NotFound:
            return False
        annotations = (found.get("metadata") or {}).get("annotations") or {}
        return f"{pod.name}/{pod.uid}" in marks(annotations, SCALED_IN_ANNOTATION)

    def _release_node(self, name: str, incident_id: str, *, unused_only: bool = False) -> bool:
        """A spare some NodeSet pod already runs on serves: its eligibility stays (taking it off
        would unpin the pod); otherwise it is undone with the claim."""
        try:
            node = self._kube.get_node(name)
        except NotFound:
            return False
        if node.annotations.get(CLAIMED_BY_ANNOTATION) != incident_id:
            return False
        if unused_only and node.labels.get(POOL_LABEL) != POOL_SPARE:
            return False  # brought in (the pods on their way): left whole, as SparePool leaves it
        serving = self.of.nodesets.nodeset_pods_on(name)
        if serving:
            if unused_only:
                return False
            # In service already (the incident failed after a pod came back here): it stays a
            # training node of the NodeSet, no longer anyone's claim, never a free spare again.
            log.warning("%s stays in service: %s already run there", name, ", ".join(p.key for p in serving))
            self._kube.update_metadata(
                name,
                labels={POOL_LABEL: POOL_TRAINING, CLAIM_LABEL: None},
                annotations={CLAIMED_BY_ANNOTATION: None},
                resource_version=node.resource_version,
            )
            return False
        for nodeset in self._eligible_for(node):
            self.of.nodesets.make_ineligible(name, nodeset)
        return super()._release_node(name, incident_id, unused_only=unused_only)

    @staticmethod
    def _eligible_for(node: KubeNode) -> list[NodeSetName]:
        raw = node.annotations.get(ELIGIBLE_ANNOTATION)
        if not raw:
            return []
        try:
            keys = list(json.loads(raw))
        except ValueError:
            return []
        return [NodeSetName(*key.split("/", 1)) for key in keys if "/" in key]

    def retire(self, node: str, incident_id: str = "") -> None:
        """No partition to leave: the node's NodeSet labels come off (also those set before
        gpufleet kept records), then it is kept cordoned, tainted and retired as anywhere."""
        for nodeset in nodesets_of(self.of.pods(node)):
            try:
                self.of.nodesets.make_ineligible(node, nodeset, also_unrecorded=True)
            except NotFound:
                continue
        self._retire_in_kube(node, incident_id)

    def return_node(self, node: str, *, as_: str) -> None:
        """Back as a bare spare (no NodeSet labels), or for training: eligible again for the
        NodeSets it recorded. A Slurm node still there (its pod never left) drained by gpufleet is
        resumed; the record goes last, so that a retry after a crash still knows the NodeSets."""
        if as_ not in (POOL_SPARE, POOL_TRAINING):
            raise InvalidInput(f"a node returns as {POOL_SPARE!r} or {POOL_TRAINING!r}, not {as_!r}")
        current = self._kube.get_node(node)
        if QUARANTINE_LABEL in current.labels:
            raise NotOwned(
                f"{node} is quarantined ({QUARANTINE_LABEL}={current.labels[QUARANTINE_LABEL]}): not returning it; "
                f"`gpufleet nodes release {node}` first, once it is really repaired"
            )
        live = self.of.nodesets.nodeset_pods_on(node)
        if live and as_ == POOL_SPARE:
            raise NotOwned(
                f"{node} still runs NodeSet pod(s) {', '.join(p.key for p in live)}: a spare runs none; "
                "return it for training"
            )
        for pod in live:
            info = self._plain.node(pod.slurm_node)
            if (info.drained or info.state in _GONE_STATES) and info.reason and not owned_reason(info.reason):
                raise NotOwned(
                    f"{pod.slurm_node} on {node} was taken out of Slurm by someone else ({info.reason!r}); "
                    "not returning it: resume it by hand once its owner is done"
                )
        nodesets = nodesets_of(self.of.pods(node))
        reason = current.annotations.get(NODE_CORDON_REASON, "")
        for taint in (RETIRED_TAINT, UNHEALTHY_TAINT):
            self._kube.remove_taint(node, key=taint)
        self._kube.set_unschedulable(node, False)
        if as_ == POOL_TRAINING:
            for nodeset in nodesets:
                self.of.nodesets.make_eligible(node, nodeset)
        else:  # a bare spare: no NodeSet's labels that gpufleet set
            for nodeset in self._eligible_for(current):
                self.of.nodesets.make_ineligible(node, nodeset)
        for pod in live:
            if owned_reason(self._plain.node(pod.slurm_node).reason):
                self._plain.resume(pod.slurm_node)
        self._kube.update_metadata(
            node,
            labels={POOL_LABEL: as_, CLAIM_LABEL: None},
            annotations={
                INCIDENT_ANNOTATION: None,
                CLAIMED_BY_ANNOTATION: None,
                NODE_LEASE_ANNOTATION: None,
                SLURM_NODES_ANNOTATION: None,
                # gpufleet's own cordon reason only; a person's stays with their cordon's record.
                **({NODE_CORDON_REASON: None} if ours_cordon_reason(reason) else {}),
            },
        )


def detect_slinky(kube: KubeClient, namespace: str) -> bool:
    """Whether the cluster's namespace holds NodeSets (its Slurm nodes are NodeSet pods)."""
    lister = getattr(kube, "list_nodesets", None)
    if lister is None:
        return False
    try:
        return bool(lister(namespace))
    except ClientError as exc:
        # Guessing wrong would remediate a Slinky cluster by editing partitions: say it and stop.
        raise type(exc)(
            f"cannot tell whether namespace {namespace} holds NodeSets ({exc}); set GPUFLEET_REMEDIATION_MODE "
            "to slurm or slinky, or let the worker list NodeSets there"
        ) from exc
