"""The fleet guard's plumbing: incidents reach their cluster's guard, the guard counts the fleet."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import client_errors
from activities.heartbeat import HEARTBEAT_EVERY, heartbeating
from clients.slurm import SlurmClient
from models.constants import (
    GUARD_ASK_UPDATE,
    GUARD_REQUEST_SIGNAL,
    GUARD_WORKFLOW,
    guard_workflow_id,
    task_queue,
)
from models.guard import GuardCommand, GuardDecision, GuardInput, SlotRequest
from models.names import validate_cluster_name

# How long an ask waits for the guard's answer (inside the incident's 60 s activity timeout; a
# guard that is slower answers the incident's next ask, a minute later).
ANSWER_WAIT = timedelta(seconds=40)


async def _heartbeat() -> None:
    """Heartbeat while the ask waits, so that a dead worker is noticed in seconds."""
    while True:
        activity.heartbeat()
        await asyncio.sleep(HEARTBEAT_EVERY)


class GuardActivities:
    def __init__(self, slurm: SlurmClient, *, cluster: str, partition: str) -> None:
        self._slurm = slurm
        self._cluster = cluster
        self._partition = partition

    @activity.defn(name="guard_request_slot")
    async def request_slot(self, request: SlotRequest) -> GuardDecision | None:
        """Ask the cluster's guard for a slot, starting the guard if it does not run yet (with
        start, so two incidents never start two guards), and return its answer.

        The ask is an update: its result is the answer. None when there is no answer here: the
        guard did not answer within ANSWER_WAIT (its answer then comes as a signal, or to the
        incident's next ask), or the server does not take updates with start (older servers:
        the ask is then a signal-with-start, answered by a signal). Asking again for the same
        incident is answered again and counts it once."""
        cluster = validate_cluster_name(self._cluster)
        client = activity.client()
        start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
            GUARD_WORKFLOW,
            GuardInput(cluster=cluster),
            id=guard_workflow_id(cluster),
            task_queue=task_queue(cluster),
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"fleet guard of cluster {cluster}",
        )
        beating = asyncio.create_task(_heartbeat())
        try:
            decision: GuardDecision = await asyncio.wait_for(
                client.execute_update_with_start_workflow(
                    GUARD_ASK_UPDATE, request, start_workflow_operation=start, result_type=GuardDecision
                ),
                timeout=ANSWER_WAIT.total_seconds(),
            )
            return decision
        except TimeoutError:
            return None
        except RPCError as exc:
            if exc.status not in (RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.PERMISSION_DENIED):
                raise
        finally:
            beating.cancel()
        # The server does not take updates with start (disabled, or older than Temporal 1.26).
        await client.start_workflow(
            GUARD_WORKFLOW,
            GuardInput(cluster=cluster),
            id=guard_workflow_id(cluster),
            task_queue=task_queue(cluster),
            start_signal=GUARD_REQUEST_SIGNAL,
            start_signal_args=[request],
            static_summary=f"fleet guard of cluster {cluster}",
            rpc_timeout=timedelta(seconds=10),
        )
        return None

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
