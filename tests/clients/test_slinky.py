"""Slinky's objects made with the official client (CustomObjectsApi for slurm-operator's kinds)
against the emulated API: in order, once (a retry keeps each generated key), deleted in reverse;
`gpufleet cluster create --dry-run` prints them and contacts nothing."""

from __future__ import annotations

import base64
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from clients.clusters import StepFailed
from clients.kube import KubernetesApi
from clients.slinky import SlinkyBackend, create_all, delete_all
from models.cluster import load_spec
from models.slinky import API, GENERATED, slinky_objects
from tests.conftest import KubeApiProcess, gpufleet_cli, lab_seed
from tests.models.test_cluster_spec import EXAMPLE

PLACEMENT = {"train": ["free1", "free2"], "debug": ["free3"]}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    process = KubeApiProcess(tmp_path / "kube", lab_seed(["gpu1"], []))
    yield process
    process.stop()


def test_the_objects_are_made_once_and_deleted_in_reverse(api: KubeApiProcess) -> None:
    kube = KubernetesApi(kubeconfig=api.kubeconfig)
    spec = load_spec(yaml.safe_load(EXAMPLE.read_text()))
    objects = slinky_objects(spec, PLACEMENT)
    assert [o["kind"] for o in objects] == [
        "Namespace",
        "Secret",
        "Secret",
        "Secret",
        "Secret",
        "PersistentVolumeClaim",
        "ConfigMap",
        "Controller",
        "NodeSet",
        "NodeSet",
        "LoginSet",
        "RestApi",
    ]
    assert create_all(kube, objects, "run-1").startswith("created 12 object(s)")
    key = kube._api.read_namespaced_secret("research-slurm-key", "slurm-research").data["slurm.key"]
    assert len(base64.b64decode(base64.b64decode(key))) == 1024  # generated (base64 of 1024 bytes), stored base64
    assert create_all(kube, objects, "run-1") == "created 0 object(s) (all there already)"  # a retry
    assert kube._api.read_namespaced_secret("research-slurm-key", "slurm-research").data["slurm.key"] == key
    nodeset = kube._custom.get_namespaced_custom_object(
        API.split("/")[0], "v1beta1", "slurm-research", "nodesets", "research-train"
    )
    assert nodeset["spec"]["replicas"] == 2 and nodeset["spec"]["extraConf"] == "Gres=gpu:8"
    assert nodeset["spec"]["partition"]["config"].startswith("Default=YES MaxTime=2-00:00:00")
    assert SlinkyBackend(kube).exists(spec) == "Namespace slurm-research"
    if shutil.which("kubectl"):
        listed = subprocess.run(
            ["kubectl", "get", "nodesets", "-n", "slurm-research", "-o", "name"],
            env={"KUBECONFIG": str(api.kubeconfig), "PATH": "/usr/bin:/bin:/usr/local/bin"},
            capture_output=True,
            text=True,
            check=False,
        )
        assert listed.stdout.split() == [
            "nodeset.slinky.slurm.net/research-train",
            "nodeset.slinky.slurm.net/research-debug",
        ]
    # Another creation of the same name never adopts these, nor deletes them.
    with pytest.raises(StepFailed, match="Namespace/slurm-research exists and was not made by this creation"):
        create_all(kube, objects, "run-2")
    assert delete_all(kube, objects, "run-2").startswith("deleted 0 object(s) (none were there); left alone")
    assert delete_all(kube, objects, "run-1").startswith(
        "deleted 12 object(s): RestApi/research, LoginSet/research-login"
    )
    assert SlinkyBackend(kube).exists(spec) == ""
    assert delete_all(kube, objects, "run-1") == "deleted 0 object(s) (none were there)"


def test_the_dry_run_prints_every_object_and_contacts_nothing() -> None:
    # No Temporal and no Kubernetes here: an address nothing listens on.
    done = gpufleet_cli(
        "cluster", "create", str(EXAMPLE), "--backend", "slinky", "--dry-run", env={"TEMPORAL_ADDRESS": "127.0.0.1:9"}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# gpufleet cluster create --dry-run: research on slinky")
    documents = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in documents][-5:] == ["Controller", "NodeSet", "NodeSet", "LoginSet", "RestApi"]
    controller = next(d for d in documents if d["kind"] == "Controller")
    assert "JobRequeue=1" in controller["spec"]["extraConf"] and "KillWait=120" in controller["spec"]["extraConf"]
    assert all(
        v == GENERATED
        for d in documents
        if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-key")
        for v in d["stringData"].values()
    )


def test_accounting_on_slinky_reads_its_database_password_from_a_secret_and_never_shows_it(
    api: KubeApiProcess,
) -> None:
    kube = KubernetesApi(kubeconfig=api.kubeconfig)
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["accounting"] = True
    assert "needs the database" in SlinkyBackend(kube).unsupported(load_spec(raw))  # no database: refused
    raw["accounting_storage"] = {
        "host": "mariadb.db.svc",
        "password_secret": {"namespace": "db", "name": "slurm-db", "key": "password"},
    }
    spec = load_spec(raw)
    # The dry run shows where the password comes from, not the password.
    objects = slinky_objects(spec, PLACEMENT)
    secret = next(o for o in objects if o["metadata"]["name"] == "research-db-password")
    assert secret["stringData"] == {"password": "<copied from Secret db/slurm-db, key password, when first created>"}
    accounting = next(o for o in objects if o["kind"] == "Accounting")
    assert accounting["spec"]["storageConfig"] == {
        "host": "mariadb.db.svc",
        "port": 3306,
        "database": "slurm_acct_db",
        "username": "slurm",
        "passwordKeyRef": {"name": "research-db-password", "key": "password"},
    }
    # Its source missing, or not labelled for copying: refused at validate, and the step fails
    # naming it, saying nothing of any value.
    assert SlinkyBackend(kube).unsupported(spec) == "no Secret db/slurm-db (the database password to copy)"
    with pytest.raises(StepFailed, match="no Secret db/slurm-db"):
        SlinkyBackend(kube).create_objects(spec, PLACEMENT, "", "run-1")
    kube.create_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "db"}})
    source = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "slurm-db", "namespace": "db"},
        "stringData": {"password": "s3cret-db"},
    }
    kube.create_object(source)
    assert "not labelled gpufleet.io/copy-to-clusters=true" in SlinkyBackend(kube).unsupported(spec)
    kube._api.patch_namespaced_secret(
        "slurm-db", "db", {"metadata": {"labels": {"gpufleet.io/copy-to-clusters": "true"}}}
    )
    assert SlinkyBackend(kube).unsupported(spec) == ""
    SlinkyBackend(kube).create_objects(spec, PLACEMENT, "", "run-1")  # a retry after the fix
    assert kube.secret_data("slurm-research", "research-db-password") == {"password": b"s3cret-db"}
    # Once its objects are gone (a deletion run again), removing accounts has nothing to ask.
    SlinkyBackend(kube).delete_objects(spec, "run-1")
    assert "slurmrestd is gone" in SlinkyBackend(kube).remove_users(spec)


def test_a_running_clusters_logins_become_the_new_specs(api: KubeApiProcess) -> None:
    """set_logins rewrites the user database Secret the login node reads: a user gone has no
    passwd line and no keys left; the Secret stays the creation's; done twice, the same."""
    kube = KubernetesApi(kubeconfig=api.kubeconfig)
    spec = load_spec(yaml.safe_load(EXAMPLE.read_text()))
    backend = SlinkyBackend(kube)
    with pytest.raises(StepFailed, match="no Secret slurm-research/research-users"):
        backend.set_logins(spec)  # nothing made yet: never created here
    backend.create_objects(spec, PLACEMENT, "", "run-1")
    assert "authorized_keys.bob" in (kube.secret_data("slurm-research", "research-users") or {})
    without_bob = spec.model_copy(update={"users": [u for u in spec.users if u.name != "bob"]})
    assert backend.set_logins(without_bob) == "Secret research-users: 1 user(s) can log in (alice)"
    data = kube.secret_data("slurm-research", "research-users") or {}
    assert sorted(data) == ["authorized_keys.alice", "group", "passwd"]
    assert b"bob" not in data["passwd"] and data["passwd"].startswith(b"alice:x:")
    secret = next(o for o in slinky_objects(spec, PLACEMENT) if o["metadata"]["name"] == "research-users")
    assert (kube.object_annotations(secret) or {}).get("gpufleet.io/creation") == "run-1"
    assert backend.set_logins(without_bob) == "Secret research-users: 1 user(s) can log in (alice)"  # again
    backend.set_logins(spec)  # undone: bob may log in again
    assert "authorized_keys.bob" in (kube.secret_data("slurm-research", "research-users") or {})


def test_the_login_is_the_address_of_the_loginsets_service_waited_for(api: KubeApiProcess) -> None:
    kube = KubernetesApi(kubeconfig=api.kubeconfig)
    spec = load_spec(yaml.safe_load(EXAMPLE.read_text()))
    backend = SlinkyBackend(kube, poll_seconds=0.05)
    with pytest.raises(StepFailed, match=r"no Service slurm-research/research-login with an address after 0\.2s"):
        backend.login_address(spec, timeout=0.2)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "slurm-research"}}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "research-login", "namespace": "slurm-research"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.0.0.7", "ports": [{"name": "login", "port": 22}]},
    }
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.post("/api/v1/namespaces", json=namespace)
        http.post("/api/v1/namespaces/slurm-research/services", json=service).raise_for_status()
    assert backend.login_address(spec, timeout=5) == "10.0.0.7:22"  # no load balancer address yet
    # The load balancer's address once it has one.
    service["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}
    with httpx.Client(base_url=api.url, timeout=10) as http:
        http.delete("/api/v1/namespaces/slurm-research/services/research-login").raise_for_status()
        http.post("/api/v1/namespaces/slurm-research/services", json=service).raise_for_status()
    assert backend.login_address(spec, timeout=5) == "192.0.2.10:22"
