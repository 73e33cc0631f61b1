"""Moving one node between training (Slurm) and inference (Kubernetes), step by step.

Every step looks before it acts, so a move run again after a crash goes on from where it was:

- **training -> inference**: drain in Slurm (reason ``gpufleet: rebalance to inference``); wait
  for the running jobs up to a deadline, then SIGTERM them, give them the grace to checkpoint,
  and requeue what is left; out of the partition (under the partition's Lease, as remediation
  edits it); ``gpufleet.io/pool=inference``, the training taint off, uncordoned.
- **inference -> training**: cordoned, the training taint on; its pods evicted through the
  eviction API (a PodDisruptionBudget makes the move wait, never break it: past one deadline
  for all of the node's pods the move is undone and the node serves on; DaemonSet pods stay, and
  so do pods that tolerate the training taint: training's own);
  ``gpufleet.io/pool=training``; into the partition; resumed in Slurm; uncordoned (the taint keeps
  inference pods away).

The node is held for the whole move by the annotation ``gpufleet.io/lease=<holder>``, written with
a resourceVersion precondition: a node leased by someone else (an incident, another move) is
not moved (NotOwned), and a node drained in Slurm by someone else is left to them. A move that
loses the lease once it has changed something (an incident took the node over) stops with
HandedOver: the pool settles the node (``settle``) once the incident has let go of it.

Each move writes ``gpufleet.io/pool-since`` beside the pool label: the nodes that went to
inference last are the first to come back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from clients import nodelease
from clients.errors import ClientError, InvalidInput, NotFound, NotOwned, TooManyRequests
from clients.kube import KubeClient, KubeNode, PodRef
from clients.slurm import SlurmClient
from clients.spares import SparePool
from models.constants import (
    INCIDENT_ANNOTATION,
    NODE_LEASE_ANNOTATION,
    POOL_LABEL,
    POOL_SINCE_ANNOTATION,
    QUARANTINE_LABEL,
    UNHEALTHY_TAINT,
)

LEASE_ANNOTATION = NODE_LEASE_ANNOTATION
TRAINING_TAINT = "gpufleet.io/pool"
TO_INFERENCE_REASON = "gpufleet: rebalance to inference"
INFERENCE = "inference"
TRAINING = "training"
FINISHED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}

Say = Callable[[str], None]


class BudgetKept(ClientError):
    """A move to training that would break a PodDisruptionBudget: it is undone, and the node
    goes on serving inference until a later look tries again."""


class HandedOver(NotOwned):
    """Someone (an incident) took the node over after the move had begun to change it: the move
    stops where it is, and the node is settled into one pool once they let go (``settle``)."""


class OutOfPool(NotOwned):
    """The node no longer belongs to the shared pool (retired by an incident, made a spare):
    nothing of the move is left to do."""


def _pool_of(node: KubeNode) -> str:
    return node.labels.get(POOL_LABEL, "")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PoolMover:
    def __init__(
        self,
        kube: KubeClient,
        slurm: SlurmClient,
        spares: SparePool,
        *,
        poll_seconds: float = 0.5,
    ) -> None:
        self._kube = kube
        self._slurm = slurm
        self._spares = spares
        self._poll = poll_seconds

    # -- the per-node lease (clients/nodelease.py) --------------------------------------------------

    def take(self, node: str, holder: str) -> None:
        nodelease.take(self._kube, node, holder)

    def give_back(self, node: str, holder: str) -> None:
        nodelease.give_back(self._kube, node, holder)

    def _ours(self, node: str, holder: str) -> None:
        """Between steps: HandedOver once an incident took the node over (the move stops there)."""
        try:
            nodelease.still_held(self._kube, node, holder)
        except NotOwned as exc:
            raise HandedOver(str(exc)) from None

    def _take_pool_node(self, node: str, holder: str) -> KubeNode:
        """Take the lease of a node of the shared pool; OutOfPool (let go again) when it is not
        one, or Kubernetes no longer has it."""
        try:
            self.take(node, holder)
            current = self._kube.get_node(node)
        except NotFound:
            raise OutOfPool(f"{node} is no longer a Kubernetes node: it has left the shared pool") from None
        if _pool_of(current) not in (TRAINING, INFERENCE):
            self.give_back(node, holder)
            raise OutOfPool(f"{node} is no longer in the shared pool ({POOL_LABEL}={_pool_of(current) or 'none'})")
        return current

    def _label(self, node: str, pool: str, holder: str) -> None:
        """The pool label, the write that makes the node a member of the other side: written
        only while the lease is still ours, so an incident taking the node at that instant is
        never overwritten."""
        try:
            nodelease.update_if_held(
                self._kube, node, holder, labels={POOL_LABEL: pool}, annotations={POOL_SINCE_ANNOTATION: _now()}
            )
        except NotOwned as exc:
            raise HandedOver(str(exc)) from None

    # -- what the pool reads ------------------------------------------------------------------------

    def slurm_nodes_of(self, nodes: list[str]) -> dict[str, list[str]]:
        """The Slurm nodes each Kubernetes node of the pool stands for: here, its own name."""
        return {name: [name] for name in nodes}

    def busy(self, node: KubeNode) -> str:
        """Why the node may not move now beyond what every flavor checks ('' when nothing)."""
        return ""

    # -- training -> inference --------------------------------------------------------------------

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
        """``move``: this move's ID (the same on every retry), in the marks its jobs carry."""
        self._take_pool_node(node, holder)
        info = self._slurm.node(node)
        if info.drained and info.reason and info.reason != TO_INFERENCE_REASON:
            self.give_back(node, holder)
            raise NotOwned(f"{node} is drained by someone else ({info.reason!r}): left to them")
        if partition in info.partitions:
            if self._slurm.partition_nodes(partition) == [node]:
                self.give_back(node, holder)
                raise NotOwned(f"{node} is the last node of partition {partition}: Slurm keeps a partition's last node")
            if not info.drained:
                self._slurm.drain(node, reason=TO_INFERENCE_REASON)
                say(f"{node} drained in Slurm")
            requeued = self._empty(
                node,
                move=move or f"{holder}:{node}",  # the activity passes one; this is for direct calls
                holder=holder,
                grace_seconds=grace_seconds,
                deadline_seconds=deadline_seconds,
                say=say,
            )
            self._left(node, holder=holder, seconds=max(grace_seconds, 60.0), say=say)
            self._ours(node, holder)
            self._spares.remove_from_partition(node, partition=partition)
            say(f"{node} out of partition {partition}")
        else:
            requeued = []
        self._ours(node, holder)
        self._label(node, INFERENCE, holder)
        self._kube.remove_taint(node, key=TRAINING_TAINT)
        self._ours(node, holder)  # an incident that took it now has cordoned it: left so
        self._kube.set_unschedulable(node, False)
        self.give_back(node, holder)
        jobs = f"; requeued {', '.join(map(str, requeued))}" if requeued else ""
        return f"{node} serves inference{jobs}"

    def _running(self, node: str) -> list[int]:
        return [job.job_id for job in self._slurm.jobs_on_node(node) if job.state not in FINISHED]

    def _empty(
        self, node: str, *, move: str, holder: str, grace_seconds: float, deadline_seconds: float, say: Say
    ) -> list[int]:
        """Wait for the node's jobs to end, up to the deadline; then SIGTERM, grace, requeue.
        An incident taking the node over meanwhile stops this (its own requeue then runs).

        Each job carries marks in Slurm (its AdminComment): ``gpufleet:signalling:<move>``
        before its SIGTERM, ``gpufleet:signalled:<move>`` once it went out,
        ``gpufleet:requeued:<move>`` once requeued. A retry after the worker died reads them:
        nobody is signalled twice; a job marked but not signalled that still runs gets its
        SIGTERM now (else a requeue would kill it with no checkpoint); and every job the move
        marked is requeued, one that checkpointed and exited meanwhile too (finished, it would
        be lost; one that ended on its own is run again, from its checkpoint). Finished jobs
        are found while slurmctld keeps them (MinJobAge, 300 s by default)."""
        signalling, signalled_mark, requeued_mark = (
            f"gpufleet:signalling:{move}",
            f"gpufleet:signalled:{move}",
            f"gpufleet:requeued:{move}",
        )
        marks = {job.job_id: self._slurm.job_marks(job.job_id) for job in self._slurm.recent_jobs_on_node(node)}
        earlier = sorted(job for job, found in marks.items() if signalling in found)
        if earlier:
            say(f"{node}: job(s) {', '.join(map(str, earlier))} marked before a restart")
        else:
            deadline = time.monotonic() + deadline_seconds
            while (running := self._running(node)) and time.monotonic() < deadline:
                self._ours(node, holder)
                say(f"{node}: waiting for job(s) {', '.join(map(str, running))}")
                time.sleep(self._poll)
            if not running:
                return []
        running_now = self._running(node)
        self._ours(node, holder)
        signalled: list[int] = []
        for job in sorted(set(earlier) | set(running_now)):
            found = marks.get(job, [])
            if signalled_mark in found or job not in running_now:
                signalled.append(job)  # signalled before, or ended since it was marked: requeued all the same
                continue
            if not self._slurm.mark_job(job, signalling):
                continue  # it has just finished, on its own
            self._slurm.signal_job(job, signal="TERM")
            self._slurm.mark_job(job, signalled_mark)
            signalled.append(job)
        say(f"{node}: SIGTERM to {', '.join(map(str, signalled))}; {grace_seconds:g}s to checkpoint")
        ends = time.monotonic() + grace_seconds
        while (left := [j for j in self._running(node) if j in signalled]) and time.monotonic() < ends:
            time.sleep(self._poll)
        # Once signalled, a job is requeued whatever happens to the node meanwhile: an incident
        # taking it over would no longer see a job that checkpointed and exited.
        requeued = []
        for job in signalled:
            if requeued_mark in self._slurm.job_marks(job):
                requeued.append(job)  # by the attempt before a restart
                continue
            why = self._requeue(job)
            if why:
                say(f"{node}: job {job} not requeued: {why}")
            else:
                self._slurm.mark_job(job, requeued_mark)
                requeued.append(job)
        say(f"{node}: requeued {', '.join(map(str, requeued)) or 'none'} ({len(left)} had not exited)")
        return requeued

    def _left(self, node: str, *, holder: str, seconds: float, say: Say) -> None:
        """Wait until no job holds the node any more (a requeued job is COMPLETING there while its
        processes end and its epilog runs): inference must not start on GPUs a job still uses.
        Past ``seconds`` this raises, and the move is retried from where it is."""
        ends = time.monotonic() + seconds
        while running := self._running(node):
            if time.monotonic() >= ends:
                raise ClientError(
                    f"{node}: job(s) {', '.join(map(str, running))} still on the node {seconds:g}s after the "
                    "requeue (completing); the move waits for them"
                )
            self._ours(node, holder)
            say(f"{node}: waiting for job(s) {', '.join(map(str, running))} to leave the node")
            time.sleep(self._poll)

    def _requeue(self, job: int) -> str:
        """Requeue one signalled job, as remediation does: '' when it is back in the queue, else
        why not (cancelled by its owner meanwhile, or refusing requeue). Never a failure of the
        move: the node leaves training either way."""
        try:
            if self._slurm.job(job).state == "CANCELLED":
                return "cancelled by its owner"
            self._slurm.requeue(job)
        except NotFound:
            return "Slurm no longer knows it"
        except InvalidInput as exc:
            return str(exc)
        return ""

    # -- inference -> training --------------------------------------------------------------------

    def _stay_inference(self, node: str, holder: str) -> None:
        """Undo the start of a move to training: the taint off, uncordoned, let go."""
        self._ours(node, holder)
        self._kube.remove_taint(node, key=TRAINING_TAINT)
        self._kube.set_unschedulable(node, False)
        self.give_back(node, holder)

    def to_training(
        self,
        node: str,
        *,
        holder: str,
        partition: str,
        eviction_timeout_seconds: float,
        say: Say = lambda _: None,
    ) -> str:
        self._take_pool_node(node, holder)
        # The taint first: a cordon without it would read as someone else's if the move stopped here.
        self._kube.add_taint(node, key=TRAINING_TAINT, value=TRAINING, effect="NoSchedule")
        self._kube.set_unschedulable(node, True)
        moved = self._vacate(node, holder=holder, deadline=time.monotonic() + eviction_timeout_seconds, say=say)
        self._ours(node, holder)
        self._label(node, TRAINING, holder)
        info = self._slurm.node(node)
        if partition not in info.partitions:
            self._spares.add_to_partition(node, partition=partition)
            say(f"{node} in partition {partition}")
        info = self._slurm.node(node)
        self._ours(node, holder)
        if info.drained and info.reason == TO_INFERENCE_REASON:
            self._slurm.resume(node)
        self._kube.set_unschedulable(node, False)
        self.give_back(node, holder)
        pods = f"; {moved} pod(s) moved away" if moved else ""
        return f"{node} serves training{pods}"

    def _inference_pods(self, node: str) -> list[PodRef]:
        """The pods that keep the node from training: every one still running there but the
        DaemonSets' (which run on every node), the kubelet's static pods, and those that tolerate the training taint
        (training's own workloads, which stay)."""
        return [
            p
            for p in self._kube.pods_on_node(node)
            if p.owner_kind not in ("DaemonSet", "Node")  # the Node's own: static (mirror) pods
            and p.holds_node
            and not p.tolerates(key=TRAINING_TAINT, value=TRAINING, effect="NoSchedule", by_name=True)
        ]

    def _vacate(self, node: str, *, holder: str, deadline: float, say: Say) -> int:
        """Evict the node's pods through the eviction API and wait until they are gone: a pod
        evicted is still there while it shuts down, and training must not start on GPUs it
        uses. One deadline for all of it; a budget still refusing then is kept (BudgetKept, the
        move undone), and pods still shutting down then fail the move (retried from here)."""
        evicted = 0
        while pods := self._inference_pods(node):
            self._ours(node, holder)
            for pod in (p for p in pods if not p.terminating):
                try:
                    self._kube.evict(
                        pod, timeout_seconds=max(0.0, deadline - time.monotonic()), progress=say, force=False
                    )
                except TooManyRequests as exc:
                    self._stay_inference(node, holder)
                    raise BudgetKept(
                        f"{node} stays in inference: {exc}; {evicted} pod(s) had moved away, the rest serve on"
                    ) from None
                evicted += 1
            if not (left := self._inference_pods(node)):
                break
            if time.monotonic() >= deadline:
                raise ClientError(
                    f"{node}: pod(s) {', '.join(p.key for p in left)} still shutting down after the eviction "
                    "deadline; the move waits for them"
                )
            say(f"{node}: waiting for {len(left)} pod(s) to shut down")
            time.sleep(self._poll)
        return evicted

    def _waiting_for(self, current: KubeNode, holder: str) -> str:
        """Whom a settle of the node waits for ('' when nobody else has it): another holder of its
        lease, its incident (annotation or unhealthy taint), its quarantine, or whoever cordoned it."""
        tainted = any(t.get("key") == TRAINING_TAINT for t in current.taints)
        held = current.annotations.get(LEASE_ANNOTATION)
        return (
            f"{held} to let go of it"
            if held and held != holder
            else f"its incident {current.annotations[INCIDENT_ANNOTATION]}"
            if current.annotations.get(INCIDENT_ANNOTATION)
            else "its incident (tainted unhealthy)"
            if any(t.get("key") == UNHEALTHY_TAINT for t in current.taints)
            else f"its quarantine ({current.labels[QUARANTINE_LABEL]}) to be released"
            if current.labels.get(QUARANTINE_LABEL)
            else "whoever cordoned it"  # a move's cordon comes with the training taint
            if current.unschedulable and not tainted
            else ""
        )

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
        """A node whose move an incident took over halfway, once the incident has let go of it:
        into one pool at the least cost. Still in the pool it was leaving (a move to inference
        that had not left the partition, a move to training that had not relabelled it), it goes
        back there; out of one and not yet in the other, the move toward ``to`` is finished.
        NotOwned while someone holds it or its incident, a quarantine, a cordon or a drain of
        someone else's is still on it (nothing is written then); OutOfPool once it has left the
        shared pool (retired, or gone from Kubernetes)."""
        try:
            current = self._kube.get_node(node)
        except NotFound:
            raise OutOfPool(f"{node} is no longer a Kubernetes node: it has left the shared pool") from None
        pool = _pool_of(current)
        if pool not in (TRAINING, INFERENCE):
            raise OutOfPool(f"{node} is no longer in the shared pool ({POOL_LABEL}={pool or 'none'})")
        tainted = any(t.get("key") == TRAINING_TAINT for t in current.taints)
        waiting = self._waiting_for(current, holder)
        if waiting:
            raise NotOwned(f"{node} waits for {waiting}")
        info = self._slurm.node(node)
        if info.drained and info.reason and info.reason != TO_INFERENCE_REASON:
            raise NotOwned(f"{node} waits for whoever drained it in Slurm ({info.reason!r})")
        in_partition = partition in info.partitions
        self._take_pool_node(node, holder)
        if pool == TRAINING and in_partition:
            if info.drained:  # with our reason: the move to inference had drained it
                self._slurm.resume(node)
            if current.unschedulable:  # with the training taint: a move to training's cordon
                self._kube.set_unschedulable(node, False)
            self.give_back(node, holder)
            return f"{node} is wholly in training"
        if pool == INFERENCE and not in_partition:
            if tainted:  # a move to training had begun: its taint and cordon come off
                self._kube.remove_taint(node, key=TRAINING_TAINT)
                self._kube.set_unschedulable(node, False)
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

    def _finish(
        self,
        node: str,
        *,
        to: str,
        holder: str,
        partition: str,
        grace_seconds: float,
        deadline_seconds: float,
        eviction_timeout_seconds: float,
        move: str,
        say: Say,
    ) -> str:
        """The move to ``to`` run again from where it stopped (each step looks before it acts)."""
        if to == INFERENCE:
            return self.to_inference(
                node,
                holder=holder,
                partition=partition,
                grace_seconds=grace_seconds,
                deadline_seconds=deadline_seconds,
                move=move,
                say=say,
            )
        return self.to_training(
            node, holder=holder, partition=partition, eviction_timeout_seconds=eviction_timeout_seconds, say=say
        )
