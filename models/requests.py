"""Single-argument inputs of activities (one pydantic model each, so fields can be added later)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from models.guard import GuardStatus
from models.incident import IncidentStatus, JobInfo
from models.policy import Action, Policy, RemediationSettings, RepairSettings
from models.xid import XidEvent


class WorkerConfig(BaseModel):
    """The worker's configuration as an incident reads it, once, at its start."""

    cluster: str
    settings: RemediationSettings
    policy: Policy
    policy_file: str | None = None


class ClassifyRequest(BaseModel):
    node: str
    events: list[XidEvent]
    # The policy the incident read at its start; None: the worker's current one.
    policy: Policy | None = None


class DrainRequest(BaseModel):
    node: str
    reason: str
    # A dry run: read, answer what would be done, change nothing (clients/dryrun.py).
    dry_run: bool = False


class SignalJobsRequest(BaseModel):
    job_ids: list[int]
    signal: str = "TERM"


class SignalJobRequest(BaseModel):
    """Signal one job, only if it still runs the run the incident found (same restart count)."""

    job_id: int
    restarts_before: int
    signal: str = "TERM"
    incident_id: str = ""
    dry_run: bool = False


class SignalJobResult(BaseModel):
    job_id: int
    signalled: bool
    why: str = ""


class RequeueJobRequest(BaseModel):
    """Requeue one job the incident signalled, unless it already restarted or its owner cancelled it."""

    job_id: int
    restarts_before: int
    signalled: bool
    incident_id: str = ""
    dry_run: bool = False
    # The job had already ended in a state the failure explains (FAILED, NODE_FAIL) when the
    # incident listed it: requeued though never signalled.
    ended_by_failure: bool = False


class FailureJobsRequest(BaseModel):
    """The jobs a failure on ``node`` touched: still there, or ended since ``since``."""

    node: str
    since: datetime


class ResumeCheckRequest(BaseModel):
    job_ids: list[int]
    restarts_before: dict[int, int] = Field(default_factory=dict)
    # Watch this long, returning as soon as every job runs again (0: look once).
    watch_seconds: float = 0.0


class ResumeCheck(BaseModel):
    resumed: list[JobInfo] = Field(default_factory=list)
    waiting: list[JobInfo] = Field(default_factory=list)


class StillRunningRequest(BaseModel):
    job_ids: list[int]
    # Watch the jobs this long, returning as soon as all have stopped (0: look once).
    watch_seconds: float = 0.0


class WaitJobsRequest(BaseModel):
    job_ids: list[int]
    timeout_seconds: float
    # For resume: a job counts as back once its restart count exceeds the one it had.
    restarts_before: dict[int, int] = Field(default_factory=dict)


class KubeDrainRequest(BaseModel):
    node: str
    incident_id: str
    eviction_timeout_seconds: float = 60.0
    dry_run: bool = False


class KubeDrainResult(BaseModel):
    node_found: bool = True
    evicted: list[str] = Field(default_factory=list)
    forced: list[str] = Field(default_factory=list)


class NodeFacts(BaseModel):
    """What the Kubernetes Node says about remediating it (``found`` False: no Kubernetes node)."""

    found: bool = True
    pool: str = ""
    # The gpufleet.io/remediation label ("disabled": record, notify, change nothing).
    remediation: str = ""
    quarantine: str = ""
    # gpufleet.io/probation and the end in its annotation (None: not on probation; an end that
    # cannot be read counts as the time it was read).
    probation_until: datetime | None = None


class ClaimRequest(BaseModel):
    incident_id: str
    dry_run: bool = False
    # The failed node's partitions (empty: the worker's own): the spare joins the first of them,
    # or the worker's own partition when it is one of them.
    partitions: list[str] = Field(default_factory=list)
    # The pool the spare serves: "training" (resumed in Slurm, into the partition) or "inference"
    # (labelled for inference; Slurm left as it is), for the replacement of an inference node.
    pool: Literal["training", "inference"] = "training"
    # A claimed spare that cannot come in (drained since by someone else, quarantined, gone) is
    # released, then: True, the claim fails with SpareLost naming it (the incident says so and
    # claims again); False (incidents before patch spare-claims-checked), the next spare is tried.
    report_lost: bool = False
    # The failed node ("" before v0.3.0): on Slinky the spare is made eligible for its NodeSets
    # and the claim waits for its pods to come back there.
    node: str = ""
    # A release by the cluster's reaper: only a claimed node still labelled a spare (never one
    # the incident already brought into service).
    unused_only: bool = False


class RetireRequest(BaseModel):
    node: str
    incident_id: str = ""
    dry_run: bool = False


class NotifyRequest(BaseModel):
    kind: str
    text: str
    incident: IncidentStatus | None = None
    guard: GuardStatus | None = None


class RepairRequest(BaseModel):
    """Reset a GPU or reboot a node through a Job pinned to it (``attempt`` makes each try its own Job)."""

    node: str
    action: Action
    incident_id: str
    attempt: int = 1
    gpu: str = ""
    settings: RepairSettings = Field(default_factory=RepairSettings)
    dry_run: bool = False


class StopRepairsRequest(BaseModel):
    """Stop the repair Jobs an incident left running (it was cancelled or terminated)."""

    incident_id: str
    namespace: str
    why: str


class RepairResult(BaseModel):
    succeeded: bool
    job: str = ""
    detail: str = ""


class NodeLeaseRequest(BaseModel):
    """An incident taking (or letting go of) its node's lease (``gpufleet.io/lease``)."""

    node: str
    holder: str


class ResumeNodeRequest(BaseModel):
    """Back into service in Slurm after a repair in place, only if this incident drained it."""

    node: str
    incident_id: str
    dry_run: bool = False


class QuarantineRequest(BaseModel):
    node: str
    code: str  # the gpufleet.io/quarantine label value
    reason: str
    incident_id: str


class QuarantinedNode(BaseModel):
    node: str
    code: str
    reason: str = ""


class ReleaseNodeRequest(BaseModel):
    node: str
    by: str = ""
    reason: str = ""


class ReturnNodeRequest(BaseModel):
    node: str
    # "spare" (back into the warm pool, outside the partition) or "training" (into the partition).
    as_: str = "spare"
    # The cluster (for its policy's validation ladder); "" from a CLI before validation.
    cluster: str = ""
    # `--skip-validation`: returned without the ladder; who and why are recorded.
    skip_validation: bool = False
    by: str = ""
    reason: str = ""


class SignalledJob(BaseModel):
    """A job an incident sent SIGTERM and never requeued, with its restart count then."""

    job_id: int
    restarts_before: int = 0


class Leftover(BaseModel):
    """What an incident that is no longer running still holds (the reaper gives it back)."""

    incident_id: str
    node: str
    # How its workflow ended, as Temporal says ("terminated", "failed", "gone", ...).
    ended: str
    lease: bool = False  # the node's gpufleet.io/lease still names it
    claim: str = ""  # a spare it claimed and never brought into service
    repair_jobs: list[str] = Field(default_factory=list)  # its repair Jobs that still run
    requeue: list[SignalledJob] = Field(default_factory=list)  # from its last status


class ReaperInput(BaseModel):
    cluster: str
    every_seconds: float = Field(default=300.0, gt=0, le=86400)
    # Sweeps already made by earlier runs (the count goes on across continue-as-new).
    sweeps: int = 0


class ReaperStatus(BaseModel):
    """What the reaper's ``status`` query returns: its sweeps and what it gave back."""

    cluster: str
    sweeps: int = 0
    last_sweep: datetime | None = None
    reaped: list[str] = Field(default_factory=list)  # one line per leftover, the latest last
    error: str = ""
