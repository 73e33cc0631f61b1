"""Failure domains: what several nodes share (a rack, a zone, an NVLink domain, a Slurm leaf
switch), so that failures clustered in one are handled as one domain incident
(workflows/domain.py) instead of a spare burned per node.

A node's domains are read from what a cluster already carries: Kubernetes node labels (a rack
label of the site's choosing, ``topology.kubernetes.io/zone``, the GPU operator's NVLink clique
label ``nvidia.com/gpu.clique``) and Slurm's topology (``scontrol show topology``: the leaf
switch whose ``Nodes=`` names the node). The policy's ``domains:`` says which kinds count and
when failures in one make a domain incident.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from models.numbers import Finite, Whole

DOMAIN_WORKFLOW = "DomainIncidentWorkflow"
# Signals of the domain incident: a failure joins it; a person confirms or releases it.
DOMAIN_JOIN_SIGNAL = "domain_join"
DOMAIN_DECIDE_SIGNAL = "domain_decide"
# `gpufleet nodes show`: a node's domains, read by the cluster's worker.
NODE_DOMAINS_WORKFLOW = "NodeDomainsWorkflow"
# The guard's signal for a domain's decision (confirm: its nodes go on one by one; release:
# the held incidents return their nodes through validation).
GUARD_DOMAIN_SIGNAL = "domain"

# The rack label gpufleet reads by default (and the lab sets): DomainSettings.rack_label.
RACK_LABEL = "gpufleet.io/rack"

# A domain's name: a label value or a Slurm switch name (letters, digits, '.', '_', '-').
_LABEL_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*$")
_DOMAIN_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


class DomainKind(StrEnum):
    RACK = "rack"
    ZONE = "zone"
    NVLINK = "nvlink"
    SWITCH = "switch"


class Domain(BaseModel):
    """One failure domain: its kind and its name (``rack/r12``)."""

    model_config = ConfigDict(frozen=True)

    kind: DomainKind
    name: str

    @field_validator("name")
    @classmethod
    def _safe(cls, value: str) -> str:
        if not _DOMAIN_NAME.match(value):
            raise ValueError(
                f"{value!r} is no domain name: letters, digits, '.', '_' and '-', at most 63, "
                "starting and ending with a letter or digit"
            )
        return value

    @property
    def key(self) -> str:
        """``kind/name``, as the commands take it."""
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> Domain:
        """``rack/r12`` (as `gpufleet domains` takes it); ValueError naming the kinds otherwise."""
        kind, sep, name = text.partition("/")
        kinds = ", ".join(k.value for k in DomainKind)
        if not sep or kind not in {k.value for k in DomainKind}:
            raise ValueError(f"{text!r} is no domain: write KIND/NAME, KIND one of {kinds} (e.g. rack/r12)")
        return cls(kind=DomainKind(kind), name=name)


def domain_workflow_id(cluster: str, domain: Domain) -> str:
    """The one open incident per domain: later failures in it join it through this ID."""
    return f"domain-{cluster}-{domain.kind}-{domain.name}"


def node_domains_workflow_id(cluster: str, millis: int) -> str:
    """A `gpufleet nodes show` of the cluster, started at ``millis`` (the node is in its input)."""
    return f"show-node-{cluster}-{millis}"


class DomainSettings(BaseModel):
    """When failures in one domain make one domain incident (policy ``domains:``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    # The kinds that group failures (a kind left out is still shown by `gpufleet nodes show`).
    kinds: list[DomainKind] = Field(default_factory=lambda: list(DomainKind))
    # Where each kind is read from: Kubernetes node labels, and Slurm's topology for switches.
    rack_label: str = RACK_LABEL
    zone_label: str = "topology.kubernetes.io/zone"
    nvlink_label: str = "nvidia.com/gpu.clique"
    slurm_switches: bool = True
    # A domain incident opens when, within the window, at least ``min_nodes`` of a domain's nodes
    # have failed and they are at least ``min_share`` of its nodes (0: no share needed).
    min_nodes: Whole = Field(default=3, ge=2, le=100000)
    min_share: Finite = Field(default=0.5, ge=0, le=1)
    window_seconds: Finite = Field(default=600.0, gt=0, le=7 * 86400)

    @field_validator("rack_label", "zone_label", "nvlink_label")
    @classmethod
    def _label_key(cls, value: str) -> str:
        """A Kubernetes label key ([prefix/]name): anything else would change the selector that
        counts a domain's nodes (``a,b``, ``x!=y``)."""
        prefix, _, name = value.rpartition("/")
        if not _LABEL_NAME.match(name) or ("/" in value and (len(prefix) > 253 or not _LABEL_PREFIX.match(prefix))):
            raise ValueError(
                f"{value!r} is no Kubernetes label key: [prefix/]name, the name at most 63 letters, digits, "
                "'-', '_' or '.' (e.g. example.com/rack)"
            )
        return value

    def label_of(self, kind: DomainKind) -> str:
        """The node label a kind is read from ("" for switches, read from Slurm)."""
        return {
            DomainKind.RACK: self.rack_label,
            DomainKind.ZONE: self.zone_label,
            DomainKind.NVLINK: self.nvlink_label,
        }.get(kind, "")


class NodeDomains(BaseModel):
    """A node's domains, and where each was read (``label gpufleet.io/rack``, ``slurm topology``)."""

    node: str
    domains: list[Domain] = Field(default_factory=list)
    sources: dict[str, str] = Field(default_factory=dict)  # domain key -> where it was read
    # What could not be read, said rather than failed (e.g. "Slurm has no topology plugin").
    notes: list[str] = Field(default_factory=list)


class DomainsRequest(BaseModel):
    """Read one node's domains (TopologyActivities.node_domains)."""

    node: str
    settings: DomainSettings = Field(default_factory=DomainSettings)


class NodeDomainsInput(BaseModel):
    """`gpufleet nodes show NODE`: the node, read with the policy's ``domains:`` of its cluster
    (the worker's; '' is the cluster of the task queue it runs on)."""

    node: str
    cluster: str = ""


class DomainNodesRequest(BaseModel):
    """List every node of one domain (TopologyActivities.domain_nodes), for its share."""

    domain: Domain
    settings: DomainSettings = Field(default_factory=DomainSettings)


class DomainFailure(BaseModel):
    """One failed node in a domain: its incident, its event, when it was drained."""

    node: str
    incident_id: str
    event: str = ""
    at: datetime


class DomainDecision(BaseModel):
    """A person's word on a domain incident."""

    confirm: bool  # True: replace node by node; False: release (the domain is fixed)
    by: str = ""
    reason: str = ""


class DomainIncidentInput(BaseModel):
    cluster: str
    domain: Domain
    # Nodes in the domain (its size when it opened) and the failures that opened it.
    size: int = 0
    failures: list[DomainFailure] = Field(default_factory=list)


class DomainIncidentStatus(BaseModel):
    """What the domain incident's ``status`` query returns (`gpufleet domains show`)."""

    cluster: str
    domain: Domain
    size: int = 0
    opened_at: datetime | None = None
    failures: list[DomainFailure] = Field(default_factory=list)
    state: str = "open"  # open | confirmed | released
    decision: DomainDecision | None = None
    decided_at: datetime | None = None
    notified: bool = False
