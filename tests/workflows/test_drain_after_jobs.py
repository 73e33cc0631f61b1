"""DRAIN_AFTER_JOBS on the time-skipping server: the node is drained, its jobs are not signalled
and run on to their end, then the node is validated, reset or replaced as the policy says; the
wait running out, or a fatal Xid during it, checkpoints and requeues the jobs and goes on as the
normal path; a less severe event changes nothing."""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from models.incident import Approval, JobInfo, NodeInfo, Outcome, Step
from models.policy import Action, DrainAfterJobsSettings, GuardSettings, Policy
from models.requests import DrainRequest
from models.xid import XidEvent
from starters.temporal import report_xid
from tests.workflows.test_guard import NODES, running, until
from tests.workflows.test_remediation import Fleet, start
from workflows.remediation import NodeRemediationWorkflow


class Jobs:
    """The node's jobs as squeue lists them: running until ``ended`` is set, or for ``looks`` looks."""

    def __init__(self, looks: int | None = None, away: bool = False) -> None:
        self.looks = looks
        self.ended = False
        self.seen = 0
        self.away = away  # slurmctld answers no try of the wait's first look, whatever its retries
        self.away_look = ""

    def activity(self) -> Any:
        @activity.defn(name="jobs_on_node")
        async def jobs_on_node(node: str) -> list[JobInfo]:
            if self.away and self.away_look in ("", activity.info().activity_id):
                self.away_look = activity.info().activity_id
                raise ApplicationError("slurmctld unreachable", type="Unavailable")
            self.seen += 1
            if self.ended or (self.looks is not None and self.seen > self.looks):
                return []
            return [JobInfo(job_id=7, user="alice", state="RUNNING")]

        return jobs_on_node


def fleet_with(jobs: Jobs, **settings: Any) -> tuple[Fleet, list[Any]]:
    fleet = Fleet(
        nodes=set(NODES),
        partition_size=4,
        policy=Policy(guard=GuardSettings(), drain_after_jobs=DrainAfterJobsSettings(**settings)),
    )
    acts = [a for a in fleet.activities() if getattr(a, "__name__", "") != "jobs_on_node"]
    return fleet, [*acts, jobs.activity()]


def signalled(fleet: Fleet) -> list[str]:
    return [call for call in fleet.calls if call.startswith("signal_job")]


async def test_then_validate_returns_the_node_once_its_job_has_finished(env: WorkflowEnvironment) -> None:
    jobs = Jobs(looks=3)
    fleet, acts = fleet_with(jobs)
    async with running(env, fleet, activities=acts):
        status = await (await start(env.client, fleet, xid=92)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.DRAIN_AFTER_JOBS
    assert signalled(fleet) == [] and status.spare is None
    # Validated: the check's Job alone (attempt 0, never a repair attempt's), then back in service.
    [check] = fleet.repairs
    assert check.action == Action.DRAIN_AFTER_JOBS and check.attempt == 0
    assert fleet.resumed_nodes == ["gpu1"] and jobs.seen == 4
    steps = [e.step for e in status.timeline if e.event == "finished"]
    assert steps.index(Step.WAIT_FOR_JOBS) < steps.index(Step.REPAIR) < steps.index(Step.RESUME)
    assert "DRAIN_AFTER_JOBS" in fleet.drain_reasons[0]
    waits = [e.detail for e in status.timeline if e.step == Step.WAIT_FOR_JOBS and e.event == "waiting"]
    assert waits and waits[0].startswith("1 job(s) still running: 7; at most until ")
    assert status.waiting_for_jobs is None
    [opened] = [n for n in fleet.notifications if n.kind == "opened"]
    assert "its jobs run on to their end" in opened.text


async def test_a_node_that_fails_its_check_after_the_jobs_is_reset(env: WorkflowEnvironment) -> None:
    fleet, acts = fleet_with(Jobs(looks=2))
    fleet.repair_succeeds = [False, True]  # the check after the jobs, then the reset
    async with running(env, fleet, activities=acts):
        status = await (await start(env.client, fleet, xid=92)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.RESET_GPU
    assert [(r.action, r.attempt) for r in fleet.repairs] == [(Action.DRAIN_AFTER_JOBS, 0), (Action.RESET_GPU, 1)]
    assert signalled(fleet) == [] and fleet.resumed_nodes == ["gpu1"]
    [escalated] = [e.detail for e in status.timeline if e.event == "escalated"]
    assert escalated.startswith("DRAIN_AFTER_JOBS -> RESET_GPU: the check after the jobs failed: Job job-1 failed")
    assert "RESET_GPU" in fleet.drain_reasons[-1]


async def test_an_xid_the_catalog_resets_when_convenient_is_reset_after_the_jobs(env: WorkflowEnvironment) -> None:
    fleet, acts = fleet_with(Jobs(looks=2))
    async with running(env, fleet, activities=acts):
        status = await (await start(env.client, fleet, xid=94)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.RESET_GPU
    assert signalled(fleet) == [] and [r.action for r in fleet.repairs] == [Action.RESET_GPU]
    assert fleet.resumed_nodes == ["gpu1"]
    steps = [e.step for e in status.timeline if e.event == "finished"]
    assert steps.index(Step.WAIT_FOR_JOBS) < steps.index(Step.REPAIR) < steps.index(Step.RESUME)
    # The drain reason names the action now taken.
    assert "RESET_GPU" in fleet.drain_reasons[-1]


async def test_then_replace_retires_the_node_once_its_job_has_finished(env: WorkflowEnvironment) -> None:
    fleet, acts = fleet_with(Jobs(looks=2), then="REPLACE_NODE")
    async with running(env, fleet, activities=acts):
        status = await (await start(env.client, fleet, xid=92)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE
    assert status.spare == "spare1" and "retire_node" in fleet.calls
    assert signalled(fleet) == [] and status.requeued == []


async def test_max_wait_replaces_the_node_and_checkpoints_and_requeues_its_jobs(env: WorkflowEnvironment) -> None:
    jobs = Jobs()
    fleet, acts = fleet_with(jobs, max_wait_seconds=3600)
    async with running(env, fleet, activities=acts):
        status = await (await start(env.client, fleet, xid=92)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE
    assert signalled(fleet) == ["signal_job:7"] and status.requeued == [7] and status.spare == "spare1"
    [escalated] = [e.detail for e in status.timeline if e.event == "escalated"]
    assert escalated == "DRAIN_AFTER_JOBS -> REPLACE_NODE: job(s) 7 still running after 3600s"
    waited = [e.at for e in status.timeline if e.step == Step.WAIT_FOR_JOBS]
    assert (waited[-1] - waited[0]).total_seconds() >= 3600
    # A look a minute (poll_seconds): an hour is sixty looks.
    assert jobs.seen == 60


async def test_a_fatal_xid_during_the_wait_escalates_at_once(env: WorkflowEnvironment) -> None:
    jobs = Jobs()
    fleet, acts = fleet_with(jobs)
    async with running(env, fleet, activities=acts):
        handle = await start(env.client, fleet, xid=92)
        await until(handle, NodeRemediationWorkflow.status, lambda s: s.waiting_for_jobs, "waiting for the jobs")
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=79, source="test"))
        status = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE
    assert signalled(fleet) == ["signal_job:7"] and status.requeued == [7] and status.spare == "spare1"
    [escalated] = [e.detail for e in status.timeline if e.event == "escalated"]
    assert escalated.startswith("DRAIN_AFTER_JOBS -> REPLACE_NODE: Xid 79 came while the jobs ran on")
    assert "REPLACE_NODE" in fleet.drain_reasons[-1]
    # Woken by the event, not by the timer: the jobs were listed once at most meanwhile.
    assert jobs.seen <= 1


async def test_a_less_severe_event_during_the_wait_changes_nothing(env: WorkflowEnvironment) -> None:
    jobs = Jobs()
    fleet, acts = fleet_with(jobs)
    async with running(env, fleet, activities=acts):
        handle = await start(env.client, fleet, xid=92)
        await until(handle, NodeRemediationWorkflow.status, lambda s: s.waiting_for_jobs, "waiting for the jobs")
        await handle.signal(NodeRemediationWorkflow.report_xid, XidEvent(node="gpu1", xid=13, source="test"))
        await until(
            handle,
            NodeRemediationWorkflow.status,
            lambda s: any(e.event == "xid while waiting" for e in s.timeline),
            "the Xid classified",
        )
        jobs.ended = True
        status = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.DRAIN_AFTER_JOBS
    assert signalled(fleet) == [] and fleet.resumed_nodes == ["gpu1"]
    assert [r.action for r in fleet.repairs] == [Action.DRAIN_AFTER_JOBS]  # the check, no repair
    [seen] = [e.detail for e in status.timeline if e.event == "xid while waiting"]
    assert seen == "Xid 13 -> OBSERVE, which DRAIN_AFTER_JOBS covers"


async def test_a_dry_run_says_it_would_wait_and_waits_for_nothing(env: WorkflowEnvironment) -> None:
    jobs = Jobs()
    fleet, acts = fleet_with(jobs)
    async with running(env, fleet, activities=acts):
        handle = await report_xid(
            env.client,
            XidEvent(node="gpu1", xid=92, source="test"),
            cluster=fleet.cluster,
            dry_run=True,
            search_attributes=False,
        )
        status = await handle.result()
    assert status.dry_run and status.outcome == Outcome.RESOLVED and jobs.seen == 0
    [waited] = [e.detail for e in status.timeline if e.step == Step.WAIT_FOR_JOBS and e.event == "finished"]
    assert waited == "dry run: would wait up to 86400s for the node's jobs (7)"


async def test_a_week_long_wait_looks_a_few_hundred_times(env: WorkflowEnvironment) -> None:
    jobs = Jobs()
    fleet, acts = fleet_with(jobs, max_wait_seconds=7 * 86400)
    async with running(env, fleet, activities=acts):
        handle = await start(env.client, fleet, xid=92)
        status = await handle.result()
        history = await handle.fetch_history()
    assert status.action == Action.REPLACE_NODE and status.requeued == [7]
    # A minute's gap at first, growing to a week / 300: the history stays small.
    assert 300 <= jobs.seen <= 330 and len(history.events) < 4000


async def test_a_node_someone_else_drained_during_the_wait_is_theirs_until_they_say(
    env: WorkflowEnvironment,
) -> None:
    """An operator drains the node for their own work while its jobs run on: once the jobs end,
    the reset the Xid calls for waits for a person, as at the first drain; rejected, nothing runs."""
    fleet, acts = fleet_with(Jobs(looks=2), poll_seconds=1)  # a few seconds: queries skip no time
    theirs = "bob: bad fan, RMA"

    @activity.defn(name="drain_slurm_node")
    async def drain(request: DrainRequest) -> NodeInfo:
        fleet.drain_reasons.append(request.reason)
        # drain_node leaves a node someone else drained with their reason.
        reason = request.reason if len(fleet.drain_reasons) == 1 else theirs
        return NodeInfo(name=request.node, state="idle", flags=["DRAIN"], reason=reason)

    acts = [a for a in acts if getattr(a, "__name__", "") != "drain"] + [drain]  # Fleet's drain_slurm_node
    async with running(env, fleet, activities=acts):
        handle = await start(env.client, fleet, xid=94)
        asking = await until(
            handle, NodeRemediationWorkflow.status, lambda s: s.waiting_for_approval, "asking a person"
        )
        await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=False, by="ops", reason="bob's"))
        status = await handle.result()
    assert "gpu1 was drained by someone else while its jobs ran on: 'bob: bad fan, RMA'" in asking.waiting_for_approval
    assert status.outcome == Outcome.REJECTED and fleet.repairs == [] and fleet.resumed_nodes == []


async def test_slurm_away_for_longer_than_a_step_retries_does_not_end_the_wait(env: WorkflowEnvironment) -> None:
    """slurmctld restarted during a day-long wait: the looks that cannot list the jobs are noted
    and the wait goes on; the incident does not fail with the node drained and nobody on it."""
    jobs = Jobs(looks=2, away=True)
    fleet, acts = fleet_with(jobs)
    async with running(env, fleet, activities=acts):
        status = await (await start(env.client, fleet, xid=92)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.DRAIN_AFTER_JOBS
    assert signalled(fleet) == [] and fleet.resumed_nodes == ["gpu1"] and jobs.seen == 3
    [away] = [e.detail for e in status.timeline if e.event == "slurm away"]
    assert "slurmctld unreachable" in away


async def test_a_job_the_failure_ends_during_the_wait_is_requeued(env: WorkflowEnvironment) -> None:
    jobs = Jobs(looks=20)
    fleet, acts = fleet_with(jobs, then="REPLACE_NODE")
    fleet.jobs = [JobInfo(job_id=7, user="alice", state="RUNNING"), JobInfo(job_id=8, user="bob", state="RUNNING")]
    async with running(env, fleet, activities=acts):
        handle = await start(env.client, fleet, xid=94)
        await until(handle, NodeRemediationWorkflow.status, lambda s: s.waiting_for_jobs, "waiting for the jobs")
        # Job 8's process was the one the contained error hit: it fails a little after the drain.
        fleet.jobs = [fleet.jobs[0], JobInfo(job_id=8, user="bob", state="FAILED")]
        status = await handle.result()
    assert status.outcome == Outcome.RESOLVED and status.requeued == [8]
    assert signalled(fleet) == []
