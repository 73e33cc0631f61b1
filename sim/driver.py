"""The what-if's driver: a workflow that sleeps until each failure of the trace, makes it happen in
every case's world, and (when gpufleet would see it) reports it after the detection delay through
starters.temporal.report_xid, as the intake does: signal-with-start of the node's incident.

One driver serves every case of a run, so that each failure happens at the same simulated moment
in each; its waits are workflow timers, which the time-skipping server jumps over.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field
from temporalio import activity, workflow
from temporalio.service import RPCError

with workflow.unsafe.imports_passed_through():
    from models.trace import TraceFailure

if TYPE_CHECKING:
    from sim.activities import SimFleet

DRIVER_WORKFLOW = "WhatIfDriver"
DRIVER_TASK_QUEUE = "gpufleet-whatif"
STEP = timedelta(seconds=60)


class DriverInput(BaseModel):
    failures: list[TraceFailure] = Field(default_factory=list)
    seconds: float
    detection_seconds: float = 0.0


class FailRequest(BaseModel):
    index: int
    start: datetime


class FailedNodes(BaseModel):
    # Per case (cluster): the node that failed, None where no node could (none usable).
    nodes: dict[str, str | None] = Field(default_factory=dict)


class ReportRequest(BaseModel):
    index: int
    start: datetime
    nodes: dict[str, str | None] = Field(default_factory=dict)


@workflow.defn(name=DRIVER_WORKFLOW)
class WhatIfDriver:
    """Every failure of the trace, at its time, in every case; done at the trace's end."""

    def __init__(self) -> None:
        self._done = 0

    @workflow.query
    def failures_done(self) -> int:
        return self._done

    @workflow.run
    async def run(self, params: DriverInput) -> int:
        start = workflow.now()
        await workflow.execute_activity("sim_begin", start, start_to_close_timeout=STEP)
        tasks = [
            asyncio.create_task(self._failure(index, failure, start, params))
            for index, failure in enumerate(params.failures)
        ]
        tasks.append(asyncio.create_task(self._returns(start, params)))
        await workflow.sleep(timedelta(seconds=params.seconds))
        await asyncio.gather(*tasks)
        return self._done

    async def _returns(self, start: datetime, params: DriverInput) -> None:
        """Wake when a retired node is back from its repair, so that incidents waiting for a spare
        hear of it (as `gpufleet spare-available` tells them), until the trace's end."""
        end = start + timedelta(seconds=params.seconds)
        while workflow.now() < end:
            wake: float = await workflow.execute_activity(
                "sim_returns", start, result_type=float, start_to_close_timeout=STEP
            )
            until = min(start + timedelta(seconds=wake), end)
            await workflow.sleep(max(until - workflow.now(), timedelta(seconds=1)))

    async def _failure(self, index: int, failure: TraceFailure, start: datetime, params: DriverInput) -> None:
        wait = (start + timedelta(seconds=failure.at) - workflow.now()).total_seconds()
        if wait > 0:
            await workflow.sleep(timedelta(seconds=wait))
        failed: FailedNodes = await workflow.execute_activity(
            "sim_fail", FailRequest(index=index, start=start), result_type=FailedNodes, start_to_close_timeout=STEP
        )
        self._done += 1
        if failure.event is None or not any(failed.nodes.values()):
            return
        if params.detection_seconds > 0:
            await workflow.sleep(timedelta(seconds=params.detection_seconds))
        await workflow.execute_activity(
            "sim_report", ReportRequest(index=index, start=start, nodes=failed.nodes), start_to_close_timeout=STEP
        )


def driver_activities(cases: dict[str, SimFleet], failures: list[TraceFailure]) -> list[Callable[..., Any]]:
    """The driver's activities over the cases' fleets, by cluster."""
    from models.constants import remediation_workflow_id
    from models.xid import XidEvent
    from starters.temporal import report_xid

    @activity.defn(name="sim_begin")
    async def begin(start: datetime) -> None:
        for fleet in cases.values():
            fleet.start = start

    @activity.defn(name="sim_fail")
    async def fail(request: FailRequest) -> FailedNodes:
        failure = failures[request.index]
        nodes: dict[str, str | None] = {}
        for cluster, fleet in cases.items():
            record = fleet.world.fail(
                failure.at,
                cause=failure.cause,
                node=failure.node,
                visible=failure.event is not None,
                kills_job=failure.kills_job,
            )
            nodes[cluster] = record.node
        return FailedNodes(nodes=nodes)

    @activity.defn(name="sim_report")
    async def report(request: ReportRequest) -> None:
        failure = failures[request.index]
        assert failure.event is not None
        client = activity.client()
        when = request.start + timedelta(seconds=failure.at)

        async def one(cluster: str, node: str) -> None:
            event = XidEvent(
                node=node,
                kind=failure.event.kind,  # type: ignore[union-attr]
                xid=failure.event.xid,  # type: ignore[union-attr]
                source="whatif",
                message=failure.cause,
                timestamp=when,
            )
            handle = await report_xid(client, event, cluster=cluster, search_attributes=False)
            record = next(r for r in reversed(cases[cluster].world.failures) if r.at == failure.at and r.node == node)
            record.incident = (handle.id, handle.first_execution_run_id or handle.result_run_id or "")

        await asyncio.gather(*(one(cluster, node) for cluster, node in request.nodes.items() if node is not None))

    @activity.defn(name="sim_returns")
    async def returns(start: datetime) -> float:
        """Tell the incidents waiting for a spare that one is free; when to look again: the next
        return from repair (a node retired later returns later than the repair time from now)."""
        client = activity.client()
        wake = math.inf
        for cluster, fleet in cases.items():
            world = fleet.now()
            for node in world.announce():
                with contextlib.suppress(RPCError):
                    await client.get_workflow_handle(remediation_workflow_id(cluster, node)).signal("spare_available")
            wake = min(wake, world.next_return())
        return wake

    return [begin, fail, report, returns]
