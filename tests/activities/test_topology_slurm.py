"""A node's failure domains on a real Slurm with the lab's tree topology (a leaf switch per rack,
a top switch over them) and a Kubernetes API whose nodes carry the lab's rack label, on each
release the lab runs: what `gpufleet nodes show` and the fleet guard read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.topology import TopologyActivities
from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from lab.kubeapi import node_object
from lab.slurm import SlurmLab, SlurmLabSpec, slurm_installed
from lab.slurmroots import RootError, root_unavailable
from models.topology import RACK_LABEL, Domain, DomainNodesRequest, DomainSettings, DomainsRequest, NodeDomains
from tests.conftest import KubeApiProcess

pytestmark = pytest.mark.slurm

RACKS = {"a": ["gpu1", "gpu2", "spare1"], "b": ["gpu3"]}


@pytest.fixture(scope="module", params=["22.05", "24.11", "26.05"], ids=lambda release: f"slurm{release}")
def slurm_lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    """gpu1..gpu3 in 'train', spare1 and inf1 outside it; racks a (gpu1, gpu2, spare1) and b (gpu3);
    inf1 in no rack."""
    release = str(request.param)
    why = root_unavailable(release)
    if why:
        pytest.skip(f"Slurm {release} cannot run here: {why}")
    lab = SlurmLab(
        tmp_path_factory.mktemp(f"slurm-topology-{release}"),
        SlurmLabSpec(nodes=["gpu1", "gpu2", "gpu3"], spares=["spare1", "inf1"], racks=RACKS),
        release=release,
    )
    try:
        if lab.install.on_host and not slurm_installed():
            pytest.fail("Slurm is not installed: run `make test` as root, or apt-get install slurm-wlm munge")
    except RootError as exc:
        pytest.skip(f"Slurm {release} cannot run here: {exc}")
    try:
        lab.start()
        yield lab
    finally:
        lab.stop()


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesApi]:
    """The racked nodes as the lab labels them; inf1 is a Slurm node only."""
    nodes: list[dict[str, Any]] = []
    for rack, members in RACKS.items():
        for name in members:
            node = node_object(name, pool="spare" if name.startswith("spare") else "training")
            node["metadata"]["labels"][RACK_LABEL] = rack
            nodes.append(node)
    api = KubeApiProcess(tmp_path_factory.mktemp("kube"), {"nodes": nodes})
    try:
        yield KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)
    finally:
        api.stop()


@pytest.fixture
def slurm(slurm_lab: SlurmLab) -> SlurmCli:
    return slurm_lab.client()


def node_domains(acts: TopologyActivities, node: str, settings: DomainSettings | None = None) -> NodeDomains:
    found: NodeDomains = ActivityEnvironment().run(
        acts.node_domains, DomainsRequest(node=node, settings=settings or DomainSettings())
    )
    return found


def test_the_client_reads_the_leaf_switches_and_the_top_one(slurm: SlurmCli, slurm_lab: SlurmLab) -> None:
    assert "TopologyPlugin=topology/tree" in slurm_lab.conf.read_text()
    topology = slurm.topology()
    assert topology.note == ""
    leaves = {s.name: s.nodes for s in topology.switches if s.leaf}
    assert leaves == {"leaf-a": ["gpu1", "gpu2", "spare1"], "leaf-b": ["gpu3"], "node-inf1": ["inf1"]}
    (top,) = [s for s in topology.switches if not s.leaf]
    assert top.name == "top" and top.level == 1
    assert sorted(top.switches) == ["leaf-a", "leaf-b", "node-inf1"]
    assert sorted(top.nodes) == ["gpu1", "gpu2", "gpu3", "inf1", "spare1"]


def test_a_node_is_in_its_rack_and_its_leaf_switch(slurm: SlurmCli, kube: KubernetesApi) -> None:
    found = node_domains(TopologyActivities(kube, slurm), "gpu1")
    assert [d.key for d in found.domains] == ["rack/a", "switch/leaf-a"]
    assert found.sources == {"rack/a": "label gpufleet.io/rack", "switch/leaf-a": "slurm topology"}
    assert found.notes == []
    assert [d.key for d in node_domains(TopologyActivities(kube, slurm), "gpu3").domains] == ["rack/b", "switch/leaf-b"]


def test_a_slurm_only_node_has_its_switch_and_a_note(slurm: SlurmCli, kube: KubernetesApi) -> None:
    found = node_domains(TopologyActivities(kube, slurm), "inf1")
    assert [d.key for d in found.domains] == ["switch/node-inf1"]
    assert found.notes == ["Kubernetes has no node inf1: no domains from node labels"]


def test_switches_are_read_only_when_the_policy_says(slurm: SlurmCli, kube: KubernetesApi) -> None:
    found = node_domains(TopologyActivities(kube, slurm), "gpu1", DomainSettings(slurm_switches=False))
    assert [d.key for d in found.domains] == ["rack/a"]


def test_a_switchs_nodes_and_a_racks(slurm: SlurmCli, kube: KubernetesApi) -> None:
    acts = TopologyActivities(kube, slurm)

    def members(domain: str) -> list[str]:
        found: list[str] = ActivityEnvironment().run(acts.domain_nodes, DomainNodesRequest(domain=Domain.parse(domain)))
        return found

    assert members("switch/leaf-a") == ["gpu1", "gpu2", "spare1"]
    assert members("rack/a") == ["gpu1", "gpu2", "spare1"]
    assert members("switch/nosuch") == []


def test_a_node_neither_knows_is_not_found(slurm: SlurmCli, kube: KubernetesApi) -> None:
    with pytest.raises(ApplicationError) as raised:
        node_domains(TopologyActivities(kube, slurm), "gpu99")
    assert raised.value.type == "NotFound" and raised.value.non_retryable


def test_without_kubernetes_the_switch_still_counts(slurm: SlurmCli) -> None:
    found = node_domains(TopologyActivities(None, slurm), "gpu2")
    assert [d.key for d in found.domains] == ["switch/leaf-a"]
