"""Dynamic Slurm nodes on Slurm 26.05 (lab/dynamic.py), as Slinky's NodeSet pods run them: each pod's
``slurmd -Z`` registers under the pod's name into its NodeSet's partition, goes with the pod, and
comes back under the same name when the pod is recreated; gpufleet's Slurm client reads them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.errors import NotFound
from clients.slurm import SlurmCli
from lab.dynamic import PRESTOP_REASON, DynamicSlurmLab
from lab.procs import wait_for
from lab.slurmroots import root_unavailable
from models.constants import owned_reason

RELEASE = "26.05"
pytestmark = pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamicSlurmLab]:
    """slurmctld with two NodeSets (``slinky`` and ``solo``) and two pods of ``slinky``."""
    lab = DynamicSlurmLab(tmp_path_factory.mktemp("dynamic") / "slurm", ("slinky", "solo"), release=RELEASE)
    try:
        lab.start(timeout=60)
        lab.add_node("slinky-0", "slinky")
        lab.add_node("slinky-1", "slinky")
        yield lab
    finally:
        lab.stop()


@pytest.fixture(scope="module")
def slurm(cluster: DynamicSlurmLab) -> SlurmCli:
    return cluster.client()


def _run(cluster: DynamicSlurmLab, *argv: str) -> str:
    done = subprocess.run(list(argv), env=cluster.env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def _submit(cluster: DynamicSlurmLab, folder: Path, *args: str) -> tuple[int, Path]:
    """A requeueable batch job that notes where it started (node and restart count) and sleeps."""
    folder.mkdir(parents=True, exist_ok=True)
    starts = folder / "starts"
    script = folder / "job.sh"
    script.write_text(f'#!/bin/sh\necho "$SLURMD_NODENAME ${{SLURM_RESTART_COUNT:-0}}" >> {starts}\nexec sleep 300\n')
    return cluster.sbatch(script, "--requeue", "-o", str(folder / "out"), *args), starts


def _started(starts: Path) -> list[str]:
    return starts.read_text().splitlines() if starts.exists() else []


def test_pods_register_under_their_names_into_their_nodesets_partition(
    cluster: DynamicSlurmLab, slurm: SlurmCli
) -> None:
    assert cluster.nodes() == ["slinky-0", "slinky-1"]
    listed = _run(cluster, "sinfo", "--noheader", "--Node", "--partition", "slinky", "--format", "%N %t %f")
    assert listed.split("\n")[:2] == ["slinky-0 idle slinky", "slinky-1 idle slinky"]
    # The operator's partitions: by NodeSet, each NodeSet its nodes' feature; solo has no pod yet.
    assert "NodeSets=slinky " in cluster.scontrol("show", "-o", "partition", "slinky")
    assert " TotalNodes=0 " in cluster.scontrol("show", "-o", "partition", "solo")
    # Slurm marks them as dynamic; gpufleet's client reads them as it reads any node.
    assert "State=IDLE+DYNAMIC_NORM " in cluster.scontrol("show", "-o", "node", "slinky-0")
    assert slurm.partition_nodes("slinky") == ["slinky-0", "slinky-1"]
    assert slurm.partition_nodes("solo") == []
    node = slurm.node("slinky-0")
    assert (node.state, node.flags, node.partitions, node.reason) == ("idle", [], ["slinky"], "")


def test_two_dynamic_slurmd_run_side_by_side_on_their_own_ports(cluster: DynamicSlurmLab) -> None:
    pods = cluster.pods()
    assert pods["slinky-0"].port != pods["slinky-1"].port
    for name in ("slinky-0", "slinky-1"):
        assert f" Port={pods[name].port} " in cluster.scontrol("show", "-o", "node", name)
    # One job step on both: slurmctld and srun reach each slurmd on its own port.
    ran = _run(cluster, "srun", "--partition", "slinky", "--nodes", "2", "printenv", "SLURMD_NODENAME")
    assert sorted(ran.split()) == ["slinky-0", "slinky-1"]


def test_a_drain_and_its_reason_stay_while_the_node_registers_again(cluster: DynamicSlurmLab, slurm: SlurmCli) -> None:
    cluster.add_node("slinky-2", "slinky")
    reason = "gpufleet: xid 79 incident dyn-1"
    drained = slurm.drain("slinky-2", reason=reason)
    assert (drained.state, drained.flags, drained.reason) == ("idle", ["DRAIN"], reason)

    # Its slurmd restarts without the preStop hook (a crashed container): drain and reason stay.
    cluster.move_node("slinky-2", prestop=False)
    node = slurm.node("slinky-2")
    assert (node.state, node.flags, node.reason, node.partitions) == ("idle", ["DRAIN"], reason, ["slinky"])

    # Recreated through the preStop hook: still drained, but the reason is now the operator's,
    # so gpufleet no longer counts the drain as its own.
    cluster.move_node("slinky-2")
    node = slurm.node("slinky-2")
    assert (node.state, node.flags, node.reason) == ("idle", ["DRAIN"], PRESTOP_REASON)
    assert not owned_reason(node.reason)
    cluster.remove_node("slinky-2")


def test_removing_a_pod_removes_its_node_from_slurm(cluster: DynamicSlurmLab, slurm: SlurmCli) -> None:
    cluster.add_node("slinky-3", "slinky")
    assert "slinky-3" in slurm.partition_nodes("slinky")

    cluster.remove_node("slinky-3")
    assert not cluster.running("slinky-3")
    assert "slinky-3" not in cluster.nodes()
    assert "slinky-3" not in cluster.pods()
    with pytest.raises(NotFound):
        slurm.node("slinky-3")
    assert slurm.partition_nodes("slinky") == ["slinky-0", "slinky-1"]
    assert "slinky-3" not in _run(cluster, "sinfo", "--noheader", "--Node", "--format", "%N")


def test_a_pod_started_again_under_its_name_runs_the_job_requeued_when_it_went(
    cluster: DynamicSlurmLab, slurm: SlurmCli, tmp_path: Path
) -> None:
    """``solo``'s one pod goes (its node deleted) and a new pod of the same name comes: the job
    requeued when the first went waits for it and runs on it."""
    first = cluster.add_node("solo-0", "solo")
    job_id, starts = _submit(cluster, tmp_path / "job", "--partition", "solo")
    wait_for(lambda: _started(starts) == ["solo-0 0"], timeout=30, what="the job to start on solo-0")

    cluster.remove_node("solo-0")
    with pytest.raises(NotFound):
        slurm.node("solo-0")
    job = slurm.job(job_id)
    assert (job.state, job.restarts) == ("PENDING", 1)

    second = cluster.add_node("solo-0", "solo")
    assert slurm.partition_nodes("solo") == ["solo-0"]
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the requeued job to run again")
    wait_for(lambda: _started(starts) == ["solo-0 0", "solo-0 1"], timeout=10, what="the job's second start")
    assert slurm.job(job_id).nodes == "solo-0"
    assert second.name == first.name
    subprocess.run(["scancel", str(job_id)], env=cluster.env, check=True, timeout=30)
    cluster.remove_node("solo-0")


def test_a_recreated_pod_keeps_its_node_name_and_runs_its_requeued_job(
    cluster: DynamicSlurmLab, slurm: SlurmCli, tmp_path: Path
) -> None:
    """A StatefulSet pod recreated on another Kubernetes node: the preStop hook's DOWN requeues
    its job, the node registers again under the same name, and the job runs there again."""
    cluster.add_node("solo-1", "solo")
    job_id, starts = _submit(cluster, tmp_path / "job", "--partition", "solo")
    wait_for(lambda: _started(starts) == ["solo-1 0"], timeout=30, what="the job to start on solo-1")

    cluster.move_node("solo-1")
    assert "solo-1" in cluster.nodes() and cluster.running("solo-1")
    wait_for(lambda: _started(starts) == ["solo-1 0", "solo-1 1"], timeout=30, what="the requeued job to run again")
    job = slurm.job(job_id)
    assert (job.state, job.restarts, job.nodes) == ("RUNNING", 1, "solo-1")
    # Back in service: the operator's DOWN cleared by the node's registration (ReturnToService=2).
    node = slurm.node("solo-1")
    assert (node.state, node.flags, node.partitions) == ("allocated", [], ["solo"])
    subprocess.run(["scancel", str(job_id)], env=cluster.env, check=True, timeout=30)
    cluster.remove_node("solo-1")
