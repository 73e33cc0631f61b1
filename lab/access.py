"""The lab's people and gpufleet's API: every `gpufleet` command in the lab goes through `gpufleet api`.

Three users, each a static token of the emulated API (``--token-file``, kube-apiserver's
``--token-auth-file`` format) in a group bound to one of deploy/'s ClusterRoles:

==============  ======================  ===================
user            group                   ClusterRole
==============  ======================  ===================
lab-viewer      gpufleet:viewers        gpufleet-viewer
lab-approver    gpufleet:approvers      gpufleet-approver
lab-operator    gpufleet:operators      gpufleet-operator
==============  ======================  ===================

The tokens are made once, in ``users/tokens.csv`` (0600), and kept: they outlive a restart of
the emulated API or of the gpufleet API. Each user has a kubeconfig, ``users/NAME.kubeconfig``
(0600), which ``GPUFLEET_API_KUBECONFIG`` names. The roles are read from
``deploy/base/user-roles.yaml`` as a cluster would apply them, never copied here.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from temporalio.client import Client
from temporalio.service import TLSConfig

from clients.kubecreds import user_credentials
from lab.certs import ServerCertificate, make_server_certificate
from lab.kubeauth import read_token_file
from starters.temporal import ApiCredentials, connect_api, use_api_credentials

ROLES_FILE = Path(__file__).resolve().parents[1] / "deploy" / "base" / "user-roles.yaml"
RBAC_GROUP = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class LabUser:
    """A person of the lab: their name, the group their token carries, the ClusterRole bound to it."""

    name: str
    group: str
    role: str


USERS = (
    LabUser("lab-viewer", "gpufleet:viewers", "gpufleet-viewer"),
    LabUser("lab-approver", "gpufleet:approvers", "gpufleet-approver"),
    LabUser("lab-operator", "gpufleet:operators", "gpufleet-operator"),
)
# Whom the lab's own `gpufleet` commands (lab.env()) act as.
DEFAULT_USER = "lab-operator"


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its owner only (written aside, then moved in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(text)
    partial.replace(path)


def user_tokens(token_file: Path) -> dict[str, str]:
    """Each lab user's token, from ``token_file`` (the emulated API's ``--token-file``); made
    there (0600) when the file is absent or lacks one of them, else kept as it is."""
    if token_file.exists():
        known = {user.name: token for token, user in read_token_file(token_file).items()}
        if all(user.name in known for user in USERS):
            return {user.name: known[user.name] for user in USERS}
    tokens = {user.name: secrets.token_urlsafe(32) for user in USERS}
    lines = io.StringIO()
    writer = csv.writer(lines, lineterminator="\n")
    for uid, user in enumerate(USERS, start=1):
        writer.writerow([tokens[user.name], user.name, f"lab-user-{uid}", user.group])
    _write_private(token_file, lines.getvalue())
    return tokens


def apply_roles(kubeconfig: Path) -> list[str]:
    """deploy/'s ClusterRoles, and a ClusterRoleBinding of each lab user's group to its role,
    applied through the API server (created, or replaced when they exist); returns their names."""
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    rbac = k8s.RbacAuthorizationV1Api(k8s.ApiClient(configuration))
    roles = [doc for doc in yaml.safe_load_all(ROLES_FILE.read_text(encoding="utf-8")) if doc]
    roles = [doc for doc in roles if doc.get("kind") == "ClusterRole"]
    wanted = {user.role for user in USERS}
    missing = wanted - {role["metadata"]["name"] for role in roles}
    if missing:
        raise ValueError(f"{ROLES_FILE} has no ClusterRole {', '.join(sorted(missing))}")
    bindings: list[dict[str, Any]] = [
        {
            "apiVersion": f"{RBAC_GROUP}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"lab-{user.role}"},
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": user.role},
            "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": user.group}],
        }
        for user in USERS
    ]
    applied = []
    for body in roles:
        _apply(rbac.create_cluster_role, rbac.replace_cluster_role, body)
        applied.append(f"ClusterRole {body['metadata']['name']}")
    for body in bindings:
        _apply(rbac.create_cluster_role_binding, rbac.replace_cluster_role_binding, body)
        applied.append(f"ClusterRoleBinding {body['metadata']['name']}")
    return applied


def _apply(create: Any, replace: Any, body: dict[str, Any]) -> None:
    try:
        create(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        replace(body["metadata"]["name"], body)


def write_kubeconfigs(folder: Path, server: str, tokens: dict[str, str]) -> dict[str, Path]:
    """A kubeconfig per user, ``folder/NAME.kubeconfig`` (0600): the lab's cluster and their token."""
    files = {}
    for name, token in tokens.items():
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "gpufleet-lab", "cluster": {"server": server}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "gpufleet-lab", "user": name}}],
            "current-context": name,
        }
        path = folder / f"{name}.kubeconfig"
        _write_private(path, yaml.safe_dump(config, sort_keys=False))
        files[name] = path
    return files


def api_certificate(home: Path) -> ServerCertificate:
    """The API's certificate for localhost and 127.0.0.1, from the lab's CA (the intake's too)."""
    return make_server_certificate(home / "certs", name="api")


def kubeconfig_credentials(kubeconfig: Path) -> ApiCredentials:
    """The current user's credentials in ``kubeconfig``, as the `gpufleet` command reads them."""
    return ApiCredentials(*user_credentials(kubeconfig))


async def connect_as(address: str, ca: Path, kubeconfig: Path, *, timeout_seconds: float = 15) -> Client:
    """The gpufleet API at ``address`` as ``kubeconfig``'s current user, as a `gpufleet` command
    connects: what the lab does in a person's name goes there, and its history names that user.

    Raises:
        starters.temporal.TemporalUnreachable: the API does not answer (ApiRefused: it refused the user).
        starters.temporal.TemporalConfigInvalid: the CA file or the kubeconfig cannot be used.
    """
    use_api_credentials(kubeconfig_credentials)
    return await connect_api(address, ca_file=ca, kubeconfig=kubeconfig, timeout_seconds=timeout_seconds)


def api_answers(address: str, ca: Path, token: str) -> bool:
    """Whether the gpufleet API at ``address`` lets ``token``'s user connect (its TokenReview
    answered, Temporal behind it reached); raises what the connection raised otherwise."""

    async def connect() -> None:
        tls = TLSConfig(server_root_ca_cert=ca.read_bytes())
        await asyncio.wait_for(Client.connect(address, tls=tls, api_key=token), timeout=5)

    # In a thread of its own: lab up may be called from a running event loop (a chaos run's).
    with ThreadPoolExecutor(max_workers=1) as thread:
        thread.submit(asyncio.run, connect()).result()
    return True
