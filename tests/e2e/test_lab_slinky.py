"""The lab's Slinky flavor as a user drives it from the command line: lab up --flavor slinky (a
Slinky cluster's objects in the emulated API, its NodeSet's pods as dynamic Slurm 26.05 nodes
named after them, slurmrestd, the worker on the rest backend), lab status --json saying which pod
and Kubernetes node each Slurm node is, the drill's job on two pods, another flavor refused while
it runs, the drill saying it does not run here yet, and lab down leaving nothing behind."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lab.drill import log_path, submit_job
from lab.fleet import FleetLab
from lab.procs import alive, pids_holding, wait_for
from lab.slurmroots import cached_root, root_unavailable
from tests.conftest import gpufleet_cli

RELEASE = "26.05"
NODESET = "lab-train"
TRAINING = {"gpu1", "gpu2", "gpu3", "gpu4"}
SPARES = {"spare1", "spare2"}
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slurm,
    pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or ""),
]


def _cli(home: Path, *args: str, timeout: float = 60) -> Any:
    return gpufleet_cli(*args, env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",), timeout=timeout)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("lab-slinky")
    up = _cli(home, "lab", "up", "--flavor", "slinky", timeout=300)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        assert f"Slurm {RELEASE}." in up.stdout
        yield home
    finally:
        _cli(home, "lab", "down", timeout=120)


def _status(home: Path) -> dict[str, Any]:
    done = _cli(home, "lab", "status", "--json")
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def test_each_slurm_node_is_a_nodeset_pod_on_a_training_node(home: Path) -> None:
    status = _status(home)
    assert status["running"] is True and status["flavor"] == "slinky"
    assert status["slurm"]["release"] == RELEASE and status["slurm"]["version"].startswith(RELEASE + ".")
    nodes = status["nodes"]
    assert len(nodes) == len(TRAINING)
    for node in nodes:
        assert re.fullmatch(rf"{NODESET}-\d", node["name"]), node
        assert node["pod"] == node["name"] and node["partitions"] == [NODESET]
        assert node["slurm_state"] == "idle" and node["pool"] == "training"
    # One pod on each training node; the spares are Kubernetes nodes with no Slurm node.
    assert sorted(node["kubernetes_node"] for node in nodes) == sorted(TRAINING)
    assert set(status["kubernetes_only"]) == SPARES
    text = _cli(home, "lab", "status")
    assert text.returncode == 0, text.stderr
    assert f"flavor slinky; Slurm {status['slurm']['version']}" in text.stdout
    assert re.search(rf"{NODESET}-0 +│ idle .*│ {NODESET}-0 +│ gpu\d", text.stdout), text.stdout
    assert "Kubernetes nodes with no Slurm node: spare1, spare2" in text.stdout


def test_the_cluster_objects_are_in_the_api_and_its_jwt_secret_holds_slurmrestds_key(home: Path) -> None:
    api = _status(home)["services"]["kubeapi"]["url"]
    with httpx.Client(base_url=api, timeout=10) as http:
        base = "/apis/slinky.slurm.net/v1beta1/namespaces/slurm-lab"
        nodeset = http.get(f"{base}/nodesets/{NODESET}").raise_for_status().json()
        assert nodeset["spec"]["replicas"] == len(TRAINING)
        assert nodeset["status"]["replicas"] == len(TRAINING)
        assert http.get(f"{base}/controllers/lab").status_code == 200
        assert http.get(f"{base}/restapis/lab").status_code == 200
        secret = http.get("/api/v1/namespaces/slurm-lab/secrets/lab-jwt-key").raise_for_status().json()
        selector = nodeset["spec"]["template"]["spec"]["nodeSelector"]
        labels = {n["metadata"]["name"]: n["metadata"]["labels"] for n in http.get("/api/v1/nodes").json()["items"]}
    assert base64.b64decode(secret["data"]["jwt_hs256.key"]) == (home / "slurm" / "jwt.key").read_bytes()
    eligible = {name for name, have in labels.items() if all(have.get(k) == v for k, v in selector.items())}
    assert eligible == TRAINING


def test_the_drills_job_runs_on_two_pods(home: Path) -> None:
    lab = FleetLab(home)
    slurm = lab.slurm.client()
    job_id = submit_job(lab, "counter", "-N", "2")
    job = wait_for(lambda: (j := slurm.job(job_id)).state == "RUNNING" and j, timeout=30, what="the job to run")
    log = log_path(job)
    ranks = wait_for(
        lambda: log.exists() and len(found := re.findall(r"rank \d on (\S+):", log.read_text())) == 2 and found,
        timeout=30,
        what="both ranks to start",
    )
    assert len(set(ranks)) == 2 and all(rank.startswith(f"{NODESET}-") for rank in ranks), ranks
    # scancel through the lab's wrappers, as a user would.
    subprocess.run(["scancel", str(job_id)], env=lab.env(), check=True, timeout=30)
    wait_for(lambda: slurm.job(job_id).state == "CANCELLED", timeout=30, what="the job to be cancelled")


def test_the_worker_runs_on_the_rest_backend(home: Path) -> None:
    services = _status(home)["services"]
    assert alive(services["worker"]["pid"])
    log = home / "logs" / "worker.log"
    said = f"Slurm backend rest ({services['slurmrestd']['url']}, API v0.0.45)"
    wait_for(lambda: said in log.read_text(), timeout=30, what="the worker to say its Slurm backend")
    wait_for(lambda: "worker on task queue gpufleet-lab" in log.read_text(), timeout=30, what="the worker to poll")


def test_another_flavor_is_refused_while_it_runs(home: Path) -> None:
    done = _cli(home, "lab", "up", "--flavor", "default")
    assert done.returncode != 0
    assert "the lab runs the slinky flavor; stop it first (gpufleet lab down)" in done.stderr + done.stdout
    done = _cli(home, "lab", "up", "--slurm", "24.11")
    assert done.returncode == 2 and "the slinky flavor runs Slurm 26.05" in done.stderr
    assert _status(home)["running"] is True


def test_a_wrong_flavor_or_release_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = _cli(tmp_path, "lab", "up", "--flavor", "kind")
    assert done.returncode == 2 and "no lab flavor 'kind'; choose one of default, slinky" in done.stderr
    done = _cli(tmp_path, "lab", "up", "--flavor", "slinky", "--slurm", "22.05")
    assert done.returncode == 2 and "the slinky flavor runs Slurm 26.05" in done.stderr
    assert not (tmp_path / "lab.json").exists()


def test_the_drill_says_it_does_not_run_on_this_flavor_yet(home: Path) -> None:
    done = _cli(home, "lab", "drill", "--json")
    assert done.returncode == 2
    assert "the drill does not run on the slinky flavor yet" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_lab_down_leaves_no_process_slurmd_or_mount(home: Path) -> None:
    root = cached_root(RELEASE)
    assert root is not None
    status = _status(home)
    pids = [svc["pid"] for svc in status["services"].values() if "pid" in svc]
    pids += list(FleetLab(home).slurm.pids().values())
    assert len([name for name in FleetLab(home).slurm.pids() if name.startswith(f"slurmd-{NODESET}-")]) == 4
    done = _cli(home, "lab", "down", timeout=120)
    assert done.returncode == 0, done.stderr
    assert [pid for pid in pids if alive(pid)] == []
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(home).encode() in (entry / "cmdline").read_bytes():
                    left.append(int(entry.name))
            except OSError:
                continue
    assert sorted({*left, *pids_holding(home, [root])}) == []
    assert str(root) not in Path("/proc/self/mountinfo").read_text()
    assert not Path(status["services"]["slurmrestd"]["folder"]).exists()
    assert _status(home)["running"] is False
