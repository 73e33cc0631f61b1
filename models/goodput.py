"""What a failure cost in GPU time: an incident's goodput ledger (docs/goodput.md).

Goodput is the share of paid GPU time that moves training forward. An incident's ledger splits
the time from the failure to the moment its jobs run again into consecutive phases, each with the
GPU-seconds it cost (its seconds times the GPUs of the jobs the failure stopped), and adds the work
those jobs lost since their last checkpoint. The recovery phases add up to the incident's recovery
time; the lost work is counted beside them, and is unknown (never zero) for a job that reported no
checkpoint.

The ledger is computed from the incident's own record (its events, timeline and jobs), so it is
part of the workflow's result, `gpufleet incidents show`, the ``gpufleet_gpu_seconds_lost_total``
metric, `gpufleet report` and `gpufleet whatif` alike.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:  # models/incident.py imports this module
    from models.incident import IncidentStatus, JobInfo, TimelineEntry
    from models.xid import XidEvent


class Phase(StrEnum):
    """The phases of a recovery, in order; every one but ``lost_work`` is a span of time."""

    # The failure (the event's own time, as the kernel logged it) until the incident opened.
    DETECTION = "detection"
    # The incident opened until the node was drained in Slurm (classify, notify, the fleet guard,
    # an approval included).
    DRAIN = "drain"
    # Drained until the signalled jobs checkpointed and ended (SIGTERM's grace).
    GRACE = "grace"
    # The requeue hold: the grace's end until the jobs were requeued.
    REQUEUE = "requeue"
    # Requeued jobs waiting while the incident waited for a spare.
    SPARE_WAIT = "spare_wait"
    # The rest of the time until the jobs ran again (scheduling, the spare joining, start-up).
    RESTART = "restart"
    # Work lost since each job's last checkpoint (GPU-seconds; no span of the recovery).
    LOST_WORK = "lost_work"


RECOVERY_PHASES: tuple[Phase, ...] = tuple(phase for phase in Phase if phase is not Phase.LOST_WORK)


class PhaseCost(BaseModel):
    phase: Phase
    # The phase's wall time (for lost work: the longest time any job lost since its checkpoint).
    seconds: float = 0.0
    # What it cost: its seconds times the GPUs stopped during it (per job); None when unknown
    # (lost work where no job reported a checkpoint).
    gpu_seconds: float | None = 0.0


class IncidentLedger(BaseModel):
    """What one incident's failure cost, phase by phase."""

    # The event that decided the incident, as people name it ("Xid 79"): the ledger's cause.
    cause: str = ""
    failed_at: datetime
    detected_at: datetime
    # When the last of the stopped jobs ran again; with no job stopped, or one that never ran
    # again, when the incident closed.
    recovered_at: datetime
    # recovered_at - failed_at: the sum of the recovery phases' seconds, exactly.
    recovery_seconds: float = 0.0
    # The GPUs of the jobs the failure stopped (signalled, or ended by it); 0: no training stopped.
    gpus: int = 0
    # Every phase of Phase, in order, lost work last.
    phases: list[PhaseCost] = Field(default_factory=list)
    # Jobs stopped that reported no checkpoint: their lost work is unknown, not zero.
    lost_work_unknown: list[int] = Field(default_factory=list)
    # The known total: every phase's GPU-seconds (lost work where known).
    gpu_seconds_lost: float = 0.0

    def cost(self, phase: Phase) -> PhaseCost:
        """The phase's entry (a zero one when the ledger has none)."""
        return next((entry for entry in self.phases if entry.phase is phase), PhaseCost(phase=phase))


# -- the computation --------------------------------------------------------------------------------


def count_hosts(hostlist: str) -> int:
    """How many hosts a Slurm hostlist names (``gpu[01-04,07],cpu1``: 6); 0 for none or for text
    that is no hostlist (the caller falls back on one node)."""
    total = 0
    depth = 0
    part = ""
    for char in hostlist.strip() + ",":
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                return 0
        if char == "," and depth == 0:
            hosts = _part_hosts(part.strip())
            if hosts < 0:
                return 0
            total += hosts
            part = ""
        else:
            part += char
    return total if depth == 0 else 0


def _part_hosts(part: str) -> int:
    """The hosts of one hostlist item (``r[1-2]n[1-2]``: 4); -1 for what is no hostlist."""
    if not part:
        return 0
    hosts = 1
    for ranges in re.findall(r"\[([^\[\]]*)\]", part):
        count = 0
        for item in ranges.split(","):
            low, _, high = item.strip().partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                return -1
            count += (int(high) - int(low) + 1) if high else 1
            if high and int(high) < int(low):
                return -1
        hosts *= count
    return hosts


def job_gpus(job: JobInfo | None, node_gpus: int) -> int:
    """A stopped job's GPUs: as Slurm said (its TRES gres/gpu), else ``node_gpus`` per node of
    the job (RemediationSettings.node_gpus), else ``node_gpus`` (its nodes unknown: one node)."""
    if job is not None and job.gpus > 0:
        return job.gpus
    nodes = count_hosts(job.nodes) if job is not None else 0
    return node_gpus * max(nodes, 1)


def _first(timeline: list[TimelineEntry], step: str, event: str, after: datetime | None = None) -> datetime | None:
    """When the timeline first has ``step``'s ``event`` (at or after ``after``), else None."""
    for entry in timeline:
        if entry.step == step and entry.event == event and (after is None or entry.at >= after):
            return entry.at
    return None


def _aware(at: datetime) -> datetime:
    """A time in UTC: one without a zone is UTC (a detector that wrote none), one in another zone
    is converted (the ledger's times are UTC, as `incidents show` and the report print them)."""
    return at.astimezone(UTC) if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _overlap(start: datetime, end: datetime, span: tuple[datetime, datetime] | None) -> float:
    """Seconds [start, end] shares with ``span``."""
    if span is None:
        return 0.0
    return max(0.0, (min(end, span[1]) - max(start, span[0])).total_seconds())


def _lost_since_checkpoint(
    job_id: int,
    listed: JobInfo | None,
    latest: JobInfo | None,
    status: IncidentStatus,
    failed: datetime,
    graced: datetime,
) -> float | None:
    """Seconds of work the job lost: since its last checkpoint before the failure, or since its
    current run began where that is later (a job that failed again before its first checkpoint
    since a restart loses that run only; the outage before it was the earlier incident's).
    A job the failure did not end and that saved when it was signalled (``checkpoint-done``
    during the grace, or a mark in its Comment from between the failure and the grace's end) lost
    nothing. None: the job reported no checkpoint."""
    if job_id not in status.ended:
        later = latest.checkpointed_at if latest is not None else None
        if job_id in status.checkpointed or (later is not None and failed <= later <= graced):
            return 0.0
    saved = listed.checkpointed_at if listed is not None else None
    if saved is None:
        return None
    began = _aware(listed.start_time) if listed is not None and listed.start_time is not None else None
    if began is not None and saved < began <= failed:
        saved = began
    return max(0.0, (failed - saved).total_seconds())


def ledger_for(
    status: IncidentStatus,
    events: list[XidEvent],
    *,
    node_gpus: int,
    now: datetime,
    cause: str = "",
    jobs: list[JobInfo] | None = None,
) -> IncidentLedger:
    """What the incident's failure cost, by phase (docs/goodput.md#the-ledger). Pure: the same
    record gives the same ledger, in a workflow or out of it; it never raises on an odd record
    (boundaries out of order are clipped, each to the one before).

    ``events`` are the incident's events (the earliest timestamp is the failure), ``now`` the
    close when the timeline has no CLOSED entry (an incident that failed), ``cause`` the deciding
    event's label (default: the first event's), ``jobs`` the jobs as listed when the failure
    stopped them (default: ``status.jobs``; their Comments carry the checkpoints before the
    failure, where a listing after the restart may carry a later one)."""
    timeline = status.timeline
    detected = timeline[0].at if timeline else now
    failed = min((_aware(event.timestamp) for event in events), default=detected)
    failed = min(failed, detected)
    drained = max(_first(timeline, "drain_slurm", "finished") or detected, detected)
    graced = max(_first(timeline, "checkpoint", "finished") or drained, drained)
    requeue = _first(timeline, "requeue", "finished") or _first(timeline, "requeue_ended", "finished")
    requeued = max(requeue or graced, graced)
    closed = _first(timeline, "closed", "started") or now

    # Signalled, ended by the failure, requeued, or one of those that could not be requeued (lost:
    # its owner resubmits it); a job left to run on was never stopped.
    stopped = list(dict.fromkeys([*status.signalled, *status.ended, *status.requeued, *sorted(status.unrequeued)]))
    ran_again = {job_id: at for job_id, at in status.ran_again_at.items() if job_id in stopped}
    # Every stopped job running again is the recovery; else it lasted until the close.
    every_one_back = bool(stopped) and len(ran_again) == len(stopped)
    recovered = max(max(ran_again.values()) if every_one_back else closed, requeued)

    waited = _first(timeline, "wait_for_spare", "started")
    spare: tuple[datetime, datetime] | None = None
    if waited is not None:
        claimed = _first(timeline, "claim_spare", "finished", after=waited)
        spare = (waited, max(claimed or recovered, waited))

    known = {job.job_id: job for job in (status.jobs if jobs is None else jobs)}
    if jobs is not None:  # a job not in the failure's listing may be in the latest one
        known = {**{job.job_id: job for job in status.jobs}, **known}
    gpus_of = {job_id: job_gpus(known.get(job_id), node_gpus) for job_id in stopped}
    gpus = sum(gpus_of.values())

    def span(phase: Phase, start: datetime, end: datetime) -> PhaseCost:
        seconds = max(0.0, (end - start).total_seconds())
        return PhaseCost(phase=phase, seconds=seconds, gpu_seconds=seconds * gpus)

    phases = [
        span(Phase.DETECTION, failed, detected),
        span(Phase.DRAIN, detected, drained),
        span(Phase.GRACE, drained, graced),
        span(Phase.REQUEUE, graced, requeued),
    ]
    waiting = _overlap(requeued, recovered, spare)
    restarting = max(0.0, (recovered - requeued).total_seconds() - waiting)
    wait_gpu = restart_gpu = 0.0
    for job_id, job_gpu_count in gpus_of.items():
        back = min(max(ran_again.get(job_id, recovered), requeued), recovered)
        job_wait = _overlap(requeued, back, spare)
        wait_gpu += job_gpu_count * job_wait
        restart_gpu += job_gpu_count * max(0.0, (back - requeued).total_seconds() - job_wait)
    phases.append(PhaseCost(phase=Phase.SPARE_WAIT, seconds=waiting, gpu_seconds=wait_gpu))
    phases.append(PhaseCost(phase=Phase.RESTART, seconds=restarting, gpu_seconds=restart_gpu))

    unknown: list[int] = []
    lost_seconds = 0.0
    lost_gpu: float | None = None if stopped else 0.0
    latest = {job.job_id: job for job in status.jobs}
    for job_id in stopped:
        lost = _lost_since_checkpoint(job_id, known.get(job_id), latest.get(job_id), status, failed, graced)
        if lost is None:
            unknown.append(job_id)
            continue
        lost_seconds = max(lost_seconds, lost)
        lost_gpu = (lost_gpu or 0.0) + gpus_of[job_id] * lost
    phases.append(PhaseCost(phase=Phase.LOST_WORK, seconds=lost_seconds, gpu_seconds=lost_gpu))

    return IncidentLedger(
        cause=cause or (events[0].label if events else ""),
        failed_at=failed,
        detected_at=detected,
        recovered_at=recovered,
        recovery_seconds=(recovered - failed).total_seconds(),
        gpus=gpus,
        phases=phases,
        lost_work_unknown=unknown,
        gpu_seconds_lost=sum(phase.gpu_seconds or 0.0 for phase in phases),
    )
