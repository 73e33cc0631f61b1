"""The node's jobs: each signalled once and given its grace to checkpoint, each requeued guarded by
its state and restart count, and watched until it runs again elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.patches import JOBS_LEFT_REQUEUED
from workflows.remediation.notify import Notifications
from workflows.retries import SHORT_STEP

with workflow.unsafe.imports_passed_through():
    from activities.slurm import ACTIVE_STATES, ENDED_BY_FAILURE, SlurmActivities
    from models.incident import JobInfo, JobRequeue, Outcome, RequeueOutcome, Step
    from models.requests import (
        FailureJobsRequest,
        RequeueJobRequest,
        ResumeCheck,
        ResumeCheckRequest,
        SignalJobRequest,
        SignalJobResult,
        StillRunningRequest,
    )

# Grace checks that watch the jobs inside the activity before the workflow falls back to timers
# (Temporal timers are not meant for sub-second waits).
WATCHED_CHECKS = 4
# Resume checks that watch for up to RESUME_WATCH_SECONDS each before backing off on timers.
RESUME_WATCHED_CHECKS = 12
RESUME_WATCH_SECONDS = 5.0
# A detector's clock far behind never widens the failure's window by more than this.
EARLIEST_EVENT = timedelta(hours=1)
PURGED = "slurmctld had already purged it (MinJobAge) when gpufleet looked: resubmit it"
# While an incident waits (an owner's approval, the guard), the jobs still on its node are looked
# at this often for this long: a job its failure ends meanwhile (a hung rank killed by its
# watchdog) is requeued before slurmctld forgets it (MinJobAge, 300 s by default).
ENDED_RECHECK = timedelta(minutes=2)
ENDED_WATCH = timedelta(minutes=30)


class Jobs(Notifications):
    """The node's jobs through checkpoint, requeue and resume."""

    # -- v0.3.0 (patch drain-first): every job the failure touched -------------------------------

    async def _jobs_hit(self) -> list[JobInfo]:
        """The jobs on the node now, and those that ended there from shortly before the first event."""
        started = workflow.info().start_time
        first = min(self._events[0].timestamp, started) if self._events else started
        since = max(first, started - EARLIEST_EVENT) - timedelta(seconds=self._settings.failure_window_seconds)
        node = self._input.node
        jobs: list[JobInfo] = await self._activity(
            SlurmActivities.jobs_hit,
            FailureJobsRequest(node=node, since=since),
            summary=f"list the jobs the failure touched on {node}",
        )
        known = {job.job_id: job for job in self._status.jobs}
        for job in jobs:
            self._restarts_before.setdefault(job.job_id, job.restarts)
            known[job.job_id] = job
        self._status.jobs = [known[job_id] for job_id in sorted(known)]
        return jobs

    async def _requeue_ended_jobs(self) -> list[JobInfo]:
        """Right after the drain, before any wait: the jobs the failure already ended (FAILED,
        NODE_FAIL) are requeued now, while slurmctld still keeps them (MinJobAge); a job that
        COMPLETED or that its owner cancelled is left alone. Returns the jobs still on the node."""
        status = self._status
        self._enter(Step.REQUEUE_ENDED)
        jobs = await self._jobs_hit()
        await self._requeue_ended(jobs)
        running = [job for job in jobs if job.state in ACTIVE_STATES]
        self._done(
            Step.REQUEUE_ENDED,
            f"requeued {len(status.ended)} ended job(s); {len(running)} still on the node"
            + (f"; lost: {sorted(status.unrequeued)}" if status.unrequeued else ""),
        )
        return running

    def _jobs_left_on_node(self) -> list[JobInfo]:
        """The jobs last seen on the node that the incident has not signalled or requeued yet."""
        done = {*self._status.signalled, *self._status.requeued, *self._status.unrequeued}
        return [job for job in self._status.jobs if job.state in ACTIVE_STATES and job.job_id not in done]

    async def _watch_ended_jobs(self, stop: Callable[[], bool]) -> None:
        """While a wait lasts (until ``stop``), for its first half hour: every two minutes, the jobs
        still on the node are listed again and those the failure ended meanwhile are requeued.
        Best effort: Slurm away only ends the watch (the flow after the wait finds them too)."""
        deadline = workflow.now() + ENDED_WATCH
        while self._jobs_left_on_node() and workflow.now() < deadline:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(stop, timeout=ENDED_RECHECK)
            if stop():
                return
            try:
                await self._requeue_ended(await self._jobs_hit())
            except ActivityError:
                return

    async def _requeue_ended(self, jobs: list[JobInfo]) -> None:
        """Requeue the jobs among ``jobs`` the failure ended (each once); say which could not be."""
        status = self._status
        lost: dict[int, str] = {}
        ended = []
        for job in jobs:
            if job.state in ACTIVE_STATES or job.job_id in status.ended or job.job_id in status.unrequeued:
                continue
            if job.state not in ENDED_BY_FAILURE:
                status.skipped.setdefault(job.job_id, f"ended {job.state}: not the failure's doing")
            elif not job.in_controller:
                lost[job.job_id] = PURGED
            else:
                ended.append(job)
        lost.update(
            await self._requeue_each(
                [
                    RequeueJobRequest(
                        job_id=job.job_id,
                        restarts_before=job.restarts,
                        signalled=False,
                        incident_id=status.incident_id,
                        dry_run=self._dry_run,
                        ended_by_failure=True,
                    )
                    for job in ended
                ],
                ended=True,
            )
        )
        if lost:
            status.unrequeued.update(lost)
            self._notify("unrequeued", self._unrequeued_text(lost))

    async def _checkpoint_jobs(self) -> list[JobInfo]:
        """SIGTERM each job once, and wait for their checkpoints. Returns the jobs signalled or
        found running (to requeue next). Since v0.3.0, jobs the failure ended meanwhile (a hung
        rank killed by its watchdog) are requeued as those found ended after the drain were."""
        status = self._status
        node = self._input.node
        self._enter(Step.CHECKPOINT)
        if self._slot_per_step:
            touched = await self._jobs_hit()
            await self._requeue_ended(touched)
            jobs = [job for job in touched if job.state in ACTIVE_STATES]
        else:
            jobs = status.jobs = await self._activity(
                SlurmActivities.jobs_on_node, node, summary=f"list jobs on {node}"
            )
            self._restarts_before = {job.job_id: job.restarts for job in status.jobs}
        results: list[SignalJobResult] = await asyncio.gather(
            *(
                self._activity(
                    SlurmActivities.signal_job,
                    SignalJobRequest(
                        job_id=job.job_id,
                        restarts_before=job.restarts,
                        incident_id=status.incident_id,
                        dry_run=self._dry_run,
                    ),
                    summary=f"SIGTERM job {job.job_id}",
                    on_result=self._record_signal,
                )
                for job in jobs
            )
        )
        status.signalled = [result.job_id for result in results if result.signalled]
        for result in results:
            if not result.signalled:
                status.skipped[result.job_id] = result.why
        if status.signalled and self._dry_run:
            detail = f"dry run: would wait up to {self._settings.grace_seconds:g}s for checkpoints"
        elif status.signalled:
            detail = await self._wait_for_checkpoints(status.signalled, self._settings.grace_seconds)
        else:
            detail = "no running jobs on the node"
        self._done(Step.CHECKPOINT, detail)
        return jobs

    async def _wait_for_checkpoints(self, job_ids: list[int], grace_seconds: float) -> str:
        """Wait until the jobs stopped or reported their checkpoints, at most the grace period.

        Most jobs save and exit within seconds of SIGTERM, so the first checks are activities
        that watch the jobs for up to a second each (noticing an exit within one worker poll).
        After that the workflow sleeps between checks on timers backing off from 1 s to 5 s,
        waking at once on ``checkpoint_done``: a full grace costs about thirty short activities.
        """
        deadline = workflow.now() + timedelta(seconds=grace_seconds)
        interval = 1.0
        check = 0
        while True:
            check += 1
            if all(job_id in self._checkpointed for job_id in job_ids):
                return "every job reported its checkpoint"
            remaining = (deadline - workflow.now()).total_seconds()
            watch = min(1.0, max(remaining, 0.0)) if check <= WATCHED_CHECKS else 0.0
            running: list[int] = await self._activity(
                SlurmActivities.still_running,
                StillRunningRequest(job_ids=job_ids, watch_seconds=watch),
                summary="check which jobs still run",
                timeout=SHORT_STEP + timedelta(seconds=watch),
            )
            if not running:
                return "jobs exited after checkpointing"
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining <= 0:
                return f"grace of {grace_seconds:.0f}s over; {len(running)} job(s) still running"
            if check <= WATCHED_CHECKS:
                continue
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: all(job_id in self._checkpointed for job_id in job_ids),
                    timeout=timedelta(seconds=min(interval, remaining)),
                )
            # At most about 200 checks however long the grace: the history stays small.
            interval = min(interval * 1.5, max(5.0, grace_seconds / 200))

    async def _requeue_jobs(self, jobs: list[JobInfo]) -> None:
        """Requeue the jobs, one at a time, each guarded by its state and restart count; and
        those seen on the node before that the last listing missed (ended meanwhile)."""
        status = self._status
        self._enter(Step.REQUEUE)
        if self._slot_per_step and self._jobs_left_on_node():
            listed = {job.job_id for job in jobs}
            missed = [job for job in self._jobs_left_on_node() if job.job_id not in listed]
            if missed and workflow.patched(JOBS_LEFT_REQUEUED):
                jobs = [*jobs, *missed]
        lost = await self._requeue_each(
            [
                RequeueJobRequest(
                    job_id=job.job_id,
                    restarts_before=job.restarts,
                    signalled=job.job_id in status.signalled,
                    incident_id=status.incident_id,
                    dry_run=self._dry_run,
                    # v0.3.0: one the failure ended between its listing and its signal
                    # (FAILED, NODE_FAIL) is requeued as the others it ended were.
                    ended_by_failure=self._slot_per_step and job.job_id not in status.signalled,
                )
                for job in jobs
            ]
        )
        if lost:  # those the failure ended were named already
            status.unrequeued.update(lost)
            self._notify("unrequeued", self._unrequeued_text(lost))
        self._done(
            Step.REQUEUE,
            f"requeued {len(status.requeued)} of {len(status.jobs)}"
            + (f"; left alone: {status.skipped}" if status.skipped else ""),
        )

    def _record_signal(self, result: SignalJobResult) -> None:
        """A SIGTERM sent is on record at once (a cancel meanwhile requeues the job)."""
        if result.signalled and result.job_id not in self._status.signalled:
            self._status.signalled.append(result.job_id)

    def _record_requeue(self, requeue: JobRequeue) -> None:
        """A requeue done is on record at once (a cancel meanwhile does not requeue it again)."""
        if requeue.outcome is RequeueOutcome.REQUEUED and requeue.job_id not in self._status.requeued:
            self._status.requeued.append(requeue.job_id)

    async def _requeue_each(self, requests: list[RequeueJobRequest], *, ended: bool = False) -> dict[int, str]:
        """Requeue each job on its own, so that one's refusal holds back none of the others;
        returns those that could not be, with why."""
        status = self._status
        requeues: list[JobRequeue] = await asyncio.gather(
            *(
                self._activity(
                    SlurmActivities.requeue_job,
                    request,
                    summary=f"requeue job {request.job_id}",
                    on_result=self._record_requeue,
                )
                for request in requests
            )
        )
        lost: dict[int, str] = {}
        for requeue in requeues:
            if requeue.outcome is RequeueOutcome.REQUEUED:
                if ended:
                    status.ended.append(requeue.job_id)
                if requeue.job_id not in status.requeued:
                    status.requeued.append(requeue.job_id)
            elif requeue.outcome is RequeueOutcome.SKIPPED:
                status.skipped.setdefault(requeue.job_id, requeue.why)
            else:
                lost[requeue.job_id] = requeue.why
        return lost

    def _resolved(self) -> str:
        """The outcome once the node is dealt with: resolved only when no job the failure touched
        was lost. Returns what to tell the owner about the jobs."""
        status = self._status
        status.outcome = Outcome.JOBS_LOST if status.unrequeued else Outcome.RESOLVED
        text = f"{len(status.ran_again)} job(s) running again"
        if status.unrequeued:
            text += f"; {len(status.unrequeued)} could not be and must be resubmitted: " + ", ".join(
                f"{job_id} ({why})" for job_id, why in sorted(status.unrequeued.items())
            )
        return text

    def _unrequeued_text(self, failed: dict[int, str]) -> str:
        owners = {job.job_id: job.user for job in self._status.jobs}
        lines = [f"job {job_id} (owner {owners.get(job_id, '?')}): {why}" for job_id, why in failed.items()]
        return f"{self._message_prefix()}: these jobs could not be requeued; please resubmit them:\n" + "\n".join(lines)

    async def _wait_resumed(self, job_ids: list[int]) -> list[JobInfo]:
        """Until every requeued job runs again: watched checks first, then timers backing off to 30 s.
        Each job's return is on record (``ran_again_at``: Slurm's StartTime, else now)."""
        if self._jobs_at_failure is None:
            self._jobs_at_failure = list(self._status.jobs)
        timeout = self._settings.resume_timeout_seconds
        deadline = workflow.now() + timedelta(seconds=timeout)
        interval = 2.0
        check = 0
        while True:
            check += 1
            watch = RESUME_WATCH_SECONDS if check <= RESUME_WATCHED_CHECKS else 0.0
            result: ResumeCheck = await self._activity(
                SlurmActivities.jobs_resumed,
                ResumeCheckRequest(job_ids=job_ids, restarts_before=self._restarts_before, watch_seconds=watch),
                summary=f"check jobs {', '.join(map(str, job_ids))} run again",
                timeout=SHORT_STEP + timedelta(seconds=watch),
            )
            self._record_ran_again(result.resumed)
            if not result.waiting:
                self._status.ran_again = [job.job_id for job in result.resumed]
                return result.resumed
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining <= 0:
                names = ", ".join(f"{job.job_id} ({job.state})" for job in result.waiting)
                raise ApplicationError(
                    f"jobs did not resume within {timeout:.0f}s: {names}", type="JobsNotResumed", non_retryable=True
                )
            if check > RESUME_WATCHED_CHECKS:
                await workflow.sleep(min(interval, remaining))
                # At most about 300 checks however long the timeout: the history stays small.
                interval = min(interval * 1.5, max(30.0, timeout / 300))

    def _record_ran_again(self, resumed: list[JobInfo]) -> None:
        """When each job seen running again started again: Slurm's StartTime (never later than
        now), else now; the first sighting stays."""
        now = workflow.now()
        for job in resumed:
            if job.job_id not in self._status.ran_again_at:
                started = job.start_time
                if started is not None and started.tzinfo is None:
                    started = started.replace(tzinfo=UTC)
                self._status.ran_again_at[job.job_id] = min(started, now) if started is not None else now
