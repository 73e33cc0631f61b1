"""What the operator stand-in makes of a Slinky cluster's objects (lab/slinkyclusters.py), the
slurm.conf lines of a dynamic cluster (lab/dynamic.py), where lab/inroot.py finds a cluster's
users, and GPUFLEET_SLINKY_RESTAPI_URL: each on its own, without Slurm."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import ValidationError

from lab.dynamic import DynamicSlurmLab, overridden, partition_line
from lab.inroot import _cluster_etc
from lab.kubeapi import training_node
from lab.operator import Operator, schedulable
from lab.slinkyclusters import (
    ClusterObjects,
    SlinkyCluster,
    accounts_in,
    extra_conf,
    group_objects,
    groups_in,
    jwt_ref,
    key_of,
    left_out,
    login_service,
    login_users_secret,
    partition_configs,
    restapi_service,
    secret_texts,
    secret_value,
    storage_mount_path,
    too_deep,
)
from lab.slinkylab import DB_SECRET, db_secret_objects
from models.cluster import load_spec
from models.settings import Settings
from models.slinky import COPY_LABEL, slinky_objects
from tests.models.test_cluster_spec import EXAMPLE


def example_objects() -> list[dict[str, Any]]:
    spec = load_spec(yaml.safe_load(EXAMPLE.read_text()))
    return slinky_objects(spec, {"train": ["free1", "free2"], "debug": ["free3"]})


def of(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_each_controller_is_grouped_with_its_nodesets_and_restapi() -> None:
    objects = example_objects()
    other = {"apiVersion": "x", "kind": "NodeSet", "metadata": {"name": "stray", "namespace": "slurm-research"}}
    other["spec"] = {"controllerRef": {"name": "elsewhere"}}
    groups = group_objects(of(objects, "Controller"), [*of(objects, "NodeSet"), other], of(objects, "RestApi"), [])
    assert list(groups) == ["slurm-research/research"]
    group = groups["slurm-research/research"]
    assert group.nodeset_names == ["research-debug", "research-train"]  # not the stray one
    assert [r["metadata"]["name"] for r in group.restapis] == ["research"] and group.accountings == []


def test_the_slurm_conf_of_a_cluster_comes_from_its_controller_and_nodesets() -> None:
    objects = example_objects()
    controller, nodesets = of(objects, "Controller")[0], of(objects, "NodeSet")
    assert extra_conf(controller) == [
        "JobRequeue=1",
        "KillWait=120",
        "GresTypes=gpu",
        "SchedulerParameters=bf_continue",
    ]
    configs = partition_configs(nodesets)
    assert configs == {
        "research-train": "Default=YES MaxTime=2-00:00:00",
        "research-debug": "Default=NO MaxTime=1:00:00 OverSubscribe=NO PriorityTier=2",
    }
    assert partition_line("research-debug", configs["research-debug"], default=False) == (
        "PartitionName=research-debug Nodes=research-debug Default=NO MaxTime=1:00:00 OverSubscribe=NO "
        "PriorityTier=2 State=UP"
    )
    # Without a config: the lab's options, the first NodeSet the default.
    assert partition_line("lab-train", "", default=True) == (
        "PartitionName=lab-train Nodes=lab-train Default=YES MaxTime=UNLIMITED State=UP"
    )
    # The GPUs a NodeSet asks for are said, not configured: the lab has none.
    assert left_out(nodesets) == [
        f"# NodeSet {name}: extraConf 'Gres=gpu:8' left out (the lab's nodes have no GPUs)"
        for name in ("research-train", "research-debug")
    ]


def test_a_key_of_the_controllers_extra_conf_replaces_the_labs() -> None:
    base = ["ClusterName=x", "KillWait=5", "SchedulerParameters=sched_interval=1", "SlurmUser=root"]
    extra = ["killwait=120", "SchedulerParameters=bf_continue", "NodeSet=a Feature=a"]
    assert overridden(base, extra) == ["ClusterName=x", "SlurmUser=root"]


def test_the_clusters_accounts_are_the_user_databases_users_with_their_keys() -> None:
    objects = example_objects()
    secret = next(o for o in objects if o["metadata"]["name"] == "research-users")
    users = secret_texts(secret)
    accounts = accounts_in(users)
    assert [(a.name, a.uid) for a in accounts] == [("alice", 20001), ("bob", 20002)]
    assert accounts[0].keys and all(key.startswith("ssh-ed25519 ") for a in accounts for key in a.keys)
    assert groups_in(users) == ["slurm-admins:x:20000:alice"]  # alice is the example's admin
    # What gpufleet could not have written is left out: a system name or ID, a bad key.
    users["passwd"] += "root:x:20003:20003::/root:/bin/bash\neve:x:0:0::/:/bin/sh\nmal:x:20004:20004::/:/bin/sh\n"
    users["authorized_keys.mal"] = 'command="/bin/sh" ssh-ed25519 AAAA mal\n'
    assert [(a.name, a.keys) for a in accounts_in(users)][2:] == [("mal", ())]


def test_the_storage_is_where_the_nodesets_slurmd_mount_their_claim() -> None:
    nodesets = of(example_objects(), "NodeSet")
    assert storage_mount_path(nodesets) == "/shared"  # the example's mount_path
    for nodeset in nodesets:
        nodeset["spec"]["slurmd"]["volumeMounts"] = [{"name": "shared", "mountPath": "/data/team"}]
    assert storage_mount_path(nodesets) == "/data/team"
    assert storage_mount_path([]) == "/shared"
    for nodeset in nodesets:
        nodeset["spec"]["slurmd"]["volumeMounts"] = [{"name": "shared", "mountPath": "/etc"}]
    with pytest.raises(ValidationError, match="system folder"):
        storage_mount_path(nodesets)


def test_the_login_service_is_named_after_its_loginset_with_the_labs_address() -> None:
    loginset = of(example_objects(), "LoginSet")[0]
    loginset["metadata"]["namespace"] = "slurm-research"
    assert login_users_secret(loginset) == "research-users"
    service = login_service(loginset, 2222)
    assert service["metadata"]["name"] == "research-login" and service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["clusterIP"] == "127.0.0.1" and service["spec"]["ports"][0]["port"] == 2222
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == "login"


def test_a_cluster_folder_too_deep_for_slurmds_step_sockets_is_refused_by_name() -> None:
    assert too_deep(Path("/tmp/gf-slk-abcdefgh/clusters/research"), ["research-train", "research-debug"]) == ""
    deep = Path("/tmp/gpufleet-slinky-clusters-hvp2mdre/clusters/research")
    said = too_deep(deep, ["research-train"])
    assert said.startswith(f"{deep} is too deep") and "use a shorter GPUFLEET_HOME" in said


def test_the_jwt_key_is_read_where_the_controller_says() -> None:
    controller = of(example_objects(), "Controller")[0]
    assert jwt_ref(controller) == ("research-jwt-key", "jwt_hs256.key")
    key = b"k" * 40
    assert secret_value({"data": {"jwt_hs256.key": base64.b64encode(key).decode()}}, "jwt_hs256.key") == key
    assert secret_value({"stringData": {"passwd": "alice:x"}}, "passwd") == b"alice:x"
    assert secret_value({"data": {}}, "jwt_hs256.key") is None


def test_the_restapi_service_is_the_operators_with_the_labs_address() -> None:
    restapi = of(example_objects(), "RestApi")[0]
    service = restapi_service(restapi, 41234)
    assert service["metadata"]["name"] == "research-restapi" and service["metadata"]["namespace"] == "slurm-research"
    assert service["spec"]["clusterIP"] == "127.0.0.1" and service["spec"]["ports"][0]["port"] == 41234
    assert service["metadata"]["ownerReferences"][0]["kind"] == "RestApi"


def test_inroot_binds_a_clusters_users_only_where_its_folder_has_them(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    assert _cluster_etc(str(conf)) == []  # the lab's own cluster, a lab-backend one
    (tmp_path / "etc").mkdir()
    for name in ("passwd", "group"):
        (tmp_path / "etc" / name).write_text("alice:x:20001:\n")
    assert _cluster_etc(str(conf)) == [
        (str(tmp_path / "etc" / "passwd"), "/etc/passwd"),
        (str(tmp_path / "etc" / "group"), "/etc/group"),
    ]
    assert _cluster_etc("slurm.conf") == [] and _cluster_etc(None) == []


def test_the_restapi_url_setting_takes_a_template_or_service() -> None:
    assert Settings(slinky_restapi_url="service").slinky_restapi_url == "service"
    assert Settings(slinky_restapi_url="http://{name}-restapi:6820").slinky_restapi_url.startswith("http://")
    with pytest.raises(ValidationError, match="or service"):
        Settings(slinky_restapi_url="services")


def test_a_created_clusters_pods_may_go_to_a_node_the_pool_gave_to_training() -> None:
    """The shared pool taints its training nodes (gpufleet.io/pool=training:NoSchedule) to keep
    inference pods off: a created cluster's NodeSet pods must still be placed there."""
    node = training_node("free1")
    node["metadata"]["labels"].update({"gpufleet.io/cluster": "research", "gpufleet.io/partition": "train"})
    for nodeset in of(example_objects(), "NodeSet"):
        pod_spec = nodeset["spec"]["template"]["spec"]
        wanted = pod_spec["nodeSelector"]["gpufleet.io/partition"]
        assert schedulable(node, pod_spec) == (wanted == "train"), nodeset["metadata"]["name"]
    inference_pod = {"nodeSelector": {}}
    assert not schedulable(node, inference_pod)  # the taint still keeps others off


def test_the_labs_database_password_secret_is_one_a_spec_with_accounting_may_name() -> None:
    namespace, name, key = DB_SECRET
    made = db_secret_objects()
    assert [o["kind"] for o in made] == ["Namespace", "Secret"] and made[0]["metadata"]["name"] == namespace
    secret = made[1]
    assert (secret["metadata"]["namespace"], secret["metadata"]["name"]) == (namespace, name)
    assert secret["metadata"]["labels"] == {COPY_LABEL: "true"} and len(secret_value(secret, key) or b"") == 32
    raw = yaml.safe_load(EXAMPLE.read_text())
    storage = {"host": "mariadb.db.svc", "password_secret": {"namespace": namespace, "name": name, "key": key}}
    spec = load_spec({**raw, "accounting": True, "accounting_storage": storage})
    accounting = of(slinky_objects(spec, {}), "Accounting")[0]
    assert accounting["spec"]["storageConfig"]["passwordKeyRef"] == {"name": "research-db-password", "key": "password"}


def _cluster_folder(folder: Path) -> None:
    """What a stopped Slinky cluster's folder holds (no daemon runs): its database among it."""
    for name in ("db/data", "state", "spool/research-train-0", "etc", "log"):
        (folder / name).mkdir(parents=True)
    (folder / "db" / "installed").touch()
    (folder / "db" / "data" / "ibdata1").write_bytes(b"accounts")
    (folder / "slurmdbd.conf").write_text("StoragePass=secret\n")
    (folder / "controller.json").write_text(json.dumps({"controller": "slurm-research/research"}))
    (folder / "jwt.key").write_bytes(b"k" * 40)
    (folder / "state" / "clustername").write_text("research\n")


def test_slurm_started_again_keeps_the_clusters_database_and_a_deleted_controller_removes_it(
    tmp_path: Path,
) -> None:
    """Stopped for a restart (slurmctld died, a NodeSet added), a cluster keeps its accounts,
    users and job records; only its Controller's deletion removes them."""
    folder = tmp_path / "research"
    _cluster_folder(folder)
    for kept in ("home/alice", "storage/results", "login/keys", "etc"):
        (folder / kept).mkdir(parents=True, exist_ok=True)
    (folder / "mounts.json").write_text("[]\n")
    SlinkyCluster(folder).stop(restart=True)
    assert sorted(p.name for p in folder.iterdir()) == [
        "db", "etc", "home", "login", "mounts.json", "slurmdbd.conf", "storage"
    ]  # fmt: skip
    assert (folder / "db" / "data" / "ibdata1").read_bytes() == b"accounts"
    assert (folder / "slurmdbd.conf").read_text() == "StoragePass=secret\n"
    SlinkyCluster(folder).stop()
    assert not folder.exists()


def test_a_stop_of_accounting_cut_short_still_restarts_slurmrestd(tmp_path: Path) -> None:
    """The operator gone after slurmdbd stopped and slurm.conf lost it, before slurmrestd was
    restarted: the next pass restarts slurmrestd, which still reads the old slurm.conf. The
    database stays."""
    folder = tmp_path / "research"
    _cluster_folder(folder)
    (folder / "slurm.conf").write_text(
        "ClusterName=research\nAccountingStorageType=accounting_storage/none\n"
        "NodeSet=research-train Feature=research-train\n"
    )
    # slurmrestd runs (this process stands in for it), started while the cluster had accounting.
    (folder / "restapi.json").write_text(json.dumps({"pid": os.getpid(), "port": 6820, "accounting": True}))
    cluster = SlinkyCluster(folder)
    restarted: list[str] = []
    cluster.stop_restapi = lambda: restarted.append("stopped")  # type: ignore[method-assign]
    cluster.start_restapi = lambda port=None: restarted.append(f"started on {port}") or 0  # type: ignore[method-assign]
    assert cluster.stop_accounting() == "its Accounting is gone, slurmrestd restarted"
    assert restarted == ["stopped", "started on 6820"]
    assert (folder / "db" / "data" / "ibdata1").exists() and (folder / "slurmdbd.conf").exists()


def _api(handler_items: dict[str, dict[str, Any]]) -> httpx.Client:
    """The emulated API's answers the operator needs here: the named objects, 404 otherwise."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path in handler_items:
            return httpx.Response(200, json=handler_items[request.url.path])
        return httpx.Response(404, json={"kind": "Status", "code": 404})

    return httpx.Client(transport=httpx.MockTransport(handle), base_url="http://api")


def test_a_cluster_whose_start_failed_halfway_is_stopped_with_its_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = example_objects()
    controller = of(objects, "Controller")[0]
    group = ClusterObjects(controller, nodesets=of(objects, "NodeSet"))
    key = key_of(group.namespace, group.name)
    secret = {"stringData": {"jwt_hs256.key": "k" * 40}}
    http = _api(
        {
            f"/api/v1/namespaces/{group.namespace}/secrets/research-jwt-key": secret,
            f"/api/v1/namespaces/{group.namespace}/pods": {"items": []},
            f"/api/v1/namespaces/{group.namespace}/services": {"items": []},
        }
    )

    def half_started(self: SlinkyCluster, *args: Any, **kwargs: Any) -> None:
        # What a start leaves when slurmctld never answers: its folder, the daemons it recorded.
        _cluster_folder(self.folder)
        raise TimeoutError("slurmctld did not answer")

    monkeypatch.setattr(SlinkyCluster, "start", half_started)
    own = DynamicSlurmLab(tmp_path / "own", ["lab"])
    operator = Operator(http, own, clusters=tmp_path / "clusters", log=lambda line: None)
    with pytest.raises(TimeoutError):
        operator.bring_up(key, group)
    assert key in operator.managed  # the operator knows what it started
    operator.take_down(key)  # the Controller deleted
    assert not (tmp_path / "clusters" / "research").exists()


def _recording_api(items: dict[str, dict[str, Any]], calls: list[str]) -> httpx.Client:
    """The emulated API's answers (the named objects, 404 otherwise), each call recorded."""

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if request.method == "GET" and request.url.path in items:
            return httpx.Response(200, json=items[request.url.path])
        return httpx.Response(200 if request.method == "DELETE" else 404, json={})

    return httpx.Client(transport=httpx.MockTransport(handle), base_url="http://api")


def test_a_login_service_whose_loginset_is_gone_is_deleted_and_others_are_kept(tmp_path: Path) -> None:
    objects = example_objects()
    group = ClusterObjects(of(objects, "Controller")[0], nodesets=of(objects, "NodeSet"))
    services = f"/api/v1/namespaces/{group.namespace}/services"
    loginset = {**of(objects, "LoginSet")[0]}
    login = login_service(loginset, 2222)
    other = {**login_service(loginset, 2223), "metadata": {**login["metadata"], "name": "elsewhere-login"}}
    other["metadata"]["labels"] = {**login["metadata"]["labels"], "slinky.slurm.net/cluster": "elsewhere"}
    calls: list[str] = []
    http = _recording_api(
        {services: {"items": [login, restapi_service(of(objects, "RestApi")[0], 6820), other]}}, calls
    )
    operator = Operator(http, DynamicSlurmLab(tmp_path / "own", ["lab"]), clusters=tmp_path, log=lambda line: None)
    operator.reconcile_login("slurm-research/research", group, SlinkyCluster(tmp_path / "research"))
    assert [c for c in calls if c.startswith("DELETE")] == [f"DELETE {services}/research-login"]


def test_without_sshd_or_root_a_loginset_is_said_once_and_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = example_objects()
    group = ClusterObjects(
        of(objects, "Controller")[0], nodesets=of(objects, "NodeSet"), loginsets=of(objects, "LoginSet")
    )
    monkeypatch.setattr("lab.operator.login_unavailable", lambda: "no sshd here")
    said: list[str] = []
    calls: list[str] = []
    http = _recording_api({f"/api/v1/namespaces/{group.namespace}/services": {"items": []}}, calls)
    operator = Operator(http, DynamicSlurmLab(tmp_path / "own", ["lab"]), clusters=tmp_path, log=said.append)
    for _ in range(2):
        operator.reconcile_login("slurm-research/research", group, SlinkyCluster(tmp_path / "research"))
    assert said == ["cluster slurm-research/research: LoginSet research-login has no login node here: no sshd here"]
    assert not any(c.startswith(("POST", "DELETE")) for c in calls) and not (tmp_path / "research").exists()
