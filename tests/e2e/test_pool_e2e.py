"""The shared pool end to end in the lab: the inference load rises (the load generator's vLLM
metrics, scraped by a real Prometheus) and training nodes leave the Slurm partition one by one,
labelled inference and schedulable, the vLLM pods landing on them; the checkpointing training job
on them is requeued. The load falls and they come back to Slurm, where the job runs on from its
checkpoint; the last nodes to come are the first to go. The nodes inference started with stay:
the vLLM PodDisruptionBudget keeps that many replicas serving, and a move that would break it is
undone, the node serving on. Throughout, inference never served on fewer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from clients.kube import KubernetesApi
from lab.drill import log_path, training_job
from lab.fleet import FleetLab, LabConfig
from lab.histories import record_histories
from lab.procs import alive, wait_for
from lab.prometheus import prometheus_installed
from tests.conftest import gpufleet_cli

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slurm,
    pytest.mark.skipif(bool(prometheus_installed()), reason=prometheus_installed() or "installed"),
]

TRAINING = ["gpu1", "gpu2", "gpu3", "gpu4"]
INFERENCE = ["inf1", "inf2"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetLab]:
    config = LabConfig(
        training=TRAINING, spares=[], inference=INFERENCE, free=[], temporal_port=0, ui_port=0, grace_seconds=5
    )
    fleet = FleetLab(tmp_path_factory.mktemp("pool"), config)
    fleet.up()
    yield fleet
    record_histories(fleet.env()["TEMPORAL_ADDRESS"])  # with GPUFLEET_RECORD_HISTORIES set: tests/replay
    pids = fleet.down()
    assert not [pid for pid in pids if alive(pid)]


class ServingWatch:
    """Counts the vLLM pods serving (Running, on a node) every 100 ms: the fewest seen is what
    inference never went below while nodes moved."""

    def __init__(self, api: str) -> None:
        self.fewest: int | None = None
        self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(api,), daemon=True)

    def _run(self, api: str) -> None:
        with httpx.Client(base_url=api, timeout=5) as http:
            while not self._stop.wait(0.1):
                pods = http.get("/api/v1/namespaces/serving/pods").json()["items"]
                serving = sum(1 for p in pods if p["status"].get("phase") == "Running" and p["spec"].get("nodeName"))
                self.looks += 1
                self.fewest = serving if self.fewest is None else min(self.fewest, serving)

    def __enter__(self) -> ServingWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def pool_view(lab: FleetLab) -> dict[str, Any]:
    done = gpufleet_cli("pool", "status", "--json", env=lab.env(), timeout=60)
    assert done.returncode == 0, done.stderr
    view: dict[str, Any] = json.loads(done.stdout)
    return view


def serving(kube: KubernetesApi, node: str) -> bool:
    return any(p.namespace == "serving" for p in kube.pods_on_node(node))


def test_the_lab_has_the_shape_of_a_shared_pool(lab: FleetLab) -> None:
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    for node in TRAINING:
        taints = kube.get_node(node).taints
        assert {"key": "gpufleet.io/pool", "value": "training", "effect": "NoSchedule"} in taints
        assert not serving(kube, node)  # no inference pod on a training node
    wait_for(lambda: all(serving(kube, n) for n in INFERENCE), timeout=30, what="vLLM pods on the inference nodes")
    assert "GPUFLEET_PROMETHEUS_URL" in lab.env()


def test_demand_moves_nodes_to_inference_and_back_and_the_job_runs_on(lab: FleetLab) -> None:
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    slurm = lab.slurm.client()
    job = training_job(lab, slurm, job_kind="counter", say=lambda _: None)  # on two training nodes
    started = gpufleet_cli(
        "pool", "start", "--preset", "vllm", "--interval", "2", "--cooldown", "0", "--min-inference", "0",
        "--drain-deadline", "2", "--eviction-deadline", "2", env=lab.env(), timeout=60,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    api = json.loads((lab.home / "lab.json").read_text())["services"]["kubeapi"]["url"]
    with ServingWatch(api) as watch:
        # Six nodes' worth of requests: training nodes go to inference one at a time, all but
        # the partition's last (Slurm keeps one), which the pool says.
        assert gpufleet_cli("lab", "demand", "192", env=lab.env()).returncode == 0
        wait_for(lambda: len(pool_view(lab)["inference"]) == 5, timeout=240, what="five nodes serving inference")
        [last] = slurm.partition_nodes("train")
        assert "Slurm keeps one" in pool_view(lab)["busy"][last]
        moved_away = [node for node in TRAINING if node != last]
        for node in moved_away:
            assert node not in slurm.partition_nodes("train")
            moved = kube.get_node(node)
            assert moved.labels["gpufleet.io/pool"] == "inference" and not moved.unschedulable
            assert not any(t["key"] == "gpufleet.io/pool" for t in moved.taints)
        wait_for(lambda: all(serving(kube, n) for n in moved_away), timeout=60, what="vLLM pods on the moved nodes")
        requeued = slurm.job(job.job_id)
        # Checkpointed and requeued, not lost; one training node left cannot hold its two.
        assert requeued.restarts >= 1 and requeued.state == "PENDING"
        # The load falls: nodes go back to training, the last to come first; the job runs on.
        assert gpufleet_cli("lab", "demand", "0", env=lab.env()).returncode == 0
        wait_for(lambda: len(pool_view(lab)["training"]) == 4, timeout=240, what="four nodes back in training")
        wait_for(lambda: slurm.job(job.job_id).state == "RUNNING", timeout=120, what="the job to run again")
        log = log_path(slurm.job(job.job_id))
        wait_for(lambda: "resumed from step" in log.read_text(), timeout=120, what="the job to resume")

        # The pool would give inference's own two back too (no minimum), but their budget keeps
        # two replicas: each move is undone, the node serving on, and left be for a while.
        def both_kept() -> bool:
            return {m["node"] for m in pool_view(lab)["last_moves"] if m["outcome"].startswith("kept:")} == set(
                INFERENCE
            )

        try:
            wait_for(both_kept, timeout=120, what="the budget to keep both inference nodes serving")
        except TimeoutError:
            raise AssertionError(json.dumps(pool_view(lab), indent=1)) from None
    assert watch.looks > 10 and watch.fewest is not None and watch.fewest >= 2, watch.fewest
    view = pool_view(lab)
    assert sorted(view["inference"]) == INFERENCE and set(view["kept_until"]) == set(INFERENCE)
    for node in INFERENCE:
        kept = kube.get_node(node)
        assert kept.labels["gpufleet.io/pool"] == "inference" and not kept.unschedulable
        assert not any(t["key"] == "gpufleet.io/pool" for t in kept.taints) and serving(kube, node)
    moved = [m for m in view["last_moves"] if m["outcome"] == "moved"]
    there = [m["node"] for m in moved if m["to"] == "inference"]
    back = [m["node"] for m in moved if m["to"] == "training"]
    assert back == there[::-1], view["last_moves"]  # last in, first out
    assert not [m for m in view["last_moves"] if m["outcome"].startswith("failed")], view["last_moves"]
    for node in view["training"]:
        assert node in slurm.partition_nodes("train") and not serving(kube, node)
