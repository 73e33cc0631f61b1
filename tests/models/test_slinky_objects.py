"""The Slinky objects of a spec as slurm-operator v1.2.1 takes them: the storage on every slurmd
and on the login node, and a login node that lets in the spec's users by their keys only."""

from __future__ import annotations

from typing import Any

import yaml

from models.cluster import load_spec
from models.slinky import LOGIN_PORT, USERS_MOUNT, login_service, slinky_objects
from tests.models.test_cluster_spec import EXAMPLE


def objects(**changes: Any) -> list[dict[str, Any]]:
    raw = {**yaml.safe_load(EXAMPLE.read_text()), **changes}
    return slinky_objects(load_spec(raw), {"train": ["n1", "n2"], "debug": ["n3"]})


def one(found: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in found if o["kind"] == kind)


def test_every_slurmd_and_the_login_node_mount_the_storage_claim_at_the_specs_path() -> None:
    rendered = objects(storage={"size": "1Ti", "mount_path": "/data/team"})
    claim = one(rendered, "PersistentVolumeClaim")["metadata"]["name"]
    login = one(rendered, "LoginSet")["spec"]
    for spec, container in [
        *((n["spec"], n["spec"]["slurmd"]) for n in rendered if n["kind"] == "NodeSet"),
        (login, login["login"]),
    ]:
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/data/team"]]["persistentVolumeClaim"] == {"claimName": claim}
    assert {m["mountPath"] for m in login["login"]["volumeMounts"]} == {USERS_MOUNT, "/data/team"}


def test_without_storage_nothing_is_mounted_but_the_user_database() -> None:
    rendered = objects(storage=None)
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in rendered)
    for nodeset in (o for o in rendered if o["kind"] == "NodeSet"):
        assert "volumeMounts" not in nodeset["spec"]["slurmd"] and "volumes" not in nodeset["spec"]["template"]["spec"]
    login = one(rendered, "LoginSet")["spec"]
    assert [m["mountPath"] for m in login["login"]["volumeMounts"]] == [USERS_MOUNT]


def test_the_login_node_takes_each_users_keys_from_the_user_database_and_nobody_as_root() -> None:
    rendered = objects()
    loginset = one(rendered, "LoginSet")
    spec = loginset["spec"]
    assert "rootSshAuthorizedKeys" not in spec  # not even the admins' keys
    sshd = dict(line.split(" ", 1) for line in spec["extraSshdConfig"].splitlines())
    assert sshd["AuthorizedKeysFile"] == f"{USERS_MOUNT}/authorized_keys.%u"
    assert sshd["PermitRootLogin"] == "no" and sshd["PasswordAuthentication"] == "no"
    assert sshd["KbdInteractiveAuthentication"] == "no" and sshd["StrictModes"] == "no"
    # Those files are the user database Secret's keys, mounted where sshd reads them.
    users = next(o for o in rendered if o["metadata"]["name"] == "research-users")
    assert {"authorized_keys.alice", "authorized_keys.bob"} <= set(users["stringData"])
    mount = next(m for m in spec["login"]["volumeMounts"] if m["mountPath"] == USERS_MOUNT)
    volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "research-users" and mount["readOnly"] is True


def test_the_login_service_is_a_load_balancer_named_after_the_loginset() -> None:
    loginset = one(objects(), "LoginSet")
    assert loginset["metadata"]["name"] == login_service("research") == "research-login"
    assert loginset["spec"]["service"] == {"spec": {"type": "LoadBalancer"}, "port": LOGIN_PORT}
    assert LOGIN_PORT == 22
