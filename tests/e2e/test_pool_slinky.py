"""The shared pool on the lab's Slinky flavor, from the command line: a training node leaves Slurm
for inference by its NodeSet scaling in with its pod first (its Slurm node drained with
gpufleet's reason, the checkpointing job on it requeued, no partition edited), and comes back by
the NodeSet scaling out onto it, where the job resumes from its checkpoint. `pool status --json`
counts the Kubernetes nodes hosting NodeSet pods as training."""

from __future__ import annotations

import getpass
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from clients.kube import KubernetesApi
from clients.onslinky import PRESTOP_REASON, SlinkyPool, SlinkySlurm
from clients.slinkymoves import SlinkyPoolMover
from clients.slurmrest_protocol import SlurmRest
from lab.drill import log_path, running_and_checkpointed, submit_job
from lab.fleet import FleetLab, LabConfig
from lab.procs import alive, wait_for
from lab.slurmroots import root_unavailable
from tests.conftest import gpufleet_cli

RELEASE = "26.05"
NODESET = "lab-train"
TRAINING = ["gpu1", "gpu2", "gpu3", "gpu4"]
INFERENCE = ["inf1", "inf2"]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slurm,
    pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or ""),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetLab]:
    config = LabConfig(
        training=TRAINING,
        inference=INFERENCE,
        free=[],
        temporal_port=0,
        ui_port=0,
        grace_seconds=10,
        flavor="slinky",
        slurm=RELEASE,
    )
    fleet = FleetLab(tmp_path_factory.mktemp("pool-slinky"), config)
    fleet.up()
    yield fleet
    pids = fleet.down()
    assert not [pid for pid in pids if alive(pid)]


def cli(lab: FleetLab, *args: str, timeout: float = 60) -> Any:
    return gpufleet_cli(*args, env=lab.env(), timeout=timeout)


def pool_view(lab: FleetLab) -> dict[str, Any]:
    done = cli(lab, "pool", "status", "--json")
    assert done.returncode == 0, done.stderr
    view: dict[str, Any] = json.loads(done.stdout)
    return view


def api(lab: FleetLab) -> httpx.Client:
    url = json.loads((lab.home / "lab.json").read_text())["services"]["kubeapi"]["url"]
    return httpx.Client(base_url=url, timeout=10)


def nodeset(lab: FleetLab) -> dict[str, Any]:
    with api(lab) as http:
        found: dict[str, Any] = (
            http.get(f"/apis/slinky.slurm.net/v1beta1/namespaces/slurm-lab/nodesets/{NODESET}")
            .raise_for_status()
            .json()
        )
    return found


def pods_by_node(lab: FleetLab) -> dict[str, list[str]]:
    with api(lab) as http:
        pods = http.get("/api/v1/namespaces/slurm-lab/pods").raise_for_status().json()["items"]
    hosts: dict[str, list[str]] = {}
    for pod in pods:
        if not pod["metadata"].get("deletionTimestamp") and pod["metadata"]["name"].startswith(f"{NODESET}-"):
            hosts.setdefault(pod["spec"].get("nodeName") or "", []).append(pod["metadata"]["name"])
    return hosts


def kube_node(lab: FleetLab, name: str) -> dict[str, Any]:
    with api(lab) as http:
        node: dict[str, Any] = http.get(f"/api/v1/nodes/{name}").raise_for_status().json()
    return node


def test_a_node_leaves_slurm_for_inference_and_comes_back_with_no_job_lost(lab: FleetLab) -> None:
    slurm = lab.slurm.client()
    started = cli(
        lab, "pool", "start", "--interval", "2", "--cooldown", "3600", "--drain-deadline", "2",
        "--eviction-deadline", "30",
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    view = wait_for(lambda: (v := pool_view(lab)).get("training") and v, timeout=60, what="the pool's first look")
    # Training is the Kubernetes nodes hosting the NodeSet's pods, not the Slurm nodes' names.
    assert sorted(view["training"]) == TRAINING and sorted(view["inference"]) == INFERENCE, view

    # A checkpointing job on every training node: whichever node goes, the job is on it.
    job_id = submit_job(lab, "counter", "-N", str(len(TRAINING)))
    job = running_and_checkpointed(slurm, job_id)
    before = pods_by_node(lab)
    replicas = nodeset(lab)["spec"]["replicas"]

    there = cli(lab, "pool", "rebalance", "--to-inference", "1", "--wait", timeout=240)
    assert there.returncode == 0, there.stdout + there.stderr
    view = pool_view(lab)
    [moved] = [n for n in view["inference"] if n not in INFERENCE]
    [pod] = before[moved]
    assert sorted(view["training"]) == sorted(set(TRAINING) - {moved})
    # The NodeSet scaled in by one, this node's pod gone; its Slurm node left DOWN by the preStop
    # hook, as slurm-operator v1.2.1 leaves it (StatefulSet mode); no partition edited.
    assert nodeset(lab)["spec"]["replicas"] == replicas - 1
    assert moved not in pods_by_node(lab)
    left = slurm.node(pod)
    assert left.state.startswith("down") and left.reason.startswith(PRESTOP_REASON), left
    node = kube_node(lab, moved)
    labels = node["metadata"]["labels"]
    assert labels["gpufleet.io/pool"] == "inference" and not node["spec"].get("unschedulable")
    # Out of the NodeSet's nodeSelector (no pod comes back there), still the cluster's node.
    assert "gpufleet.io/partition" not in labels and labels["gpufleet.io/cluster"] == "lab"
    assert not any(t["key"] == "gpufleet.io/pool" for t in node["spec"].get("taints") or [])
    # The job was requeued, not lost; three nodes cannot hold it.
    requeued = slurm.job(job.job_id)
    assert requeued.restarts >= 1 and requeued.state == "PENDING", requeued
    moves = [m for m in view["last_moves"] if m["node"] == moved]
    assert moves and moves[-1]["outcome"] == "moved", view["last_moves"]

    back = cli(lab, "pool", "rebalance", "--to-training", "1", "--wait", timeout=240)
    assert back.returncode == 0, back.stdout + back.stderr
    view = pool_view(lab)
    assert sorted(view["training"]) == TRAINING and sorted(view["inference"]) == INFERENCE, view
    assert nodeset(lab)["spec"]["replicas"] == replicas
    assert len(pods_by_node(lab).get(moved, [])) == 1
    node = kube_node(lab, moved)
    assert node["metadata"]["labels"]["gpufleet.io/pool"] == "training"
    assert any(t["key"] == "gpufleet.io/pool" for t in node["spec"].get("taints") or [])
    # The job runs again on four nodes, from its checkpoint.
    wait_for(lambda: slurm.job(job.job_id).state == "RUNNING", timeout=120, what="the job to run again")
    log = log_path(slurm.job(job.job_id))
    wait_for(lambda: "resumed from step" in log.read_text(), timeout=120, what="the job to resume")
    assert re.search(r"resumed from step [1-9]", log.read_text())
    assert not [m for m in pool_view(lab)["last_moves"] if m["outcome"].startswith("failed")]
    worker_log = (lab.home / "logs" / "worker.log").read_text()
    assert "remediation on Slinky" in worker_log
    subprocess.run(["scancel", str(job.job_id)], env=lab.env(), check=True, timeout=30)
    wait_for(lambda: slurm.job(job.job_id).state == "CANCELLED", timeout=30, what="the job to be cancelled")


class Crash(Exception):
    """The worker dying right after a step's write."""


def crash_after(words: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        if words in line:
            raise Crash(line)

    return say


def mover(lab: FleetLab) -> SlinkyPoolMover:
    """The worker's mover, in this process: Slurm through the lab's slurmrestd."""
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig", poll_seconds=0.1)
    url = json.loads((lab.home / "lab.json").read_text())["services"]["slurmrestd"]["url"]
    rest = SlurmRest(url, version="v0.0.45", user=getpass.getuser(), key_file=lab.jwt_key_file)
    slurm = SlinkySlurm(rest, kube)
    pool = SlinkyPool(kube=kube, slurm=slurm, partition=NODESET, cluster="lab", poll_seconds=0.1)
    return SlinkyPoolMover(kube, slurm, pool, namespace="slurm-lab", poll_seconds=0.1)


def test_a_move_stopped_after_its_scale_in_or_out_and_run_again_scales_only_once(lab: FleetLab) -> None:
    """A move whose worker died right after it scaled the NodeSet in, tried again, and one that
    died right after the scale-out, settled by the pool: each changed the replicas by one only."""
    assert cli(lab, "pool", "pause").returncode == 0
    move = mover(lab)
    replicas = nodeset(lab)["spec"]["replicas"]
    node = "gpu3"
    [pod] = pods_by_node(lab)[node]
    args: dict[str, Any] = {"holder": "pool-test", "partition": NODESET, "grace_seconds": 2, "deadline_seconds": 1}
    with pytest.raises(Crash):
        move.to_inference(node, say=crash_after("scaled in"), **args)
    assert nodeset(lab)["spec"]["replicas"] == replicas - 1
    assert move.to_inference(node, **args) == f"{node} serves inference"
    assert nodeset(lab)["spec"]["replicas"] == replicas - 1
    assert node not in pods_by_node(lab) and lab.slurm.client().node(pod).reason.startswith(PRESTOP_REASON)
    assert kube_node(lab, node)["metadata"]["labels"]["gpufleet.io/pool"] == "inference"

    with pytest.raises(Crash):
        move.to_training(node, holder="pool-test", partition=NODESET, eviction_timeout_seconds=30,
                         say=crash_after("scaled out"))  # fmt: skip
    assert nodeset(lab)["spec"]["replicas"] == replicas
    settled = move.settle(node, to="training", eviction_timeout_seconds=30, **args)
    # Its pod may have landed already (then it is wholly in training), or the move is finished.
    assert settled in {f"{node} serves training", f"{node} is wholly in training"}, settled
    assert nodeset(lab)["spec"]["replicas"] == replicas
    assert len(pods_by_node(lab)[node]) == 1
    assert "gpufleet.io/lease" not in kube_node(lab, node)["metadata"].get("annotations", {})
    # Settled again, it is wholly in training: nothing left to do.
    assert move.settle(node, to="training", eviction_timeout_seconds=30, **args) == f"{node} is wholly in training"
    assert nodeset(lab)["spec"]["replicas"] == replicas
    assert cli(lab, "pool", "resume").returncode == 0
