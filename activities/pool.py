"""Pool rebalancing's activities: one look at the pool, and one node's move."""

from __future__ import annotations

import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.errors import ClientError, NotOwned
from clients.kube import KubeClient, KubeNode
from clients.onslinky import combined, leftover
from clients.poolmoves import (
    INFERENCE,
    LEASE_ANNOTATION,
    TO_INFERENCE_REASON,
    TRAINING,
    BudgetKept,
    HandedOver,
    OutOfPool,
    PoolMover,
)
from clients.prometheus import PrometheusApi
from clients.slurm import SlurmClient
from models.constants import (
    CLUSTER_LABEL,
    INCIDENT_ANNOTATION,
    POOL_LABEL,
    POOL_SINCE_ANNOTATION,
    QUARANTINE_LABEL,
    REMEDIATION_DISABLED,
    REMEDIATION_LABEL,
    RETIRED_TAINT,
    UNHEALTHY_TAINT,
)
from models.incident import JobInfo, NodeInfo
from models.names import safe_mark_part
from models.poolops import MoveRequest, MoveResult, PoolRequest, PoolView, Stopped
from models.rebalance import Demand, inference_nodes

_NONE = NodeInfo(name="", state="unknown")


def _why_busy(node: KubeNode, holder: str, slurm_reason: str) -> str:
    held = node.annotations.get(LEASE_ANNOTATION)
    if held and held != holder:
        return f"held by {held}"
    if node.annotations.get(INCIDENT_ANNOTATION):
        return f"open incident {node.annotations[INCIDENT_ANNOTATION]}"
    if any(t.get("key") == UNHEALTHY_TAINT for t in node.taints):
        return "tainted unhealthy (an incident)"
    if node.labels.get(REMEDIATION_LABEL) == REMEDIATION_DISABLED:
        return "opted out of gpufleet"
    if node.unschedulable and not held:
        return "cordoned by someone else"
    if node.labels.get(QUARANTINE_LABEL):
        return f"quarantined ({node.labels[QUARANTINE_LABEL]})"
    if any(t.get("key") == RETIRED_TAINT for t in node.taints):
        return "retired"
    if slurm_reason and slurm_reason != TO_INFERENCE_REASON:
        return f"drained in Slurm ({slurm_reason})"  # an incident's, or a person's
    if not node.ready:
        return "not Ready"
    return ""


class PoolActivities:
    def __init__(
        self,
        kube: KubeClient,
        slurm: SlurmClient,
        mover: PoolMover,
        prometheus: PrometheusApi | None,
        *,
        grace_seconds: float = 120.0,
    ) -> None:
        self._kube = kube
        self._slurm = slurm
        self._mover = mover
        self._prometheus = prometheus
        self._grace = grace_seconds

    @activity.defn(name="pool_observe")
    @heartbeating
    def observe(self, request: PoolRequest) -> PoolView:
        """Who serves training and inference (Kubernetes' pool labels, this cluster's nodes),
        who may not move now and why, and the inference demand (None when unknown)."""
        settings = request.settings
        holder = activity.info().workflow_id or ""
        with client_errors():
            nodes = [
                n
                for n in self._kube.list_nodes(label_selector=f"{POOL_LABEL} in ({TRAINING},{INFERENCE})")
                if n.labels.get(CLUSTER_LABEL, settings.cluster) == settings.cluster
            ]
            slurm_nodes = {n.name: n for n in self._slurm.nodes()}
            # The Slurm nodes each Kubernetes node stands for: itself, or on Slinky its NodeSet pods'.
            hosted = self._mover.slurm_nodes_of([n.name for n in nodes])
        host_of = {slurm_node: name for name, names in hosted.items() for slurm_node in names}
        by_kube: dict[str, NodeInfo] = {}
        for name, names in hosted.items():
            infos = [slurm_nodes[n] for n in names if n in slurm_nodes]
            if infos:
                by_kube[name] = infos[0] if len(infos) == 1 else combined(name, infos)
        reasons = {name: (n.reason if n.drained else "") for name, n in by_kube.items()}
        labelled_training = [n.name for n in nodes if n.labels[POOL_LABEL] == TRAINING]
        # Training is what Slurm's partition holds, too: a node labelled training elsewhere
        # serves other jobs and is not this pool's to move.
        training = [name for name in labelled_training if settings.partition in by_kube.get(name, _NONE).partitions]
        view = PoolView(
            training=self._least_loss_first(training, by_kube, settings.partition, host_of),
            # The last to go to inference comes back first; those that always served, last.
            inference=[
                n.name
                for n in sorted(
                    (n for n in nodes if n.labels[POOL_LABEL] == INFERENCE),
                    key=lambda n: (n.annotations.get(POOL_SINCE_ANNOTATION, ""), n.name),
                    reverse=True,
                )
            ],
        )
        for node in nodes:
            why = _why_busy(node, holder, reasons.get(node.name, "")) or self._mover.busy(node)
            if why:
                view.busy[node.name] = why
        # On Slinky a pod scaled in leaves its Slurm node DOWN (slurm-operator v1.2.1): that record
        # is no member, unless a pod of its name runs again.
        members = sorted(
            {
                host_of.get(name, name)
                for name, info in slurm_nodes.items()
                if settings.partition in info.partitions and not leftover(info, hosted=name in host_of)
            }
        )
        if len(members) == 1 and members[0] not in view.busy:
            # Slurm refuses a partition with no node: its last one stays in training.
            view.busy[members[0]] = f"the last node of partition {settings.partition} (Slurm keeps one)"
        view.demand = self._demand(settings.query, settings.per_node)
        try:
            with client_errors():
                pending = self._slurm.pending(settings.partition)
            view.demand.training = float(pending.nodes)
            view.demand.training_jobs, view.demand.training_gpus = pending.jobs, pending.gpus
        except ApplicationError as exc:
            # Unknown training demand only means inference keeps its spare: no move hangs on it.
            activity.logger.warning("training demand unknown: %s", exc)
        return view

    def _least_loss_first(
        self, training: list[str], slurm_nodes: dict[str, NodeInfo], partition: str, host_of: dict[str, str]
    ) -> list[str]:
        """The training nodes in the order they should leave: idle ones first; then the one
        whose jobs lose least: fewest running jobs, then the most recent checkpoint (what a job
        said in its Comment, else its start: the work since then is what a requeue loses)."""
        jobs_on: dict[str, list[JobInfo]] = {name: [] for name in training}
        if any(not slurm_nodes[name].state.startswith("idle") for name in training):
            try:
                with client_errors():
                    for job in self._slurm.partition_jobs(partition):
                        for host in {host_of.get(h, h) for h in self._slurm.hostnames(job.nodes)}:
                            jobs_on.get(host, []).append(job)
            except ApplicationError as exc:
                activity.logger.warning("running jobs unknown, nodes ordered by name: %s", exc)

        now = time.time()

        def at_risk_since(job: JobInfo) -> float:
            saved = job.checkpointed_at or job.start_time
            # Unknown: as if nothing were saved; a time to come (a clock off, a made-up Comment): now.
            return min(saved.timestamp(), now) if saved else 0.0

        def loss(name: str) -> tuple[bool, int, float, str]:
            idle = slurm_nodes[name].state.startswith("idle")
            jobs = jobs_on[name]
            # The job with the oldest checkpoint is the one that loses most.
            oldest = min((at_risk_since(job) for job in jobs), default=float("inf"))
            return (not idle, len(jobs), -oldest, name)

        return sorted(training, key=loss)

    def _demand(self, query: str, per_node: float) -> Demand:
        if not query:
            return Demand(error="no query set: demand comes from `gpufleet pool set-demand` only")
        if self._prometheus is None:
            return Demand(error="no Prometheus configured (GPUFLEET_PROMETHEUS_URL)")
        try:
            load = self._prometheus.query(query)
        except ClientError as exc:
            return Demand(error=str(exc))
        if load is None:
            return Demand(error=f"the query returned nothing: {query}")
        return Demand(inference=inference_nodes(load, per_node), source=f"{query} = {load:g} ({per_node:g} per node)")

    @activity.defn(name="pool_move_node")
    @heartbeating
    def move(self, request: MoveRequest) -> MoveResult:
        """Move one node; a node someone else holds or drained is skipped, not failed."""
        settings = request.settings

        def say(text: str) -> None:
            activity.heartbeat(text)

        info = activity.info()
        # One ID per move, the same on its retries: the marks its jobs carry. A request from an
        # older workflow has none: this scheduled activity's own identity stands in.
        move_id = request.move_id or safe_mark_part(
            f"{request.workflow_id}:{request.node}:{(info.workflow_run_id or '')[:8]}:{info.activity_id}"
        )

        with client_errors():
            try:
                if request.settle:
                    detail = self._mover.settle(
                        request.node,
                        to=request.to,
                        holder=request.workflow_id,
                        partition=settings.partition,
                        grace_seconds=self._grace,
                        deadline_seconds=settings.drain_deadline_seconds,
                        eviction_timeout_seconds=settings.eviction_deadline_seconds,
                        move=move_id,
                        say=say,
                    )
                elif request.to == INFERENCE:
                    detail = self._mover.to_inference(
                        request.node,
                        holder=request.workflow_id,
                        partition=settings.partition,
                        grace_seconds=self._grace,
                        deadline_seconds=settings.drain_deadline_seconds,
                        move=move_id,
                        say=say,
                    )
                else:
                    detail = self._mover.to_training(
                        request.node,
                        holder=request.workflow_id,
                        partition=settings.partition,
                        eviction_timeout_seconds=settings.eviction_deadline_seconds,
                        say=say,
                    )
            except BudgetKept as exc:
                return MoveResult(moved=False, detail=str(exc), stopped=Stopped.BUDGET)
            except HandedOver as exc:
                return MoveResult(moved=False, detail=str(exc), stopped=Stopped.HANDED_OVER)
            except OutOfPool as exc:
                return MoveResult(moved=False, detail=str(exc), stopped=Stopped.OUT_OF_POOL)
            except NotOwned as exc:
                if info.attempt > 1 and not request.settle:
                    # An earlier attempt may have changed the node before the worker died: the
                    # pool must settle it once its holder lets go, not take it as untouched.
                    return MoveResult(moved=False, detail=str(exc), stopped=Stopped.HANDED_OVER)
                return MoveResult(moved=False, detail=str(exc), stopped=Stopped.HELD)
        return MoveResult(moved=True, detail=detail)
