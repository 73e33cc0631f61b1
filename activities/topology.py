"""A node's failure domains (models/topology.py), read from Kubernetes node labels and Slurm's
topology; and a domain's nodes, for the share of it that failed."""

from __future__ import annotations

from temporalio import activity

from clients.kube import KubeClient
from clients.slurm import SlurmClient
from models.topology import DomainNodesRequest, DomainsRequest, NodeDomains


class TopologyActivities:
    """Reads only: the same answer however often it runs."""

    def __init__(self, kube: KubeClient | None, slurm: SlurmClient | None) -> None:
        self._kube = kube
        self._slurm = slurm

    @activity.defn(name="node_domains")
    async def node_domains(self, request: DomainsRequest) -> NodeDomains:
        """The node's domains of every kind the settings read, and where each came from."""
        raise NotImplementedError

    @activity.defn(name="domain_nodes")
    async def domain_nodes(self, request: DomainNodesRequest) -> list[str]:
        """Every node of the domain (the Kubernetes nodes carrying its label, or the switch's Slurm
        nodes), sorted."""
        raise NotImplementedError
