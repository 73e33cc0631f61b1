"""The steps of cluster creation (and their undos) as activities over the pool and a backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import client_errors
from activities.heartbeat import heartbeating, heartbeats
from clients import pool
from clients.clusters import ClusterBackend, HasLogin, StepFailed
from clients.errors import ClientError
from clients.kube import KubeClient
from clients.notify import Notifier
from models.cluster import SpecError, load_spec
from models.clusterops import (
    ClusterOutcome,
    ClusterRequest,
    ClusterStatus,
    DeletionStatus,
    JobsResult,
    StepResult,
    cluster_workflow_id,
    deletion_workflow_id,
)
from models.constants import REMEDIATION_WORKFLOW, guard_workflow_id, reaper_workflow_id, task_queue
from models.incident import CancelRequest, Notification

# How long a deletion waits for the cluster's incidents to stop once cancelled (each gives back
# what it holds first): past it the deletion stops, the cluster whole, and says which still run.
INCIDENTS_STOP_SECONDS = 120.0
INCIDENTS_POLL_SECONDS = 0.5


def _wanted(request: ClusterRequest) -> dict[str, int]:
    wanted = {p.name: p.nodes for p in request.spec.partitions}
    if request.spec.spares:
        wanted[pool.SPARES] = request.spec.spares
    return wanted


class ClusterActivities:
    def __init__(
        self,
        kube: KubeClient,
        backends: Mapping[str, ClusterBackend],
        notifier: Notifier,
        *,
        namespace: str = "gpufleet",
        uid_range: tuple[int, int] = (2000, 59999),
        own_cluster: str = "",
    ) -> None:
        self._kube = kube
        self._backends = backends
        self._notifier = notifier
        self._namespace = namespace
        self._uid_range = uid_range
        self._own_cluster = own_cluster

    def _backend(self, request: ClusterRequest) -> ClusterBackend:
        backend = self._backends.get(request.backend)
        if backend is None:
            known = ", ".join(sorted(self._backends)) or "none"
            raise ApplicationError(
                f"this worker has no {request.backend!r} backend (it has: {known})",
                type="InvalidInput",
                non_retryable=True,
            )
        return backend

    def _run(self, request: ClusterRequest, fn: Callable[[ClusterBackend], str]) -> StepResult:
        backend = self._backend(request)
        try:
            with client_errors():
                return StepResult(detail=fn(backend))
        except StepFailed as exc:
            raise ApplicationError(str(exc), type="StepFailed", non_retryable=True) from exc

    @activity.defn(name="cluster_validate")
    @heartbeating
    def validate(self, request: ClusterRequest) -> StepResult:
        """The spec once more, now against the free pool; and no cluster of that name yet."""
        backend = self._backend(request)
        with client_errors():
            held = pool.holdings(self._kube, request.spec.name)
            free = pool.free_nodes(self._kube)
            existing = backend.exists(request.spec)
        if request.spec.name == self._own_cluster:
            raise ApplicationError(
                f"{request.spec.name} is the cluster this worker remediates (task queue gpufleet-{self._own_cluster}): "
                "choose another name",
                type="InvalidInput",
                non_retryable=True,
            )
        refused = backend.unsupported(request.spec)
        if refused:
            raise ApplicationError(f"the {backend.name} backend: {refused}", type="InvalidInput", non_retryable=True)
        if held or existing:
            what = existing or f"nodes {', '.join(n for ns in held.values() for n in ns)}"
            raise ApplicationError(
                f"a cluster named {request.spec.name} exists already ({what}): delete it or choose another name",
                type="InvalidInput",
                non_retryable=True,
            )
        try:
            load_spec(request.spec.model_dump(mode="json"), uid_range=self._uid_range, free_nodes=free)
        except SpecError as exc:
            raise ApplicationError(str(exc), type="SpecInvalid", non_retryable=True) from None
        return StepResult(detail=f"spec valid; {free} free node(s) for {request.spec.nodes_needed} asked")

    @activity.defn(name="cluster_reserve")
    @heartbeating
    def reserve(self, request: ClusterRequest) -> StepResult:
        self._backend(request)
        with client_errors():
            placement = pool.reserve(self._kube, request.spec.name, _wanted(request), namespace=self._namespace)
        detail = "; ".join(f"{where}: {', '.join(nodes)}" for where, nodes in placement.items())
        return StepResult(detail=detail, placement=placement)

    @activity.defn(name="cluster_release")
    @heartbeating
    def release(self, request: ClusterRequest) -> StepResult:
        with client_errors():
            freed, kept = pool.release(self._kube, request.spec.name)
        detail = f"back to the free pool: {', '.join(freed) or 'nothing held'}"
        if kept:
            detail += "; kept out of it: " + ", ".join(f"{node} ({why})" for node, why in kept.items())
        return StepResult(detail=detail)

    @activity.defn(name="cluster_render")
    def render(self, request: ClusterRequest) -> StepResult:
        backend = self._backend(request)
        conf = backend.render_conf(request.spec, request.placement)
        lines = sum(1 for line in conf.splitlines() if line and not line.startswith("#"))
        return StepResult(detail=f"slurm.conf: {lines} lines", slurm_conf=conf)

    @activity.defn(name="cluster_create_objects")
    @heartbeating
    def create_objects(self, request: ClusterRequest) -> StepResult:
        return self._run(
            request, lambda b: b.create_objects(request.spec, request.placement, request.slurm_conf, request.creation)
        )

    @activity.defn(name="cluster_delete_objects")
    @heartbeating
    def delete_objects(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.delete_objects(request.spec, request.creation))

    @activity.defn(name="cluster_bring_up")
    @heartbeating
    def bring_up(self, request: ClusterRequest) -> StepResult:
        result = self._run(request, lambda b: b.bring_up(request.spec, request.placement, request.slurm_conf))
        backend = self._backend(request)
        if isinstance(backend, HasLogin):
            result.login = self._run(request, lambda b: backend.login_address(request.spec)).detail
        return result

    @activity.defn(name="cluster_tear_down")
    @heartbeating
    def tear_down(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.tear_down(request.spec))

    @activity.defn(name="cluster_add_users")
    @heartbeating
    def add_users(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.add_users(request.spec))

    @activity.defn(name="cluster_remove_users")
    @heartbeating
    def remove_users(self, request: ClusterRequest) -> StepResult:
        if request.only is None:
            return self._run(request, lambda b: b.remove_users(request.spec))
        return self._run(request, lambda b: b.remove_users(request.spec, only=request.only))

    @activity.defn(name="cluster_set_logins")
    @heartbeating
    def set_logins(self, request: ClusterRequest) -> StepResult:
        """The login node's users and keys become the spec's (a running cluster's users change)."""
        backend = self._backend(request)
        if not callable(getattr(backend, "set_logins", None)):
            raise ApplicationError(
                f"the {backend.name} backend cannot change the logins of a running cluster yet "
                "(it has no set_logins): its users were left as they were",
                type="Unsupported",
                non_retryable=True,
            )
        return self._run(request, lambda b: b.set_logins(request.spec))

    @activity.defn(name="cluster_smoke_test")
    @heartbeating
    def smoke_test(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.smoke_test(request.spec))

    @activity.defn(name="cluster_make_remediable")
    @heartbeating
    def make_remediable(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.make_remediable(request.spec))

    @activity.defn(name="cluster_unmake_remediable")
    @heartbeating
    def unmake_remediable(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.unmake_remediable(request.spec))

    @activity.defn(name="cluster_notify")
    def notify(self, request: ClusterRequest) -> StepResult:
        spec = request.spec
        parts = ", ".join(f"{p.name} ({p.nodes} nodes)" for p in spec.partitions)
        text = f"cluster {spec.name} is ready on {request.backend}: partitions {parts}; users {len(spec.users)}."
        return StepResult(detail=self._tell("cluster_ready", text))

    def _tell(self, kind: str, text: str) -> str:
        """Best effort: a webhook that is down does not undo a cluster; the status says so."""
        try:
            sent = self._notifier.send(Notification(kind=kind, text=text))
        except ClientError as exc:
            return f"{text} (not sent: {exc})"
        return text if sent else f"{text} (no webhook configured: logged only)"

    @activity.defn(name="cluster_stop_incidents")
    async def stop_incidents(self, request: ClusterRequest) -> StepResult:
        """Cancel the cluster's open incidents (each requeues what it signalled and gives back its
        lease, claim and slot), wait for them to stop, then end its fleet guard and its reaper.
        Idempotent: a retry finds fewer incidents, or none."""
        name = request.spec.name
        client = activity.client()
        query = (
            f"WorkflowType='{REMEDIATION_WORKFLOW}' AND ExecutionStatus='Running' AND TaskQueue='{task_queue(name)}'"
        )
        why = f"cluster {name} is being deleted"
        async with heartbeats():
            open_ids = [execution.id async for execution in client.list_workflows(query)]
            for workflow_id in open_ids:
                handle = client.get_workflow_handle(workflow_id)
                try:
                    await handle.signal("cancel_requested", CancelRequest(by="gpufleet cluster delete", reason=why))
                    await handle.cancel(reason=why)
                except RPCError as exc:
                    if exc.status != RPCStatusCode.NOT_FOUND:
                        raise
            still = await self._still_running(open_ids)
            if still:
                raise ApplicationError(
                    f"{len(still)} incident(s) of cluster {name} did not stop within {INCIDENTS_STOP_SECONDS:g}s of "
                    f"their cancel: {', '.join(still)}; is the cluster's worker running? Start it and delete again",
                    type="StepFailed",
                    non_retryable=True,
                )
            ended = []
            for workflow_id in (guard_workflow_id(name), reaper_workflow_id(name)):
                try:
                    await client.get_workflow_handle(workflow_id).terminate(reason=why)
                    ended.append(workflow_id)
                except RPCError as exc:
                    if exc.status != RPCStatusCode.NOT_FOUND:
                        raise
        return StepResult(
            detail=f"cancelled {len(open_ids)} open incident(s)"
            + (f"; ended {', '.join(ended)}" if ended else "; no fleet guard or reaper was running")
        )

    async def _still_running(self, workflow_ids: list[str]) -> list[str]:
        """Those of ``workflow_ids`` still running once the wait is over (at once when none is)."""
        client = activity.client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + INCIDENTS_STOP_SECONDS
        running = list(workflow_ids)
        while running:
            described = [await client.get_workflow_handle(w).describe() for w in running]
            running = [d.id for d in described if d.status == WorkflowExecutionStatus.RUNNING]
            if not running or loop.time() > deadline:
                break
            await asyncio.sleep(INCIDENTS_POLL_SECONDS)
        return running

    @activity.defn(name="cluster_users_check")
    async def users_check(self, request: ClusterRequest) -> StepResult:
        """Before a running cluster's users change: this worker has its backend, and the cluster
        is the one ``request.creation`` made, ready and not deleted since, and its logins are still
        the users the change was read against."""
        backend = self._backend(request)
        name = request.spec.name
        client = activity.client()
        async with heartbeats():
            try:
                made = client.get_workflow_handle(cluster_workflow_id(name))
                described = await made.describe()
                status = await made.query("status", result_type=ClusterStatus)
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
                raise ApplicationError(f"no cluster named {name}", type="InvalidInput", non_retryable=True) from None
            if described.run_id != request.creation:
                raise ApplicationError(
                    f"cluster {name} was made by creation {described.run_id}, not {request.creation}: "
                    "read its users again",
                    type="InvalidInput",
                    non_retryable=True,
                )
            if status is None or status.outcome != ClusterOutcome.READY:
                outcome = status.outcome if status is not None else "starting"
                raise ApplicationError(
                    f"cluster {name} is not ready (it is {outcome})", type="InvalidInput", non_retryable=True
                )
            try:
                gone = await client.get_workflow_handle(deletion_workflow_id(name)).query(
                    "status", result_type=DeletionStatus
                )
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
                gone = None
            if gone is not None and gone.started_at and status.started_at and gone.started_at > status.started_at:
                raise ApplicationError(
                    f"cluster {name} is being deleted or is deleted ({gone.outcome})",
                    type="InvalidInput",
                    non_retryable=True,
                )
        differ = getattr(backend, "logins_differ", None)
        if callable(differ):
            try:
                with client_errors():
                    differs = await asyncio.to_thread(differ, request.spec)
            except StepFailed as exc:
                raise ApplicationError(str(exc), type="StepFailed", non_retryable=True) from None
            if differs:
                raise ApplicationError(
                    f"cluster {name}'s users changed since this change was read ({differs}): read them again "
                    f"(gpufleet cluster users list {name}) and ask again",
                    type="InvalidInput",
                    non_retryable=True,
                )
        return StepResult(detail=f"cluster {name} is ready, made by creation {request.creation}")

    @activity.defn(name="cluster_drain")
    @heartbeating
    def drain(self, request: ClusterRequest) -> StepResult:
        return self._run(request, lambda b: b.drain(request.spec))

    @activity.defn(name="cluster_running_jobs")
    @heartbeating
    def running_jobs(self, request: ClusterRequest) -> JobsResult:
        running = self._run(request, lambda b: str(b.running_jobs(request.spec)))
        count = int(running.detail)
        return JobsResult(running=count, detail=f"{count} job(s) running")

    @activity.defn(name="cluster_cancel_jobs")
    @heartbeating
    def cancel_jobs(self, request: ClusterRequest) -> JobsResult:
        cancelled = self._run(request, lambda b: str(b.cancel_jobs(request.spec)))
        return JobsResult(running=int(cancelled.detail))

    @activity.defn(name="cluster_notify_deleted")
    def notify_deleted(self, request: ClusterRequest) -> StepResult:
        text = f"cluster {request.spec.name} on {request.backend} is deleted; its nodes left it."
        return StepResult(detail=self._tell("cluster_deleted", text))

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.validate,
            self.reserve,
            self.release,
            self.render,
            self.create_objects,
            self.delete_objects,
            self.bring_up,
            self.tear_down,
            self.add_users,
            self.remove_users,
            self.set_logins,
            self.users_check,
            self.smoke_test,
            self.make_remediable,
            self.unmake_remediable,
            self.notify,
            self.stop_incidents,
            self.drain,
            self.running_jobs,
            self.cancel_jobs,
            self.notify_deleted,
        ]
