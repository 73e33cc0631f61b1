"""Slurm steps: check, drain, signal, wait, requeue, watch the jobs come back."""

from __future__ import annotations

import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import client_errors
from clients.errors import NotFound
from clients.slurm import SlurmClient
from models.incident import JobInfo, NodeInfo, RequeueResult
from models.requests import DrainRequest, SignalJobsRequest, StillRunningRequest, WaitJobsRequest

_STOPPED = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "OUT_OF_MEMORY",
    "PENDING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "DEADLINE",
}


class SlurmActivities:
    def __init__(self, slurm: SlurmClient, *, poll_seconds: float = 0.5) -> None:
        self._slurm = slurm
        self._poll = poll_seconds

    @activity.defn(name="slurm_node_state")
    def node_state(self, node: str) -> NodeInfo:
        """The node as Slurm sees it; an unknown node fails the incident at once."""
        with client_errors():
            return self._slurm.node(node)

    @activity.defn(name="drain_slurm_node")
    def drain_node(self, request: DrainRequest) -> NodeInfo:
        """Drain with our reason. A node already drained by someone else is left with their reason."""
        with client_errors():
            return self._slurm.drain(request.node, reason=request.reason)

    @activity.defn(name="jobs_on_node")
    def jobs_on_node(self, node: str) -> list[JobInfo]:
        with client_errors():
            return self._slurm.jobs_on_node(node)

    @activity.defn(name="signal_jobs")
    def signal_jobs(self, request: SignalJobsRequest) -> list[int]:
        """Send the signal to every job still running; returns the jobs signalled."""
        signalled = []
        with client_errors():
            for job_id in request.job_ids:
                try:
                    if self._slurm.job(job_id).state not in {"RUNNING", "SUSPENDED"}:
                        continue
                    self._slurm.signal_job(job_id, signal=request.signal)
                except NotFound:
                    continue
                signalled.append(job_id)
        return signalled

    @activity.defn(name="jobs_still_running")
    def still_running(self, request: StillRunningRequest) -> list[int]:
        """The jobs that have not stopped yet, watched up to ``watch_seconds`` (a job Slurm forgot has stopped)."""
        deadline = time.monotonic() + request.watch_seconds
        while True:
            with client_errors():
                running = [job_id for job_id in request.job_ids if not self._stopped(job_id)]
            if not running or time.monotonic() >= deadline:
                return running
            activity.heartbeat(f"{len(running)} job(s) still running")
            time.sleep(self._poll)

    def _stopped(self, job_id: int) -> bool:
        try:
            return self._slurm.job(job_id).state in _STOPPED
        except NotFound:
            return True

    @activity.defn(name="requeue_jobs")
    def requeue_jobs(self, job_ids: list[int]) -> RequeueResult:
        """Requeue each job; a job that cannot be requeued is reported, never silently dropped."""
        result = RequeueResult()
        for job_id in job_ids:
            try:
                with client_errors():
                    self._slurm.requeue(job_id)
                result.requeued.append(job_id)
            except ApplicationError as exc:
                if not exc.non_retryable:
                    raise
                result.failed[job_id] = str(exc)
        return result

    @activity.defn(name="wait_jobs_resumed")
    def wait_jobs_resumed(self, request: WaitJobsRequest) -> list[JobInfo]:
        """Wait, heartbeating, until every job runs again after a restart."""
        deadline = time.monotonic() + request.timeout_seconds
        while True:
            with client_errors():
                jobs = [self._slurm.job(job_id) for job_id in request.job_ids]
            waiting = [
                job
                for job in jobs
                if not (job.state == "RUNNING" and job.restarts > request.restarts_before.get(job.job_id, 0))
            ]
            activity.heartbeat(f"{len(waiting)} job(s) not running again yet")
            if not waiting:
                return jobs
            if time.monotonic() >= deadline:
                names = ", ".join(f"{job.job_id} ({job.state})" for job in waiting)
                raise ApplicationError(
                    f"jobs did not resume within {request.timeout_seconds:.0f}s: {names}",
                    type="JobsNotResumed",
                    non_retryable=True,
                )
            time.sleep(self._poll)
