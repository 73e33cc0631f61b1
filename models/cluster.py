"""A Slurm cluster as a spec: partitions, users, storage, spares, accounting, extra configuration.

``load_spec`` lists every problem in a spec at once, each under the field it concerns
(``partitions[1].max_time: ...``), before anything is created: the fields one at a time
(pydantic), then what only the whole spec shows (duplicate names and uids, two default
partitions, uids outside the allowed range, more nodes than the free pool holds).
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re
import struct
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from models.names import InvalidName, validate_cluster_name
from models.numbers import Finite, Whole

# Partition names are also label values and parts of object names (NodeSet <cluster>-<partition>):
# a DNS label. Account and Linux user names: what every tool on a login node accepts.
_PARTITION = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_ACCOUNT = re.compile(r"^[a-z0-9_][a-z0-9_-]{0,31}$")
# Slurm's time limits: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or INFINITE / UNLIMITED.
_TIME = re.compile(r"^(INFINITE|UNLIMITED|\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")
# A Kubernetes resource quantity for storage (binary or decimal suffix).
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_CONF_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
# A key ending in "pass" anywhere in a line (StoragePass, AccountingStoragePass...), in any case.
_PASS_KEY = re.compile(r"(?:^|[\s#])([A-Za-z][A-Za-z0-9]*pass)\s*=", re.IGNORECASE)
# Where a cluster's storage may not be mounted: the folders its nodes' system lives in, and /home
# (its users' homes).
SYSTEM_FOLDERS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
)
# Accounts every node of a cluster has already: a spec's user may not be one of them.
SYSTEM_USERS = frozenset({"root", "sshd", "slurm", "slurmrestd", "munge", "mysql"})
_STORAGE_CLASS = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SSH_TYPES = {
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
}
# slurm.conf keys gpufleet or the backend writes (hosts, ports, users, authentication, paths):
# an extra line may not set them again (Slurm reads keys in any case, the last one winning).
OWNED_CONF_KEYS = frozenset(
    key.lower()
    for key in (
        "ClusterName",
        "SlurmctldHost",
        "ControlMachine",
        "NodeName",
        "PartitionName",
        "JobRequeue",
        "KillWait",
        "AccountingStorageType",
        "AccountingStorageHost",
        "AccountingStoragePort",
        "AccountingStorageUser",
        "SlurmUser",
        "SlurmdUser",
        "SlurmctldPort",
        "SlurmdPort",
        "AuthType",
        "AuthInfo",
        "CredType",
        "AuthAltTypes",
        "AuthAltParameters",
        "StateSaveLocation",
        "SlurmdSpoolDir",
        "SlurmctldPidFile",
        "SlurmdPidFile",
        "SlurmctldLogFile",
        "SlurmdLogFile",
        "GresTypes",
        "Include",
    )
)
# A cluster may not take a name that is already a task queue's or a workflow's own.
RESERVED_NAMES = frozenset({"clusters"})
OWNED_PARTITION_KEYS = frozenset({"PartitionName", "Nodes", "Default", "MaxTime"})
DEFAULT_UID_RANGE = (2000, 59999)


def check_ssh_key(key: str) -> str:
    """``key`` when it is one OpenSSH public key line (type, base64 blob naming the same type,
    optional comment), else ValueError saying what is wrong. Nothing but printable characters:
    a newline would add a line (another key, or options) to the file sshd reads keys from."""
    if not key.strip().isprintable():
        raise ValueError("an SSH public key is one line of printable characters (no newline, tab or control byte)")
    parts = key.strip().split(None, 2)
    if len(parts) < 2:
        raise ValueError("an SSH public key is 'TYPE BASE64 [COMMENT]' (one line of id_*.pub)")
    kind, blob = parts[0], parts[1]
    if kind not in _SSH_TYPES:
        raise ValueError(f"unknown SSH key type {kind!r} (one of {', '.join(sorted(_SSH_TYPES))})")
    try:
        raw = base64.b64decode(blob, validate=True)
        (length,) = struct.unpack(">I", raw[:4])
        named = raw[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        raise ValueError(f"the {kind} key's body is not valid base64 key data") from None
    if named != kind or len(raw) <= 4 + length:
        raise ValueError(f"the key says {kind!r} but its body is a {named!r} key or is cut short")
    return key.strip()


def check_user_name(name: str) -> str:
    """``name`` when it is a Linux user name a login node accepts, else ValueError saying so."""
    if not _USER.fullmatch(name):
        raise ValueError("a Linux user name: lowercase letters, digits, '_' and '-', at most 32 characters")
    if name in SYSTEM_USERS:
        raise ValueError(f"{name!r} is a system account of every node; choose another name")
    return name


class PartitionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    nodes: Whole = Field(ge=1, le=4096)
    gpus_per_node: Whole = Field(default=8, ge=0, le=64)
    default: bool = False
    max_time: str = "INFINITE"
    # More PartitionName options, as slurm.conf spells them (e.g. {OverSubscribe: "NO"}).
    options: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _PARTITION.fullmatch(name):
            raise ValueError("lowercase letters, digits and '-', at most 32 characters, a letter or digit at each end")
        return name

    @field_validator("max_time")
    @classmethod
    def _time(cls, value: str) -> str:
        if not _TIME.fullmatch(value):
            raise ValueError(f"{value!r} is not a Slurm time (e.g. 60, 4:00:00, 2-00:00:00, INFINITE)")
        return value

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, str]) -> dict[str, str]:
        for key, value in options.items():
            if not _CONF_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a slurm.conf key")
            if key in OWNED_PARTITION_KEYS:
                raise ValueError(f"{key} comes from the partition's own fields")
            if not value or any(c.isspace() for c in value) or "#" in value:
                raise ValueError(f"{key}={value!r}: a value without spaces or '#'")
        return options


class UserSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    uid: Whole
    ssh_keys: list[str] = Field(min_length=1)
    account: str = "research"
    admin: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_user_name(name)

    @field_validator("account")
    @classmethod
    def _account(cls, account: str) -> str:
        if not _ACCOUNT.fullmatch(account):
            raise ValueError("a Slurm account: lowercase letters, digits, '_' and '-', at most 32 characters")
        return account

    @field_validator("ssh_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        return [check_ssh_key(key) for key in keys]


class StorageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size: str = "1Ti"
    storage_class: str | None = None  # the cluster's default class
    mount_path: str = "/shared"

    @field_validator("size")
    @classmethod
    def _size(cls, size: str) -> str:
        if not _QUANTITY.fullmatch(size) or float(re.sub(r"[A-Za-z]+$", "", size)) <= 0:
            raise ValueError(f"{size!r} is not a size (e.g. 500Gi, 2Ti)")
        return size

    @field_validator("storage_class")
    @classmethod
    def _class(cls, name: str | None) -> str | None:
        if name is not None and not _STORAGE_CLASS.fullmatch(name):
            raise ValueError(f"{name!r} is not a StorageClass name")
        return name

    @field_validator("mount_path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/") or any(c.isspace() for c in path) or "/../" in f"{path}/" or path == "/":
            raise ValueError(f"{path!r}: an absolute path below / without spaces or '..'")
        clean = path.rstrip("/")
        if posixpath.normpath(path) != clean or path.startswith("//") or not path.isprintable():
            raise ValueError(f"{path!r}: write it plainly, e.g. {posixpath.normpath('/' + path.lstrip('/'))!r}")
        for folder in SYSTEM_FOLDERS:
            if clean == folder or clean.startswith(folder + "/"):
                raise ValueError(f"{path!r} is in {folder}, a system folder of every node; use e.g. /shared")
        return clean


class SecretRef(BaseModel):
    """A key of a Kubernetes Secret that exists already and is labelled
    ``gpufleet.io/copy-to-clusters=true`` (gpufleet copies it, never shows it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str
    name: str
    key: str = "password"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, name: str) -> str:
        if not re.fullmatch(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?", name):
            raise ValueError(f"{name!r} is not a namespace name (a DNS label)")
        return name

    @field_validator("name")
    @classmethod
    def _object_name(cls, name: str) -> str:
        if not _STORAGE_CLASS.fullmatch(name):
            raise ValueError(f"{name!r} is not a Kubernetes object name")
        return name

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        if not re.fullmatch(r"[-._a-zA-Z0-9]{1,253}", key):
            raise ValueError(f"{key!r} is not a Secret key")
        return key


class AccountingStorage(BaseModel):
    """The MariaDB/MySQL database slurmdbd keeps its records in, where the backend does not run
    one itself (Slinky: the ``Accounting`` object's ``storageConfig``). The password stays in
    its Secret: gpufleet copies it into the cluster's namespace, never into the workflow."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    port: Whole = Field(default=3306, ge=1, le=65535)
    database: str = "slurm_acct_db"
    username: str = "slurm"
    password_secret: SecretRef

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host):
            raise ValueError(f"{host!r} is not a host name or address")
        return host

    @field_validator("database", "username")
    @classmethod
    def _identifier(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_]{1,64}", name):
            raise ValueError(f"{name!r}: letters, digits and '_' only, at most 64")
        return name


class RemediationDefaults(BaseModel):
    """What the cluster's incidents start from (the worker's settings for this cluster)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grace_seconds: Finite = Field(default=120.0, ge=0, le=3600)
    requeue: bool = True


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    partitions: list[PartitionSpec] = Field(min_length=1)
    users: list[UserSpec] = Field(default_factory=list)
    storage: StorageSpec | None = None
    spares: Whole = Field(default=1, ge=0, le=1024)
    accounting: bool = False
    # Where slurmdbd keeps its records, for backends that do not run a database (Slinky).
    accounting_storage: AccountingStorage | None = None
    slurm_conf: list[str] = Field(default_factory=list)  # extra slurm.conf lines
    remediation: RemediationDefaults = Field(default_factory=RemediationDefaults)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        try:
            validate_cluster_name(name)
        except InvalidName as exc:
            raise ValueError(str(exc).removeprefix(f"invalid cluster name {name!r}: ")) from None
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is reserved (gpufleet's own task queue gpufleet-{name})")
        return name

    @field_validator("slurm_conf")
    @classmethod
    def _extra(cls, lines: list[str]) -> list[str]:
        for number, line in enumerate(lines, 1):
            # First, before any message that could quote the line: no password in it at all.
            secret = _PASS_KEY.search(line)
            if secret:
                raise ValueError(
                    f"line {number}: {secret.group(1)} holds a password: it would be in the workflow's history; "
                    "use a file"
                )
            if "\n" in line or "#" in line or not line.strip():
                raise ValueError(f"{line!r} is not one 'Key=Value' slurm.conf line")
            for pair in line.split():
                key, sep, value = pair.partition("=")
                if not sep or not _CONF_KEY.fullmatch(key) or not value:
                    raise ValueError(f"{line!r} is not one 'Key=Value' slurm.conf line")
                if key.lower() in OWNED_CONF_KEYS:
                    raise ValueError(f"{key} is set by gpufleet or its backend; remove it from {line!r}")
        return lines

    @property
    def nodes_needed(self) -> int:
        return sum(p.nodes for p in self.partitions) + self.spares

    @property
    def default_partition(self) -> str:
        return next((p.name for p in self.partitions if p.default), self.partitions[0].name)


class SpecError(ValueError):
    """Every problem in a spec, each as ``(field, message)``."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"{where}: {what}" for where, what in problems))


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(spec)"


def _listed(value: Any) -> list[Any]:
    """``value`` when it is a list, else none (its field's own problem is said elsewhere)."""
    return value if isinstance(value, list) else []


def _whole_spec_problems(
    raw: dict[str, Any], uid_range: tuple[int, int], free_nodes: int | None
) -> list[tuple[str, str]]:
    """What only the spec as a whole shows; tolerant of fields that are themselves wrong."""
    problems: list[tuple[str, str]] = []
    partitions = [p for p in _listed(raw.get("partitions")) if isinstance(p, dict)]
    users = [u for u in _listed(raw.get("users")) if isinstance(u, dict)]
    for what, items, key in (("partition", partitions, "name"), ("user", users, "name"), ("uid", users, "uid")):
        seen: dict[Any, int] = {}
        group = "partitions" if what == "partition" else "users"
        for index, item in enumerate(items):
            value = item.get(key)
            if not isinstance(value, (str, int)):
                continue  # none, or of a type its field's own problem names
            if value in seen:
                problems.append((f"{group}[{index}].{key}", f"{what} {value!r} is already {group}[{seen[value]}]'s"))
            else:
                seen[value] = index
    defaults = [i for i, p in enumerate(partitions) if p.get("default") is True]
    if len(defaults) > 1:
        problems.append((f"partitions[{defaults[1]}].default", f"partitions[{defaults[0]}] is the default already"))
    low, high = uid_range
    for index, user in enumerate(users):
        uid = user.get("uid")
        if isinstance(uid, int) and not low <= uid <= high:
            problems.append((f"users[{index}].uid", f"{uid} is outside the allowed range {low}-{high}"))
    if free_nodes is not None:
        nodes = [p.get("nodes") for p in partitions]
        spares = raw.get("spares", 1)
        if all(isinstance(n, int) for n in nodes) and isinstance(spares, int):
            wanted = sum(n for n in nodes if isinstance(n, int)) + spares
            if wanted > free_nodes:
                problems.append(
                    ("partitions", f"{wanted} nodes asked (spares included) but the free pool holds {free_nodes}")
                )
    return problems


def load_spec(
    raw: Any, *, uid_range: tuple[int, int] = DEFAULT_UID_RANGE, free_nodes: int | None = None
) -> ClusterSpec:
    """The spec, or SpecError with every problem in it (``free_nodes``: the free pool's size,
    when known)."""
    if not isinstance(raw, dict):
        raise SpecError([("(spec)", "a cluster spec is a mapping (name, partitions, users, ...)")])
    problems: list[tuple[str, str]] = []
    spec: ClusterSpec | None = None
    try:
        spec = ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        for error in exc.errors():
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append((_where(tuple(error["loc"])), message))
    problems += _whole_spec_problems(raw, uid_range, free_nodes)
    if problems or spec is None:
        raise SpecError(problems)
    return spec


def kill_wait(spec: ClusterSpec) -> int:
    """Slurm's KillWait (SIGTERM to SIGKILL when a job ends) matching the checkpoint grace."""
    return max(1, min(65533, round(spec.remediation.grace_seconds)))


def job_requeue(spec: ClusterSpec) -> int:
    """Slurm's default for batch jobs: requeued on a node failure (1), or only those that ask
    with ``--requeue`` (0). gpufleet's remediation requeues what Slurm lets it, and names each
    job that refuses."""
    return 1 if spec.remediation.requeue else 0


def render_slurm_conf(
    spec: ClusterSpec,
    placement: dict[str, list[str]],
    *,
    site: list[str] | None = None,
    node_options: dict[str, str] | None = None,
    spares: list[str] | None = None,
    gres: bool = True,
) -> str:
    """``slurm.conf`` for the spec with its nodes placed (partition name: node names).

    ``site`` holds what the backend decides (hosts, ports, paths, authentication);
    ``node_options`` adds per-node options (``NodeAddr=... Port=...``). gpufleet's own
    defaults come first: jobs requeue (``JobRequeue=1``, ``0`` when the spec's remediation says
    ``requeue: false``) and get the checkpoint grace between
    SIGTERM and SIGKILL (``KillWait``). The spec's extra lines come last but for the nodes
    and partitions. ``spares`` are Slurm nodes outside every partition (a claim moves one in);
    ``gres=False`` leaves GPUs out, for nodes that have none (the lab's).
    """
    missing = [p.name for p in spec.partitions if len(placement.get(p.name, [])) != p.nodes]
    if missing:
        raise ValueError(f"placement does not match the spec's node counts for: {', '.join(missing)}")
    gpus = gres and any(p.gpus_per_node for p in spec.partitions)
    accounting = "accounting_storage/slurmdbd" if spec.accounting else "accounting_storage/none"
    lines = [
        f"# slurm.conf for cluster {spec.name}, written by gpufleet from its spec.",
        f"ClusterName={spec.name}",
        *(site or []),
        "# gpufleet's defaults: requeue, and the checkpoint grace between SIGTERM and SIGKILL.",
        f"JobRequeue={job_requeue(spec)}",
        f"KillWait={kill_wait(spec)}",
        f"AccountingStorageType={accounting}",
    ]
    if gpus:
        lines.append("GresTypes=gpu")
    if spec.slurm_conf:
        lines += ["# From the spec:", *spec.slurm_conf]
    lines.append("# Nodes and partitions.")

    def node_line(node: str, gpus_per_node: int) -> str:
        gpu = f" Gres=gpu:{gpus_per_node}" if gpus and gpus_per_node else ""
        extra = f" {node_options[node]}" if node_options and node in node_options else ""
        return f"NodeName={node}{gpu}{extra} State=UNKNOWN"

    for partition in spec.partitions:
        lines += [node_line(node, partition.gpus_per_node) for node in placement[partition.name]]
    if spares:
        lines.append("# Spares: in no partition until an incident claims one.")
        lines += [node_line(node, max(p.gpus_per_node for p in spec.partitions)) for node in spares]
    default = spec.default_partition
    for partition in spec.partitions:
        options = "".join(f" {key}={value}" for key, value in sorted(partition.options.items()))
        lines.append(
            f"PartitionName={partition.name} Nodes={','.join(placement[partition.name])} "
            f"Default={'YES' if partition.name == default else 'NO'} MaxTime={partition.max_time}{options} State=UP"
        )
    return "\n".join(lines) + "\n"
