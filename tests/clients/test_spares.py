"""The spare pool over real Slurm and the emulated Kubernetes API: idempotent claims, no double claims."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from clients.spares import SparePool
from lab.slurm import SlurmLab
from tests.conftest import KubeApiProcess

pytestmark = pytest.mark.slurm


@pytest.fixture
def pool(slurm_lab: SlurmLab, kube_api: KubeApiProcess) -> Iterator[tuple[SparePool, KubernetesApi, SlurmCli]]:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    slurm = SlurmCli(slurm_conf=slurm_lab.conf)
    yield SparePool(kube=kube, slurm=slurm, partition="train"), kube, slurm
    subprocess.run(
        ["scontrol", "update", "PartitionName=train", f"Nodes={','.join(slurm_lab.spec.nodes)}"],
        env=slurm_lab.env,
        check=True,
    )


def test_claim_is_idempotent_and_brings_the_spare_in(pool: tuple[SparePool, KubernetesApi, SlurmCli]) -> None:
    spares, kube, slurm = pool
    first = spares.claim("incident-a")
    again = spares.claim("incident-a")
    assert first == again == "spare1"
    assert "spare1" in slurm.partition_nodes("train")
    node = kube.get_node("spare1")
    assert node.labels["gpufleet.io/pool"] == "training"
    assert node.annotations["gpufleet.io/claimed-by"] == "incident-a"


def test_two_incidents_never_share_a_spare(pool: tuple[SparePool, KubernetesApi, SlurmCli]) -> None:
    spares, _, _ = pool
    claims = {spares.claim(f"incident-{i}") for i in range(3)}
    assert claims == {"spare1", "spare2", None}


def test_retire_takes_the_node_out_everywhere(pool: tuple[SparePool, KubernetesApi, SlurmCli]) -> None:
    spares, kube, slurm = pool
    spares.retire("gpu3")
    spares.retire("gpu3")
    assert "gpu3" not in slurm.partition_nodes("train")
    assert "gpu3" not in [n.name for n in kube.list_nodes()]


def test_racing_incidents_never_share_a_spare(pool: tuple[SparePool, KubernetesApi, SlurmCli]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    spares, kube, _ = pool
    with ThreadPoolExecutor(max_workers=6) as executor:
        claims = list(executor.map(spares.claim, [f"race-{i}" for i in range(6)]))
    won = [claim for claim in claims if claim is not None]
    assert sorted(won) == ["spare1", "spare2"]
    for name in won:
        owner = kube.get_node(name).annotations["gpufleet.io/claimed-by"]
        assert claims[int(owner.removeprefix("race-"))] == name
