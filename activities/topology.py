"""A node's failure domains (models/topology.py), read from Kubernetes node labels and Slurm's
topology; and a domain's nodes, for the share of it that failed.

Reads only, so the same answer however often it runs. What cannot be read is said in
``NodeDomains.notes`` rather than raised: a label value that is no domain name, a Slurm without a
switch topology, a slurmrestd that serves none, a node Kubernetes does not know (a Slurm-only
node). A node that neither Kubernetes nor Slurm knows is NotFound (not retried).
"""

from __future__ import annotations

from pydantic import ValidationError
from temporalio import activity

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.errors import NotFound
from clients.kube import KubeClient, KubeNode
from clients.slurm import SlurmClient, SlurmTopology
from models.names import validate_node_name
from models.topology import Domain, DomainKind, DomainNodesRequest, DomainSettings, DomainsRequest, NodeDomains

# Where a switch domain was read (NodeDomains.sources).
SLURM_TOPOLOGY = "slurm topology"


def label_source(label: str) -> str:
    """Where a labelled domain was read (NodeDomains.sources): ``label gpufleet.io/rack``."""
    return f"label {label}"


def label_kinds(settings: DomainSettings) -> list[tuple[DomainKind, str]]:
    """The kinds the settings read from node labels, each with its label."""
    return [(kind, settings.label_of(kind)) for kind in settings.kinds if settings.label_of(kind)]


def domains_from_labels(node: KubeNode, settings: DomainSettings, found: NodeDomains) -> None:
    """Add to ``found`` a domain for each kind whose label the node carries; a value that is no
    domain name is skipped with a note."""
    for kind, label in label_kinds(settings):
        value = node.labels.get(label)
        if value is None:
            continue
        try:
            domain = Domain(kind=kind, name=value)
        except ValidationError:
            found.notes.append(
                f"label {label}={value!r} on {node.name} is no domain name (letters, digits, '.', '_', '-'; "
                f"at most 63): no {kind} domain"
            )
            continue
        _add(found, domain, label_source(label))


def domains_from_switches(topology: SlurmTopology, settings: DomainSettings, found: NodeDomains) -> None:
    """Add to ``found`` the leaf switches (Level=0) whose nodes hold the node; a switch name that
    is no domain name is skipped with a note, and a topology that could not be read is noted."""
    if topology.note:
        found.notes.append(topology.note)
    for switch in topology.leaves_of(found.node):
        try:
            domain = Domain(kind=DomainKind.SWITCH, name=switch.name)
        except ValidationError:
            found.notes.append(f"Slurm switch {switch.name!r} is no domain name: no switch domain")
            continue
        _add(found, domain, SLURM_TOPOLOGY)


def _add(found: NodeDomains, domain: Domain, source: str) -> None:
    if domain not in found.domains:
        found.domains.append(domain)
        found.sources[domain.key] = source


def reads_switches(settings: DomainSettings) -> bool:
    return settings.slurm_switches and DomainKind.SWITCH in settings.kinds


class TopologyActivities:
    """Reads only: the same answer however often it runs."""

    def __init__(self, kube: KubeClient | None, slurm: SlurmClient | None) -> None:
        self._kube = kube
        self._slurm = slurm

    @activity.defn(name="node_domains")
    @heartbeating
    def node_domains(self, request: DomainsRequest) -> NodeDomains:
        """The node's domains of every kind the settings read, and where each came from.

        NotFound (not retried) when neither Kubernetes nor Slurm knows the node; InvalidInput for
        an unsafe node name."""
        settings = request.settings
        with client_errors():
            node = validate_node_name(request.node)
            found = NodeDomains(node=node)
            known = False
            if self._kube is not None:
                try:
                    kube_node = self._kube.get_node(node)
                except NotFound:
                    found.notes.append(f"Kubernetes has no node {node}: no domains from node labels")
                else:
                    known = True
                    domains_from_labels(kube_node, settings, found)
            if self._slurm is not None and reads_switches(settings):
                topology = self._slurm.topology()
                domains_from_switches(topology, settings, found)
                known = known or any(node in switch.nodes for switch in topology.switches)
            if not known and not (self._slurm is not None and self._slurm_knows(node)):
                raise NotFound(f"no node {node}: neither Kubernetes nor Slurm knows it (check the name, and --cluster)")
        return found

    def _slurm_knows(self, node: str) -> bool:
        assert self._slurm is not None
        try:
            self._slurm.node(node)
        except NotFound:
            return False
        return True

    @activity.defn(name="domain_nodes")
    @heartbeating
    def domain_nodes(self, request: DomainNodesRequest) -> list[str]:
        """Every node of the domain (the Kubernetes nodes carrying its label, or the switch's Slurm
        nodes), sorted; none when the settings do not read its kind."""
        domain, settings = request.domain, request.settings
        with client_errors():
            if domain.kind is DomainKind.SWITCH:
                if self._slurm is None or not settings.slurm_switches:
                    return []
                topology = self._slurm.topology()
                return sorted(
                    {name for switch in topology.switches if switch.name == domain.name for name in switch.nodes}
                )
            label = settings.label_of(domain.kind)
            if self._kube is None or not label:
                return []
            # Domain's validator keeps the name label-safe: no selector syntax can ride in on it.
            return sorted(node.name for node in self._kube.list_nodes(label_selector=f"{label}={domain.name}"))
