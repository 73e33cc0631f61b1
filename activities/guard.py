"""The fleet guard's plumbing: incidents reach their cluster's guard, the guard counts the fleet."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import client_errors
from activities.heartbeat import heartbeating, heartbeats
from clients.slurm import SlurmClient
from models.constants import (
    GUARD_DECISION_SIGNAL,
    GUARD_DRAINED_SIGNAL,
    GUARD_REQUEST_SIGNAL,
    GUARD_WORKFLOW,
    guard_task_queue,
    guard_workflow_id,
)
from models.guard import GuardAnswer, GuardCommand, GuardInput, SlotRequest
from models.names import validate_cluster_name
from models.topology import (
    DOMAIN_JOIN_SIGNAL,
    DOMAIN_WORKFLOW,
    DomainFailure,
    DomainIncidentInput,
    domain_workflow_id,
)

# Answers signalled (or incidents described) at once by one activity.
ANSWERS_AT_ONCE = 32
# Each call to the Temporal service; the activities heartbeat meanwhile, so a slow call in a live
# worker is not taken for a dead worker, and each one's start-to-close is well above this.
RPC_TIMEOUT = timedelta(seconds=10)
# Failures that pass: the batch is tried again.
PASSING = frozenset(
    {
        RPCStatusCode.UNAVAILABLE,
        RPCStatusCode.DEADLINE_EXCEEDED,
        RPCStatusCode.RESOURCE_EXHAUSTED,
        RPCStatusCode.INTERNAL,
        RPCStatusCode.UNKNOWN,
        RPCStatusCode.ABORTED,
        RPCStatusCode.CANCELLED,
    }
)


def refuse_for_good(exc: RPCError) -> None:
    """Raise a refusal the server would give again (an invalid request, no permission) as an error
    that is not retried; a failure that passes (PASSING) is left to be retried."""
    if exc.status not in PASSING:
        raise ApplicationError(f"the Temporal service refused: {exc}", type="Refused", non_retryable=True) from exc


async def _start_with_signal(
    workflow: str, arg: object, *, workflow_id: str, cluster: str, signal: str, message: object, summary: str
) -> None:
    """Signal a workflow on the cluster's guard queue, starting it first when it does not run
    (signal-with-start: two callers never start two); heartbeating meanwhile."""
    async with heartbeats():
        try:
            await activity.client().start_workflow(
                workflow,
                arg,
                id=workflow_id,
                task_queue=guard_task_queue(cluster),
                start_signal=signal,
                start_signal_args=[message],
                static_summary=summary,
                rpc_timeout=RPC_TIMEOUT,
            )
        except RPCError as exc:
            refuse_for_good(exc)
            raise


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
        await self._signal_with_start(GUARD_REQUEST_SIGNAL, request)

    @activity.defn(name="guard_drained")
    async def drained(self, command: GuardCommand) -> None:
        """Tell the cluster's guard that an incident drained its node (counted for storms),
        starting the guard if it does not run yet; nothing is answered."""
        await self._signal_with_start(GUARD_DRAINED_SIGNAL, command)

    async def _signal_with_start(self, signal: str, message: SlotRequest | GuardCommand) -> None:
        cluster = self._cluster_name()
        await _start_with_signal(
            GUARD_WORKFLOW,
            GuardInput(cluster=cluster),
            workflow_id=guard_workflow_id(cluster),
            cluster=cluster,
            signal=signal,
            message=message,
            summary=f"fleet guard of cluster {cluster}",
        )

    def _cluster_name(self) -> str:
        with client_errors():
            return validate_cluster_name(self._cluster)

    @activity.defn(name="guard_domain_join")
    async def domain_join(self, opening: DomainIncidentInput, failure: DomainFailure) -> None:
        """A failure joins its domain's incident, starting the incident (``opening`` its input)
        when none runs (signal-with-start: two failures never open two). Joining twice is one
        join: the incident counts each incident ID once."""
        cluster = self._cluster_name()
        await _start_with_signal(
            DOMAIN_WORKFLOW,
            opening,
            workflow_id=domain_workflow_id(cluster, opening.domain),
            cluster=cluster,
            signal=DOMAIN_JOIN_SIGNAL,
            message=failure,
            summary=f"domain incident: {opening.domain.key} in cluster {cluster}",
        )

    @activity.defn(name="guard_answer")
    async def answer(self, answers: list[GuardAnswer]) -> list[str]:
        """Signal each incident its answer, straight to the incident (the server's transfer queue,
        which a workflow's own signals to another go through, took tens of seconds per answer in a
        burst). Only an incident's newest answer is sent (it supersedes the earlier ones), so a
        retry never sends an older answer after a newer one. Returns the incident IDs whose
        workflow is gone (nothing to hold a slot for).

        An answer the server refuses for good (an invalid or oversized signal, no permission) is
        logged and dropped: the incident asks again, and one bad incident never holds up the
        others' answers. A passing failure (the server unavailable) retries the batch after the
        others are sent; sending an answer again is harmless."""
        client = activity.client()
        newest: dict[tuple[str, str], GuardAnswer] = {}
        for answer in answers:
            newest[(answer.workflow_id, answer.decision.incident_id)] = answer
        gone: list[str] = []
        passing: list[RPCError] = []
        limit = asyncio.Semaphore(ANSWERS_AT_ONCE)

        async def send(answer: GuardAnswer) -> None:
            async with limit:
                try:
                    await client.get_workflow_handle(answer.workflow_id).signal(
                        GUARD_DECISION_SIGNAL, answer.decision, rpc_timeout=RPC_TIMEOUT
                    )
                except RPCError as exc:
                    if exc.status == RPCStatusCode.NOT_FOUND:
                        gone.append(answer.decision.incident_id)
                    elif exc.status in PASSING:
                        passing.append(exc)
                    else:
                        activity.logger.warning(
                            "answer to %s not sent, dropped (it asks again): %s", answer.workflow_id, exc
                        )

        async with heartbeats():
            await asyncio.gather(*(send(answer) for answer in newest.values()))
        if passing:
            raise RuntimeError(f"{len(passing)} answer(s) not sent yet: {passing[0]}")
        return sorted(set(gone))

    @activity.defn(name="guard_tell")
    async def tell(self, signal: str, command: GuardCommand) -> bool:
        """Send the guard a word (``release``, ``admit``); False when no guard runs (nothing to tell)."""
        workflow_id = guard_workflow_id(self._cluster_name())  # a bad name refused before anything
        handle = activity.client().get_workflow_handle(workflow_id)
        async with heartbeats():
            try:
                await handle.signal(signal, command, rpc_timeout=RPC_TIMEOUT)
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    return False
                refuse_for_good(exc)
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
        client = activity.client()
        limit = asyncio.Semaphore(ANSWERS_AT_ONCE)

        async def runs(request: SlotRequest) -> bool:
            async with limit:
                try:
                    asked = await client.get_workflow_handle(
                        request.workflow_id, run_id=request.run_id or None
                    ).describe(rpc_timeout=RPC_TIMEOUT)
                    status = asked.status
                    if status == WorkflowExecutionStatus.CONTINUED_AS_NEW:
                        latest = await client.get_workflow_handle(request.workflow_id).describe(rpc_timeout=RPC_TIMEOUT)
                        status = latest.status
                except RPCError as exc:
                    if exc.status == RPCStatusCode.NOT_FOUND:
                        return False
                    refuse_for_good(exc)
                    raise
                return status == WorkflowExecutionStatus.RUNNING

        async with heartbeats():
            running = await asyncio.gather(*(runs(request) for request in held))
        return [request.incident_id for request, alive in zip(held, running, strict=True) if alive]
