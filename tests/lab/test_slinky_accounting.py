"""Accounting for a cluster of the lab's Slinky flavor (lab/dynamic.py, Slurm 26.05 from its root):
a private MariaDB and the root's slurmdbd, the cluster registered under its own name, slurmrestd
serving ``openapi/slurmdbd`` beside ``openapi/slurmctld``, and the accounts and users that a
cluster's creation adds and removes through it (``SlurmRestClient``), checked with ``sacctmgr``;
a job's record; and accounting found again after slurmdbd dies, and turned off and on again
under a running cluster whose job keeps running."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from clients.slurmrest import SlurmRestClient, jwt_token
from lab.accounting import MARIADB_TOOLS
from lab.dynamic import DynamicSlurmLab
from lab.procs import alive, wait_for
from lab.slurmrest import Slurmrestd, jwt_lines, start_slurmrestd
from lab.slurmroots import root_unavailable

RELEASE = "26.05"
CLUSTER = "slinky-acct"  # Slinky's Controller clusterName: the spec's name
NODESET = "train"
MISSING = root_unavailable(RELEASE) or (
    "" if all(shutil.which(tool) for tool in MARIADB_TOOLS) else "MariaDB is missing: apt-get install mariadb-server"
)
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(bool(MISSING), reason=MISSING or "")]
ROOT_ONLY = {("root", ""), ("root", "root")}


@dataclass
class Live:
    slurm: DynamicSlurmLab
    restd: Slurmrestd
    key: bytes

    def client(self, version: str = "v0.0.45") -> SlurmRestClient:
        return SlurmRestClient(self.restd.url, self.key, version=version)

    def run(self, *argv: str) -> str:
        """A Slurm command of the cluster's root (sacctmgr, sacct, squeue), its output."""
        done = subprocess.run(
            self.slurm.argv(list(argv)), env=self.slurm.env, capture_output=True, text=True, timeout=30, check=True
        )
        return done.stdout

    def associations(self) -> set[str]:
        return set(
            self.run(
                "sacctmgr", "-n", "-P", "show", "assoc", f"cluster={CLUSTER}", "format=account,user,lineage"
            ).split()
        )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The cluster as the operator stand-in starts it for a Controller whose accountingRef names
    an Accounting: its name, its NodeSet, the JWT key, accounting; one pod; then its RestApi."""
    root = tmp_path_factory.mktemp("slinky-acct")
    key = root / "jwt_hs256.key"
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)
    slurm = DynamicSlurmLab(
        root / "slurm", (NODESET,), cluster_name=CLUSTER, accounting=True, extra_lines=jwt_lines(key)
    )
    restd = None
    try:
        slurm.start(timeout=60)
        slurm.add_node(f"{NODESET}-0", NODESET)
        restd = start_slurmrestd(slurm)
        yield Live(slurm, restd, key.read_bytes())
    finally:
        if restd is not None:
            restd.stop()
        slurm.stop()


def test_the_cluster_keeps_its_records_under_its_own_name(live: Live) -> None:
    config = live.slurm.scontrol("show", "config")
    assert f"ClusterName             = {CLUSTER}\n" in config
    assert "AccountingStorageType   = accounting_storage/slurmdbd\n" in config
    assert live.run("sacctmgr", "-n", "-P", "show", "cluster", "format=cluster").split() == [CLUSTER]
    # slurmdbd speaks the cluster's auth/slurm, and holds the database's password alone.
    dbd_conf = live.slurm.root / "slurmdbd.conf"
    assert "AuthType=auth/slurm\n" in dbd_conf.read_text()
    assert dbd_conf.stat().st_mode & 0o777 == 0o600
    assert live.slurm.whole()
    # slurmrestd serves the accounting API next to the controller's.
    client = live.client()
    assert client.detect_version() == "v0.0.45"
    assert client.associations(CLUSTER) == ROOT_ONLY


@pytest.mark.parametrize("version", ["v0.0.42", "v0.0.43", "v0.0.44", "v0.0.45"])
def test_accounts_and_users_go_in_and_out_through_slurmrestd(live: Live, version: str) -> None:
    account = f"vision{version[-2:]}"
    client = live.client(version)
    client.add_account(account, cluster=CLUSTER)
    client.add_account(account, cluster=CLUSTER)  # a retry changes nothing
    client.add_user("nobody", account=account, cluster=CLUSTER, admin=False)
    client.add_user("daemon", account=account, cluster=CLUSTER, admin=True)
    assert client.associations(CLUSTER) == ROOT_ONLY | {(account, ""), (account, "nobody"), (account, "daemon")}
    # As sacctmgr sees them: the account's own association under root, each user's under it.
    assert {f"{account}||/{account}/", f"{account}|nobody|/{account}/0-nobody/"} <= live.associations()
    assert f"{account}|daemon|/{account}/0-daemon/" in live.associations()
    users = live.run("sacctmgr", "-n", "-P", "show", "user", "daemon,nobody", "format=user,defaultaccount,admin")
    assert sorted(users.split()) == [f"daemon|{account}|Administrator", f"nobody|{account}|None"]

    client.remove_association(CLUSTER, account, "nobody")
    client.remove_association(CLUSTER, account, "daemon")
    client.remove_association(CLUSTER, account)
    assert client.associations(CLUSTER) == ROOT_ONLY
    assert not [line for line in live.associations() if line.startswith(f"{account}|")]
    # The users themselves stay: the database may serve other clusters.
    assert {"nobody", "daemon"} <= set(live.run("sacctmgr", "-n", "-P", "show", "user", "format=user").split())


def _sleeper(live: Live, seconds: int) -> Path:
    script = live.slurm.root / f"sleep-{seconds}.sh"
    script.write_text(f"#!/bin/sh\nsleep {seconds}\n")
    return script


def test_a_job_is_recorded_under_the_cluster_and_its_account(live: Live) -> None:
    job = live.slurm.sbatch(_sleeper(live, 0), "--account=root", "-o", "/dev/null")

    def recorded() -> str:
        said = live.run("sacct", "-X", "-n", "-P", "-j", str(job), "--format=jobid,cluster,account,user,state")
        return said.strip() if said.strip().endswith("COMPLETED") else ""

    assert wait_for(recorded, timeout=30, what=f"job {job} in sacct") == f"{job}|{CLUSTER}|root|root|COMPLETED"
    # The same record through slurmrestd's accounting API.
    token = jwt_token(live.key, "root")
    reply = httpx.get(
        f"{live.restd.url}/slurmdb/v0.0.45/job/{job}",
        headers={"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token},
        timeout=30,
    )
    (record,) = reply.json()["jobs"]
    assert (record["cluster"], record["account"], record["state"]["current"]) == (CLUSTER, "root", ["COMPLETED"])


def test_accounting_is_found_again_after_slurmdbd_dies(live: Live) -> None:
    pids = live.slurm.pids()
    os.kill(pids["slurmdbd"], 9)
    wait_for(lambda: not alive(pids["slurmdbd"]), timeout=10, what="slurmdbd to die")
    assert not live.slurm.whole()
    assert live.slurm.start_accounting() == "slurmdbd started"
    assert live.slurm.pids()["mariadbd"] == pids["mariadbd"]
    assert live.slurm.start_accounting() == "MariaDB and slurmdbd were running"
    assert live.slurm.whole()


def test_accounting_turned_off_and_on_again_under_a_running_job(live: Live) -> None:
    client = live.client()
    client.add_account("kept", cluster=CLUSTER)
    job = live.slurm.sbatch(_sleeper(live, 300), "--account=root", "-o", "/dev/null")
    wait_for(
        lambda: live.run("squeue", "-h", "-j", str(job), "-o", "%T").strip() == "RUNNING",
        timeout=30,
        what="the job to run",
    )

    assert live.slurm.stop_accounting() == "slurmdbd and MariaDB stopped, slurmctld restarted"
    assert "AccountingStorageType   = (null)\n" in live.slurm.scontrol("show", "config")
    assert live.slurm.stop_accounting() == "neither MariaDB nor slurmdbd was running"
    assert live.slurm.nodes() == [f"{NODESET}-0"]

    said = live.slurm.start_accounting()
    assert said == "MariaDB started, slurmdbd started, slurmctld restarted"
    assert "AccountingStorageType   = accounting_storage/slurmdbd\n" in live.slurm.scontrol("show", "config")
    # The job ran on through both restarts of the controller, and the database kept its records.
    assert live.run("squeue", "-h", "-j", str(job), "-o", "%T").strip() == "RUNNING"
    assert "kept||/kept/" in live.associations()
    assert live.slurm.whole()
    live.run("scancel", str(job))
