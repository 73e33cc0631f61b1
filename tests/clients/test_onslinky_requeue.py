"""An incident's Slurm steps on Slinky over slurmrestd API v0.0.44 (what Slinky's Slurm 25.11
serves: no requeue), against real Slurm 26.05 dynamic nodes and the root's own slurmrestd.

One Kubernetes node, gpu1, hosts two NodeSet pods (research-train-0 and -1, dynamic Slurm nodes
of those names); research-train-2 runs on gpu2. The incident is keyed on gpu1: its drain covers
both pods' Slurm nodes, and a job on them is requeued by setting DOWN the node gpufleet drained.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.slurm import SlurmActivities, requeued_mark, signalled_mark
from clients.errors import InvalidInput
from clients.kube import KubernetesApi
from clients.onslinky import SLURM_NODES_ANNOTATION, SlinkySlurm
from clients.slurm import SlurmCli
from clients.slurmrest_protocol import SlurmRest, unsupported_methods
from lab.dynamic import DynamicSlurmLab
from lab.kubeapi import node_object
from lab.procs import wait_for
from lab.slurmrest import jwt_lines, start_slurmrestd
from lab.slurmroots import root_unavailable
from models.constants import drain_reason
from models.incident import JobInfo, RequeueOutcome
from models.requests import RequeueJobRequest
from models.slinky import API
from tests.conftest import KubeApiProcess

RELEASE = "26.05"
VERSION = "v0.0.44"
NS = "slurm-research"
NODESET = "research-train"
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or ""),
]
INCIDENT = "research-gpu1-20260101T000000Z"
REASON = drain_reason(event="xid 79", action="REPLACE_NODE", incident_id=INCIDENT)
ON_GPU1 = ["research-train-0", "research-train-1"]


def _pod(name: str, node: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/name": "slurmd", "slinky.slurm.net/cluster": "research"},
            "ownerReferences": [
                {"apiVersion": API, "kind": "NodeSet", "name": NODESET, "uid": "u", "controller": True}
            ],
        },
        "spec": {"nodeName": node, "hostname": name, "containers": [{"name": "slurmd", "image": "slurmd"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@dataclass
class Live:
    cluster: DynamicSlurmLab
    url: str
    key_file: Path
    kube: KubernetesApi
    cli: SlurmCli
    jobs: dict[str, int]

    def slinky(self) -> SlinkySlurm:
        return SlinkySlurm(SlurmRest(self.url, version=VERSION, key_file=self.key_file), self.kube)

    def sbatch(self, *args: str) -> int:
        done = subprocess.run(
            self.cluster.argv(["sbatch", "--parsable", "-o", "/dev/null", *args]),
            env=self.cluster.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return int(done.stdout.strip().split(";")[0])

    def job(self, name: str) -> JobInfo:
        return self.cli.job(self.jobs[name])


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    root = Path(tempfile.mkdtemp(prefix="gpufleet-onslinky-", dir="/tmp"))
    root.chmod(0o755)
    key_file = root / "jwt.key"
    key_file.write_bytes(b"gpufleet-test-key-" + b"0" * 32)
    key_file.chmod(0o600)
    seed: dict[str, object] = {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
        "nodes": [node_object("gpu1", pool="training"), node_object("gpu2", pool="training")],
        "pods": [*(_pod(name, "gpu1") for name in ON_GPU1), _pod("research-train-2", "gpu2")],
    }
    api = KubeApiProcess(root / "kube", seed)
    cluster = DynamicSlurmLab(root / "slurm", (NODESET,), release=RELEASE, extra_lines=jwt_lines(key_file))
    restd = None
    try:
        cluster.start(timeout=60)
        for name in [*ON_GPU1, "research-train-2"]:
            cluster.add_node(name, NODESET, cpus=2)
        restd = start_slurmrestd(cluster)
        live = Live(
            cluster,
            restd.url,
            key_file,
            KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05),
            cluster.client(),
            {},
        )
        live.jobs["failed"] = live.sbatch("-w", "research-train-1", "--wrap", "exit 3")
        live.jobs["no_requeue"] = live.sbatch("--no-requeue", "-w", "research-train-1", "--wrap", "sleep 600")
        wait_for(
            lambda: (live.job("failed").state, live.job("no_requeue").state) == ("FAILED", "RUNNING"),
            timeout=60,
            what="research-train-1's jobs to end and to run",
        )
        # The requeue-able job names no node (so that, requeued, it may run on gpu2's): placed on
        # research-train-0 while the others are held.
        held = ("research-train-1", "research-train-2")
        for name in held:
            cluster.scontrol("update", f"nodename={name}", "state=drain", "reason=test: placing a job")
        live.jobs["running"] = live.sbatch("--requeue", "--wrap", "sleep 600")
        wait_for(
            lambda: live.job("running").state == "RUNNING",
            timeout=60,
            what="a job to run on research-train-0",
        )
        for name in held:
            cluster.scontrol("update", f"nodename={name}", "state=resume")
        assert live.job("running").nodes == "research-train-0"
        yield live
    finally:
        if restd is not None:
            restd.stop()
        cluster.stop()
        api.stop()
        shutil.rmtree(root, ignore_errors=True)


def requeue(live: Live, job: JobInfo, *, ended_by_failure: bool = False) -> tuple[RequeueOutcome, str]:
    acts = SlurmActivities(live.slinky(), poll_seconds=0.1)
    request = RequeueJobRequest(
        job_id=job.job_id,
        restarts_before=job.restarts,
        signalled=not ended_by_failure,
        incident_id=INCIDENT,
        ended_by_failure=ended_by_failure,
    )
    done = ActivityEnvironment().run(acts.requeue_job, request)
    return done.outcome, done.why


def test_the_kubernetes_nodes_drain_drains_each_of_its_slurm_nodes_and_records_them(live: Live) -> None:
    slinky = live.slinky()
    assert slinky.unsupported().get("requeue") is None  # served through DOWN on v0.0.44
    assert "requeue" in unsupported_methods(slinky.inner)

    combined = slinky.drain("gpu1", reason=REASON)

    assert combined.name == "gpu1" and combined.drained and combined.reason == REASON
    for name in ON_GPU1:
        node = live.cli.node(name)
        assert node.drained and node.reason == REASON, node
    assert not live.cli.node("research-train-2").drained  # on gpu2: not this incident's
    recorded = live.kube.get_node("gpu1").annotations[SLURM_NODES_ANNOTATION]
    assert all(name in recorded for name in ON_GPU1) and "research-train-2" not in recorded
    assert [job.job_id for job in slinky.jobs_on_node("gpu1")] == sorted(
        [live.jobs["running"], live.jobs["no_requeue"]]
    )


def test_a_running_job_is_requeued_through_down_once_however_often_asked(live: Live) -> None:
    before = live.job("running")
    assert (before.state, before.restarts, before.nodes, before.requeue) == ("RUNNING", 0, "research-train-0", True)

    first = requeue(live, before)

    assert first[0] is RequeueOutcome.REQUEUED, first
    after = live.job("running")
    assert (after.state, after.restarts) == ("PENDING", 1), after  # back in the queue, once
    assert requeued_mark(INCIDENT, 0) in live.slinky().job_marks(after.job_id)
    node = live.cli.node("research-train-0")
    assert node.drained and node.reason == REASON  # still gpufleet's drain, with its reason
    # Its new run starts on gpu2's Slurm node; the same step tried again then (a retry after a
    # lost answer) must leave that run alone.
    wait_for(lambda: live.job("running").state == "RUNNING", timeout=60, what="the requeued job to run again")
    assert live.job("running").nodes == "research-train-2"

    again = requeue(live, before)

    assert again[0] is RequeueOutcome.REQUEUED, again
    now = live.job("running")
    assert (now.state, now.restarts, now.nodes) == ("RUNNING", 1, "research-train-2")
    assert live.cli.node("research-train-2").state != "down"


def test_an_ended_job_is_refused_saying_that_v0_0_45_can_requeue_it(live: Live) -> None:
    failed = live.job("failed")
    assert failed.state == "FAILED"
    with pytest.raises(InvalidInput, match=r"v0\.0\.45") as refused:
        live.slinky().requeue(failed.job_id)
    assert "has ended (FAILED)" in str(refused.value)

    outcome, why = requeue(live, failed, ended_by_failure=True)

    assert outcome is RequeueOutcome.FAILED and "v0.0.45" in why and "resubmits" in why
    assert (live.job("failed").state, live.job("failed").restarts) == ("FAILED", 0)
    assert signalled_mark(INCIDENT) not in live.slinky().job_marks(failed.job_id)


def test_a_job_submitted_with_no_requeue_is_refused_and_left_running(live: Live) -> None:
    """Setting its node DOWN would kill it (NODE_FAIL): refused before anything is sent, as
    v0.0.45's requeue refuses it."""
    job = live.job("no_requeue")
    assert job.state == "RUNNING" and not job.requeue

    outcome, why = requeue(live, job)

    assert outcome is RequeueOutcome.FAILED and "--no-requeue" in why, why
    assert (live.job("no_requeue").state, live.job("no_requeue").restarts) == ("RUNNING", 0)
    node = live.cli.node("research-train-1")
    assert node.state != "down" and node.drained and node.reason == REASON


def test_no_down_that_would_also_end_a_no_requeue_job_beside_it(live: Live) -> None:
    """A requeue-able job beside the --no-requeue one on research-train-1: setting the node DOWN
    for the first would end the second (NODE_FAIL), so neither is touched and the owner is told."""
    live.cluster.scontrol("update", "nodename=research-train-1", "state=resume")
    live.jobs["beside"] = live.sbatch("--requeue", "-w", "research-train-1", "--wrap", "sleep 600")
    wait_for(lambda: live.job("beside").state == "RUNNING", timeout=60, what="a job beside the --no-requeue one")
    live.slinky().drain("gpu1", reason=REASON)

    outcome, why = requeue(live, live.job("beside"))

    assert outcome is RequeueOutcome.FAILED, why
    assert f"would also end job(s) {live.jobs['no_requeue']} there, which may not be requeued" in why, why
    assert (live.job("beside").state, live.job("beside").restarts) == ("RUNNING", 0)
    assert live.job("no_requeue").state == "RUNNING"
    node = live.cli.node("research-train-1")
    assert node.state != "down" and node.drained and node.reason == REASON
