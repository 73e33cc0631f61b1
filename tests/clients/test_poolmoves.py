"""One node's move between training and inference over real Slurm and the emulated Kubernetes
API: a running job is given its deadline, then SIGTERM, grace and requeue; the node leaves the
partition and serves inference, then comes back and runs jobs again. A node leased or drained by
someone else is not touched."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from clients import nodelease
from clients.errors import ClientError, NotOwned, Unavailable
from clients.kube import KubernetesApi
from clients.poolmoves import LEASE_ANNOTATION, TRAINING_TAINT, BudgetKept, HandedOver, OutOfPool, PoolMover
from clients.slurm import SlurmCli
from clients.spares import SparePool
from lab.procs import wait_for
from lab.slurm import SlurmLab
from tests.clients.test_spares import Pool, pool  # noqa: F401 - the fixture, reused

pytestmark = pytest.mark.slurm


@pytest.fixture
def mover(pool: Pool) -> Iterator[tuple[PoolMover, KubernetesApi, SlurmCli]]:  # noqa: F811
    spares, kube, slurm = pool
    yield PoolMover(kube, slurm, spares, poll_seconds=0.1), kube, slurm


def test_a_node_goes_to_inference_with_its_job_requeued_and_comes_back(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    move, kube, slurm = mover
    with running_job(slurm_lab, tmp_path, "gpu3", "#!/bin/sh\nsleep 300\n", "--requeue", "-o", "/dev/null") as job:
        said: list[str] = []
        detail = move.to_inference(
            "gpu3", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1, say=said.append
        )
        assert detail == f"gpu3 serves inference; requeued {job}"
        assert any("SIGTERM" in line for line in said)
        assert "gpu3" not in slurm.partition_nodes("train")
        node = kube.get_node("gpu3")
        assert node.labels["gpufleet.io/pool"] == "inference" and not node.unschedulable
        assert LEASE_ANNOTATION not in node.annotations and not any(t["key"] == TRAINING_TAINT for t in node.taints)
        assert slurm.job(job).state in {"PENDING", "REQUEUED", "RUNNING"}  # requeued, not lost
        # And back: in the partition, resumed, labelled training, tainted against inference pods.
        assert move.to_training("gpu3", holder="pool-shared", partition="train", eviction_timeout_seconds=5) == (
            "gpu3 serves training"
        )
        assert "gpu3" in slurm.partition_nodes("train") and not slurm.node("gpu3").drained
        node = kube.get_node("gpu3")
        assert node.labels["gpufleet.io/pool"] == "training"
        assert any(t["key"] == TRAINING_TAINT and t["effect"] == "NoSchedule" for t in node.taints)


def test_a_node_held_or_drained_by_someone_else_is_not_moved(mover: tuple[PoolMover, KubernetesApi, SlurmCli]) -> None:
    move, kube, slurm = mover
    kube.update_metadata("gpu1", annotations={LEASE_ANNOTATION: "remediate-lab-gpu1"})
    with pytest.raises(NotOwned, match="held by remediate-lab-gpu1"):
        move.to_inference("gpu1", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1)
    assert "gpu1" in slurm.partition_nodes("train") and not slurm.node("gpu1").drained
    kube.update_metadata("gpu1", annotations={LEASE_ANNOTATION: None})
    slurm.drain("gpu2", reason="dimm swap by ops")
    with pytest.raises(NotOwned, match="drained by someone else"):
        move.to_inference("gpu2", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1)
    assert slurm.node("gpu2").reason == "dimm swap by ops" and "gpu2" in slurm.partition_nodes("train")
    assert LEASE_ANNOTATION not in kube.get_node("gpu2").annotations  # given back


def slurm_wait_running(slurm: SlurmCli, job: int) -> None:
    wait_for(lambda: slurm.job(job).state == "RUNNING", timeout=30, what=f"job {job} running")


@contextlib.contextmanager
def running_job(slurm_lab: SlurmLab, tmp_path: Path, node: str, script: str, *options: str) -> Iterator[int]:
    """A batch job running ``script`` on ``node`` (in partition train), cancelled afterwards."""
    path = tmp_path / f"job-{node}.sh"
    path.write_text(script)
    job = slurm_lab.sbatch(path, "-p", "train", "-w", node, *options)
    try:
        slurm_wait_running(SlurmCli(slurm_conf=slurm_lab.conf), job)
        yield job
    finally:
        subprocess.run(["scancel", str(job)], env=slurm_lab.env, check=False)


class Crash(Exception):
    """The worker dies here."""


def crash_after(step: str) -> Callable[[str], None]:
    def say(text: str) -> None:
        if step in text:
            raise Crash(text)

    return say


@pytest.mark.parametrize("step", ["drained in Slurm", "out of partition"])
def test_a_move_cut_short_by_a_crash_resumes_into_one_pool(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], step: str
) -> None:
    move, kube, slurm = mover
    with pytest.raises(Crash):
        move.to_inference(
            "gpu1", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1, say=crash_after(step)
        )
    assert kube.get_node("gpu1").annotations[LEASE_ANNOTATION] == "pool-shared"  # still held: nobody else takes it
    # The retry (same holder) goes on from where it was and ends in one pool.
    assert move.to_inference(
        "gpu1", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1
    ).startswith("gpu1 serves inference")
    assert (
        "gpu1" not in slurm.partition_nodes("train") and kube.get_node("gpu1").labels["gpufleet.io/pool"] == "inference"
    )
    # Or, cut short again, rolled back the other way: back in one pool, training.
    move.to_training("gpu1", holder="pool-shared", partition="train", eviction_timeout_seconds=5)
    assert "gpu1" in slurm.partition_nodes("train") and not slurm.node("gpu1").drained
    assert kube.get_node("gpu1").labels["gpufleet.io/pool"] == "training"
    assert LEASE_ANNOTATION not in kube.get_node("gpu1").annotations


def test_an_incident_taking_the_node_mid_move_stops_the_move_where_it_is(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    move, kube, slurm = mover
    with running_job(slurm_lab, tmp_path, "gpu3", "#!/bin/sh\nsleep 300\n", "--requeue", "-o", "/dev/null") as job:

        def xid_arrives(text: str) -> None:
            # While the move waits for the job, an Xid opens an incident that takes the node.
            if "waiting for job" in text:
                nodelease.take_over(kube, "gpu3", "remediate-lab-gpu3")

        with pytest.raises(HandedOver, match="taken over by remediate-lab-gpu3"):
            move.to_inference(
                "gpu3", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=30, say=xid_arrives
            )
        # The move stopped: the job was neither signalled nor requeued by it, the node is still in
        # the partition and not labelled inference; the incident holds it.
        assert slurm.job(job).state == "RUNNING" and slurm.job(job).restarts == 0
        assert "gpu3" in slurm.partition_nodes("train")
        node = kube.get_node("gpu3")
        assert node.labels.get("gpufleet.io/pool") != "inference"
        assert node.annotations[LEASE_ANNOTATION] == "remediate-lab-gpu3"
        # And a new move does not take it from the incident.
        with pytest.raises(NotOwned, match="held by remediate-lab-gpu3"):
            move.to_inference("gpu3", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1)


def test_a_job_that_refuses_requeue_does_not_fail_the_move_and_is_named(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    move, _, slurm = mover
    with running_job(slurm_lab, tmp_path, "gpu2", "#!/bin/sh\nsleep 300\n", "--no-requeue", "-o", "/dev/null") as job:
        said: list[str] = []
        detail = move.to_inference(
            "gpu2", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1, say=said.append
        )
        assert detail == "gpu2 serves inference"  # nothing requeued, and the node moved all the same
        assert any(f"job {job} not requeued" in line and "--no-requeue" in line for line in said), said
        assert "gpu2" not in slurm.partition_nodes("train")
        move.to_training("gpu2", holder="pool-shared", partition="train", eviction_timeout_seconds=5)


def test_a_move_to_training_that_would_break_a_budget_is_undone_and_the_node_serves_on(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli],
) -> None:
    move, kube, slurm = mover
    move.to_inference("gpu3", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1)
    # Two inference replicas, one on gpu3, and a budget that keeps both (made with the official
    # client: gpufleet itself creates no pods nor budgets).
    core = kube._api
    policy = k8s.PolicyV1Api(core.api_client)
    for name, node in (("web-a", "gpu3"), ("web-b", "spare1")):
        core.create_namespaced_pod(
            "default",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default", "labels": {"app": "web"}},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "vllm"}]},
                "status": {"phase": "Running"},
            },
        )
    policy.create_namespaced_pod_disruption_budget(
        "default",
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}},
        },
    )
    with pytest.raises(BudgetKept, match="gpu3 stays in inference: evicting default/web-a would break"):
        move.to_training("gpu3", holder="pool-shared", partition="train", eviction_timeout_seconds=0.5)
    node = kube.get_node("gpu3")
    assert node.labels["gpufleet.io/pool"] == "inference" and not node.unschedulable
    assert not any(t["key"] == TRAINING_TAINT for t in node.taints) and LEASE_ANNOTATION not in node.annotations
    assert [p.name for p in kube.pods_on_node("gpu3")] == ["web-a"]  # still serving
    assert "gpu3" not in slurm.partition_nodes("train")
    # Once the budget allows it, the move goes through.
    policy.delete_namespaced_pod_disruption_budget("web", "default")
    assert move.to_training("gpu3", holder="pool-shared", partition="train", eviction_timeout_seconds=5) == (
        "gpu3 serves training; 1 pod(s) moved away"
    )


def settle(move: PoolMover, node: str, to: str) -> str:
    return move.settle(
        node,
        to=to,
        holder="pool-shared",
        partition="train",
        grace_seconds=1,
        deadline_seconds=1,
        eviction_timeout_seconds=5,
    )


def test_a_node_handed_over_halfway_is_settled_into_one_pool_once_the_incident_lets_go(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli],
) -> None:
    move, kube, slurm = mover

    def xid_arrives(text: str) -> None:
        if "out of partition" in text:  # out of Slurm, not yet labelled inference: in neither pool
            nodelease.take_over(kube, "gpu1", "remediate-lab-gpu1")

    with pytest.raises(HandedOver):
        move.to_inference(
            "gpu1", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1, say=xid_arrives
        )
    assert (
        "gpu1" not in slurm.partition_nodes("train") and kube.get_node("gpu1").labels["gpufleet.io/pool"] == "training"
    )
    # While the incident holds it, or keeps its annotation, the settle waits.
    with pytest.raises(NotOwned, match="waits for remediate-lab-gpu1 to let go"):
        settle(move, "gpu1", "inference")
    nodelease.give_back(kube, "gpu1", "remediate-lab-gpu1")
    kube.update_metadata("gpu1", annotations={"gpufleet.io/incident": "remediate-lab-gpu1"})
    with pytest.raises(NotOwned, match="waits for its incident remediate-lab-gpu1"):
        settle(move, "gpu1", "inference")
    kube.update_metadata("gpu1", annotations={"gpufleet.io/incident": None})
    # Repaired in place and let go: the move is finished, the node wholly in inference.
    assert settle(move, "gpu1", "inference") == "gpu1 serves inference"
    node = kube.get_node("gpu1")
    assert node.labels["gpufleet.io/pool"] == "inference" and not node.unschedulable
    assert LEASE_ANNOTATION not in node.annotations and "gpu1" not in slurm.partition_nodes("train")
    # Settled again (a retry), it is left as it is.
    assert settle(move, "gpu1", "inference") == "gpu1 is wholly in inference"
    move.to_training("gpu1", holder="pool-shared", partition="train", eviction_timeout_seconds=5)
    # A node its incident put back wholly in training is left there, whatever the move wanted.
    assert settle(move, "gpu1", "inference") == "gpu1 is wholly in training"
    assert "gpu1" in slurm.partition_nodes("train")
    # One the incident retired is out of the pool: nothing left to do.
    kube.update_metadata("gpu1", labels={"gpufleet.io/pool": "retired"})
    with pytest.raises(OutOfPool, match="no longer in the shared pool"):
        settle(move, "gpu1", "training")
    assert LEASE_ANNOTATION not in kube.get_node("gpu1").annotations
    kube.update_metadata("gpu1", labels={"gpufleet.io/pool": "training"})


def test_a_move_to_training_waits_for_evicted_pods_to_shut_down(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli],
) -> None:
    move, kube, slurm = mover
    move.to_inference("gpu2", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1)
    core = kube._api
    for name in ("slow", "done", "sync"):
        core.create_namespaced_pod(
            "default",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                # A finalizer keeps the evicted pod there, terminating, as a container slow to stop would.
                "metadata": {"name": name, "namespace": "default", "finalizers": ["lab.gpufleet.io/stopping"]},
                "spec": {
                    "nodeName": "gpu2",
                    "containers": [{"name": "c", "image": "vllm"}],
                    # Training's own workload tolerates the training taint: it stays.
                    "tolerations": [{"key": TRAINING_TAINT, "operator": "Exists"}] if name == "sync" else [],
                },
                "status": {"phase": "Running" if name != "done" else "Succeeded"},
            },
        )
    said: list[str] = []

    def stops(text: str) -> None:
        said.append(text)
        if "shut down" in text:
            assert "gpu2" not in slurm.partition_nodes("train")  # training waits for the GPUs
            core.patch_namespaced_pod("slow", "default", {"metadata": {"finalizers": None}})

    assert move.to_training(
        "gpu2", holder="pool-shared", partition="train", eviction_timeout_seconds=30, say=stops
    ) == ("gpu2 serves training; 1 pod(s) moved away")
    assert any("waiting for 1 pod(s) to shut down" in line for line in said), said
    # A finished pod holds nothing; training's own stays.
    assert sorted(p.name for p in kube.pods_on_node("gpu2")) == ["done", "sync"]
    # Past the deadline with a pod still stopping, the move fails (and is retried) rather than
    # put training on GPUs in use.
    move.to_inference("gpu2", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=1)
    core.create_namespaced_pod(
        "default",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "stuck", "namespace": "default", "finalizers": ["lab.gpufleet.io/stopping"]},
            "spec": {"nodeName": "gpu2", "containers": [{"name": "c", "image": "vllm"}]},
            "status": {"phase": "Running"},
        },
    )
    with pytest.raises(ClientError, match="still shutting down"):
        move.to_training("gpu2", holder="pool-shared", partition="train", eviction_timeout_seconds=1)
    assert "gpu2" not in slurm.partition_nodes("train")
    core.patch_namespaced_pod("stuck", "default", {"metadata": {"finalizers": None}})
    assert move.to_training("gpu2", holder="pool-shared", partition="train", eviction_timeout_seconds=5).startswith(
        "gpu2 serves training"
    )


def test_a_node_taken_while_its_jobs_drained_goes_back_to_training_and_a_cordon_not_ours_waits(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    move, kube, slurm = mover
    with running_job(slurm_lab, tmp_path, "gpu3", "#!/bin/sh\nsleep 300\n", "--requeue", "-o", "/dev/null") as job:

        def xid_arrives(text: str) -> None:
            if "waiting for job" in text:
                nodelease.take_over(kube, "gpu3", "remediate-lab-gpu3")

        with pytest.raises(HandedOver):
            move.to_inference(
                "gpu3", holder="pool-shared", partition="train", grace_seconds=1, deadline_seconds=30, say=xid_arrives
            )
        nodelease.give_back(kube, "gpu3", "remediate-lab-gpu3")
        kube.set_unschedulable("gpu3", True)  # an operator's cordon, after the incident
        with pytest.raises(NotOwned, match="waits for whoever cordoned it"):
            settle(move, "gpu3", "inference")
        assert LEASE_ANNOTATION not in kube.get_node("gpu3").annotations  # nothing written
        kube.set_unschedulable("gpu3", False)
        # Still in the partition, drained with the move's reason: back to training, the job untouched.
        assert settle(move, "gpu3", "inference") == "gpu3 is wholly in training"
        assert not slurm.node("gpu3").drained and "gpu3" in slurm.partition_nodes("train")
        assert slurm.job(job).state == "RUNNING" and slurm.job(job).restarts == 0


def test_a_job_that_checkpointed_and_exited_while_the_worker_was_down_is_still_requeued(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    move, _, slurm = mover
    # Saves its checkpoint on SIGTERM and exits cleanly, as a training job does.
    with running_job(
        slurm_lab,
        tmp_path,
        "gpu2",
        "#!/bin/sh\ntrap 'echo saved; exit 0' TERM\nwhile true; do sleep 1; done\n",
        "--requeue",
        "-o",
        "/dev/null",
    ) as job:
        with pytest.raises(Crash):  # the worker dies right after the SIGTERM
            move.to_inference(
                "gpu2",
                holder="pool-shared",
                partition="train",
                grace_seconds=30,
                deadline_seconds=1,
                move="pool-shared:gpu2:1",
                say=crash_after("SIGTERM to"),
            )
        wait_for(lambda: slurm.job(job).state == "COMPLETED", timeout=30, what="the job to checkpoint and exit")
        # The retry (same move) signals nobody again and requeues the job it had signalled.
        said: list[str] = []
        detail = move.to_inference(
            "gpu2",
            holder="pool-shared",
            partition="train",
            grace_seconds=30,
            deadline_seconds=1,
            move="pool-shared:gpu2:1",
            say=said.append,
        )
        assert detail == f"gpu2 serves inference; requeued {job}", said
        assert any("marked before a restart" in line for line in said), said
        assert slurm.job(job).restarts == 1 and slurm.job(job).state in {"PENDING", "REQUEUED", "RUNNING"}
        # The marks make it idempotent: run again, the move requeues nobody a second time.
        assert move._empty(
            "gpu2",
            move="pool-shared:gpu2:1",
            holder="pool-shared",
            grace_seconds=1,
            deadline_seconds=1,
            say=said.append,
        ) in ([], [job])
        assert slurm.job(job).restarts == 1
        move.to_training("gpu2", holder="pool-shared", partition="train", eviction_timeout_seconds=5)


class SignalFails(SlurmCli):
    """Slurm whose first signal times out, as scancel can: the job is marked, not signalled."""

    def __init__(self, slurm_conf: Path) -> None:
        super().__init__(slurm_conf=slurm_conf)
        self.failed = False

    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None:
        if not self.failed:
            self.failed = True
            raise Unavailable("scancel: timed out")
        super().signal_job(job_id, signal=signal)


def test_a_job_marked_but_never_signalled_gets_its_sigterm_on_the_retry(
    mover: tuple[PoolMover, KubernetesApi, SlurmCli], slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    move, kube, slurm = mover
    out = tmp_path / "job.out"
    with running_job(
        slurm_lab,
        tmp_path,
        "gpu3",
        "#!/bin/sh\ntrap 'echo saved; exit 0' TERM\nwhile true; do sleep 1; done\n",
        "--requeue",
        "-o",
        str(out),
    ) as job:
        flaky = SignalFails(slurm_lab.conf)
        spares = SparePool(kube=kube, slurm=flaky, partition="train", cluster="lab")
        with pytest.raises(Unavailable):
            PoolMover(kube, flaky, spares, poll_seconds=0.1).to_inference(
                "gpu3", holder="pool-shared", partition="train", grace_seconds=30, deadline_seconds=1, move="m:gpu3:7"
            )
        assert "gpufleet:signalling:m:gpu3:7" in slurm.job_marks(job)
        assert "gpufleet:signalled:m:gpu3:7" not in slurm.job_marks(job) and slurm.job(job).state == "RUNNING"
        # The retry sends the SIGTERM that never went out: the job saves before it is requeued.
        detail = move.to_inference(
            "gpu3", holder="pool-shared", partition="train", grace_seconds=30, deadline_seconds=1, move="m:gpu3:7"
        )
        assert detail == f"gpu3 serves inference; requeued {job}"
        assert "saved" in out.read_text() and slurm.job(job).restarts == 1
        move.to_training("gpu3", holder="pool-shared", partition="train", eviction_timeout_seconds=5)
