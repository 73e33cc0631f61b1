"""A cancelled incident leaves nothing behind: the jobs it signalled are requeued, its repair Job is
stopped, its spare claim, guard slot and node lease are given back, and the owner is told what
stays drained. Through the workflow's own signal and Temporal's cancel, and through
`gpufleet incidents cancel` as a person runs it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import CancelledError
from temporalio.testing import WorkflowEnvironment

from models.guard import GuardStatus
from models.incident import CancelRequest, IncidentStatus, Outcome, Step
from models.requests import RepairRequest, RepairResult, RequeueJobRequest, StillRunningRequest, StopRepairsRequest
from tests.conftest import gpufleet_cli
from tests.workflows.test_guard import guard, running, until
from tests.workflows.test_remediation import Fleet, start
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow


async def closed_by_cancel(handle: Any) -> None:
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert isinstance(failure.value.cause, CancelledError)


def in_grace(status: IncidentStatus) -> bool:
    return status.step == Step.CHECKPOINT and status.signalled == [7]  # and checking the job


def checking_in_grace(fleet: Fleet) -> list[Any]:
    """The fleet's activities, but the job's check in the grace period watches until the incident
    is cancelled: a cancel then reaches a running activity, never one finishing at that moment
    (the test server cannot take a cancel that races an activity's completion)."""

    @activity.defn(name="jobs_still_running")
    async def still_running(request: StillRunningRequest) -> list[int]:
        fleet.calls.append("jobs_still_running")
        while True:
            activity.heartbeat()
            await asyncio.sleep(0.1)

    return [*without(fleet.activities(), "jobs_still_running"), still_running]


def without(activities: list[Any], name: str) -> list[Any]:
    return [a for a in activities if activity._Definition.must_from_callable(a).name != name]


async def test_a_cancel_in_the_grace_period_requeues_the_signalled_job_and_gives_everything_back(
    env: WorkflowEnvironment,
) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with running(env, fleet, manual_clock=True, activities=checking_in_grace(fleet)):
        handle = await start(env.client, fleet)
        await until(handle, NodeRemediationWorkflow.status, in_grace, "SIGTERM sent, grace running")
        await handle.signal(NodeRemediationWorkflow.cancel_requested, CancelRequest(by="alice", reason="wrong node"))
        await handle.cancel()
        await closed_by_cancel(handle)
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        slots: GuardStatus = await until(
            guard(env.client, fleet), FleetGuardWorkflow.status, lambda s: not s.state.in_flight, "the slot given back"
        )
    assert not slots.state.in_flight
    assert status.outcome == Outcome.CANCELLED
    assert status.cancelled == "by alice: wrong node"
    # The job got SIGTERM and no requeue from the flow: the cancel requeued it, as signalled.
    requeues = [w for w in fleet.writes if isinstance(w, RequeueJobRequest)]
    assert [(r.job_id, r.signalled) for r in requeues] == [(7, True)]
    assert status.requeued == [7]
    assert fleet.leases == {}  # the node's lease given back
    assert "claim_spare" not in fleet.calls  # no claim was made, none is left
    assert status.left == ["gpu1 stays drained in Slurm: `gpufleet nodes return gpu1` once it is checked"]
    cancelled = [n.text for n in fleet.notifications if n.kind == "cancelled"]
    assert len(cancelled) == 1
    assert "cancelled at checkpoint by alice: wrong node" in cancelled[0]
    assert "gpu1 stays drained in Slurm" in cancelled[0]


class BlockingRepair:
    """A reset whose Job runs until the incident is cancelled; the stop that the cancel asks for."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.stops: list[StopRepairsRequest] = []

    def activities(self) -> list[Any]:
        @activity.defn(name="repair_node")
        async def repair(request: RepairRequest) -> RepairResult:
            self.started.set()
            while True:  # until cancelled (the workflow waits for the cancel to complete)
                activity.heartbeat()
                await asyncio.sleep(0.1)

        @activity.defn(name="stop_repair_jobs")
        async def stop(request: StopRepairsRequest) -> list[str]:
            self.stops.append(request)
            return ["gpufleet-reset-gpu1-0a1b2c3d"]

        return [repair, stop]


async def test_a_cancel_during_a_repair_stops_its_job_and_gives_back_the_slot(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    blocking = BlockingRepair()
    acts = [*without(fleet.activities(), "repair_node"), *blocking.activities()]
    async with running(env, fleet, manual_clock=True, activities=acts):
        handle = await start(env.client, fleet, xid=48)  # a reset in place
        await asyncio.wait_for(blocking.started.wait(), timeout=30)
        holding: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        assert len(holding.state.in_flight) == 1  # the repair holds a slot
        await handle.cancel()
        await closed_by_cancel(handle)
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        await until(
            guard(env.client, fleet), FleetGuardWorkflow.status, lambda s: not s.state.in_flight, "the slot given back"
        )
    assert status.outcome == Outcome.CANCELLED
    assert [s.incident_id for s in blocking.stops] == [status.incident_id]
    assert "cancelled" in blocking.stops[0].why
    stopped = [e.detail for e in status.timeline if e.event == "stopped"]
    assert stopped == ["repair Job(s) gpufleet-reset-gpu1-0a1b2c3d"]
    assert fleet.leases == {}


async def test_incidents_cancel_stops_an_incident_and_says_what_stays_drained(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    address = env.client.service_client.config.target_host
    async with running(env, fleet, manual_clock=True, activities=checking_in_grace(fleet)):
        handle = await start(env.client, fleet)
        status = await until(handle, NodeRemediationWorkflow.status, in_grace, "SIGTERM sent, grace running")
        done = await asyncio.to_thread(
            gpufleet_cli,
            "incidents",
            "cancel",
            status.incident_id,
            "--reason",
            "drill",
            "--cluster",
            fleet.cluster,
            env={"TEMPORAL_ADDRESS": address},
        )
        assert done.returncode == 0, done.stderr
        assert f"{status.incident_id}: cancelled at checkpoint" in done.stdout
        assert "left: gpu1 stays drained in Slurm" in done.stdout
        closed: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        assert closed.cancelled.endswith(": drill") and closed.requeued == [7]
        # A second cancel finds nothing open, says so and changes nothing.
        again = await asyncio.to_thread(
            gpufleet_cli,
            "incidents",
            "cancel",
            status.incident_id,
            "--cluster",
            fleet.cluster,
            env={"TEMPORAL_ADDRESS": address},
        )
    assert again.returncode == 1
    assert "is not open (cancelled)" in again.stderr
    assert "Traceback" not in again.stderr
