"""The goodput ledger an incident computes as it closes, on the time-skipping test server.

A hand-computable incident: an Xid 79 whose failure the kernel logged 30 s before it was reported,
one job of 8 GPUs that checkpointed 600 s before the failure and ignores SIGTERM (its grace of
120 s runs out), a spare free 300 s after the first claim found none (re-checked every 100 s, the
wait continuing as new on the way), and the job running again 60 s after the spare came in. Each
phase must be within 1 s of its hand-computed value. An incident that fails, and one that is
cancelled, still carry a ledger.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from models.goodput import RECOVERY_PHASES, IncidentLedger, Phase
from models.incident import CancelRequest, IncidentStatus, JobInfo, Outcome
from models.policy import RemediationSettings
from models.requests import ClaimRequest, ResumeCheck, ResumeCheckRequest
from models.xid import XidEvent
from starters.temporal import report_xid
from tests.workflows.test_cancel import checking_in_grace, closed_by_cancel, in_grace, without
from tests.workflows.test_guard import running, until
from tests.workflows.test_remediation import Fleet, start, worker
from workflows.remediation import NodeRemediationWorkflow


@pytest.fixture
async def env(temporal_test_server: str) -> AsyncIterator[WorkflowEnvironment]:
    """A test server of each test's own: a workflow an earlier test leaves with a task on a queue
    nobody polls any more (its fleet guard, say) would stop this test's time from skipping."""
    environment = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=temporal_test_server,
        test_server_startup_timeout=timedelta(seconds=60),
    )
    yield environment
    await environment.shutdown()


GRACE = 120.0
RECHECK = 100.0
SPARE_AFTER = 300.0  # a spare comes free this long after the first claim found none
BACK_AFTER = 60.0  # the job runs again this long after the spare came in
BEFORE_REPORT = 30.0
CHECKPOINT_BEFORE = 600.0


class SlowSpareFleet:
    """The fleet's activities, but a spare comes free SPARE_AFTER seconds (server time) after the
    first claim found none, and the job starts again BACK_AFTER seconds after the spare came in,
    as Slurm's StartTime says."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.first_claim: datetime | None = None
        self.spare_in: datetime | None = None

    def activities(self) -> list[Any]:
        fleet = self.fleet

        @activity.defn(name="claim_spare")
        async def claim(request: ClaimRequest) -> str | None:
            fleet.claim_started.set()
            now = activity.info().current_attempt_scheduled_time
            self.first_claim = self.first_claim or now
            if now < self.first_claim + timedelta(seconds=SPARE_AFTER):
                return None
            self.spare_in = now
            return "spare1"

        @activity.defn(name="jobs_resumed")
        async def resumed(request: ResumeCheckRequest) -> ResumeCheck:
            now = activity.info().current_attempt_scheduled_time
            assert self.spare_in is not None
            back = self.spare_in + timedelta(seconds=BACK_AFTER)
            jobs = [JobInfo(job_id=j, state="RUNNING", restarts=1, nodes="spare1", gpus=8) for j in request.job_ids]
            if now < back:
                return ResumeCheck(waiting=[job.model_copy(update={"state": "PENDING"}) for job in jobs])
            return ResumeCheck(resumed=[job.model_copy(update={"start_time": back}) for job in jobs])

        return [*without(without(fleet.activities(), "claim_spare"), "jobs_resumed"), claim, resumed]


def checkpointed_job(failed: datetime) -> JobInfo:
    # Whole seconds in the Comment: the checkpoint is at most 1 s later than CHECKPOINT_BEFORE says.
    stamp = math.ceil(failed.timestamp() - CHECKPOINT_BEFORE)
    return JobInfo(job_id=7, user="alice", state="RUNNING", gpus=8, comment=f"epoch 3 gpufleet:checkpoint:{stamp}:4200")


def assert_adds_up(ledger: IncidentLedger) -> None:
    recovery = sum(ledger.cost(phase).seconds for phase in RECOVERY_PHASES)
    assert recovery == pytest.approx(ledger.recovery_seconds, abs=1e-6)
    assert ledger.recovery_seconds == pytest.approx((ledger.recovered_at - ledger.failed_at).total_seconds())


async def test_a_hand_computed_incident_costs_what_its_phases_say(env: WorkflowEnvironment) -> None:
    failed = await env.get_current_time() - timedelta(seconds=BEFORE_REPORT)
    fleet = Fleet(
        jobs=[checkpointed_job(failed)],
        jobs_exit_on_sigterm=False,
        settings=RemediationSettings(grace_seconds=GRACE, spare_recheck_seconds=RECHECK),
    )
    slow = SlowSpareFleet(fleet)
    async with worker(env, fleet, activities=slow.activities()):
        event = XidEvent(node="gpu1", xid=79, source="test", timestamp=failed)
        handle = await report_xid(env.client, event, cluster=fleet.cluster, search_attributes=False)
        status: IncidentStatus = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.spare == "spare1"
    assert slow.spare_in is not None
    assert status.ran_again_at == {7: slow.spare_in + timedelta(seconds=BACK_AFTER)}
    ledger = status.ledger
    assert ledger is not None
    expected = {
        Phase.DETECTION: BEFORE_REPORT,
        Phase.DRAIN: 0.0,
        Phase.GRACE: GRACE,
        Phase.REQUEUE: 0.0,
        Phase.SPARE_WAIT: SPARE_AFTER,
        Phase.RESTART: BACK_AFTER,
        Phase.LOST_WORK: CHECKPOINT_BEFORE,
    }
    got = {phase: ledger.cost(phase).seconds for phase in Phase}
    for phase, seconds in expected.items():
        assert got[phase] == pytest.approx(seconds, abs=1.0), (phase, got)
        assert ledger.cost(phase).gpu_seconds == pytest.approx(got[phase] * 8), phase
    assert ledger.gpus == 8 and ledger.cause == "Xid 79" and ledger.lost_work_unknown == []
    assert ledger.failed_at == failed and ledger.recovered_at == slow.spare_in + timedelta(seconds=BACK_AFTER)
    assert_adds_up(ledger)
    total = sum(expected.values()) * 8
    assert ledger.gpu_seconds_lost == pytest.approx(total, abs=8 * 7)


async def test_a_failed_incident_carries_its_ledger(env: WorkflowEnvironment) -> None:
    fleet = Fleet(retire_fails=True)  # the retirement is refused: the incident fails there
    async with worker(env, fleet):
        handle = await start(env.client, fleet)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
    assert status.outcome == Outcome.FAILED
    ledger = status.ledger
    assert ledger is not None
    assert_adds_up(ledger)
    # The job stopped and said nothing of its checkpoints; it never ran again before the failure.
    assert ledger.gpus == 8 and ledger.lost_work_unknown == [7]
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds is None


async def test_a_cancelled_incident_carries_its_ledger(env: WorkflowEnvironment) -> None:
    fleet = Fleet(jobs_exit_on_sigterm=False)
    async with running(env, fleet, manual_clock=True, activities=checking_in_grace(fleet)):
        handle = await start(env.client, fleet)
        await until(handle, NodeRemediationWorkflow.status, in_grace, "SIGTERM sent, grace running")
        await handle.signal(NodeRemediationWorkflow.cancel_requested, CancelRequest(by="alice", reason="wrong node"))
        await handle.cancel()
        await closed_by_cancel(handle)
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
    assert status.outcome == Outcome.CANCELLED
    ledger = status.ledger
    assert ledger is not None
    assert_adds_up(ledger)
    assert ledger.gpus == 8 and ledger.lost_work_unknown == [7]
