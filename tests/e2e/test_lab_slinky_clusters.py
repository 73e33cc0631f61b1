"""Slurm clusters created into the Slinky lab, from the command line: `gpufleet cluster create
examples/cluster.yaml --backend slinky` applies its objects to the emulated API (checked against
Slinky's CRDs), the operator stand-in brings the cluster up from them (slurmctld, slurmrestd and
its Service, one slurmd -Z per NodeSet pod on the reserved nodes, Slurm 26.05), the smoke jobs run
as the spec's first user, who exists only in the cluster's user database; with accounting, the
cluster's own slurmdbd and MariaDB run for its Accounting (one added later too) and each account
and user is added through the cluster's slurmrestd; they outlive slurmctld killed and brought
back. `cluster delete` takes it all down and gives the nodes back. A worker killed during
bring-up leaves a creation that ends once a worker is back; a creation kept on failure and rolled
back leaves nothing. alice logs in to the cluster's login node (its LoginSet's Service) with a key
of her own over ssh, runs sinfo and a job writing into the cluster's storage; another key is
refused. One lab for the module."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from clients.kube import KubernetesApi
from clients.pool import free_nodes, holdings
from clients.slurmrest import SlurmRestClient, SlurmRestError
from lab.fleet import FleetLab
from lab.login import login_unavailable
from lab.procs import alive, wait_for
from lab.slurmroots import root_unavailable
from models.cluster import ClusterSpec
from models.slinky import slinky_objects
from tests.conftest import REPO, gpufleet_cli
from tests.e2e.logins import make_key, ssh

RELEASE = "26.05"
NAME = "research"
NS = f"slurm-{NAME}"
SLINKY = "/apis/slinky.slurm.net/v1beta1"
# A spec with accounting names the database password Secret `lab up --flavor slinky` seeds.
STORAGE = {"host": "mariadb.db.svc", "password_secret": {"namespace": "gpufleet", "name": "lab-db", "key": "password"}}
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slurm,
    pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or ""),
]


@pytest.fixture(scope="module")
def lab() -> Iterator[FleetLab]:
    # The cluster's users run their jobs from its spool: its folders must be reachable by them,
    # which pytest's private temporary folders are not. And short: a job step's socket in the
    # spool (<home>/clusters/<name>/spool/<pod>/<pod>_<job>.<step>) must fit in 108 bytes.
    home = Path(tempfile.mkdtemp(prefix="gf-slk-", dir="/tmp"))
    home.chmod(0o755)
    env = {"GPUFLEET_HOME": str(home)}
    try:
        up = gpufleet_cli("lab", "up", "--flavor", "slinky", env=env, unset=("TEMPORAL_ADDRESS",), timeout=300)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        yield FleetLab(home)
    finally:
        gpufleet_cli("lab", "down", env=env, unset=("TEMPORAL_ADDRESS",), timeout=120)
        shutil.rmtree(home, ignore_errors=True)


def cli(lab: FleetLab, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = gpufleet_cli(*args, "--json", env=lab.env(), timeout=timeout)
    lines = done.stdout.strip().splitlines()
    return done, json.loads(lines[-1]) if lines else {}


def show(lab: FleetLab, name: str) -> dict[str, Any]:
    done = gpufleet_cli("cluster", "show", name, "--json", env=lab.env())
    assert done.returncode == 0, done.stderr
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown


def api(lab: FleetLab) -> httpx.Client:
    return httpx.Client(base_url=lab.state()["services"]["kubeapi"]["url"], timeout=10)


def kube(lab: FleetLab) -> KubernetesApi:
    return KubernetesApi(kubeconfig=lab.home / "kubeconfig")


def items(lab: FleetLab, path: str) -> list[dict[str, Any]]:
    with api(lab) as http:
        found: list[dict[str, Any]] = http.get(path).raise_for_status().json()["items"]
    return found


def cluster_pids(lab: FleetLab, name: str) -> list[int]:
    """Every live process the cluster's folder records (slurmctld, each slurmd, slurmrestd, and
    slurmdbd and MariaDB while it has accounting)."""
    pids: dict[str, int] = json.loads((lab.home / "clusters" / name / "pids.json").read_text())
    return [pid for pid in pids.values() if alive(pid)]


def assert_all_gone(lab: FleetLab, name: str, pids: list[int]) -> None:
    """No process of the cluster, no pod, Service or object of it left, its nodes free again."""
    namespace = f"slurm-{name}"
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=60, what=f"{name}'s processes to stop")
    wait_for(lambda: not items(lab, f"/api/v1/namespaces/{namespace}/pods"), timeout=60, what=f"{name}'s pods to go")
    assert not (lab.home / "clusters" / name).exists()
    for path in (
        f"/api/v1/namespaces/{namespace}/services",
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
        f"{SLINKY}/namespaces/{namespace}/controllers",
        f"{SLINKY}/namespaces/{namespace}/nodesets",
        f"{SLINKY}/namespaces/{namespace}/restapis",
    ):
        assert items(lab, path) == [], path
    assert free_nodes(kube(lab)) == 4 and holdings(kube(lab), name) == {}
    assert login_processes(lab.home / "clusters" / name) == []


def login_processes(folder: Path) -> list[int]:
    """The cluster's sshd and its sessions' processes (its login folder on their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{folder.resolve()}/login/".encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def slurm(lab: FleetLab, name: str, *argv: str) -> str:
    """A Slurm command on the cluster, through its release's wrappers."""
    root = lab.home / "clusters" / name
    done = subprocess.run(
        [str(root / "bin" / argv[0]), *argv[1:]],
        env={**os.environ, "SLURM_CONF": str(root / "slurm.conf")},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout


def spec_file(tmp: Path, name: str, **changes: Any) -> Path:
    raw = yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text())
    raw["name"] = name
    raw.update(changes)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def accounting_processes(folder: Path) -> list[int]:
    """Each slurmdbd or mariadbd of the cluster whose folder is ``folder`` (its slurm.conf in
    slurmdbd's environment, its folder on mariadbd's command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm == "slurmdbd":
                ours = f"SLURM_CONF={folder}/slurm.conf".encode() in (entry / "environ").read_bytes().split(b"\0")
            else:
                ours = comm == "mariadbd" and str(folder).encode() in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ours:
            found.append(int(entry.name))
    return found


def test_the_example_becomes_a_slinky_cluster_and_its_deletion_leaves_nothing(lab: FleetLab, tmp_path: Path) -> None:
    # The example, alice's key one this test holds.
    key, public = make_key(tmp_path / "alice")
    raw = yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text())
    raw["users"][0]["ssh_keys"] = [public]
    done, result = cli(
        lab, "cluster", "create", str(spec_file(tmp_path, NAME, users=raw["users"])), "--backend", "slinky", "--wait"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert result["outcome"] == "ready" and result["backend"] == "slinky"
    assert result["partitions"] == [{"name": "train", "nodes": 2}, {"name": "debug", "nodes": 1}]

    # Its Slurm: 26.05, a partition per NodeSet (named after it) with its nodes idle.
    sinfo = slurm(lab, NAME, "sinfo", "-h", "-o", "%R %D %t")
    assert sorted(sinfo.splitlines()) == ["research-debug 1 idle", "research-train 2 idle"]
    assert slurm(lab, NAME, "scontrol", "--version").split()[1].startswith(RELEASE + ".")
    # Each NodeSet pod runs on a node reserved for its partition.
    nodes = {n["metadata"]["name"]: n["metadata"]["labels"] for n in items(lab, "/api/v1/nodes")}
    pods = items(lab, f"/api/v1/namespaces/{NS}/pods")
    assert sorted(p["metadata"]["name"] for p in pods) == ["research-debug-0", "research-train-0", "research-train-1"]
    for pod in pods:
        labels = nodes[pod["spec"]["nodeName"]]
        partition = pod["metadata"]["name"].split("-")[1]
        assert labels["gpufleet.io/cluster"] == NAME and labels["gpufleet.io/partition"] == partition, pod
        assert pod["status"]["phase"] == "Running"
    assert len({p["spec"]["nodeName"] for p in pods}) == 3

    logs_in(lab, tmp_path, key)

    # The smoke jobs ran as alice (uid 20001), whom only the cluster's user database knows.
    timeline = show(lab, NAME)["timeline"]
    smoke = next(e["detail"] for e in timeline if e["step"] == "smoke_test" and e["event"] == "done")
    assert "train: job" in smoke and "debug: job" in smoke and smoke.count("as alice COMPLETED") == 2
    jobs = [int(word) for word in smoke.replace(";", " ").split() if word.isdigit()]
    for job in jobs:
        assert "UserId=alice(20001)" in slurm(lab, NAME, "scontrol", "show", "job", str(job))
    # And a job through the cluster's slurmrestd (at its Service's address) runs as that uid.
    with api(lab) as http:
        service = http.get(f"/api/v1/namespaces/{NS}/services/{NAME}-restapi").raise_for_status().json()
        secret = http.get(f"/api/v1/namespaces/{NS}/secrets/{NAME}-jwt-key").raise_for_status().json()
    url = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    out = Path(tempfile.mkdtemp(prefix="gpufleet-whoami-"))
    out.chmod(0o777)
    try:
        client = SlurmRestClient(url, base64.b64decode(secret["data"]["jwt_hs256.key"]))
        client.detect_version()
        job = client.submit(
            "#!/bin/sh\nid -u\n", user="alice", partition="research-debug", name="whoami", output=str(out / "id")
        )
        assert client.wait_job(job, user="alice", timeout=60) == "COMPLETED"
        assert (out / "id").read_text().strip() == "20001" and (out / "id").stat().st_uid == 20001
    finally:
        shutil.rmtree(out, ignore_errors=True)

    # An Accounting that appears once the cluster runs: its slurmdbd and MariaDB start, and the
    # cluster's slurmrestd, started again at the same address, serves the accounting API.
    folder = (lab.home / "clusters" / NAME).resolve()
    raw = {**yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text()), "accounting": True}
    rendered = slinky_objects(ClusterSpec.model_validate({**raw, "accounting_storage": STORAGE}), {})
    accounting = next(o for o in rendered if o["kind"] == "Accounting")
    with api(lab) as http:
        http.post(f"{SLINKY}/namespaces/{NS}/accountings", json=accounting).raise_for_status()
        http.patch(
            f"{SLINKY}/namespaces/{NS}/controllers/{NAME}",
            content=json.dumps({"spec": {"accountingRef": {"name": NAME}}}),
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()

    def associations() -> set[tuple[str, str]] | None:
        try:
            return client.associations(NAME)
        except SlurmRestError:
            return None

    found = wait_for(associations, timeout=60, what="the cluster's slurmrestd to serve its accounting")
    assert ("root", "") in found and len(accounting_processes(folder)) == 2
    # Its deletion stops them and keeps the database (Slinky's is external and outlives it);
    # slurmrestd serves Slurm without it.
    with api(lab) as http:
        http.delete(f"{SLINKY}/namespaces/{NS}/accountings/{NAME}").raise_for_status()
    wait_for(lambda: not accounting_processes(folder), timeout=60, what="the cluster's slurmdbd and MariaDB to stop")
    assert (folder / "db" / "data").is_dir() and (folder / "slurmdbd.conf").exists()
    wait_for(lambda: associations() is None and client.ping(), timeout=30, what="slurmrestd without accounting")
    client.close()

    pids = cluster_pids(lab, NAME)
    assert len(pids) == 5  # slurmctld, three slurmd, slurmrestd
    done, result = cli(lab, "cluster", "delete", NAME, "--wait")
    assert done.returncode == 0 and result["outcome"] == "deleted", done.stdout[-3000:] + done.stderr[-3000:]
    assert_all_gone(lab, NAME, pids)


def logs_in(lab: FleetLab, tmp_path: Path, key: Path) -> None:
    """alice logs in at the address gpufleet reported, her LoginSet's Service: sinfo, and a job
    writing into the cluster's storage (the example's /shared), read back there and on the host;
    bob's place is not hers, and a key the spec does not name is refused."""
    if problem := login_unavailable():
        print(f"no login node to log in to: {problem}")
        return
    with api(lab) as http:
        service = http.get(f"/api/v1/namespaces/{NS}/services/{NAME}-login").raise_for_status().json()
    address = f"{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    assert service["spec"]["type"] == "LoadBalancer"
    # What gpufleet reported at bring-up (SlinkyBackend.login_address, through the Service).
    shown = show(lab, NAME)
    assert shown["login"] == address and shown["ssh"]["alice"] == f"ssh -p {address.rpartition(':')[2]} alice@127.0.0.1"
    job = "printf '#!/bin/sh\\nid -un > /shared/from-login\\n' > job.sh && sbatch --wait -o job.out job.sh"
    done = ssh(address, "alice", key, f"sinfo -h -o '%R %D' && {job} && cat /shared/from-login", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split("\n")
    assert sorted(lines[:2]) == ["research-debug 1", "research-train 2"] and done.stdout.endswith("alice\n")
    stored = lab.home / "clusters" / NAME / "storage" / "from-login"
    assert stored.read_text() == "alice\n" and stored.stat().st_uid == 20001
    other, _ = make_key(tmp_path / "mallory")
    refused = ssh(address, "alice", other, "true", timeout=60)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr
    assert ssh(address, "root", key, "true", timeout=60).returncode == 255
    # Her keys changed on the running cluster: the user database Secret is rewritten, and the
    # login node takes the new key, and only it, as the operator reads the Secret again.
    new_key, new_public = make_key(tmp_path / "alice-new")
    done, result = cli(lab, "cluster", "users", "set-keys", NAME, "--user", "alice", "--key", new_public)
    assert done.returncode == 0 and result["outcome"] == "done", done.stdout[-2000:] + done.stderr[-2000:]
    wait_for(
        lambda: ssh(address, "alice", new_key, "id -un", timeout=60).stdout == "alice\n",
        timeout=60,
        what="alice's new key to let her in",
    )
    assert ssh(address, "alice", key, "true", timeout=60).returncode == 255


def test_a_cluster_with_accounting_gets_its_accounts_and_users_and_its_deletion_removes_them(
    lab: FleetLab, tmp_path: Path
) -> None:
    name = "ledger"
    path = spec_file(tmp_path, name, accounting=True, accounting_storage=STORAGE)
    done, result = cli(lab, "cluster", "create", str(path), "--backend", "slinky", "--wait")
    assert done.returncode == 0 and result["outcome"] == "ready", done.stdout[-3000:] + done.stderr[-3000:]
    folder = (lab.home / "clusters" / name).resolve()
    assert len(accounting_processes(folder)) == 2

    # "Accounts and users" added each account and each user in it through the cluster's
    # slurmrestd, which serves the accounting API of the cluster's own slurmdbd...
    timeline = show(lab, name)["timeline"]
    users = next(e["detail"] for e in timeline if e["step"] == "accounts_and_users" and e["event"] == "done")
    for added in ("account language", "account vision", "user alice in vision", "user bob in language"):
        assert added in users, users
    wanted = {("language", ""), ("vision", ""), ("vision", "alice"), ("language", "bob")}
    with api(lab) as http:
        service = http.get(f"/api/v1/namespaces/slurm-{name}/services/{name}-restapi").raise_for_status().json()
        secret = http.get(f"/api/v1/namespaces/slurm-{name}/secrets/{name}-jwt-key").raise_for_status().json()
    url = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    client = SlurmRestClient(url, base64.b64decode(secret["data"]["jwt_hs256.key"]))
    client.detect_version()
    assert wanted <= client.associations(name), client.associations(name)
    client.close()
    # ...and sacctmgr on the cluster sees them; the smoke jobs ran as alice.
    shown = slurm(lab, name, "sacctmgr", "-n", "-P", "show", "assoc", "format=cluster,account,user")
    assert {f"{name}|{account}|{user}" for account, user in wanted} <= set(shown.split()), shown
    smoke = next(e["detail"] for e in timeline if e["step"] == "smoke_test" and e["event"] == "done")
    assert smoke.count("as alice COMPLETED") == 2, smoke

    # slurmctld killed: the operator starts the cluster's Slurm again, and its database with it,
    # the accounts and users still there.
    slurmctld = json.loads((folder / "pids.json").read_text())["slurmctld"]
    os.kill(slurmctld, signal.SIGKILL)

    def back_with_associations() -> bool:
        try:
            pids = json.loads((folder / "pids.json").read_text())
            shown = slurm(lab, name, "sacctmgr", "-n", "-P", "show", "assoc", "format=cluster,account,user")
            nodes = slurm(lab, name, "sinfo", "-h", "-o", "%t %D")
        except (OSError, ValueError, subprocess.SubprocessError):
            return False  # its Slurm is being started again
        return (
            pids.get("slurmctld") not in (None, slurmctld)
            and len(pids) == 7
            and all(alive(pid) for pid in pids.values())
            and {f"{name}|{account}|{user}" for account, user in wanted} <= set(shown.split())
            and nodes.split() == ["idle", "3"]
        )

    wait_for(back_with_associations, timeout=120, what=f"{name}'s Slurm back with its accounts and users")

    pids = cluster_pids(lab, name)
    assert len(pids) == 7  # slurmctld, three slurmd, slurmrestd, slurmdbd, MariaDB
    # Its deletion removes the cluster's associations, then its slurmdbd and database go.
    done = gpufleet_cli("cluster", "delete", name, "--wait", env=lab.env(), timeout=300)
    assert done.returncode == 0 and f"cluster {name} is deleted" in done.stdout, done.stdout[-3000:] + done.stderr
    said = " ".join(done.stdout.split())  # as the console wrapped it
    removed = said[said.index("remove_accounts done") :][:400]
    for gone in ("user alice from vision", "user bob from language", "account language", "account vision"):
        assert gone in removed, removed
    assert_all_gone(lab, name, pids)
    assert accounting_processes(folder) == []


def test_a_worker_killed_during_bring_up_leaves_a_creation_that_ends_once_a_worker_is_back(
    lab: FleetLab, tmp_path: Path
) -> None:
    operator = lab.state()["services"]["operator"]["pid"]
    os.kill(operator, signal.SIGSTOP)  # bring-up waits for the operator: the worker is killed there
    try:
        started = gpufleet_cli(
            "cluster", "create", str(spec_file(tmp_path, "phoenix")), "--backend", "slinky", "--no-wait",
            env=lab.env(),
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        wait_for(
            lambda: any(e["step"] == "bring_up" for e in show(lab, "phoenix")["timeline"]),
            timeout=60,
            what="the creation to reach bring-up",
        )
        worker = lab.state()["services"]["worker"]["pid"]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not alive(worker), timeout=10, what="the worker to die")
    finally:
        os.kill(operator, signal.SIGCONT)
    lab.up(keep_slurm=True)  # a worker again
    assert lab.state()["services"]["worker"]["pid"] != worker
    shown = wait_for(
        lambda: (s := show(lab, "phoenix"))["outcome"] != "creating" and s, timeout=150, what="the creation to end"
    )
    assert shown["outcome"] == "ready", shown
    events = [(e["step"], e["event"]) for e in shown["timeline"]]
    assert events.count(("bring_up", "done")) == 1 and ("smoke_test", "done") in events
    pids = cluster_pids(lab, "phoenix")
    done, result = cli(lab, "cluster", "delete", "phoenix", "--wait")
    assert done.returncode == 0 and result["outcome"] == "deleted", done.stdout[-3000:] + done.stderr[-3000:]
    assert_all_gone(lab, "phoenix", pids)


def test_a_creation_kept_on_failure_then_rolled_back_leaves_nothing(lab: FleetLab, tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text())
    debug = raw["partitions"][1]
    debug["options"] = {**debug.get("options", {}), "AllowGroups": "bob"}  # alice may not use it...
    # ...and a job she submits there is refused at once rather than left pending.
    path = spec_file(tmp_path, "kept", partitions=raw["partitions"], slurm_conf=["EnforcePartLimits=ALL"])
    done, result = cli(lab, "cluster", "create", str(path), "--backend", "slinky", "--keep-on-failure")
    assert done.returncode == 1 and result["outcome"] == "failed_kept", done.stdout[-3000:] + done.stderr[-3000:]
    assert result["failed_step"] == "smoke_test" and "partition debug" in result["error"], result
    assert "PENDING" not in result["error"], result
    pids = cluster_pids(lab, "kept")
    assert all(alive(pid) for pid in pids) and len(items(lab, "/api/v1/namespaces/slurm-kept/pods")) == 3  # kept
    done, result = cli(lab, "cluster", "create", "--roll-back", "kept")
    assert result["outcome"] == "rolled_back", done.stdout[-3000:] + done.stderr[-3000:]
    assert_all_gone(lab, "kept", pids)
