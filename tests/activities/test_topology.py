"""A node's failure domains from its Kubernetes labels, over the official client against the
emulated API server: what `gpufleet nodes show` and the fleet guard read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.topology import TopologyActivities
from clients.kube import KubernetesApi
from lab.kubeapi import node_object
from models.topology import Domain, DomainKind, DomainNodesRequest, DomainSettings, DomainsRequest, NodeDomains
from tests.conftest import KubeApiProcess


def labelled(name: str, **labels: str) -> dict[str, Any]:
    node = node_object(name, pool="training")
    node["metadata"]["labels"].update(labels)
    return node


RACK, ZONE, CLIQUE = "gpufleet.io/rack", "topology.kubernetes.io/zone", "nvidia.com/gpu.clique"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesApi]:
    seed = {
        "nodes": [
            labelled("gpu1", **{RACK: "r12", ZONE: "eu-west-1a", CLIQUE: "c0.1"}),
            labelled("gpu2", **{RACK: "r12", ZONE: "eu-west-1a"}),
            labelled("gpu3", **{RACK: "r13", "example.com/row": "row-7"}),
            labelled("gpu4", **{RACK: "rack 14!", ZONE: "-bad-"}),  # values that are no domain names
            labelled("gpu5"),
        ]
    }
    api = KubeApiProcess(tmp_path_factory.mktemp("kube"), seed)
    try:
        yield KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)
    finally:
        api.stop()


def node_domains(kube: KubernetesApi, node: str, settings: DomainSettings | None = None) -> NodeDomains:
    acts = TopologyActivities(kube, None)
    found: NodeDomains = ActivityEnvironment().run(
        acts.node_domains, DomainsRequest(node=node, settings=settings or DomainSettings())
    )
    return found


def domain_nodes(kube: KubernetesApi, domain: str, settings: DomainSettings | None = None) -> list[str]:
    acts = TopologyActivities(kube, None)
    found: list[str] = ActivityEnvironment().run(
        acts.domain_nodes, DomainNodesRequest(domain=Domain.parse(domain), settings=settings or DomainSettings())
    )
    return found


def test_each_label_the_node_carries_is_a_domain_saying_where_it_was_read(kube: KubernetesApi) -> None:
    found = node_domains(kube, "gpu1")
    assert [d.key for d in found.domains] == ["rack/r12", "zone/eu-west-1a", "nvlink/c0.1"]
    assert found.sources == {
        "rack/r12": "label gpufleet.io/rack",
        "zone/eu-west-1a": "label topology.kubernetes.io/zone",
        "nvlink/c0.1": "label nvidia.com/gpu.clique",
    }
    assert found.notes == []


def test_a_node_without_labels_is_in_no_domain(kube: KubernetesApi) -> None:
    found = node_domains(kube, "gpu5")
    assert found.node == "gpu5" and found.domains == [] and found.notes == []


def test_the_policy_names_the_rack_label_and_the_kinds(kube: KubernetesApi) -> None:
    rows = DomainSettings(rack_label="example.com/row", kinds=[DomainKind.RACK])
    assert [d.key for d in node_domains(kube, "gpu3", rows).domains] == ["rack/row-7"]
    assert node_domains(kube, "gpu1", rows).domains == []  # no example.com/row; its zone not read


def test_values_that_are_no_domain_names_are_skipped_with_a_note(kube: KubernetesApi) -> None:
    found = node_domains(kube, "gpu4")
    assert found.domains == []
    assert len(found.notes) == 2
    assert "label gpufleet.io/rack='rack 14!' on gpu4 is no domain name" in found.notes[0]
    assert "no rack domain" in found.notes[0]
    assert "topology.kubernetes.io/zone='-bad-'" in found.notes[1]


def test_an_unknown_node_is_not_found_and_not_retried(kube: KubernetesApi) -> None:
    with pytest.raises(ApplicationError) as raised:
        node_domains(kube, "gpu99")
    assert raised.value.type == "NotFound" and raised.value.non_retryable
    assert "no node gpu99: neither Kubernetes nor Slurm knows it" in raised.value.message


def test_an_unsafe_node_name_is_refused(kube: KubernetesApi) -> None:
    with pytest.raises(ApplicationError) as raised:
        node_domains(kube, "gpu1;reboot")
    assert raised.value.type == "InvalidInput" and raised.value.non_retryable


def test_a_domains_nodes_are_those_carrying_its_label_sorted(kube: KubernetesApi) -> None:
    assert domain_nodes(kube, "rack/r12") == ["gpu1", "gpu2"]
    assert domain_nodes(kube, "zone/eu-west-1a") == ["gpu1", "gpu2"]
    assert domain_nodes(kube, "nvlink/c0.1") == ["gpu1"]
    assert domain_nodes(kube, "rack/r99") == []
    assert domain_nodes(kube, "rack/row-7", DomainSettings(rack_label="example.com/row")) == ["gpu3"]
    # Switches come from Slurm: without one, none.
    assert domain_nodes(kube, "switch/leaf-a") == []
