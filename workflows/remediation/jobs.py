"""The node's jobs: each signalled once and given its grace to checkpoint, each requeued guarded by
its state and restart count, and watched until it runs again elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from workflows.remediation.notify import Notifications
from workflows.retries import SHORT_STEP

with workflow.unsafe.imports_passed_through():
    from activities.slurm import SlurmActivities
    from models.incident import JobInfo, JobRequeue, RequeueOutcome, Step
    from models.requests import (
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


class Jobs(Notifications):
    """The node's jobs through checkpoint, requeue and resume."""

    async def _checkpoint_jobs(self) -> None:
        """SIGTERM each job once, and wait for their checkpoints."""
        status = self._status
        node = self._input.node
        self._enter(Step.CHECKPOINT)
        status.jobs = await self._activity(SlurmActivities.jobs_on_node, node, summary=f"list jobs on {node}")
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
                )
                for job in status.jobs
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

    async def _requeue_jobs(self) -> None:
        """Requeue the jobs, one at a time, each guarded by its state and restart count."""
        status = self._status
        self._enter(Step.REQUEUE)
        requeues: list[JobRequeue] = await asyncio.gather(
            *(
                self._activity(
                    SlurmActivities.requeue_job,
                    RequeueJobRequest(
                        job_id=job.job_id,
                        restarts_before=job.restarts,
                        signalled=job.job_id in status.signalled,
                        incident_id=status.incident_id,
                        dry_run=self._dry_run,
                    ),
                    summary=f"requeue job {job.job_id}",
                )
                for job in status.jobs
            )
        )
        for requeue in requeues:
            if requeue.outcome is RequeueOutcome.REQUEUED:
                status.requeued.append(requeue.job_id)
            elif requeue.outcome is RequeueOutcome.SKIPPED:
                status.skipped.setdefault(requeue.job_id, requeue.why)
            else:
                status.unrequeued[requeue.job_id] = requeue.why
        if status.unrequeued:
            self._notify("unrequeued", self._unrequeued_text(status.unrequeued))
        self._done(
            Step.REQUEUE,
            f"requeued {len(status.requeued)} of {len(status.jobs)}"
            + (f"; left alone: {status.skipped}" if status.skipped else ""),
        )

    def _unrequeued_text(self, failed: dict[int, str]) -> str:
        owners = {job.job_id: job.user for job in self._status.jobs}
        lines = [f"job {job_id} (owner {owners.get(job_id, '?')}): {why}" for job_id, why in failed.items()]
        return f"{self._message_prefix()}: these jobs could not be requeued; please resubmit them:\n" + "\n".join(lines)

    async def _wait_resumed(self, job_ids: list[int]) -> list[JobInfo]:
        """Until every requeued job runs again: watched checks first, then timers backing off to 30 s."""
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
            if not result.waiting:
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
