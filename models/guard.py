"""The fleet guard's messages and state: slots for incidents, the breaker, pause."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from models.policy import GuardSettings
from models.topology import Domain, DomainFailure

# The guard's own record of its decisions, newest last, this many kept.
GUARD_LOG_SIZE = 200


class SlotRequest(BaseModel):
    """An incident asking for a slot before its first destructive step (the Slurm drain)."""

    incident_id: str
    workflow_id: str
    # The run that asked (a later run of the same ID, after a continue-as-new, is the same incident).
    run_id: str = ""
    node: str = ""
    action: str = ""
    # Set by the guard when the request arrives, with the quarantine or escalation its node has earned.
    asked_at: datetime | None = None
    quarantine: str = ""
    quarantine_why: str = ""
    escalate_to: str = ""
    escalate_why: str = ""
    # Why it waits: "pause" (checked against the limits when let in), "breaker", or "slots"
    # (every slot taken: it goes on as one is given back, tripping nothing).
    held_by: str = ""
    # Which of the incident's asks this is (each destructive step asks anew): the answer names
    # it, so a late answer to an earlier ask never passes a later one. 0: the incident asks once.
    ask: int = 0
    # The step the slot is for ("checkpoint", "repair", "retire_node"); "" for the whole incident.
    step: str = ""


class GuardDecision(BaseModel):
    """The guard's answer to an incident: go on, or wait (and why); and whether its node is a
    lemon to quarantine once the incident has taken it out (``quarantine``: the label value)."""

    incident_id: str
    granted: bool
    why: str = ""
    quarantine: str = ""
    quarantine_why: str = ""
    # The least action the incident may take: its node was repaired in place within the
    # escalation window, so this time one level more ("" when not).
    escalate_to: str = ""
    escalate_why: str = ""
    # The ask it answers (SlotRequest.ask).
    ask: int = 0
    # Set when a person released the node's domain incident (the domain is fixed): the incident
    # validates its node and returns it instead of its own repair or replacement ("rack/a").
    domain_released: str = ""


class GuardAnswer(BaseModel):
    """One answer the guard sends, to the incident workflow that asked."""

    workflow_id: str
    decision: GuardDecision


class GuardCommand(BaseModel):
    """An operator's or incident's word to the guard: who, why, for which incident or node."""

    incident_id: str = ""
    node: str = ""
    by: str = ""
    reason: str = ""
    # On release: the repair in place that put the node back in service, if one did.
    repaired_by: str = ""
    # On a drain: the event that drained the node ("Xid 79"), for a domain incident's summary.
    event: str = ""
    # A domain incident's decision (GUARD_DOMAIN_SIGNAL): the domain ("rack/a") and confirm or release.
    domain: str = ""
    confirm: bool = False


class NodeRecord(BaseModel):
    """A node's recent incidents, its last return to service (cooldown and quarantine) and its
    last repair in place (escalation)."""

    incidents: list[datetime] = Field(default_factory=list)
    # The incident counted last: the same incident draining and asking for slots counts once.
    last_incident: str = ""
    returned_at: datetime | None = None
    repaired_by: str = ""
    repaired_at: datetime | None = None
    # The failed validations counted (each once, however often it is told), the latest last.
    failed_validations: list[str] = Field(default_factory=list)


class WindowEntry(BaseModel):
    """A node that got a slot (or was approved past the breaker), and when."""

    node: str
    incident_id: str
    at: datetime
    # The domain incident the failure is part of ("rack/a"): the breaker counts a domain as one node.
    domain: str = ""


class GuardEvent(BaseModel):
    """One guard decision, for `gpufleet breaker status` and the Temporal UI."""

    at: datetime
    # granted | waiting | tripped | paged | released | approved | reset | paused | resumed | reaped
    # | lemon | returned | forgiven
    event: str
    incident_id: str = ""
    node: str = ""
    detail: str = ""


class DomainWatch(BaseModel):
    """Failures in one domain: counted (``counting``) until they make a domain incident
    (``open``), which a person confirms (its nodes go on one by one) or releases (the held
    incidents return their nodes through validation; counting starts again)."""

    domain: Domain
    state: str = "counting"  # counting | open | confirmed | released
    # The domain's nodes when it opened (its share's denominator).
    size: int = 0
    # Failures counted (within the window while counting; every one since it opened after).
    failures: list[DomainFailure] = Field(default_factory=list)
    opened_at: datetime | None = None
    decided_at: datetime | None = None
    # Released: its incidents, told so each time they ask for a slot to fix their node, until
    # they close (an answer may be lost, or crossed by an ask sent before it).
    released: list[str] = Field(default_factory=list)
    # Whether its domain incident (the workflow) was started and told of every failure; a
    # failed telling is tried again when one of its incidents asks.
    told: bool = False


class GuardState(BaseModel):
    """Everything the guard knows; carried over when it continues as new."""

    cluster: str
    in_flight: list[SlotRequest] = Field(default_factory=list)
    waiting: list[SlotRequest] = Field(default_factory=list)
    window: list[WindowEntry] = Field(default_factory=list)
    # Nodes counted in the window only from here (set by a reset).
    window_since: datetime | None = None
    # The incidents a reset of the tripped breaker let through: not counted in the window again
    # until let_through_until (window_seconds after that reset; a reset of a breaker not tripped does not extend it).
    let_through: list[str] = Field(default_factory=list)
    let_through_until: datetime | None = None
    tripped: bool = False
    tripped_at: datetime | None = None
    tripped_why: str = ""
    paused: bool = False
    paused_by: str = ""
    paused_reason: str = ""
    pages: int = 0
    nodes: dict[str, NodeRecord] = Field(default_factory=dict)
    # Messages handled so far (a caller that signals can wait for this to pass what it saw).
    handled: int = 0
    # Failure domains with failures in them, by key ("rack/a"), and the incidents whose fix waits
    # for their domain incident's decision (kept apart from ``waiting``: they hold no line).
    domains: dict[str, DomainWatch] = Field(default_factory=dict)
    domain_held: list[SlotRequest] = Field(default_factory=list)
    log: list[GuardEvent] = Field(default_factory=list)


class GuardInput(BaseModel):
    cluster: str
    # Set only by the guard itself when it continues as new.
    state: GuardState | None = None


class GuardStatus(BaseModel):
    """What the guard's ``status`` query returns."""

    state: GuardState
    limits: GuardSettings
    # Nodes in the cluster's partition at the last count (0: not counted yet).
    nodes: int = 0
    nodes_in_window: list[str] = Field(default_factory=list)
