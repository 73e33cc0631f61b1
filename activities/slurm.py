"""Slurm steps: check, drain, signal, wait, requeue, watch the jobs come back."""

from __future__ import annotations

import time
from datetime import datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.dryrun import dry_run
from clients.errors import ClientError, Unavailable
from clients.slurm import ACTIVE_STATES as ACTIVE_STATES  # the workflows' word for a job on its node
from clients.slurm import SlurmClient, owned_reason
from models.incident import JobInfo, JobRequeue, NodeInfo, RequeueOutcome
from models.requests import (
    DrainRequest,
    FailureJobsRequest,
    RequeueJobRequest,
    ResumeCheck,
    ResumeCheckRequest,
    ResumeNodeRequest,
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


def signalled_mark(incident_id: str) -> str:
    return f"gpufleet:signalled:{incident_id}"


def requeued_mark(incident_id: str, run: int) -> str:
    """The requeue of one run (restart count) of a job, by one incident."""
    return f"gpufleet:requeued:{incident_id}:{run}"


# How a job ends when a GPU it used fails: its rank dies with a CUDA error and the job fails
# (srun cancels the step, the batch script exits non-zero), or Slurm loses the node. A job that
# COMPLETED, or that its owner CANCELLED, is never requeued for the failure.
ENDED_BY_FAILURE = frozenset({"FAILED", "NODE_FAIL"})

_SIGNALLABLE = {"RUNNING", "SUSPENDED", "CONFIGURING"}
# A requeued job (more restarts than before) in one of these ran again: running now, or already
# ended after it started (a short job may start and end between two looks of the resume watch;
# how its new run ended is its own, not the failure's). CANCELLED is not among them: a job
# cancelled while it waited in the queue never ran again.
# COMPLETING is not among them either: a requeue leaves the job COMPLETING while its old run ends.
RAN_AGAIN = frozenset(
    {"RUNNING", "SUSPENDED", "COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}
)
# A job whose processes are still being cleaned up (COMPLETING) has not said how it ended yet: a
# requeue waits this long for its final state, then tries again later.
COMPLETING_WAIT_SECONDS = 40.0
_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}


def _requeue_refused(message: str) -> str:
    """Why Slurm refused a requeue, and what the owner can do."""
    lowered = message.lower()
    if "only batch jobs" in lowered:
        return "not a batch job (srun or salloc): Slurm requeues only sbatch jobs; resubmit it"
    if "--no-requeue" in lowered or "not requeueable" in lowered:
        return "submitted with --no-requeue: resubmit it (sbatch --requeue lets gpufleet requeue it)"
    return message


class SlurmActivities:
    def __init__(self, slurm: SlurmClient, *, poll_seconds: float = 0.5) -> None:
        self._slurm = slurm
        self._poll = poll_seconds

    @activity.defn(name="slurm_node_state")
    @heartbeating
    def node_state(self, node: str) -> NodeInfo:
        """The node as Slurm sees it; an unknown node fails the incident at once."""
        with client_errors():
            return self._slurm.node(node)

    @activity.defn(name="drain_slurm_node")
    @heartbeating
    def drain_node(self, request: DrainRequest) -> NodeInfo:
        """Drain with our reason. A node already drained by someone else is left with their reason.
        A dry run answers with the node as the drain would leave it."""
        with client_errors(), dry_run(request.dry_run):
            if request.dry_run:
                node = self._slurm.node(request.node)
                if node.drained:
                    return node
                return node.model_copy(update={"flags": [*node.flags, "DRAIN"], "reason": request.reason})
            return self._slurm.drain(request.node, reason=request.reason)

    @activity.defn(name="resume_slurm_node")
    @heartbeating
    def resume_node(self, request: ResumeNodeRequest) -> NodeInfo:
        """Back into service after a repair in place, only while the node is drained with this
        incident's reason (an operator's later drain, or a drain for another incident, stays)."""
        with client_errors(), dry_run(request.dry_run):
            node = self._slurm.node(request.node)
            ours = owned_reason(node.reason) and request.incident_id in node.reason
            if not (node.drained or node.state in {"down", "drained"}) or not ours or request.dry_run:
                return node
            self._slurm.resume(request.node)
            return self._slurm.node(request.node)

    @activity.defn(name="jobs_on_node")
    @heartbeating
    def jobs_on_node(self, node: str) -> list[JobInfo]:
        with client_errors():
            return self._slurm.jobs_on_node(node)

    @activity.defn(name="jobs_hit_by_failure")
    @heartbeating
    def jobs_hit(self, request: FailureJobsRequest) -> list[JobInfo]:
        """The jobs a failure on the node touched: those still on it, and those that ended there
        since ``request.since`` (slurmctld keeps them for MinJobAge). With an accounting database,
        the ones slurmctld already purged are added (``in_controller`` False: too late to requeue)."""
        with client_errors():
            recent = self._slurm.recent_jobs_on_node(request.node)
        try:
            # Best effort: an accounting database that does not answer never holds up the requeue
            # of what slurmctld shows.
            accounted = self._slurm.accounted_jobs(request.node, request.since) or []
        except ClientError as exc:
            activity.logger.warning("sacct did not answer; jobs already purged are not seen: %s", exc)
            accounted = []
        touched = {
            job.job_id: job
            for job in recent
            if (job.state in ACTIVE_STATES and not _ended_before(job, request.since))
            or (job.end_time is not None and job.end_time >= request.since)
        }
        for job in accounted:
            known = any(other.job_id == job.job_id for other in recent)
            if not known and job.end_time is not None and job.end_time >= request.since:
                touched.setdefault(job.job_id, job)
        return [touched[job_id] for job_id in sorted(touched)]

    @activity.defn(name="signal_job")
    @heartbeating
    def signal_job(self, request: SignalJobRequest) -> SignalJobResult:
        """Signal the job once, if it still runs the run this incident found; say why not otherwise.

        The intent is marked on the job before the signal: a retry after a crash reads the mark
        and never signals twice (a crash between mark and signal leaves the job running until
        the grace ends; it is requeued all the same, never lost).
        """
        job_id = request.job_id
        mark = signalled_mark(request.incident_id)

        def result(signalled: bool, why: str = "") -> SignalJobResult:
            return SignalJobResult(job_id=job_id, signalled=signalled, why=why)

        try:
            with client_errors(), dry_run(request.dry_run):
                job = self._slurm.jobs_by_id([job_id]).get(job_id)
                if job is None:
                    return result(False, "Slurm no longer knows the job")
                if job.restarts > request.restarts_before:
                    return result(False, "already restarted elsewhere")
                if request.incident_id and mark in self._slurm.job_marks(job_id):
                    return result(True, "signalled before this retry")
                if job.state not in _SIGNALLABLE:
                    return result(False, f"not running ({job.state})")
                if request.dry_run:
                    return result(True, f"dry run: would send SIG{request.signal}")
                if request.incident_id:
                    self._slurm.mark_job(job_id, mark)
                self._slurm.signal_job(job_id, signal=request.signal)
        except ApplicationError as exc:
            if not exc.non_retryable:
                raise
            # One job that cannot be signalled must not stop the incident for the others.
            return result(False, str(exc))
        return result(True)

    @activity.defn(name="jobs_still_running")
    @heartbeating
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
    @heartbeating
    def requeue_job(self, request: RequeueJobRequest) -> JobRequeue:
        """Requeue one job of the incident, guarded by its state, its restart count and its marks.

        A job that exited after our SIGTERM, however it exited, is requeued: that is the point.
        Left alone: a job that already restarted since the incident began by anyone else's doing
        (requeueing it would kill the new run), one that had ended before we signalled it, and
        one that was cancelled (gpufleet never cancels a job: CANCELLED is its owner's or an
        admin's word). The intent is marked on the job first (with the run it applies to), so a
        retry, or a second incident sharing a multi-node job, sees the requeue as done or finishes
        it, and never requeues a run twice.
        """
        job_id = request.job_id
        run = request.restarts_before

        def outcome(kind: RequeueOutcome, why: str = "") -> JobRequeue:
            return JobRequeue(job_id=job_id, outcome=kind, why=why)

        try:
            with client_errors(), dry_run(request.dry_run):
                job = self._ended_state(job_id)
                if job is None:
                    return outcome(
                        RequeueOutcome.FAILED, "Slurm no longer knows the job (purged after MinJobAge): resubmit it"
                    )
                marks = self._slurm.job_marks(job_id) if request.incident_id else []
                intended = [m for m in marks if m.startswith("gpufleet:requeued:") and m.endswith(f":{run}")]
                if job.restarts > run and request.ended_by_failure:
                    # It had ended when listed, so nobody else's run was killed by its requeue.
                    return outcome(RequeueOutcome.REQUEUED, f"back in the queue ({job.state})")
                if job.restarts > run:
                    # A finished job cannot be marked (Slurm refuses): our signal mark then stands
                    # for the requeue that followed it.
                    if intended or signalled_mark(request.incident_id) in marks:
                        return outcome(RequeueOutcome.REQUEUED, "requeued by gpufleet")
                    return outcome(RequeueOutcome.SKIPPED, f"already restarted by someone else ({job.state})")
                if job.state in _QUEUED:
                    return outcome(RequeueOutcome.REQUEUED, "already back in the queue")
                if not intended:
                    if request.ended_by_failure and job.state not in ENDED_BY_FAILURE:
                        return outcome(RequeueOutcome.SKIPPED, f"ended {job.state}, not by the failure")
                    if not request.signalled and not request.ended_by_failure:
                        return outcome(RequeueOutcome.SKIPPED, f"had ended before gpufleet signalled it ({job.state})")
                    if job.state == "CANCELLED":
                        return outcome(RequeueOutcome.SKIPPED, "cancelled by its owner")
                    if request.dry_run:
                        return outcome(RequeueOutcome.REQUEUED, "dry run: would requeue")
                    if request.incident_id and not request.ended_by_failure:
                        # An ended job cannot be marked (Slurm refuses): its restart count is the mark.
                        self._slurm.mark_job(job_id, requeued_mark(request.incident_id, run))
                self._slurm.requeue(job_id)
        except ApplicationError as exc:
            if not exc.non_retryable:
                raise
            return outcome(RequeueOutcome.FAILED, _requeue_refused(str(exc)))
        return outcome(RequeueOutcome.REQUEUED)

    def _ended_state(self, job_id: int) -> JobInfo | None:
        """The job as Slurm shows it once it is past COMPLETING (a rank crashed with its GPU leaves
        the job COMPLETING while slurmd cleans up: FAILED or COMPLETED only then says which);
        Unavailable (retried) when it is still COMPLETING after COMPLETING_WAIT_SECONDS."""
        deadline = time.monotonic() + COMPLETING_WAIT_SECONDS
        while True:
            job = self._slurm.jobs_by_id([job_id]).get(job_id)
            if job is None or job.state != "COMPLETING":
                return job
            if time.monotonic() > deadline:
                raise Unavailable(f"job {job_id} is still COMPLETING after {COMPLETING_WAIT_SECONDS:g}s; looking again")
            time.sleep(self._poll)

    @activity.defn(name="jobs_resumed")
    @heartbeating
    def jobs_resumed(self, request: ResumeCheckRequest) -> ResumeCheck:
        """Which jobs run again after a restart, watched up to ``watch_seconds`` (heartbeating)."""
        deadline = time.monotonic() + request.watch_seconds
        while True:
            with client_errors():
                jobs = self._slurm.jobs_by_id(request.job_ids)
            check = ResumeCheck()
            for job_id in request.job_ids:
                job = jobs.get(job_id) or JobInfo(job_id=job_id, state="UNKNOWN")
                # Requeued since (more restarts), and running, or already done: a short job may
                # run and complete between two looks. A requeue leaves the job PENDING (or
                # COMPLETING while its old processes end), so COMPLETED means it ran after it.
                back = job.state in RAN_AGAIN and job.restarts > request.restarts_before.get(job_id, 0)
                (check.resumed if back else check.waiting).append(job)
            if not check.waiting or time.monotonic() >= deadline:
                return check
            activity.heartbeat(f"{len(check.waiting)} job(s) not running again yet")
            time.sleep(self._poll)


def _ended_before(job: JobInfo, since: datetime) -> bool:
    """A job still COMPLETING that ended before ``since`` (stuck cleaning up since before the
    failure): not the failure's doing. A running job's EndTime is its time limit, not an end."""
    return job.state == "COMPLETING" and job.end_time is not None and job.end_time < since
