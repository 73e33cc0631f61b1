"""Cluster creation as Temporal sees it: the steps, what each activity is asked, the status."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from models.cluster import ClusterSpec

CLUSTER_TASK_QUEUE = "gpufleet-clusters"
CLUSTER_CREATION_WORKFLOW = "ClusterCreation"
CLUSTER_DELETION_WORKFLOW = "ClusterDeletion"
RESUME_SIGNAL = "resume"
ROLL_BACK_SIGNAL = "roll_back"
# The cluster-creation backends every worker has; others (the lab's) come from installed packages
# (entry point group gpufleet.cluster_backends, models/plugins.py).
BUILTIN_BACKENDS = ("slinky",)


def _span(started: datetime | None, finished: datetime | None) -> float | None:
    """Seconds from start to finish; None until both are known."""
    return None if started is None or finished is None else (finished - started).total_seconds()


def cluster_workflow_id(name: str) -> str:
    return f"cluster-{name}"


def deletion_workflow_id(name: str) -> str:
    # Its own prefix: no cluster's creation ID (cluster-...) is ever a deletion's.
    return f"delete-cluster-{name}"


class ClusterStep(StrEnum):
    VALIDATE = "validate"
    RESERVE = "reserve_nodes"
    RENDER = "render_slurm_conf"
    OBJECTS = "kubernetes_objects"
    BRING_UP = "bring_up"
    USERS = "accounts_and_users"
    SMOKE = "smoke_test"
    REMEDIABLE = "make_remediable"
    NOTIFY = "notify"


STEPS: tuple[ClusterStep, ...] = tuple(ClusterStep)
# Steps that leave something behind, and so are undone (in reverse) when a later one fails.
UNDOABLE = frozenset(
    {ClusterStep.RESERVE, ClusterStep.OBJECTS, ClusterStep.BRING_UP, ClusterStep.USERS, ClusterStep.REMEDIABLE}
)


class ClusterOutcome(StrEnum):
    CREATING = "creating"
    READY = "ready"
    FAILED_KEPT = "failed_kept"  # kept as it was at the failure: resume or roll back
    ROLLED_BACK = "rolled_back"  # failed; everything done was undone
    ROLLBACK_INCOMPLETE = "rollback_incomplete"  # failed; an undo failed too (said which)


class ClusterCreateInput(BaseModel):
    spec: ClusterSpec
    backend: str
    keep_on_failure: bool = False
    requested_by: str = ""


class ClusterRequest(BaseModel):
    """What every step's activity is given: the spec, the backend, and what earlier steps made."""

    spec: ClusterSpec
    backend: str
    placement: dict[str, list[str]] = Field(default_factory=dict)
    slurm_conf: str = ""
    creation: str = ""  # the creation's run ID: marks what it made, so undo and delete touch nothing else
    # Removing users: only these (None: every user of the spec), and only the accounts no other uses.
    only: list[str] | None = None


class StepResult(BaseModel):
    detail: str = ""
    placement: dict[str, list[str]] = Field(default_factory=dict)
    slurm_conf: str = ""
    login: str = ""  # bring_up: where the login node answers (host:port), '' when it has none


class StepEvent(BaseModel):
    step: ClusterStep
    event: str  # started | done | failed | undone | undo_failed | resumed
    at: datetime
    detail: str = ""


class ClusterStatus(BaseModel):
    name: str
    backend: str
    spec: ClusterSpec | None = None  # what it was made from (a deletion needs it)
    creation: str = ""  # its run ID, on every object it made
    outcome: ClusterOutcome = ClusterOutcome.CREATING
    step: ClusterStep | None = None
    done: list[ClusterStep] = Field(default_factory=list)
    failed_step: ClusterStep | None = None
    error: str = ""
    placement: dict[str, list[str]] = Field(default_factory=dict)
    partitions: dict[str, int] = Field(default_factory=dict)
    users: list[str] = Field(default_factory=list)
    login: str = ""  # where its users log in with ssh (host:port), once brought up
    timeline: list[StepEvent] = Field(default_factory=list)
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def seconds(self) -> float | None:
        return _span(self.started_at, self.finished_at)


class DeleteStep(StrEnum):
    STOP_INCIDENTS = "stop_incidents"
    DRAIN = "drain"
    WAIT_JOBS = "wait_for_jobs"
    UNMAKE_REMEDIABLE = "stop_remediation"
    ACCOUNTS = "remove_accounts"
    TEAR_DOWN = "tear_down"
    RELEASE = "release_nodes"
    OBJECTS = "delete_objects"
    NOTIFY = "notify"


class ClusterDeleteInput(BaseModel):
    spec: ClusterSpec
    backend: str
    creation: str = ""  # the creation whose objects to delete
    force: bool = False  # cancel running jobs instead of waiting for them (only with a reason)
    deadline_seconds: float = Field(default=3600.0, gt=0, le=7 * 86400)
    requested_by: str = ""
    reason: str = ""  # why; required with force (models/trust.py)


class DeleteEvent(BaseModel):
    step: DeleteStep
    event: str  # started | done | failed | waiting
    at: datetime
    detail: str = ""


class DeletionStatus(BaseModel):
    name: str
    backend: str
    outcome: str = "deleting"  # deleting | deleted | failed
    step: DeleteStep | None = None
    running_jobs: int | None = None
    cancelled_jobs: int = 0
    error: str = ""
    timeline: list[DeleteEvent] = Field(default_factory=list)
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def seconds(self) -> float | None:
        return _span(self.started_at, self.finished_at)


class JobsResult(BaseModel):
    running: int
    detail: str = ""
