"""The fleet guard's plumbing: incidents reach their cluster's guard, the guard counts the fleet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import client_errors
from activities.heartbeat import HEARTBEAT_EVERY, heartbeating
from clients.slurm import SlurmClient
from models.constants import (
    GUARD_DECISION_SIGNAL,
    GUARD_REQUEST_SIGNAL,
    GUARD_WORKFLOW,
    guard_workflow_id,
    task_queue,
)
from models.guard import GuardAnswer, GuardCommand, GuardInput, SlotRequest
from models.names import validate_cluster_name

# Answers signalled at once by one guard_answer activity.
ANSWERS_AT_ONCE = 32


@contextlib.asynccontextmanager
async def heartbeats() -> AsyncIterator[None]:
    """Heartbeat every second while the body runs, so that a dead worker is noticed in seconds."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_EVERY)

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()


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

    @activity.defn(name="guard_answer")
    async def answer(self, answers: list[GuardAnswer]) -> list[str]:
        """Signal each incident its answer, straight to the incident (the server's transfer queue,
        which a workflow's own signals to another go through, took tens of seconds per answer in a
        burst). An incident's answers are sent in the order given; different incidents' at once.
        Returns the incident IDs whose workflow is gone (nothing to hold a slot for). Sending an
        answer again (a retry) is harmless: an incident keeps the last answer it was sent."""
        client = activity.client()
        by_workflow: dict[str, list[GuardAnswer]] = {}
        for answer in answers:
            by_workflow.setdefault(answer.workflow_id, []).append(answer)
        gone: list[str] = []
        limit = asyncio.Semaphore(ANSWERS_AT_ONCE)

        async def send(workflow_id: str, theirs: list[GuardAnswer]) -> None:
            async with limit:
                handle = client.get_workflow_handle(workflow_id)
                for answer in theirs:
                    try:
                        await handle.signal(GUARD_DECISION_SIGNAL, answer.decision, rpc_timeout=timedelta(seconds=10))
                    except RPCError as exc:
                        if exc.status != RPCStatusCode.NOT_FOUND:
                            raise
                        gone.append(answer.decision.incident_id)

        async with heartbeats():
            await asyncio.gather(*(send(workflow_id, theirs) for workflow_id, theirs in by_workflow.items()))
        return sorted(set(gone))

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
