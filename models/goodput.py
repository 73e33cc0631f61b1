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

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field


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
