"""The Slinky clusters the operator stand-in (lab/operator.py) brings up beside the lab's own:
each ``Controller`` in the emulated API becomes a ``DynamicSlurmLab`` of its own (Slurm 26.05)
under ``$GPUFLEET_HOME/clusters/<name>``, as slurm-operator makes a cluster from its objects:

- slurm.conf: the lab's site lines, the Controller's ``extraConf`` (a key it sets replaces the
  lab's), and per NodeSet referencing the Controller ``NodeSet=<nodeset> Feature=<nodeset>`` and
  its partition, named after it, with the NodeSet's ``partition.config``. A NodeSet's own
  ``extraConf`` (``Gres=gpu:N``) is left out, said in a comment: the lab's nodes have no GPUs;
- the JWT key from the Secret the Controller's ``jwtKeyRef`` names (slurmctld and slurmrestd
  accept tokens signed with it);
- the users of the cluster's user database Secret (``<name>-users``: ``passwd``, ``group`` and
  ``authorized_keys.<user>``, as sssd and sshd read them in Slinky's pods), written by lab/login.py
  ``ClusterUsers`` after the Slurm root's system accounts: ``etc/`` beside slurm.conf, which
  lab/inroot.py binds over the root's ``/etc/passwd`` and ``/etc/group`` for this cluster's
  daemons, jobs and commands only, and (as root) their homes at ``/home`` and the storage in
  ``storage/`` at the path the NodeSets' slurmd mount their PersistentVolumeClaim (``/shared``
  by default);
- for a ``LoginSet`` (lab/operator.py, each pass): the login node, a real sshd (lab/login.py
  ``LoginNode``) letting in the Secret's users by their keys, and the Service named after the
  LoginSet, its ``clusterIP`` 127.0.0.1 and its port sshd's;
- a ``RestApi`` referencing the Controller: slurmrestd (lab/slurmrest.py), and the Service
  ``<restapi>-restapi`` the operator makes, its ``clusterIP`` 127.0.0.1 and its port slurmrestd's;
- the ``Accounting`` the Controller references (``accountingRef``): the cluster's own slurmdbd
  (Slurm 26.05) and MariaDB (lab/accounting.py), the cluster registered under the Controller's
  ``clusterName``, slurmrestd serving ``openapi/slurmdbd`` too. The lab runs its own database and
  ignores the Accounting's ``storageConfig``. An Accounting that appears after the cluster is up
  starts them on the running cluster (slurmctld and slurmrestd restarted to use them); one that
  goes stops them and keeps the database (``db/``, as Slinky's external database outlives its
  Accounting), which goes with the Controller only.

The NodeSet pods themselves (a ``slurmd -Z`` each) are the operator's NodeSet controller's work,
as for the lab's own cluster. Everything a cluster runs is recorded in its folder (``pids.json``,
``restapi.json``, ``controller.json``), so a restarted operator finds it again and ``lab down``
stops it (lab/cluster.py ``stop_all``). Slurm started again (slurmctld gone, a NodeSet added)
keeps the cluster's database, its users' homes and storage and its login node's host key and port
(``DURABLE``; the login node itself is started again with Slurm): only a deleted Controller
removes the folder.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.accounting import Accounting, accounting_unavailable
from lab.dynamic import RELEASE, DynamicSlurmLab
from lab.login import DEFAULT_MOUNT_PATH, SYSTEM_UID_LIMIT, Account, ClusterUsers, LoginNode
from lab.procs import alive, stop
from lab.slurmrest import jwt_lines, start_slurmrestd
from models.cluster import StorageSpec, check_ssh_key, check_user_name
from models.slinky import USERS_MOUNT

API_VERSION = "slinky.slurm.net/v1beta1"
CLUSTER_LABEL = "slinky.slurm.net/cluster"
JWT_KEY_FILE = "jwt.key"
# The lab's Services answer on this machine.
SERVICE_IP = "127.0.0.1"
# A UNIX socket's path holds at most 107 bytes; slurmd makes one per job step in its spool.
MAX_SOCKET_PATH = 107
# What of a cluster's folder outlives its Slurm started again: the accounting database and the
# slurmdbd.conf that reaches it (lab/accounting.py), and its users, homes, storage and login node
# (lab/login.py: its host key and port). Its Controller deleted, they go too.
DURABLE = ("db", "slurmdbd.conf", "etc", "home", "storage", "login", "mounts.json")
LOGIN_APP = "login"
# Written while an Accounting is being stopped, removed once slurmctld and slurmrestd no longer
# use it: a stop cut short is finished on the next pass.
ACCOUNTING_STOPPING = "accounting-stopping"


def nodesets_of(conf: Path) -> list[str]:
    """The NodeSets a dynamic cluster's slurm.conf declares (``NodeSet=<name> Feature=...``)."""
    return re.findall(r"^NodeSet=(\S+)", conf.read_text(), flags=re.MULTILINE)


def key_of(namespace: str, name: str) -> str:
    """How the operator names one cluster: its Controller's namespace and name."""
    return f"{namespace}/{name}"


def controller_of(obj: dict[str, Any]) -> str:
    """The cluster an object of slurm-operator belongs to (its ``controllerRef``), as ``key_of``."""
    ref = ((obj.get("spec") or {}).get("controllerRef") or {}).get("name", "")
    return key_of(obj["metadata"]["namespace"], ref)


@dataclass
class ClusterObjects:
    """What the API holds for one Controller."""

    controller: dict[str, Any]
    nodesets: list[dict[str, Any]] = field(default_factory=list)
    restapis: list[dict[str, Any]] = field(default_factory=list)
    accountings: list[dict[str, Any]] = field(default_factory=list)
    loginsets: list[dict[str, Any]] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return str(self.controller["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.controller["metadata"]["name"])

    @property
    def nodeset_names(self) -> list[str]:
        return sorted(n["metadata"]["name"] for n in self.nodesets)


def group_objects(
    controllers: list[dict[str, Any]],
    nodesets: list[dict[str, Any]],
    restapis: list[dict[str, Any]],
    accountings: list[dict[str, Any]],
    loginsets: list[dict[str, Any]] | None = None,
) -> dict[str, ClusterObjects]:
    """Each Controller with the NodeSets, RestApis and LoginSets that reference it, and the
    Accounting it references (``accountingRef``)."""
    groups = {key_of(c["metadata"]["namespace"], c["metadata"]["name"]): ClusterObjects(c) for c in controllers}
    for nodeset in nodesets:
        if (group := groups.get(controller_of(nodeset))) is not None:
            group.nodesets.append(nodeset)
    for restapi in restapis:
        if (group := groups.get(controller_of(restapi))) is not None:
            group.restapis.append(restapi)
    for loginset in loginsets or []:
        if (group := groups.get(controller_of(loginset))) is not None:
            group.loginsets.append(loginset)
    for group in groups.values():
        ref = ((group.controller.get("spec") or {}).get("accountingRef") or {}).get("name")
        group.accountings = [
            a
            for a in accountings
            if ref and a["metadata"]["namespace"] == group.namespace and a["metadata"]["name"] == ref
        ]
    return groups


def extra_conf(controller: dict[str, Any]) -> list[str]:
    """The Controller's ``extraConf`` as slurm.conf lines (blank lines and comments dropped)."""
    text = str((controller.get("spec") or {}).get("extraConf") or "")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def partition_configs(nodesets: list[dict[str, Any]]) -> dict[str, str]:
    """Each NodeSet's ``partition.config`` (its partition line's options)."""
    return {
        n["metadata"]["name"]: str(((n.get("spec") or {}).get("partition") or {}).get("config") or "") for n in nodesets
    }


def left_out(nodesets: list[dict[str, Any]]) -> list[str]:
    """slurm.conf comments for what of the NodeSets the lab does not run (their ``extraConf``)."""
    return [
        f"# NodeSet {n['metadata']['name']}: extraConf {' '.join(str(extra).split())!r} left out "
        "(the lab's nodes have no GPUs)"
        for n in nodesets
        if (extra := (n.get("spec") or {}).get("extraConf"))
    ]


def step_socket(folder: Path, nodeset: str) -> str:
    """The path of a job step's socket in the spool of a pod of ``nodeset``, for the cluster's
    first jobs (ordinals below 10, job IDs below 100, the batch step): later ones are longer."""
    pod = f"{nodeset}-9"
    return f"{folder}/spool/{pod}/{pod}_99.4294967291"


def too_deep(folder: Path, nodesets: list[str]) -> str:
    """Why the cluster's slurmd could not run jobs from ``folder`` ('' when they can)."""
    longest = max((step_socket(folder, n) for n in nodesets), key=len, default="")
    if len(longest) <= MAX_SOCKET_PATH:
        return ""
    return (
        f"{folder} is too deep: a job step's socket there ({len(longest)} bytes) would not fit in "
        f"{MAX_SOCKET_PATH} bytes; use a shorter GPUFLEET_HOME"
    )


def secret_value(secret: dict[str, Any], key: str) -> bytes | None:
    """A Secret's value for ``key`` (``data``, base64, or ``stringData``); None when absent."""
    if key in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][key])
    if key in (secret.get("stringData") or {}):
        return str(secret["stringData"][key]).encode()
    return None


def secret_texts(secret: dict[str, Any] | None) -> dict[str, str]:
    """Every value of a Secret, as text."""
    if secret is None:
        return {}
    keys = [*(secret.get("data") or {}), *(secret.get("stringData") or {})]
    return {key: (secret_value(secret, key) or b"").decode(errors="replace") for key in keys}


def _valid_name(name: str) -> bool:
    """A name a spec could give a user (models/cluster.py ``check_user_name``)."""
    try:
        check_user_name(name)
    except ValueError:
        return False
    return True


def _valid_user(name: str, uid: int) -> bool:
    return _valid_name(name) and uid >= SYSTEM_UID_LIMIT


def _valid_key(key: str) -> bool:
    try:
        check_ssh_key(key)
    except ValueError:
        return False
    return True


def accounts_in(users: dict[str, str]) -> list[Account]:
    """The accounts of a user database Secret (models/slinky.py ``user_database``): each
    ``passwd`` line of a user gpufleet could have made (a valid name, uid 1000 and above) with the
    keys of its ``authorized_keys.<name>``; others are left out."""
    found: dict[str, Account] = {}
    for line in users.get("passwd", "").splitlines():
        fields = line.split(":")
        if len(fields) < 7 or not fields[2].isdigit() or fields[0] in found:
            continue
        name, uid = fields[0], int(fields[2])
        if not _valid_user(name, uid) or uid in {a.uid for a in found.values()}:
            continue
        keys = users.get(f"authorized_keys.{name}", "").splitlines()
        found[name] = Account(name, uid, tuple(k.strip() for k in keys if _valid_key(k.strip())))
    return list(found.values())


def groups_in(users: dict[str, str]) -> list[str]:
    """The Secret's ``group`` lines beyond each user's own (``slurm-admins``), gids 1000 and above."""
    names = {a.name for a in accounts_in(users)}
    kept = []
    for line in users.get("group", "").splitlines():
        fields = line.split(":")
        if len(fields) != 4 or fields[0] in names or not fields[2].isdigit() or int(fields[2]) < SYSTEM_UID_LIMIT:
            continue
        if _valid_name(fields[0]) and re.fullmatch(r"[a-z0-9_,-]*", fields[3]):
            kept.append(line)
    return kept


def storage_mount_path(nodesets: list[dict[str, Any]]) -> str:
    """Where the NodeSets' slurmd mount the storage claim (their pods' PersistentVolumeClaim
    volume); ``/shared`` when none does. A path the spec could not name is refused."""
    for nodeset in sorted(nodesets, key=lambda n: n["metadata"]["name"]):
        spec = nodeset.get("spec") or {}
        volumes = ((spec.get("template") or {}).get("spec") or {}).get("volumes") or []
        claims = {v.get("name") for v in volumes if v.get("persistentVolumeClaim")}
        for mount in (spec.get("slurmd") or {}).get("volumeMounts") or []:
            if mount.get("name") in claims and mount.get("mountPath"):
                path = str(mount["mountPath"])
                StorageSpec.model_validate({"mount_path": path})  # ValueError: not a storage's place
                return path
    return DEFAULT_MOUNT_PATH


def login_users_secret(loginset: dict[str, Any]) -> str:
    """The user database Secret a LoginSet's login container mounts at ``USERS_MOUNT``
    (``<controller>-users`` when it mounts none)."""
    spec = loginset.get("spec") or {}
    mounted = {
        m.get("name") for m in (spec.get("login") or {}).get("volumeMounts") or [] if m.get("mountPath") == USERS_MOUNT
    }
    for volume in ((spec.get("template") or {}).get("spec") or {}).get("volumes") or []:
        if volume.get("name") in mounted and (volume.get("secret") or {}).get("secretName"):
            return str(volume["secret"]["secretName"])
    return f"{(spec.get('controllerRef') or {}).get('name', '')}-users"


def login_service(loginset: dict[str, Any], port: int) -> dict[str, Any]:
    """The Service the operator makes for a LoginSet (named after it, its type the LoginSet's
    ``service.spec.type``); in the lab its clusterIP is this machine's and its port sshd's."""
    meta = loginset["metadata"]
    spec = loginset.get("spec") or {}
    controller = (spec.get("controllerRef") or {}).get("name", "")
    kind = str(((spec.get("service") or {}).get("spec") or {}).get("type") or "ClusterIP")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": {
                "app.kubernetes.io/name": LOGIN_APP,
                "app.kubernetes.io/instance": meta["name"],
                CLUSTER_LABEL: controller,
            },
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "LoginSet",
                    "name": meta["name"],
                    "uid": meta.get("uid", ""),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "type": kind,
            "clusterIP": SERVICE_IP,
            "ports": [{"name": LOGIN_APP, "port": port, "targetPort": port, "protocol": "TCP"}],
            "selector": {"app.kubernetes.io/name": LOGIN_APP, "app.kubernetes.io/instance": meta["name"]},
        },
    }


def jwt_ref(controller: dict[str, Any]) -> tuple[str, str]:
    """The Secret and key of the Controller's JWT key (``jwtKeyRef``, or 1.0's ``jwtHs256KeyRef``)."""
    spec = controller.get("spec") or {}
    ref = spec.get("jwtKeyRef") or spec.get("jwtHs256KeyRef") or {}
    name = controller["metadata"]["name"]
    return str(ref.get("name") or f"{name}-jwt-key"), str(ref.get("key") or "jwt_hs256.key")


def users_secret(controller: dict[str, Any]) -> str:
    """The user database Secret gpufleet makes for the cluster (models/slinky.py)."""
    return f"{controller['metadata']['name']}-users"


def service_name(restapi: dict[str, Any]) -> str:
    """The operator's Service for a RestApi."""
    return f"{restapi['metadata']['name']}-restapi"


def restapi_service(restapi: dict[str, Any], port: int) -> dict[str, Any]:
    """The Service ``<restapi>-restapi`` the operator makes for slurmrestd; in the lab its
    clusterIP is this machine's and its port the one slurmrestd listens on."""
    meta = restapi["metadata"]
    controller = ((restapi.get("spec") or {}).get("controllerRef") or {}).get("name", "")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(restapi),
            "namespace": meta["namespace"],
            "labels": {"app.kubernetes.io/name": "slurmrestd", CLUSTER_LABEL: controller},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "RestApi",
                    "name": meta["name"],
                    "uid": meta.get("uid", ""),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": SERVICE_IP,
            "ports": [{"name": "restapi", "port": port, "targetPort": port, "protocol": "TCP"}],
            "selector": {"app.kubernetes.io/name": "slurmrestd", "app.kubernetes.io/instance": meta["name"]},
        },
    }


class SlinkyCluster:
    """One Slinky cluster's Slurm on this machine: slurmctld (a ``DynamicSlurmLab``), its
    slurmrestd, and its slurmdbd and MariaDB, all recorded under ``folder``."""

    def __init__(self, folder: Path, *, binds: list[Path] | None = None) -> None:
        self.folder = folder.resolve()
        self.binds = list(binds or [])

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def users_folder(self) -> Path:
        """``passwd`` and ``group`` beside slurm.conf, which lab/inroot.py binds over the root's."""
        return self.folder / "etc"

    def slurm(self) -> DynamicSlurmLab:
        """The cluster's Slurm as it was started (its NodeSets read from its slurm.conf)."""
        nodesets = nodesets_of(self.conf) if self.conf.exists() else []
        return DynamicSlurmLab(self.folder, nodesets or ["none"], release=RELEASE, binds=self.binds)

    def controller(self) -> str:
        """Whose folder this is (``key_of``), '' when no Controller's."""
        try:
            data = json.loads((self.folder / "controller.json").read_text())
        except (OSError, ValueError):
            return ""
        return str(data.get("controller", ""))

    def running(self) -> bool:
        """Whether its slurmctld runs."""
        return self.conf.exists() and alive(self.slurm().pids().get("slurmctld", 0))

    def nodesets(self) -> list[str]:
        return self.slurm().nodesets if self.running() else []

    def start(
        self, objects: ClusterObjects, jwt_key: bytes, users: dict[str, str], *, timeout: float = 60.0
    ) -> DynamicSlurmLab:
        """slurmctld for the Controller and its NodeSets, with its JWT key and users; with the
        Accounting it references (where the host can run one: ``accounting_missing``), its
        slurmdbd and MariaDB first."""
        if problem := too_deep(self.folder, objects.nodeset_names):
            raise ValueError(problem)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o755)  # its users' jobs reach their scripts in its spool
        (self.folder / "controller.json").write_text(
            json.dumps({"controller": key_of(objects.namespace, objects.name)})
        )
        key = self.folder / JWT_KEY_FILE
        key.write_bytes(jwt_key)
        key.chmod(0o600)
        slurm = DynamicSlurmLab(
            self.folder,
            objects.nodeset_names,
            release=RELEASE,
            binds=self.binds,
            extra_lines=[*jwt_lines(key), *extra_conf(objects.controller), *left_out(objects.nodesets)],
            partitions=partition_configs(objects.nodesets),
            cluster_name=str((objects.controller.get("spec") or {}).get("clusterName") or objects.name),
        )
        slurm.with_accounting = bool(objects.accountings) and not accounting_unavailable(slurm.install)
        self.write_users(objects.nodesets, users, slurm=slurm)
        slurm.start(timeout=timeout)
        return slurm

    def write_users(
        self, nodesets: list[dict[str, Any]], users: dict[str, str], *, slurm: DynamicSlurmLab | None = None
    ) -> list[str]:
        """The accounts of the user database ``users`` (``accounts_in``) in the cluster's view
        (lab/login.py ``ClusterUsers``), its storage where its NodeSets mount it; as root, with
        their homes, keys and storage too. Returns what changed."""
        slurm = slurm or self.slurm()
        return ClusterUsers(self.folder, slurm.install).write(
            accounts_in(users),
            storage_mount_path(nodesets),
            groups=groups_in(users),
            accounts_only=os.geteuid() != 0,
        )

    def login(self) -> LoginNode:
        """The cluster's login node (lab/login.py), its sshd seeing what its daemons see."""
        slurm = self.slurm()
        return LoginNode(self.folder, slurm.install, self.binds)

    # -- slurmrestd -------------------------------------------------------------------------------

    def _restapi(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.folder / "restapi.json").read_text())
        except (OSError, ValueError):
            return {}
        return data

    def restapi_port(self) -> int:
        """The port its slurmrestd listens on (0: none runs)."""
        found = self._restapi()
        return int(found.get("port", 0)) if found and alive(int(found.get("pid", 0))) else 0

    def start_restapi(self, port: int | None = None) -> int:
        """slurmrestd for the cluster (its users known to it), on ``port`` (default: a free one),
        serving the accounting API where the cluster has slurmdbd; returns its port."""
        slurm = self.slurm()
        restd = start_slurmrestd(slurm, users=self.users_folder, port=port)
        slurm._record("slurmrestd", restd.pid)
        port = int(restd.url.rsplit(":", 1)[1])
        accounting = slurm.accounting is not None
        (self.folder / "restapi.json").write_text(
            json.dumps({"pid": restd.pid, "port": port, "folder": str(restd.folder), "accounting": accounting})
        )
        return port

    def restart_restapi_for_accounting(self) -> str:
        """A running slurmrestd started before the cluster's accounting changed (it reads its own
        copy of slurm.conf) started again on its port; ', slurmrestd restarted' when it was."""
        port = self.restapi_port()
        if not port or bool(self._restapi().get("accounting")) == (self.slurm().accounting is not None):
            return ""
        self.stop_restapi()
        self.start_restapi(port)
        return ", slurmrestd restarted"

    def stop_restapi(self) -> None:
        found = self._restapi()
        if found:
            stop([int(found.get("pid", 0))])
            if found.get("folder"):
                shutil.rmtree(found["folder"], ignore_errors=True)
            (self.folder / "restapi.json").unlink(missing_ok=True)

    # -- accounting -------------------------------------------------------------------------------

    def accounting_missing(self) -> str:
        """What the host lacks to run an Accounting ('' when nothing)."""
        return accounting_unavailable(self.slurm().install)

    def accounting_runs(self) -> bool:
        """Whether the cluster's slurm.conf names slurmdbd, and its slurmdbd and MariaDB run."""
        slurm = self.slurm()
        pids = slurm.pids()
        return slurm.accounting is not None and all(alive(pids.get(name, 0)) for name in ("slurmdbd", "mariadbd"))

    def start_accounting(self, accounting: dict[str, Any], *, timeout: float = 60.0) -> str:
        """What the cluster's ``Accounting`` runs on the running cluster: MariaDB and slurmdbd
        (those running kept), the cluster registered, slurmctld and slurmrestd restarted to use
        them. Says what it did; '' when all of it ran already."""
        slurm = self.slurm()
        did = "" if self.accounting_runs() else slurm.start_accounting(timeout=timeout)
        did += self.restart_restapi_for_accounting()
        return f"Accounting {accounting['metadata']['name']}: {did.lstrip(', ')}" if did else ""

    def stop_accounting(self, *, timeout: float = 60.0) -> str:
        """The cluster's Accounting gone: its slurmdbd and MariaDB stopped, slurmctld and
        slurmrestd restarted without them; its database kept (``db/``) for the Controller's
        lifetime, as Slinky's external database outlives an Accounting. Says what it did; ''
        when there was nothing to do. A stop cut short (the operator gone halfway) is finished
        by the next call, slurmrestd's restart included."""
        slurm = self.slurm()
        marker = self.folder / ACCOUNTING_STOPPING
        pids = slurm.pids()
        recorded = any(alive(pids.get(name, 0)) for name in ("slurmdbd", "mariadbd"))
        did = ""
        if slurm.accounting is not None or recorded or marker.exists():
            marker.touch()
            did = slurm.stop_accounting(timeout=timeout)
        # Whether slurmrestd still serves the old slurm.conf (restapi.json says how it started)
        # is decided whatever the rest found to do: a restart cut short is not skipped.
        restarted = self.restart_restapi_for_accounting()
        marker.unlink(missing_ok=True)
        if not did:
            return f"its Accounting is gone{restarted}" if restarted else ""
        database = Accounting(self.folder, None).folder
        kept = f", its database kept in {database}" if database.exists() else ""
        return f"its Accounting is gone: {did}{kept}{restarted}"

    # -- down -------------------------------------------------------------------------------------

    def stop(self, *, restart: bool = False) -> None:
        """Stop everything the cluster runs and remove its folder; with ``restart`` (its Slurm to
        be started again) keep what is durable of it (``DURABLE``: its accounting database)."""
        self.stop_restapi()
        # Its sessions see the Slurm that is stopping: the next pass starts it again (its host key
        # and port kept) once Slurm is back.
        LoginNode(self.folder).stop()
        if self.conf.exists() or (self.folder / "pids.json").exists():
            self.slurm().stop()
        if not restart:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        if not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            if entry.name in DURABLE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def clusters_under(home: Path, *, binds: list[Path] | None = None) -> dict[str, SlinkyCluster]:
    """The Slinky clusters recorded under ``home`` (a folder of cluster folders), by ``key_of``."""
    found = {}
    for folder in sorted(home.glob("*")):
        cluster = SlinkyCluster(folder, binds=binds)
        if cluster.controller():
            found[cluster.controller()] = cluster
    return found
