"""Single-argument inputs of activities (one pydantic model each, so fields can be added later)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from models.incident import IncidentStatus
from models.xid import XidEvent


class ClassifyRequest(BaseModel):
    node: str
    events: list[XidEvent]


class DrainRequest(BaseModel):
    node: str
    reason: str


class SignalJobsRequest(BaseModel):
    job_ids: list[int]
    signal: str = "TERM"


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


class KubeDrainResult(BaseModel):
    node_found: bool = True
    evicted: list[str] = Field(default_factory=list)
    forced: list[str] = Field(default_factory=list)


class ClaimRequest(BaseModel):
    incident_id: str


class NotifyRequest(BaseModel):
    kind: str
    text: str
    incident: IncidentStatus
