"""What crosses the wire between workflows, activities and the CLI."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from models.policy import Action


class Step(StrEnum):
    """The remediation steps, in the order of DESIGN.md."""

    CLASSIFY = "classify"
    NOTIFY = "notify"
    DRAIN_SLURM = "drain_slurm"
    CHECKPOINT = "checkpoint"
    REQUEUE = "requeue"
    APPROVE = "approve"
    DRAIN_KUBERNETES = "drain_kubernetes"
    CLAIM_SPARE = "claim_spare"
    WAIT_FOR_SPARE = "wait_for_spare"
    RETIRE_NODE = "retire_node"
    RESUME = "resume"
    CLOSED = "closed"


class Outcome(StrEnum):
    OPEN = "open"
    RESOLVED = "resolved"
    OBSERVED = "observed"
    AWAITING_REPAIR = "awaiting_repair"
    FAILED = "failed"


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


class RequeueResult(BaseModel):
    requeued: list[int] = Field(default_factory=list)
    failed: dict[int, str] = Field(default_factory=dict)


class TimelineEntry(BaseModel):
    step: Step
    event: str
    at: datetime
    detail: str = ""


class RemediationInput(BaseModel):
    """Options of one incident; Xids arrive through the ``report_xid`` signal."""

    cluster: str
    node: str
    grace_seconds: float = 120.0
    spare_recheck_seconds: float = 60.0
    resume_timeout_seconds: float = 1800.0
    # The time-skipping test server knows no custom search attributes.
    search_attributes: bool = True


class IncidentStatus(BaseModel):
    """What the ``status`` query returns and the CLI shows."""

    incident_id: str
    cluster: str
    node: str
    xids: list[int] = Field(default_factory=list)
    action: Action | None = None
    step: Step = Step.CLASSIFY
    outcome: Outcome = Outcome.OPEN
    jobs: list[JobInfo] = Field(default_factory=list)
    checkpointed: list[int] = Field(default_factory=list)
    unrequeued: dict[int, str] = Field(default_factory=dict)
    spare: str | None = None
    waiting_for_spare: bool = False
    timeline: list[TimelineEntry] = Field(default_factory=list)
    error: str | None = None


class Notification(BaseModel):
    """One message to the owner: the text people read and the incident for machines."""

    kind: str
    text: str
    incident: IncidentStatus
