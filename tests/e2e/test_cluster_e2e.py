"""Cluster creation end to end in the lab: a spec with two partitions and two users becomes a
running Slurm cluster of its own (real slurmctld and slurmd), made from the lab's free pool; a
spec the pool cannot hold fails at once with nothing made; a smoke job that fails is kept, and
resumed after the fix; lab down leaves nothing of either running. Its users log in over SSH
with their own keys (and no other), see its partitions, run a job that writes into the cluster's
storage and read the file on the login node."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from clients.kube import KubernetesApi
from clients.pool import free_nodes, holdings
from lab.accounting import accounting_installed
from lab.fleet import FleetLab, LabConfig
from lab.histories import record_histories
from lab.login import login_unavailable
from lab.procs import alive, pids_with_env, wait_for
from models.clusterops import CLUSTER_TASK_QUEUE, ClusterStatus, cluster_workflow_id
from models.clusterusers import (
    CLUSTER_USERS_WORKFLOW,
    UsersAction,
    UsersChangeInput,
    UsersChangeStatus,
    UsersOutcome,
    users_workflow_id,
)
from tests.conftest import gpufleet_cli
from tests.e2e.logins import ssh

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH"
# The lab's home: a folder every user may pass through, as their homes and the cluster's
# slurm.conf must be (pytest's own temporary folder is its owner's only).
HOME = Path("/tmp") / f"gpufleet-clusters-e2e-{os.getpid()}"
KEYS = HOME / "keys"


def key_of(name: str) -> tuple[Path, str]:
    """The key pair of ``name`` in the lab's home (made on first use)."""
    private = KEYS / name
    if not private.exists():
        KEYS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(private)], check=True, timeout=30)
    return private, private.with_name(f"{name}.pub").read_text().strip()


def spec(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "partitions": [
            {"name": "train", "nodes": 2, "default": True},
            {"name": "debug", "nodes": 1, "max_time": "30"},
        ],
        "users": [
            {"name": "alice", "uid": 20001, "account": "vision", "admin": True, "ssh_keys": [key_of("alice")[1]]},
            {"name": "bob", "uid": 20002, "account": "language", "ssh_keys": [f"{KEY} bob"]},
        ],
        "spares": 1,
        "remediation": {"grace_seconds": 30},
        "storage": {"mount_path": "/shared"},
        **extra,
    }


@pytest.fixture(scope="module")
def lab() -> Iterator[FleetLab]:
    config = LabConfig(
        training=["gpu1"], spares=["spare1"], free=["free1", "free2", "free3", "free4"], temporal_port=0, ui_port=0
    )
    HOME.mkdir(mode=0o755, exist_ok=True)
    HOME.chmod(0o755)
    fleet = FleetLab(HOME / "lab", config)
    try:
        fleet.up()
        yield fleet
        record_histories(fleet.env()["TEMPORAL_ADDRESS"])  # with GPUFLEET_RECORD_HISTORIES set: tests/replay
        pids = fleet.down()
        assert not [pid for pid in pids if alive(pid)]
        # Nothing of the clusters it made is left running either: no daemon, no login node.
        for root in (fleet.home / "clusters").glob("*"):
            assert not pids_with_env("SLURM_CONF", str(root / "slurm.conf"))
            assert not [line for line in _processes() if str(root / "login") in line]
    finally:
        fleet.down()
        shutil.rmtree(HOME, ignore_errors=True)


def _processes() -> list[str]:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()


def write(tmp: Path, body: dict[str, Any]) -> Path:
    path = tmp / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def create(lab: FleetLab, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = gpufleet_cli("cluster", "create", *args, "--json", env=lab.env(), timeout=300)
    return done, json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}


def kube(lab: FleetLab) -> KubernetesApi:
    return KubernetesApi(kubeconfig=lab.home / "kubeconfig")


def test_a_spec_the_pool_cannot_hold_fails_at_once_with_nothing_made(lab: FleetLab, tmp_path: Path) -> None:
    big = spec("huge")
    big["partitions"][0]["nodes"] = 9
    done, result = create(lab, str(write(tmp_path, big)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert result["outcome"] == "rolled_back" and result["failed_step"] == "validate"
    assert "11 nodes asked (spares included) but the free pool holds 4" in result["error"]
    assert free_nodes(kube(lab)) == 4 and holdings(kube(lab), "huge") == {}


def test_a_spec_becomes_a_running_slurm_cluster(lab: FleetLab, tmp_path: Path) -> None:
    done, result = create(lab, str(write(tmp_path, spec("research"))))
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["outcome"] == "ready" and result["users"] == ["alice", "bob"]
    assert result["partitions"] == [{"name": "train", "nodes": 2}, {"name": "debug", "nodes": 1}]
    # Its own Slurm: sinfo on its slurm.conf shows both partitions with their node counts.
    conf = lab.home / "clusters" / "research" / "slurm.conf"
    sinfo = subprocess.run(
        ["sinfo", "-h", "-o", "%R %D"],
        env={**lab.env(), "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert sorted(sinfo.stdout.split("\n")[:-1]) == ["debug 1", "train 2"]
    text = conf.read_text()
    assert "JobRequeue=1" in text and "KillWait=30" in text  # gpufleet's defaults, the spec's grace
    # The smoke jobs ran, one per partition.
    shown = json.loads(gpufleet_cli("cluster", "show", "research", "--json", env=lab.env()).stdout)
    smoke = next(e["detail"] for e in shown["timeline"] if e["step"] == "smoke_test" and e["event"] == "done")
    assert "train: job" in smoke and "debug: job" in smoke and "hello from free" in smoke
    # Its nodes came from the free pool; its objects exist.
    api = kube(lab)
    placed = holdings(api, "research")
    assert sorted(len(nodes) for nodes in placed.values()) == [1, 1, 2] and free_nodes(api) == 0
    for kind, name in [
        ("Namespace", "slurm-research"),
        ("Secret", "research-users"),
        ("ConfigMap", "gpufleet-remediation"),
    ]:
        obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": "slurm-research"}}
        assert api.object_exists(obj), (kind, name)
    # And it is remediable: a worker on its own task queue.
    assert alive(int((lab.home / "clusters" / "research" / "worker.pid").read_text()))


def test_its_users_log_in_with_their_keys_and_share_its_storage(lab: FleetLab) -> None:
    if why := login_unavailable():
        pytest.skip(f"no login node here: {why}")
    shown = json.loads(gpufleet_cli("cluster", "show", "research", "--json", env=lab.env()).stdout)
    login = shown["login"]
    assert shown["ssh"]["alice"] == f"ssh -p {login.rpartition(':')[2]} alice@127.0.0.1"
    assert sorted(shown["ssh"]) == ["alice", "bob"]
    # Alice, with her key: she is herself there, sees the cluster's partitions, and a job of hers
    # writes into the storage, where she reads it from the login node.
    job = '#!/bin/sh\necho "$(id -un) ran $SLURM_JOB_ID on $SLURMD_NODENAME" > /shared/alice.txt\n'
    command = (
        "id -un; sinfo -h -o '%R %D' | sort; "
        f"printf '{job}' > ~/job.sh && sbatch --wait -p debug -o ~/job.out ~/job.sh && cat /shared/alice.txt"
    )
    alice_key, _ = key_of("alice")
    done = ssh(login, "alice", alice_key, command)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "alice" and lines[1:3] == ["debug 1", "train 2"]
    assert lines[-1].startswith("alice ran ") and " on free" in lines[-1]
    stored = lab.home / "clusters" / "research" / "storage" / "alice.txt"
    assert stored.read_text().strip() == lines[-1] and stored.stat().st_uid == 20001
    # Another key is refused, for her and for bob (whose key in the spec is not this one).
    for user, key in (("alice", key_of("mallory")[0]), ("bob", alice_key)):
        refused = ssh(login, user, key, "true")
        assert refused.returncode == 255 and "Permission denied" in refused.stderr, (user, refused.stderr)
    # And no root login, whatever the key.
    assert ssh(login, "root", alice_key, "true").returncode == 255


def test_users_and_keys_change_on_the_running_cluster(lab: FleetLab) -> None:
    if why := login_unavailable():
        pytest.skip(f"no login node here: {why}")
    login = json.loads(gpufleet_cli("cluster", "show", "research", "--json", env=lab.env()).stdout)["login"]
    bob_key, bob_public = key_of("bob")
    carol_key, _ = key_of("carol")

    def users(*args: str) -> dict[str, Any]:
        done = gpufleet_cli("cluster", "users", *args, "--json", env=lab.env(), timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    # Bob's key replaced: his new one lets him in.
    users("set-keys", "research", "--user", "bob", "--key", bob_public)
    assert ssh(login, "bob", bob_key, "id -un").stdout.strip() == "bob"
    # Carol added: she logs in at once, under her uid, with a home of her own, and runs a job.
    users("add", "research", "--user", "carol", "--uid", "20003", "--key-file", str(KEYS / "carol.pub"))
    done = ssh(
        login, "carol", carol_key, "id -u; pwd; sbatch --wait -p debug -o /dev/null --wrap 'id -un > /shared/carol.txt'"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["20003", "/home/carol"]
    assert (lab.home / "clusters" / "research" / "storage" / "carol.txt").read_text().strip() == "carol"
    # Alice removed: her key no longer opens anything; show names the users now.
    users("remove", "research", "--user", "alice")
    refused = ssh(login, "alice", key_of("alice")[0], "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr
    shown = json.loads(gpufleet_cli("cluster", "show", "research", "--json", env=lab.env()).stdout)
    assert sorted(shown["ssh"]) == ["bob", "carol"]
    # A change read before the last one ended (alice still there): the worker finds the logins
    # are not what it read and refuses it; the users now are still the last change's.
    stale = asyncio.run(_stale_change(lab, "research"))
    assert stale.outcome == UsersOutcome.REFUSED and "users changed since this change was read" in stale.error
    listed = gpufleet_cli("cluster", "users", "list", "research", "--json", env=lab.env())
    assert [user["name"] for user in json.loads(listed.stdout)] == ["bob", "carol"], listed.stderr
    assert ssh(login, "carol", carol_key, "true").returncode == 0


async def _stale_change(lab: FleetLab, name: str) -> UsersChangeStatus:
    """A change of the cluster's users built on its creation's spec, as a command that read it
    before the changes above would send it."""
    client = await Client.connect(lab.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
    made = await client.get_workflow_handle(cluster_workflow_id(name)).query("status", result_type=ClusterStatus)
    assert made is not None and made.spec is not None
    old = made.spec
    new = old.model_copy(update={"users": [u for u in old.users if u.name != "alice"]})
    handle = await client.start_workflow(
        CLUSTER_USERS_WORKFLOW,
        UsersChangeInput(name=name, backend="lab", creation=made.creation, old=old, new=new, action=UsersAction.REMOVE),
        id=users_workflow_id(name),
        task_queue=CLUSTER_TASK_QUEUE,
        result_type=UsersChangeStatus,
    )
    status: UsersChangeStatus = await handle.result()
    return status


def test_an_existing_name_is_refused_and_nothing_changes(lab: FleetLab, tmp_path: Path) -> None:
    done = gpufleet_cli("cluster", "create", str(write(tmp_path, spec("research"))), env=lab.env(), timeout=120)
    assert done.returncode == 1 and "cluster research exists already" in done.stderr
    assert sorted(len(n) for n in holdings(kube(lab), "research").values()) == [1, 1, 2]
    shown = json.loads(gpufleet_cli("cluster", "show", "research", "--json", env=lab.env()).stdout)
    assert shown["outcome"] == "ready"  # still the one that was made


def test_delete_waits_for_a_running_job_or_cancels_it_when_forced(lab: FleetLab, tmp_path: Path) -> None:
    root = lab.home / "clusters" / "research"
    script = tmp_path / "long.sh"
    script.write_text("#!/bin/sh\nsleep 300\n")
    env = {**lab.env(), "SLURM_CONF": str(root / "slurm.conf")}
    subprocess.run(["sbatch", "-p", "train", "-o", "/dev/null", str(script)], env=env, check=True, timeout=30)
    # Not forced: the job runs past the deadline, so the cluster stays, drained, whole.
    done = gpufleet_cli("cluster", "delete", "research", "--deadline", "3", "--json", env=lab.env(), timeout=120)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and result["outcome"] == "failed"
    assert "1 job(s) still running after 3s" in result["error"]
    assert alive(int((root / "worker.pid").read_text())) and free_nodes(kube(lab)) == 0
    # Forced: the job is cancelled (and said so); everything goes; the nodes are free again.
    done = gpufleet_cli(
        "cluster", "delete", "research", "--force", "--reason", "test over", "--json", env=lab.env(), timeout=180
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["outcome"] == "deleted" and result["cancelled_jobs"] == 1
    api = kube(lab)
    assert free_nodes(api) == 4 and holdings(api, "research") == {}
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "slurm-research"}}
    assert not api.object_exists(namespace)
    assert not root.exists() and not pids_with_env("SLURM_CONF", str(root / "slurm.conf"))
    assert not [line for line in _processes() if str(root / "login") in line]  # its login node too
    shown = json.loads(gpufleet_cli("cluster", "show", "research", "--json", env=lab.env()).stdout)
    assert shown["outcome"] == "deleted" and shown["login"] is None


def test_kept_on_failure_then_resumed_after_the_fix(lab: FleetLab, tmp_path: Path) -> None:
    told = lab.home / "smoke-fails"
    told.touch()
    done, result = create(lab, str(write(tmp_path, spec("kept"))), "--keep-on-failure")
    assert done.returncode == 1 and result["outcome"] == "failed_kept", done.stdout + done.stderr
    assert result["failed_step"] == "smoke_test" and "remove" in result["error"]
    root = lab.home / "clusters" / "kept"
    assert pids_with_env("SLURM_CONF", str(root / "slurm.conf")) or (root / "slurm.conf").exists()
    assert sorted(len(n) for n in holdings(kube(lab), "kept").values()) == [1, 1, 2]  # all kept
    told.unlink()  # the fix
    done, result = create(lab, "--resume", "kept")
    assert done.returncode == 0 and result["outcome"] == "ready", done.stdout + done.stderr
    shown = json.loads(gpufleet_cli("cluster", "show", "kept", "--json", env=lab.env()).stdout)
    events = [(e["step"], e["event"]) for e in shown["timeline"]]
    assert ("smoke_test", "resumed") in events and events.count(("bring_up", "done")) == 1  # not redone
    done = gpufleet_cli("cluster", "delete", "kept", "--force", "--reason", "test over", env=lab.env(), timeout=180)
    assert done.returncode == 0 and free_nodes(kube(lab)) == 4


def running_under(root: Path) -> list[str]:
    """Command lines of the processes that name ``root`` (the cluster's daemons, its database)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(root).encode() in arg for arg in argv):
            found.append(" ".join(a.decode(errors="replace") for a in argv))
    return found


@pytest.mark.skipif(bool(accounting_installed()), reason=accounting_installed() or "installed")
def test_accounting_puts_the_users_in_their_accounts_on_a_real_slurmdbd(lab: FleetLab, tmp_path: Path) -> None:
    done, result = create(lab, str(write(tmp_path, spec("ledger", accounting=True))))
    assert done.returncode == 0 and result["outcome"] == "ready", done.stdout + done.stderr
    root = lab.home / "clusters" / "ledger"
    env = {**lab.env(), "SLURM_CONF": str(root / "slurm.conf")}

    def sacctmgr(*args: str) -> list[str]:
        out = subprocess.run(["sacctmgr", "-n", "-P", *args], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return sorted(out.stdout.split())

    # Each user in its account, on this cluster; alice an administrator.
    assert "ledger|language|bob" in sacctmgr("show", "assoc", "cluster=ledger", "format=cluster,account,user")
    assert "ledger|vision|alice" in sacctmgr("show", "assoc", "cluster=ledger", "format=cluster,account,user")
    assert sacctmgr("show", "user", "alice,bob", "format=user,admin") == ["alice|Administrator", "bob|None"]

    # The smoke jobs are in the accounting database: slurmctld reports to this slurmdbd (as it
    # goes: a job's record may come a moment after the job).
    def smoke_jobs() -> list[str]:
        sacct = subprocess.run(
            ["sacct", "-n", "-P", "-X", "-a", "-S", "now-1hour", "-o", "jobname,partition,state"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return sorted(sacct.stdout.split())

    wanted = ["gpufleet-smoke|debug|COMPLETED", "gpufleet-smoke|train|COMPLETED"]
    wait_for(lambda: smoke_jobs() == wanted, timeout=60, what=f"sacct to list {wanted}")
    assert (root / "slurmdbd.conf").stat().st_mode & 0o077 == 0  # it holds the database password
    # A user added to the running cluster gets an association in a new account; removed, both go,
    # and the accounts still used stay.
    added = gpufleet_cli(
        "cluster",
        "users",
        "add",
        "ledger",
        "--user",
        "carol",
        "--uid",
        "20003",
        "--key",
        KEY,
        "--account",
        "audio",
        env=lab.env(),
        timeout=180,
    )
    assert added.returncode == 0, added.stdout + added.stderr
    assert "ledger|audio|carol" in sacctmgr("show", "assoc", "cluster=ledger", "format=cluster,account,user")
    removed = gpufleet_cli("cluster", "users", "remove", "ledger", "--user", "carol", env=lab.env(), timeout=180)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    accounts = sacctmgr("show", "assoc", "cluster=ledger", "format=account,user")
    assert not [line for line in accounts if "carol" in line or line.startswith("audio|")]
    assert "vision|alice" in accounts and "language|bob" in accounts
    done = gpufleet_cli("cluster", "delete", "ledger", "--json", env=lab.env(), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert free_nodes(kube(lab)) == 4 and not running_under(root)  # MariaDB and slurmdbd went too
    assert not pids_with_env("SLURM_CONF", str(root / "slurm.conf"))


@pytest.mark.skipif(bool(accounting_installed()), reason=accounting_installed() or "installed")
def test_a_failed_creation_with_accounting_leaves_no_database_running(lab: FleetLab, tmp_path: Path) -> None:
    told = lab.home / "smoke-fails"
    told.touch()
    try:
        done, result = create(lab, str(write(tmp_path, spec("ledger2", accounting=True))))
    finally:
        told.unlink()
    assert done.returncode == 1 and result["outcome"] == "rolled_back", done.stdout + done.stderr
    shown = json.loads(gpufleet_cli("cluster", "show", "ledger2", "--json", env=lab.env()).stdout)
    undone = {e["step"]: e["detail"] for e in shown["timeline"] if e["event"] == "undone"}
    assert "user bob" in undone["accounts_and_users"] and "account vision" in undone["accounts_and_users"]
    root = lab.home / "clusters" / "ledger2"
    assert free_nodes(kube(lab)) == 4 and not running_under(root) and not root.exists()
    assert not pids_with_env("SLURM_CONF", str(root / "slurm.conf"))
