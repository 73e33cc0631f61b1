"""Slurm's REST API against a real slurmrestd (Debian's 22.05, API v0.0.38) in front of a real
slurmctld: the raw client (tokens gpufleet signs, jobs as a named user, refusals said clearly),
and the Slinky backend's steps that go through it (waiting for the nodes, the smoke jobs, the
job counts of a deletion), with the JWT key taken from the Secret the creation made."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from clients.clusters import StepFailed
from clients.kube import KubernetesApi
from clients.slinky import SlinkyBackend
from clients.slurmrest import SlurmRestClient, SlurmRestError, jwt_token
from lab.accounting import Accounting, accounting_installed
from lab.procs import free_port, wait_for
from lab.slurm import SlurmLab, slurm_installed
from lab.slurmrest import jwt_lines, slurmrestd_installed, start_slurmrestd
from models.cluster import ClusterSpec, load_spec
from tests.conftest import KubeApiProcess, lab_seed

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not slurm_installed(), reason="Slurm is not installed"),
    pytest.mark.skipif(bool(slurmrestd_installed()), reason=slurmrestd_installed() or "installed"),
]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH nobody"
PLACEMENT = {"train": ["free1", "free2"], "debug": ["free3"]}


ACCOUNTING = not accounting_installed()


def spec(train_nodes: int = 2) -> ClusterSpec:
    return load_spec(
        {
            "name": "rest",
            "partitions": [{"name": "train", "nodes": train_nodes, "default": True}, {"name": "debug", "nodes": 1}],
            # Users this machine has, so that the smoke job can run as the spec's first user.
            "users": [
                {"name": "nobody", "uid": 20001, "account": "research", "ssh_keys": [KEY]},
                {"name": "daemon", "uid": 20002, "account": "ops", "admin": True, "ssh_keys": [KEY]},
            ],
            "spares": 0,
            "accounting": ACCOUNTING,
        }
    )


@dataclass
class RestCluster:
    kube: KubernetesApi
    slurm: SlurmLab
    url: str
    key: bytes

    def client(self) -> SlurmRestClient:
        return SlurmRestClient(self.url, self.key)

    def backend(self, **options: float) -> SlinkyBackend:
        return SlinkyBackend(self.kube, restapi=self.url, **options)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestCluster]:
    root = tmp_path_factory.mktemp("rest")
    api = KubeApiProcess(root / "kube", lab_seed(["gpu1"], []))
    kube = KubernetesApi(kubeconfig=api.kubeconfig)
    # The creation's objects, the JWT key Secret among them: the controller signs with that key.
    SlinkyBackend(kube).create_objects(spec(), PLACEMENT, "", "run-1")
    key = (kube.secret_data("slurm-rest", "rest-jwt-key") or {})["jwt_hs256.key"]
    # Jobs run as nobody here: their spool must be reachable by nobody, which pytest's 0700
    # folders are not.
    slurm_root = Path(tempfile.mkdtemp(prefix="gpufleet-rest-"))
    slurm_root.chmod(0o755)
    key_file = slurm_root / "jwt.key"
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    slurm = SlurmLab(slurm_root)
    nodes = ["rest-train-0", "rest-train-1", "rest-debug-0"]
    # Partitions named after their NodeSets (rest-train, rest-debug), as slurm-operator names them.
    conf = [
        "ClusterName=rest",
        *slurm.site_lines(),
        *jwt_lines(key_file),
        # With slurmdbd where the machine has it (its own MariaDB), for the accounting calls.
        *(Accounting.site_lines(slurm.munge_socket) if ACCOUNTING else []),
        f"AccountingStorageType=accounting_storage/{'slurmdbd' if ACCOUNTING else 'none'}",
        *(f"NodeName={node} {slurm.node_options()} State=UNKNOWN" for node in nodes),
        "PartitionName=rest-train Nodes=rest-train-0,rest-train-1 Default=YES MaxTime=INFINITE State=UP",
        "PartitionName=rest-debug Nodes=rest-debug-0 MaxTime=INFINITE State=UP",
    ]
    slurm = SlurmLab(slurm_root, conf="\n".join(conf) + "\n", nodes=nodes)
    restd = None
    try:
        slurm.start()
        restd = start_slurmrestd(
            slurm, plugins="openapi/v0.0.38,openapi/dbv0.0.38" if ACCOUNTING else "openapi/v0.0.38"
        )
        yield RestCluster(kube, slurm, restd.url, key)
    finally:
        if restd is not None:
            restd.stop()
        slurm.stop()
        api.stop()
        shutil.rmtree(slurm_root, ignore_errors=True)


def test_the_server_says_its_version_and_release(cluster: RestCluster) -> None:
    client = cluster.client()
    assert client.detect_version() == "v0.0.38"
    assert client.ping().startswith("22.05")


def test_a_job_submitted_for_a_user_runs_as_that_user(cluster: RestCluster) -> None:
    client = cluster.client()
    job = client.submit("#!/bin/sh\nid -un\n", user="nobody", partition="rest-debug", name="as-nobody")
    assert client.wait_job(job, user="nobody", timeout=60, interval=0.2) == "COMPLETED"
    shown = cluster.slurm.scontrol("show", "-o", "job", str(job))
    assert "UserId=nobody(" in shown and "Partition=rest-debug" in shown


def test_a_token_signed_with_another_key_is_refused_with_the_cause(cluster: RestCluster) -> None:
    client = SlurmRestClient(cluster.url, os.urandom(32))
    # Slurm 22.05 says so as a 500 from the controller; the message names the likely cause.
    with pytest.raises(SlurmRestError, match=r"slurmctld config is unable to load.*must be the cluster's jwt_key"):
        client.ping()


def test_an_expired_token_is_refused(cluster: RestCluster) -> None:
    token = jwt_token(cluster.key, "root", lifetime=60, now=1_000_000)  # expired in 1970
    reply = httpx.get(
        f"{cluster.url}/slurm/v0.0.38/ping", headers={"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token}
    )
    assert reply.status_code in (401, 403) or reply.json().get("errors")


def test_a_server_that_is_not_there_is_said_to_be_unreachable() -> None:
    client = SlurmRestClient(f"http://127.0.0.1:{free_port()}", b"k" * 32, timeout=2)
    with pytest.raises(SlurmRestError, match=r"did not answer GET /slurm/v0.0.38/ping.*RestApi up"):
        client.ping()


def test_jobs_are_listed_and_cancelled(cluster: RestCluster) -> None:
    client = cluster.client()
    job = client.submit("#!/bin/sh\nsleep 300\n", user="root", partition="rest-train", name="long")
    assert client.jobs()[job] in {"PENDING", "RUNNING", "CONFIGURING"}
    client.cancel(job)
    assert client.wait_job(job, user="root", timeout=60, interval=0.2) == "CANCELLED"


def test_a_refused_submission_names_slurms_reason(cluster: RestCluster) -> None:
    with pytest.raises(SlurmRestError, match=r"refused POST /slurm/v0.0.38/job/submit"):
        cluster.client().submit("#!/bin/sh\ntrue\n", user="root", partition="nosuch", name="x")


# -- the Slinky backend through slurmrestd ----------------------------------------------------------


def test_bring_up_returns_once_every_partition_has_its_nodes(cluster: RestCluster) -> None:
    detail = cluster.backend().bring_up(spec(), PLACEMENT, "")
    assert "up through slurmrestd (v0.0.38): 3 node(s) ready" in detail


def test_bring_up_that_never_completes_names_what_is_missing(cluster: RestCluster) -> None:
    backend = cluster.backend(wait_seconds=1.0, poll_seconds=0.2)
    with pytest.raises(StepFailed, match=r"not up after 1s: train: 2 of 3 node\(s\) up"):
        backend.bring_up(spec(train_nodes=3), PLACEMENT, "")


def test_smoke_jobs_run_on_every_partition_as_the_first_user(cluster: RestCluster) -> None:
    detail = cluster.backend().smoke_test(spec())
    assert "train: job" in detail and "debug: job" in detail and detail.count("as nobody COMPLETED") == 2


def test_a_deletion_counts_and_cancels_the_jobs_through_slurmrestd(cluster: RestCluster) -> None:
    backend = cluster.backend()
    client = cluster.client()
    job = client.submit("#!/bin/sh\nsleep 300\n", user="root", partition="rest-train", name="long")
    wait_for(lambda: client.job_state(job) == "RUNNING", timeout=60, what="the job to run")
    assert backend.running_jobs(spec()) == 1
    assert backend.cancel_jobs(spec()) == 1
    assert client.wait_job(job, user="root", timeout=60, interval=0.2) == "CANCELLED"
    assert backend.running_jobs(spec()) == 0


def test_without_slurmrestd_a_deletion_is_told_to_force(cluster: RestCluster) -> None:
    gone = SlinkyBackend(cluster.kube, restapi=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StepFailed, match=r"did not answer.*delete with --force"):
        gone.running_jobs(spec())
    assert gone.cancel_jobs(spec()) == 0  # nothing this backend can reach; the operator drains


@pytest.mark.skipif(not ACCOUNTING, reason=accounting_installed() or "installed")
def test_accounts_and_users_go_into_slurmdbd_and_come_out_again(cluster: RestCluster) -> None:
    backend = cluster.backend()
    detail = backend.add_users(spec())
    assert "account ops" in detail and "user nobody in research" in detail and "user daemon in ops" in detail
    assert "was there already" in backend.add_users(spec())  # a retry adds nothing
    out = subprocess.run(
        ["sacctmgr", "-n", "-P", "show", "assoc", "cluster=rest", "format=account,user"],
        env=cluster.slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert {"research|nobody", "ops|daemon"} <= set(out.stdout.split())
    admins = subprocess.run(
        ["sacctmgr", "-n", "-P", "show", "user", "daemon,nobody", "format=user,admin"],
        env=cluster.slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert sorted(admins.stdout.split()) == ["daemon|Administrator", "nobody|None"]
    assert backend.remove_users(spec()) == (
        "slurmdbd: removed user nobody from research, user daemon from ops, account ops, account research on rest"
    )
    assert backend.remove_users(spec()) == "no accounts to remove"
    assert cluster.client().associations("rest") == {("root", ""), ("root", "root")}
    # The users themselves stay: the database may serve other clusters.
    users = subprocess.run(
        ["sacctmgr", "-n", "-P", "show", "user", "format=user"],
        env=cluster.slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert {"nobody", "daemon"} <= set(users.stdout.split())


@pytest.mark.skipif(not ACCOUNTING, reason=accounting_installed() or "installed")
def test_accounts_cannot_be_assumed_gone_when_slurmrestd_does_not_answer(cluster: RestCluster) -> None:
    gone = SlinkyBackend(cluster.kube, restapi=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StepFailed, match=r"removing the accounts through slurmrestd: .*did not answer"):
        gone.remove_users(spec())


@pytest.mark.skipif(not ACCOUNTING, reason=accounting_installed() or "installed")
def test_only_the_users_named_leave_and_only_the_accounts_no_user_left_uses(cluster: RestCluster) -> None:
    """A running cluster's users removed one at a time (``remove_users(spec, only=...)``): the
    account a remaining user still uses stays, the last user's account goes with it."""
    raw = spec().model_dump(mode="json")
    raw["users"].append({"name": "bin", "uid": 20003, "account": "research", "ssh_keys": [KEY]})
    three = load_spec(raw)
    backend = cluster.backend()
    backend.add_users(three)
    assert backend.remove_users(three, only=["nobody"]) == "slurmdbd: removed user nobody from research on rest"
    assert cluster.client().associations("rest") >= {("research", ""), ("research", "bin"), ("ops", "daemon")}
    assert ("research", "nobody") not in cluster.client().associations("rest")
    assert backend.remove_users(three, only=["daemon"]) == (
        "slurmdbd: removed user daemon from ops, account ops on rest"
    )
    assert backend.remove_users(three, only=["daemon"]) == "no accounts to remove"  # a retry
    assert backend.remove_users(three, only=[]) == "no accounts to remove"
    assert backend.remove_users(three) == "slurmdbd: removed user bin from research, account research on rest"
    assert cluster.client().associations("rest") == {("root", ""), ("root", "root")}
