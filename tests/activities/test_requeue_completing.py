"""A job whose GPU crashed sits COMPLETING while slurmd cleans up its processes: its requeue waits
for the final state (FAILED: requeued, as the failure ended it) instead of leaving it alone, and
says so when it is still COMPLETING past the wait (the activity is then retried). The Slurm here
is a recording of what squeue shows, one answer per look: a COMPLETING that lasts is what the
real lab cannot be made to show on demand (tests/activities/test_failed_jobs.py has the rest on
real Slurm)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.slurm as slurm_activities
from activities.slurm import SlurmActivities
from models.incident import JobInfo, RequeueOutcome
from models.requests import FailureJobsRequest, RequeueJobRequest


@dataclass
class SqueueShows:
    """Job 5's state at each look (the last one repeats), and the requeues asked for."""

    states: list[str]
    requeued: list[int] = field(default_factory=list)

    def jobs_by_id(self, job_ids: list[int]) -> dict[int, JobInfo]:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return {5: JobInfo(job_id=5, user="alice", state=state, restarts=0)}

    def job_marks(self, job_id: int) -> list[str]:
        return []

    def requeue(self, job_id: int) -> None:
        self.requeued.append(job_id)


REQUEST = RequeueJobRequest(
    job_id=5, restarts_before=0, signalled=False, incident_id="lab-gpu1-x", ended_by_failure=True
)


def test_a_job_completing_after_its_gpu_crashed_is_requeued_once_it_shows_failed() -> None:
    squeue = SqueueShows(["COMPLETING", "COMPLETING", "FAILED"])
    acts = SlurmActivities(squeue, poll_seconds=0.01)  # type: ignore[arg-type]
    requeue = ActivityEnvironment().run(acts.requeue_job, REQUEST)
    assert requeue.outcome is RequeueOutcome.REQUEUED
    assert squeue.requeued == [5]


def test_a_job_completing_that_then_completed_is_left_alone() -> None:
    squeue = SqueueShows(["COMPLETING", "COMPLETED"])
    acts = SlurmActivities(squeue, poll_seconds=0.01)  # type: ignore[arg-type]
    requeue = ActivityEnvironment().run(acts.requeue_job, REQUEST)
    assert requeue.outcome is RequeueOutcome.SKIPPED and "COMPLETED" in requeue.why
    assert squeue.requeued == []


def test_a_job_still_completing_past_the_wait_is_looked_at_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_activities, "COMPLETING_WAIT_SECONDS", 0.05)
    squeue = SqueueShows(["COMPLETING"])
    acts = SlurmActivities(squeue, poll_seconds=0.01)  # type: ignore[arg-type]
    with pytest.raises(ApplicationError) as retried:
        ActivityEnvironment().run(acts.requeue_job, REQUEST)
    assert not retried.value.non_retryable
    assert "job 5 is still COMPLETING" in str(retried.value)
    assert squeue.requeued == []


@dataclass
class NodeShows:
    """What the node's listing shows: jobs in a state, each with its end time."""

    jobs: list[JobInfo]

    def recent_jobs_on_node(self, name: str) -> list[JobInfo]:
        return self.jobs

    def accounted_jobs(self, name: str, since: datetime) -> list[JobInfo] | None:
        return None


def test_a_job_completing_since_before_the_failure_is_not_the_failures() -> None:
    """A job stuck COMPLETING since before the failure's window (its cleanup hung long ago) is
    not among the jobs the failure touched; one that ended inside it, or that still runs, is."""
    failure = datetime(2026, 12, 7, 4, 0, tzinfo=UTC)
    shows = NodeShows(
        [
            JobInfo(job_id=1, state="COMPLETING", end_time=failure - timedelta(hours=2)),
            JobInfo(job_id=2, state="COMPLETING", end_time=failure + timedelta(seconds=3)),
            JobInfo(job_id=3, state="RUNNING", end_time=failure - timedelta(hours=1)),  # its time limit, oddly past
            JobInfo(job_id=4, state="FAILED", end_time=failure - timedelta(hours=2)),
        ]
    )
    acts = SlurmActivities(shows, poll_seconds=0.01)  # type: ignore[arg-type]
    touched = ActivityEnvironment().run(acts.jobs_hit, FailureJobsRequest(node="gpu1", since=failure))
    assert [job.job_id for job in touched] == [2, 3]
