"""Slurm steps: check, drain, signal, wait, requeue, watch the jobs come back."""

from __future__ import annotations

import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import client_errors
from clients.slurm import SlurmClient
from models.incident import JobInfo, JobRequeue, NodeInfo, RequeueOutcome
from models.requests import (
    DrainRequest,
    RequeueJobRequest,
    ResumeCheck,
    ResumeCheckRequest,
    SignalJobRequest,
    SignalJobResult,
    StillRunningRequest,
)

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


_SIGNALLABLE = {"RUNNING", "SUSPENDED", "CONFIGURING"}
_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}


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

    @activity.defn(name="signal_job")
    def signal_job(self, request: SignalJobRequest) -> SignalJobResult:
        """Signal the job if it still runs the run this incident found; say why not otherwise.

        One job per call, so a retry never repeats a signal another job already got.
        """
        with client_errors():
            job = self._slurm.jobs_by_id([request.job_id]).get(request.job_id)
            if job is None:
                return SignalJobResult(job_id=request.job_id, signalled=False, why="Slurm no longer knows the job")
            if job.restarts > request.restarts_before:
                return SignalJobResult(job_id=job.job_id, signalled=False, why="already restarted elsewhere")
            if job.state not in _SIGNALLABLE:
                return SignalJobResult(job_id=job.job_id, signalled=False, why=f"not running ({job.state})")
            self._slurm.signal_job(job.job_id, signal=request.signal)
        return SignalJobResult(job_id=job.job_id, signalled=True)

    @activity.defn(name="jobs_still_running")
    def still_running(self, request: StillRunningRequest) -> list[int]:
        """The jobs that have not stopped yet, watched up to ``watch_seconds`` (a job Slurm forgot has stopped)."""
        deadline = time.monotonic() + request.watch_seconds
        while True:
            with client_errors():
                jobs = self._slurm.jobs_by_id(request.job_ids)
            running = [job_id for job_id in request.job_ids if job_id in jobs and jobs[job_id].state not in _STOPPED]
            if not running or time.monotonic() >= deadline:
                return running
            activity.heartbeat(f"{len(running)} job(s) still running")
            time.sleep(self._poll)

    @activity.defn(name="requeue_job")
    def requeue_job(self, request: RequeueJobRequest) -> JobRequeue:
        """Requeue one job of the incident, guarded by its state and restart count.

        A job that exited after our SIGTERM, however it exited, is requeued: that is the point.
        Left alone: a job that already restarted since the incident began (requeueing it would
        kill the new run), one that had ended before we signalled it, and one its owner
        cancelled. A job found pending again was requeued already (by a retry, or by another
        incident sharing a multi-node job) and counts as requeued.
        """
        job_id = request.job_id

        def outcome(kind: RequeueOutcome, why: str = "") -> JobRequeue:
            return JobRequeue(job_id=job_id, outcome=kind, why=why)

        try:
            with client_errors():
                job = self._slurm.jobs_by_id([job_id]).get(job_id)
                if job is None:
                    return outcome(RequeueOutcome.FAILED, "Slurm no longer knows the job (past MinJobAge)")
                if job.restarts > request.restarts_before:
                    if job.state in _QUEUED:
                        return outcome(RequeueOutcome.REQUEUED, "already back in the queue")
                    return outcome(RequeueOutcome.SKIPPED, f"already restarted ({job.state})")
                if job.state in _QUEUED:
                    return outcome(RequeueOutcome.REQUEUED, "already back in the queue")
                if not request.signalled:
                    return outcome(RequeueOutcome.SKIPPED, f"had ended before gpufleet signalled it ({job.state})")
                if job.state == "CANCELLED":
                    return outcome(RequeueOutcome.SKIPPED, "cancelled by its owner")
                self._slurm.requeue(job_id)
        except ApplicationError as exc:
            if not exc.non_retryable:
                raise
            return outcome(RequeueOutcome.FAILED, str(exc))
        return outcome(RequeueOutcome.REQUEUED)

    @activity.defn(name="jobs_resumed")
    def jobs_resumed(self, request: ResumeCheckRequest) -> ResumeCheck:
        """Which jobs run again after a restart, watched up to ``watch_seconds`` (heartbeating)."""
        deadline = time.monotonic() + request.watch_seconds
        while True:
            with client_errors():
                jobs = self._slurm.jobs_by_id(request.job_ids)
            check = ResumeCheck()
            for job_id in request.job_ids:
                job = jobs.get(job_id) or JobInfo(job_id=job_id, state="UNKNOWN")
                back = job.state == "RUNNING" and job.restarts > request.restarts_before.get(job_id, 0)
                (check.resumed if back else check.waiting).append(job)
            if not check.waiting or time.monotonic() >= deadline:
                return check
            activity.heartbeat(f"{len(check.waiting)} job(s) not running again yet")
            time.sleep(self._poll)
