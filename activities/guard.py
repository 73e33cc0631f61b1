"""The fleet guard's plumbing: incidents reach their cluster's guard, the guard counts the fleet."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.slurm import SlurmClient
from models.constants import (
    GUARD_REQUEST_SIGNAL,
    GUARD_WORKFLOW,
    guard_workflow_id,
    task_queue,
)
from models.guard import GuardCommand, GuardInput, SlotRequest
from models.names import validate_cluster_name


class GuardActivities:
    def __init__(self, slurm: SlurmClient, *, cluster: str, partition: str) -> None:
        self._slurm = slurm
        self._cluster = cluster
        self._partition = partition

    @activity.defn(name="guard_request_slot")
    async def request_slot(self, request: SlotRequest) -> None:
        """Ask the cluster's guard for a slot, starting the guard if it does not run yet
        (signal-with-start, so two incidents never start two guards). The answer comes back
        as a signal to the incident; asking again for the same incident is answered again."""
        cluster = validate_cluster_name(self._cluster)
        await activity.client().start_workflow(
            GUARD_WORKFLOW,
            GuardInput(cluster=cluster),
            id=guard_workflow_id(cluster),
            task_queue=task_queue(cluster),
            start_signal=GUARD_REQUEST_SIGNAL,
            start_signal_args=[request],
            static_summary=f"fleet guard of cluster {cluster}",
            rpc_timeout=timedelta(seconds=10),
        )

    @activity.defn(name="guard_tell")
    async def tell(self, signal: str, command: GuardCommand) -> bool:
        """Send the guard a word (``release``, ``admit``); False when no guard runs (nothing to tell)."""
        handle = activity.client().get_workflow_handle(guard_workflow_id(validate_cluster_name(self._cluster)))
        try:
            await handle.signal(signal, command, rpc_timeout=timedelta(seconds=10))
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    @activity.defn(name="guard_fleet_size")
    @heartbeating
    def fleet_size(self) -> int:
        """How many nodes the cluster's partition has now (the breaker's share is of these)."""
        with client_errors():
            return len(self._slurm.partition_nodes(self._partition))

    @activity.defn(name="guard_running")
    async def running(self, held: list[SlotRequest]) -> list[str]:
        """The incidents (by incident ID) among ``held`` that still run: the run that asked, or a
        run it continued as new into. A terminated incident never gives its slot back, and a new
        incident on the same node (same workflow ID, new run) is not the one that held it."""
        alive = []
        client = activity.client()
        for request in held:
            try:
                asked = await client.get_workflow_handle(request.workflow_id, run_id=request.run_id or None).describe(
                    rpc_timeout=timedelta(seconds=10)
                )
                status = asked.status
                if status == WorkflowExecutionStatus.CONTINUED_AS_NEW:
                    latest = await client.get_workflow_handle(request.workflow_id).describe(
                        rpc_timeout=timedelta(seconds=10)
                    )
                    status = latest.status
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    continue
                raise
            if status == WorkflowExecutionStatus.RUNNING:
                alive.append(request.incident_id)
        return alive
