"""What crosses the wire between workflows, activities and the CLI."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from models.goodput import IncidentLedger
from models.guard import GuardStatus
from models.policy import Action, RemediationSettings
from models.xid import XidEvent


class Step(StrEnum):
    """The remediation steps, in the order of the recovery (docs/remediation.md)."""

    CLASSIFY = "classify"
    NOTIFY = "notify"
    GUARD = "guard"
    AWAITING_APPROVAL = "awaiting_approval"
    DRAIN_SLURM = "drain_slurm"
    REQUEUE_ENDED = "requeue_ended"
    # DRAIN_AFTER_JOBS: drained, nothing signalled; waiting for the node's jobs to end.
    WAIT_FOR_JOBS = "wait_for_jobs"
    CHECKPOINT = "checkpoint"
    REQUEUE = "requeue"
    APPROVE = "approve"
    REPAIR = "repair"
    SETTLE = "settle"
    VALIDATE = "validate"
    DRAIN_KUBERNETES = "drain_kubernetes"
    CLAIM_SPARE = "claim_spare"
    WAIT_FOR_SPARE = "wait_for_spare"
    RETIRE_NODE = "retire_node"
    RESUME = "resume"
    CLOSED = "closed"


class Outcome(StrEnum):
    OPEN = "open"
    RESOLVED = "resolved"
    # The node was dealt with, but a job the failure touched could not run again (its owner was told).
    JOBS_LOST = "jobs_lost"
    OBSERVED = "observed"
    AWAITING_REPAIR = "awaiting_repair"
    AWAITING_APPROVAL = "awaiting_approval"
    REJECTED = "rejected"
    OPTED_OUT = "opted_out"
    ALREADY_RETIRED = "already_retired"
    FAILED = "failed"
    # Stopped by a person (`gpufleet incidents cancel`, the Temporal UI, `cluster delete`): what it
    # held is given back, the jobs it signalled are requeued, the node stays drained.
    CANCELLED = "cancelled"


class NodeInfo(BaseModel):
    """A Slurm node as ``sinfo`` reports it."""

    name: str
    state: str
    flags: list[str] = Field(default_factory=list)
    reason: str = ""
    partitions: list[str] = Field(default_factory=list)

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state in {"DRAINED", "DRAINING"}


# In a job's Comment (``gpufleet checkpoint-done`` writes it from inside the job; or
# ``scontrol update JobId=$SLURM_JOB_ID Comment=gpufleet:checkpoint:$(date +%s)``): the job saved a
# checkpoint at that Unix time, of that training step when one follows (docs/goodput.md).
CHECKPOINT_MARK = re.compile(r"gpufleet:checkpoint:(\d{1,12})(?::(\d{1,18}))?\b")
# A mark with the blanks before it, as with_checkpoint takes it out of a Comment.
_MARK_AND_BLANKS = re.compile(r"[ \t]*" + CHECKPOINT_MARK.pattern)


def with_checkpoint(comment: str, at: int, step: int | None = None) -> str:
    """The job's Comment with its checkpoint mark set to ``at`` (and ``step``): an earlier mark is
    replaced, the rest of the comment kept as it was (its spacing and lines too).

    Raises:
        ValueError: ``at`` or ``step`` is one the mark cannot carry (``at`` 0..10**12-1, ``step``
            0..10**18-1): written, it would be read back without it and left in the Comment.
    """
    if not 0 <= at < 10**12:
        raise ValueError(f"checkpoint time {at} is not Unix seconds of at most 12 digits")
    if step is not None and not 0 <= step < 10**18:
        raise ValueError(f"checkpoint step {step} is not a step of at most 18 digits")
    mark = f"gpufleet:checkpoint:{at}" + (f":{step}" if step is not None else "")
    rest = _MARK_AND_BLANKS.sub("", comment).strip(" \t")
    return f"{rest} {mark}" if rest else mark


class JobInfo(BaseModel):
    """A Slurm job as ``squeue`` reports it."""

    job_id: int
    name: str = ""
    user: str = ""
    state: str = ""
    restarts: int = 0
    nodes: str = ""
    requeue: bool = True
    stdout: str = ""
    start_time: datetime | None = None  # when it (last) started running
    end_time: datetime | None = None  # when it ended (None while it runs, or when Slurm does not say)
    # False for a job only the accounting database still knows (slurmctld purged it: MinJobAge),
    # which can no longer be requeued.
    in_controller: bool = True
    comment: str = ""  # the job's own Comment: a job says when it last checkpointed here
    # GPUs allocated to the job on all its nodes (squeue's tres-alloc gres/gpu); 0: Slurm did not say.
    gpus: int = 0

    @property
    def checkpointed_at(self) -> datetime | None:
        """When the job last saved a checkpoint, as it said in its Comment
        (``gpufleet:checkpoint:<unix seconds>[:<step>]``, the latest one), else None."""
        latest = self._checkpoint()
        return latest[0] if latest else None

    @property
    def checkpoint_step(self) -> int | None:
        """The training step of the job's latest checkpoint, when its mark names one."""
        latest = self._checkpoint()
        return latest[1] if latest else None

    def _checkpoint(self) -> tuple[datetime, int | None] | None:
        marks = []
        for stamp, step in CHECKPOINT_MARK.findall(self.comment):
            try:
                marks.append((datetime.fromtimestamp(int(stamp), tz=UTC), int(step) if step else None))
            except (ValueError, OverflowError, OSError):
                continue  # not a time (year 33658, say): as if the job had not said
        return max(marks, key=lambda mark: mark[0], default=None)


class RequeueOutcome(StrEnum):
    REQUEUED = "requeued"  # requeued now, or found already back in the queue
    SKIPPED = "skipped"  # deliberately left alone (restarted already, ended before, cancelled by its owner)
    FAILED = "failed"  # should have been requeued and could not be: its owner is told


class JobRequeue(BaseModel):
    job_id: int
    outcome: RequeueOutcome
    why: str = ""


class TimelineEntry(BaseModel):
    step: Step
    event: str
    at: datetime
    detail: str = ""


class NotificationRecord(BaseModel):
    """One message to the owner and what became of it (sent beside the flow, never blocking it)."""

    kind: str
    at: datetime
    outcome: str = "pending"  # pending | sent | failed | not_sent (no webhook configured)
    attempts: int = 0
    error: str = ""


class RemediationInput(BaseModel):
    """What a caller knows: the cluster and the node. Xids arrive through the ``report_xid`` signal.

    Everything else (grace, timeouts, policy) is the worker's, read once by the workflow.
    """

    cluster: str
    node: str
    # The time-skipping test server knows no custom search attributes.
    search_attributes: bool = True
    # Set only by the workflow itself when it continues as new while waiting for a spare...
    carried: CarriedIncident | None = None
    # ... or when Xids arrived as it closed: they open the node's next incident.
    pending_events: list[XidEvent] = Field(default_factory=list)
    # Run every step and record what it would do; change nothing (workflow ID dryrun-{cluster}-{node}).
    dry_run: bool = False


class Approval(BaseModel):
    """An operator's answer to an incident waiting at ``awaiting_approval``."""

    approved: bool
    by: str = ""
    reason: str = ""
    # Which wait it answers (the incident's ``approval_wait`` when it was read); 0: the current one.
    wait: int = 0
    # Which incident it answers ("": whichever runs under the workflow ID).
    incident_id: str = ""


class CancelRequest(BaseModel):
    """Who stops an incident and why (`gpufleet incidents cancel`), sent just before Temporal's cancel."""

    by: str = ""
    reason: str = ""
    # Which incident it stops ("": whichever runs under the workflow ID).
    incident_id: str = ""


class IncidentStatus(BaseModel):
    """What the ``status`` query returns and the CLI shows."""

    incident_id: str
    cluster: str
    node: str
    xids: list[int] = Field(default_factory=list)  # GPU Xid codes (a bus loss counts as 79)
    # Every event that joined, as people name them: "Xid 79", "SXid 22013", "init_failed".
    events: list[str] = Field(default_factory=list)
    action: Action | None = None
    step: Step = Step.CLASSIFY
    outcome: Outcome = Outcome.OPEN
    settings: RemediationSettings | None = None
    jobs: list[JobInfo] = Field(default_factory=list)
    signalled: list[int] = Field(default_factory=list)
    checkpointed: list[int] = Field(default_factory=list)
    requeued: list[int] = Field(default_factory=list)
    # Jobs the failure had already ended when the incident looked (FAILED, NODE_FAIL), requeued
    # at once; they are in ``requeued`` too.
    ended: list[int] = Field(default_factory=list)
    # The requeued jobs seen running again, and when each started again (Slurm's StartTime,
    # else when the incident saw it running).
    ran_again: list[int] = Field(default_factory=list)
    ran_again_at: dict[int, datetime] = Field(default_factory=dict)
    skipped: dict[int, str] = Field(default_factory=dict)
    unrequeued: dict[int, str] = Field(default_factory=dict)
    spare: str | None = None
    # The failed node's Slurm partitions, as the incident found them: the spare joins the first
    # (the worker's own when it is one of them).
    partitions: list[str] = Field(default_factory=list)
    # The failed node's pool (its gpufleet.io/pool label) as the incident found it: an inference
    # node's replacement serves inference (policy spares.inference).
    pool: str = ""
    # Set while the incident holds the node's lease (gpufleet.io/lease), carried across
    # continue-as-new; let go when the incident closes.
    node_leased: bool = False
    waiting_for_spare: bool = False
    # DRAIN_AFTER_JOBS: what the wait for the node's jobs waits for ("2 job(s) still running:
    # 7, 9; until ..."), None when it does not wait.
    waiting_for_jobs: str | None = None
    waiting_for_approval: str | None = None
    # Counts the incident's waits for approval, so that an answer meets only the wait it was for.
    approval_wait: int = 0
    # When the current wait for approval began, and how many times it expired unanswered since
    # (each time the owner and the operators were told again; it is never approved by default).
    approval_asked_at: datetime | None = None
    approval_expired: int = 0
    approval: Approval | None = None
    # Holds a slot of the cluster's fleet guard (given back when the incident closes).
    guard_slot: bool = False
    # A dry run: every step recorded as it would have been done; nothing changed, nobody notified.
    dry_run: bool = False
    # Why the node is to be quarantined once this incident has taken it out ("" when it is not),
    # the label value, and whether it has been.
    quarantine: str = ""
    quarantine_label: str = ""
    quarantined: bool = False
    # "ACTION: why" when the fleet guard raised the action (the node failed again soon after a repair).
    escalated_by_guard: str = ""
    notifications: list[NotificationRecord] = Field(default_factory=list)
    timeline: list[TimelineEntry] = Field(default_factory=list)
    error: str | None = None
    # Cancelled: by whom and why ("by alice: wrong node"); and what the cancel left for a person.
    cancelled: str = ""
    left: list[str] = Field(default_factory=list)
    # What the failure cost (models/goodput.py), computed as the incident closes.
    ledger: IncidentLedger | None = None


class CarriedIncident(BaseModel):
    """What a continued-as-new incident carries over: its status and what it still has to do."""

    status: IncidentStatus
    events: list[XidEvent]
    restarts_before: dict[int, int] = Field(default_factory=dict)
    # How many of ``events`` the last classification saw (later ones open the next incident).
    classified: int = 0


class Notification(BaseModel):
    """One message to the owner: the text people read, and the incident (or, for a page from
    the fleet guard, the guard's state) for machines."""

    kind: str
    text: str
    incident: IncidentStatus | None = None
    guard: GuardStatus | None = None


RemediationInput.model_rebuild()


def seen(status: IncidentStatus) -> str:
    """An incident's events as people name them ("Xid 79, SXid 22013"); older incidents list Xids only."""
    return ", ".join(status.events) or ("Xid " + ", ".join(map(str, status.xids)) if status.xids else "-")
