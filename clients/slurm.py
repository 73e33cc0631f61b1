"""Slurm through its CLI (``scontrol``, ``squeue``, ``scancel``).

Nodes are read with ``scontrol show -o node``: ``sinfo`` only lists nodes that belong to a
partition, and a spare outside every partition must still be visible. 22.05's scontrol has
no JSON, so its one-line records are parsed here.

Jobs are read scoped to the incident, with ``squeue --Format`` rather than ``squeue --json``:
22.05's ``squeue --json`` ignores every filter (``-w``, ``--jobs``, ``--states``: checked on
22.05.8, it always dumps every job of the cluster), while the plain output honours them on
every version. ``--json`` is kept for the whole-cluster listing (``SlurmCli.jobs``), and
``parse_squeue_json`` reads both its 22.05 (v0.0.38) and its 23.11+ (data_parser v0.0.40+) shapes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from clients.dryrun import refuse_writes
from clients.errors import (
    ClientError,
    InvalidInput,
    LastNodeOfPartition,
    NotFound,
    NotOwned,
    Unavailable,
    checked_node_name,
)
from models.constants import owned_reason as owned_reason  # re-exported for the spare pool
from models.constants import takes_over
from models.incident import JobInfo, NodeInfo, with_checkpoint

_UNREACHABLE = (
    "unable to contact slurm controller",
    "connection refused",
    "socket timed out",
    "communication connection failure",
    "zero bytes were transmitted",
    "munge",
)
_NOT_FOUND = ("invalid node name", "invalid job id", "does not exist", "invalid partition name", "not found")


class Pending(BaseModel):
    """What a partition's pending jobs ask for."""

    jobs: int = 0
    nodes: int = 0
    gpus: int = 0  # from their per-node GPU requests (``--gres=gpu:N``); 0 where they ask none


_GPU_GRES = re.compile(r"gpu(?::[A-Za-z0-9_.-]+)?[:=](\d+)")


def gpus_in(gres: str) -> int:
    """GPUs per node in a job's gres as squeue prints it (``gres:gpu:2``, ``gres/gpu:a100:4``,
    ``gpu:8``; ``N/A`` or none: 0)."""
    return sum(int(count) for count in _GPU_GRES.findall(gres))


def gpus_allocated(tres: str) -> int:
    """A job's GPUs on all its nodes from its TRES as Slurm prints them (squeue's ``tres-alloc``,
    the JSON's ``tres_alloc_str``): ``cpu=2,mem=1G,node=1,billing=2,gres/gpu=2`` is 2. The untyped
    ``gres/gpu`` is the total; without it the typed ones (``gres/gpu:h100=8``) are added up. 0 when
    none is named (a cluster without gres.conf, a job that asked for no GPU)."""
    total: int | None = None
    typed = 0
    for item in tres.split(","):
        name, _, value = item.strip().partition("=")
        if not value.strip().isdigit():
            continue
        if name == "gres/gpu":
            total = int(value)
        elif name.startswith("gres/gpu:"):
            typed += int(value)
    return total if total is not None else typed


# Pending reasons of jobs that would not start on a free node now (held, waiting for another job
# or a time, over a limit).
_NOT_WAITING_FOR_NODES = (
    "Dependency",
    "BeginTime",
    "JobHeld",
    "DependencyNeverSatisfied",
    "AssocGrp",
    "AssocMax",
    "QOS",
)
_REFUSED = ("presently disabled", "only batch jobs", "not requeueable", "access/permission denied")


class SlurmClient(Protocol):
    """What gpufleet needs from a Slurm controller."""

    def node(self, name: str) -> NodeInfo: ...
    def nodes(self) -> list[NodeInfo]: ...
    def drain(self, name: str, *, reason: str) -> NodeInfo: ...
    def down(self, name: str, *, reason: str) -> None: ...
    def resume(self, name: str) -> None: ...
    def jobs_on_node(self, name: str) -> list[JobInfo]: ...
    def recent_jobs_on_node(self, name: str) -> list[JobInfo]: ...
    def accounted_jobs(self, name: str, since: datetime) -> list[JobInfo] | None: ...
    def pending(self, partition: str) -> Pending: ...
    def partition_jobs(self, partition: str) -> list[JobInfo]: ...
    def hostnames(self, hostlist: str) -> list[str]: ...
    def jobs_by_id(self, job_ids: list[int]) -> dict[int, JobInfo]: ...
    def job(self, job_id: int) -> JobInfo: ...
    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None: ...
    def requeue(self, job_id: int) -> None: ...
    def job_marks(self, job_id: int) -> list[str]: ...
    def mark_job(self, job_id: int, mark: str) -> bool: ...
    def partition_nodes(self, partition: str) -> list[str]: ...
    def add_to_partition(self, partition: str, node: str) -> None: ...
    def remove_from_partition(self, partition: str, node: str) -> None: ...
    def topology(self) -> SlurmTopology: ...


class SlurmSwitch(BaseModel):
    """One switch of Slurm's tree topology (``scontrol show topology``): level 0 is a leaf,
    whose nodes hang off it directly; an upper switch's nodes are those under its switches."""

    name: str
    level: int = 0
    nodes: list[str] = []
    switches: list[str] = []  # the switches under it (upper levels only)

    @property
    def leaf(self) -> bool:
        return self.level == 0


class SlurmTopology(BaseModel):
    """Slurm's switches, or none and why (no topology plugin, a backend that cannot read it)."""

    switches: list[SlurmSwitch] = []
    note: str = ""

    def leaves_of(self, node: str) -> list[SlurmSwitch]:
        """The leaf switches whose node list holds ``node``."""
        return [switch for switch in self.switches if switch.leaf and node in switch.nodes]


# What scontrol says when the cluster has no switches (no TopologyPlugin=topology/tree, or a
# topology.conf that names none).
_NO_TOPOLOGY = ("no topology", "not supported", "topology/default", "no switches")
_TOPOLOGY_FIELD = re.compile(r"(?:^|\s)(\w+)=(\S*)")
# The longest line scontrol before 23.11 prints for a switch, asked for (SLURM_TOPO_LEN).
TOPO_LINE = 262144
NO_TOPOLOGY_NOTE = "Slurm has no switch topology (no TopologyPlugin=topology/tree with a topology.conf)"


def parse_topology(out: str, expand: Callable[[str], list[str]], notes: list[str] | None = None) -> list[SlurmSwitch]:
    """``scontrol show topology``: one switch a line, ``SwitchName=s0 Level=0 LinkSpeed=1
    Nodes=gpu[1-3]``, an upper one with ``Switches=s[0-1]`` too. ``expand`` turns a hostlist into
    its names (``scontrol show hostnames``, or clients.slurmrest_protocol.expand_hostlist).

    A line that cannot be read (a level that is no number; a node list cut short, as scontrol
    before 23.11 cuts each line at SLURM_TOPO_LEN, 512 characters by default) is left out and
    said in ``notes``: one switch misread never costs the others."""
    switches: list[SlurmSwitch] = []
    for line in out.splitlines():
        fields = dict(_TOPOLOGY_FIELD.findall(line))
        name = fields.get("SwitchName", "")
        if not name:
            continue
        level = fields.get("Level", "0")
        try:
            if not level.isdigit():
                raise ValueError(f"Level={level} is no number")
            nodes = expand(_listed(fields.get("Nodes", "")))
            below = expand(_listed(fields.get("Switches", "")))
        except (ValueError, ClientError) as exc:
            if notes is not None:
                notes.append(f"switch {name} of scontrol show topology left out: {exc}")
            continue
        switches.append(SlurmSwitch(name=name, level=int(level), nodes=nodes, switches=below))
    return switches


def _listed(value: str) -> str:
    """A hostlist field's value, or '' for none (Slurm prints ``(null)``)."""
    return "" if value in ("", "(null)") else value


_MARK = re.compile(r"gpufleet:[a-z]+:[A-Za-z0-9._:-]+")
_MARK_SAFE = re.compile(r"^gpufleet:[a-z]+:[A-Za-z0-9._:-]+$")


_log = logging.getLogger(__name__)

# scontrol subcommands that only read (anything else, and scancel, changes the cluster).
_READS = frozenset({"show", "ping", "version", "listpids"})


class SlurmCli:
    """SlurmClient over the Slurm commands, run with argv lists (never a shell)."""

    def __init__(
        self,
        *,
        slurm_conf: Path | None = None,
        bin_dir: Path | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        self._env = dict(os.environ)
        if slurm_conf is not None:
            self._env["SLURM_CONF"] = str(slurm_conf)
        self._bin_dir = bin_dir
        self._timeout = timeout_seconds
        # Partition membership is read-modify-write; keep one writer per process.
        self._partition_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------------

    def _run(self, argv: list[str], *, env: dict[str, str] | None = None) -> str:
        if argv[0] == "scancel" or (argv[0] == "scontrol" and argv[1] not in _READS):
            refuse_writes(" ".join(argv))
        program = str(self._bin_dir / argv[0]) if self._bin_dir else argv[0]
        try:
            done = subprocess.run(
                [program, *argv[1:]],
                capture_output=True,
                text=True,
                timeout=self._timeout,
                env={**self._env, **env} if env else self._env,
                check=False,
            )
        except FileNotFoundError:
            raise Unavailable(f"{argv[0]} is not installed or not on PATH (install slurm-client)") from None
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{' '.join(argv)} timed out after {self._timeout:.0f}s") from None
        if done.returncode != 0:
            message = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            lowered = message.lower()
            if any(marker in lowered for marker in _NOT_FOUND):
                raise NotFound(f"{' '.join(argv)}: {message}")
            if any(marker in lowered for marker in _REFUSED):
                raise InvalidInput(f"{' '.join(argv)}: {message}")
            if any(marker in lowered for marker in _UNREACHABLE):
                raise Unavailable(f"{' '.join(argv)}: {message}")
            raise ClientError(f"{' '.join(argv)}: {message}")
        return done.stdout

    def _json(self, argv: list[str]) -> dict[str, Any]:
        out = self._run(argv)
        try:
            data: dict[str, Any] = json.loads(out)
        except json.JSONDecodeError as exc:
            raise ClientError(f"{' '.join(argv)} printed no JSON: {exc}") from None
        errors = data.get("errors") or []
        if errors:
            raise ClientError(f"{' '.join(argv)}: {errors}")
        return data

    # -- nodes ------------------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        out = self._run(["scontrol", "show", "-o", "node"])
        return [parse_node_record(line) for line in out.splitlines() if line.startswith("NodeName=")]

    def node(self, name: str) -> NodeInfo:
        name = checked_node_name(name)
        try:
            out = self._run(["scontrol", "show", "-o", "node", name])
        except NotFound:
            raise NotFound(f"Slurm has no node named {name!r}") from None
        records = [parse_node_record(line) for line in out.splitlines() if line.startswith("NodeName=")]
        if not records or records[0].name != name:
            raise NotFound(f"Slurm has no node named {name!r}")
        return records[0]

    def drain(self, name: str, *, reason: str) -> NodeInfo:
        """Drain with our reason; a node someone else drained keeps their reason.

        Returns the node as it is after the call.
        """
        current = self.node(name)
        if current.drained and not owned_reason(current.reason) and not takes_over(current.reason, reason):
            return current
        if current.drained and current.reason == reason:
            return current
        self._run(["scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"])
        return self.node(name)

    def down(self, name: str, *, reason: str) -> None:
        current = self.node(name)
        if current.reason and not owned_reason(current.reason):
            raise NotOwned(f"{name} is held by someone else ({current.reason!r}); leaving it as it is")
        if current.state == "down" and current.reason == reason:
            return
        self._run(["scontrol", "update", f"NodeName={name}", "State=DOWN", f"Reason={reason}"])

    def resume(self, name: str) -> None:
        """Return a node to service, only when gpufleet took it out (or nobody did)."""
        current = self.node(name)
        if not current.drained and current.state not in {"down", "fail"}:
            return
        if current.reason and not owned_reason(current.reason):
            raise NotOwned(f"{name} was taken out by someone else ({current.reason!r}); not resuming it")
        self._run(["scontrol", "update", f"NodeName={name}", "State=RESUME"])

    # -- jobs -------------------------------------------------------------------------------------

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        """The jobs running (or completing, suspended, ...) on the node, from one squeue scoped to it."""
        name = checked_node_name(name)
        try:
            # squeue's default states (not finished, completing included), narrowed here to the active ones.
            jobs = self._squeue(f"--nodelist={name}")
        except NotFound:
            raise NotFound(f"Slurm has no node named {name!r}") from None
        return [job for job in jobs if job.state in _ACTIVE_STATES]

    def recent_jobs_on_node(self, name: str) -> list[JobInfo]:
        """The jobs on the node, finished ones too (those slurmctld still keeps: MinJobAge), and
        those still completing on other nodes after this one finished its part (`completing_on`)."""
        name = checked_node_name(name)
        # The completing jobs first: one that finishes completing between the two reads is then
        # in the node's listing (with its whole node list again), not in neither.
        try:
            completing = self._squeue_json(["--states=COMPLETING"])
        except Unavailable:
            raise  # a timeout or slurmctld away: retried, never taken for "nothing completing"
        except ClientError as exc:  # a Slurm without JSON output: the node's own listing only
            _log.warning("squeue --json did not answer; jobs completing elsewhere are not seen: %s", exc)
            completing = []
        try:
            listed = self._squeue("--states=all", f"--nodelist={name}")
        except NotFound:
            raise NotFound(f"Slurm has no node named {name!r}") from None
        return listed + completing_on(name, completing, {job.job_id for job in listed})

    def _squeue_json(self, filters: list[str]) -> list[dict[str, Any]]:
        """``squeue --json``'s job records (22.05 ignores ``filters``: the caller filters again)."""
        jobs: list[dict[str, Any]] = self._json(["squeue", "--json", *filters]).get("jobs") or []
        return jobs

    def accounted_jobs(self, name: str, since: datetime) -> list[JobInfo] | None:
        """The jobs that ran on the node and ended since ``since``, from the accounting database
        (``sacct``): it keeps jobs slurmctld has purged (MinJobAge). None without accounting."""
        name = checked_node_name(name)
        start = since.astimezone().strftime("%Y-%m-%dT%H:%M:%S")  # sacct reads local time
        # Every user's jobs (as root sacct shows only root's otherwise). No --state: with a start
        # time and no end time it selects nothing; jobs still running have no End and are dropped.
        argv = ["sacct", "--allusers", "--allocations", "--noheader", "--parsable2", f"--nodelist={name}"]
        argv += [f"--starttime={start}", "--format=JobIDRaw,JobName,User,State,End,NodeList"]
        try:
            out = self._run(argv)
        except ClientError as exc:
            if any(marker in str(exc).lower() for marker in _NO_ACCOUNTING):
                return None
            raise
        return parse_sacct(out)

    def pending(self, partition: str) -> Pending:
        """What the partition's pending jobs ask for (training's demand): jobs, nodes and GPUs.
        Jobs held, or waiting on a dependency or a begin time, ask for nothing yet."""
        partition = checked_node_name(partition)  # a partition name has a node name's shape
        out = self._run(["squeue", "--noheader", f"--partition={partition}", "--states=PENDING", "--format=%D|%r|%b"])
        demand = Pending()
        for line in out.splitlines():
            nodes, _, rest = line.strip().partition("|")
            reason, _, gres = rest.partition("|")
            if not nodes.isdigit() or reason.startswith(_NOT_WAITING_FOR_NODES):
                continue
            demand.jobs += 1
            demand.nodes += int(nodes)
            demand.gpus += int(nodes) * gpus_in(gres)
        return demand

    def partition_jobs(self, partition: str) -> list[JobInfo]:
        """The partition's jobs that hold nodes now (running, completing, suspended...), from one squeue."""
        partition = checked_node_name(partition)
        return [job for job in self._squeue(f"--partition={partition}") if job.state in _ACTIVE_STATES]

    def jobs_by_id(self, job_ids: list[int]) -> dict[int, JobInfo]:
        """The given jobs from ONE squeue, finished ones included (within MinJobAge).

        A job Slurm no longer knows is absent from the result.
        """
        wanted = sorted({checked_job_id(job_id) for job_id in job_ids})
        if not wanted:
            return {}
        try:
            jobs = self._squeue("--states=all", f"--jobs={','.join(str(job_id) for job_id in wanted)}")
        except NotFound:
            # With one ID squeue asks for that job alone and fails when Slurm has forgotten it
            # ("Invalid job id specified"); with several it just leaves the unknown ones out.
            if len(wanted) > 1:
                raise
            return {}
        # An array's base ID also selects its tasks: keep only what was asked for.
        return {job.job_id: job for job in jobs if job.job_id in wanted}

    def job(self, job_id: int) -> JobInfo:
        found = self.jobs_by_id([job_id]).get(job_id)
        if found is None:
            raise NotFound(f"Slurm has no job {job_id}")
        return found

    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None:
        """Signal each running step of the job, or its batch shell when it runs no step.

        The tasks are what must see the signal to save a checkpoint. A job-wide SIGTERM is
        a cancel to slurmctld, and signalling the batch shell with srun in it (``--full``)
        makes srun force its step down: both kill the tasks before they could save.
        """
        if signal not in {"TERM", "INT", "USR1", "USR2", "HUP"}:
            raise InvalidInput(f"refusing to send signal {signal!r}")
        job = str(checked_job_id(job_id))
        listed = self._run(["squeue", "--steps", "--noheader", "--format=%i", f"--jobs={job}"]).split()
        steps = [step for step in listed if step.partition(".")[2].isdigit()]
        if not steps:
            self._run(["scancel", f"--signal={signal}", "--batch", job])
        for step in steps:
            self._run(["scancel", f"--signal={signal}", step])

    def requeue(self, job_id: int) -> None:
        job = self.job(job_id)
        if job.state in {"PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING"}:
            return
        if not job.requeue:
            raise InvalidInput(f"job {job_id} was submitted with --no-requeue")
        try:
            self._run(["scontrol", "requeue", str(checked_job_id(job_id))])
        except ClientError as exc:
            # Between our read and the requeue the job may already have gone back to pending.
            if "pending execution" not in str(exc).lower():
                raise

    # -- marks: what gpufleet did to a job, kept on the job itself -------------------------------

    def _admin_comment(self, job_id: int) -> str:
        out = self._run(["scontrol", "show", "job", str(checked_job_id(job_id))])
        for line in out.splitlines():
            stripped = line.strip()
            if stripped.startswith("AdminComment="):
                comment = stripped.removeprefix("AdminComment=")
                return "" if comment == "(null)" else comment
        return ""

    def job_marks(self, job_id: int) -> list[str]:
        """gpufleet's marks on the job (``gpufleet:signalled:<incident>``...), from its AdminComment."""
        return _MARK.findall(self._admin_comment(job_id))

    def mark_job(self, job_id: int, mark: str) -> bool:
        """Record ``mark`` on the job, durably in slurmctld, before acting on it.

        A retry of an activity killed half-way reads the mark and knows what was already
        decided. Whatever else the job's AdminComment holds is kept. Slurm refuses to change a
        job that has finished: then nothing is written and False is returned.
        """
        if not _MARK_SAFE.match(mark):
            raise InvalidInput(f"refusing to write job mark {mark!r}")
        comment = self._admin_comment(job_id)
        if mark in _MARK.findall(comment):
            return True
        updated = f"{comment}; {mark}" if comment else mark
        try:
            self._run(["scontrol", "update", f"JobId={checked_job_id(job_id)}", f"AdminComment={updated}"])
        except ClientError as exc:
            if "already finished" in str(exc).lower():
                return False
            raise
        return True

    def record_checkpoint(self, job_id: int, at: int, step: int | None = None) -> str:
        """Set the job's checkpoint mark in its Comment (``gpufleet:checkpoint:<at>[:<step>]``,
        docs/goodput.md), replacing an earlier one and keeping the rest; the job's owner may.
        Returns the Comment as written."""
        job_id = checked_job_id(job_id)
        comment = self.job(job_id).comment
        updated = with_checkpoint(comment, at, step)
        if updated != comment:
            self._run(["scontrol", "update", f"JobId={job_id}", f"Comment={updated}"])
        return updated

    def _squeue(self, *filters: str) -> list[JobInfo]:
        """``squeue --noheader --Format=...`` with ``filters``, parsed.

        The separators carry a fresh random token: a job name or output path (free text, where
        Slurm accepts even newlines and control characters) cannot contain a string that did not
        exist when the job was submitted, so records and fields split unambiguously.
        """
        token = secrets.token_hex(8)
        separator, terminator = f"\x1f{token}\x1f", f"\x1e{token}\x1e"
        # No width after the colon: the field is printed whole, neither padded nor cut.
        spec = ",".join(f"{field}:{separator}" for field in _SQUEUE_FIELDS[:-1])
        spec += f",{_SQUEUE_FIELDS[-1]}:{terminator}"
        out = self._run(["squeue", "--noheader", *filters, f"--Format={spec}"])
        return parse_squeue_format(out, separator=separator, terminator=terminator)

    def _hostnames(self, hostlist: str) -> list[str]:
        if not hostlist:
            return []
        if "[" not in hostlist:
            return hostlist.split(",")
        return self._run(["scontrol", "show", "hostnames", hostlist]).split()

    def jobs(self) -> list[JobInfo]:
        """Every job Slurm still knows, finished ones included (within MinJobAge)."""
        # The whole cluster (22.05 would ignore any filter here anyway).
        return parse_squeue_json(self._json(["squeue", "--json", "--states=all"]))

    def hostnames(self, hostlist: str) -> list[str]:
        """``gpu[1-2],spare1`` as ``["gpu1", "gpu2", "spare1"]``."""
        return self._hostnames(hostlist)

    # -- topology ---------------------------------------------------------------------------------

    def topology(self) -> SlurmTopology:
        """The switches of ``scontrol show topology``, their hostlists expanded; none and a note
        where Slurm has no switch topology (that is no error: the node has no switch domain).
        InvalidInput for a node list that is no hostlist."""
        try:
            # Before 23.11 scontrol cuts each switch's line at SLURM_TOPO_LEN (512 by default): a
            # top switch over a real cluster's nodes is longer. (It sizes a buffer on the stack.)
            out = self._run(["scontrol", "show", "topology"], env={"SLURM_TOPO_LEN": str(TOPO_LINE)})
        except ClientError as exc:
            if isinstance(exc, Unavailable) or not any(marker in str(exc).lower() for marker in _NO_TOPOLOGY):
                raise
            return SlurmTopology(note=NO_TOPOLOGY_NOTE)
        # Expanded here, as scontrol would (one `scontrol show hostnames` per switch would be a
        # process per switch at every read); the parser lives beside the slurmrestd client, which
        # imports this module.
        from clients.slurmrest_protocol import expand_hostlist

        notes: list[str] = []
        switches = parse_topology(out, expand_hostlist, notes)
        note = "; ".join(notes) or ("" if switches else NO_TOPOLOGY_NOTE)
        return SlurmTopology(switches=switches, note=note)

    # -- partitions -------------------------------------------------------------------------------

    def partition_nodes(self, partition: str) -> list[str]:
        checked_node_name(partition)
        return [node.name for node in self.nodes() if partition in node.partitions]

    def _set_partition(self, partition: str, nodes: list[str]) -> None:
        self._run(["scontrol", "update", f"PartitionName={partition}", f"Nodes={','.join(nodes)}"])

    def add_to_partition(self, partition: str, node: str) -> None:
        node = checked_node_name(node)
        with self._partition_lock:
            members = self.partition_nodes(partition)
            if node not in members:
                self._set_partition(partition, [*members, node])

    def remove_from_partition(self, partition: str, node: str) -> None:
        node = checked_node_name(node)
        with self._partition_lock:
            members = self.partition_nodes(partition)
            if node in members:
                # Slurm refuses an empty node list; such a partition keeps its last node.
                remaining = [member for member in members if member != node]
                if not remaining:
                    raise LastNodeOfPartition(f"{node} is the last node of partition {partition}")
                self._set_partition(partition, remaining)


# sacct's words when the cluster keeps no accounting.
_NO_ACCOUNTING = ("accounting storage is disabled", "slurmdbd", "no such file")


def parse_sacct(out: str) -> list[JobInfo]:
    """``sacct --allocations --parsable2 --format=JobIDRaw,JobName,User,State,End,NodeList``.

    State may carry who cancelled (``CANCELLED by 1000``); a job's array or het suffix is not
    in JobIDRaw. Such a job is past the controller: ``in_controller`` is False until squeue says
    otherwise.
    """
    jobs = []
    for line in out.splitlines():
        fields = line.split("|")
        if len(fields) != 6 or not fields[0].isdigit():
            continue
        job_id, name, user, state, ended, nodes = fields
        state = state.split()[0].upper() if state.strip() else ""
        if state not in ENDED_STATES:
            continue  # still running or waiting: squeue says more of it
        jobs.append(
            JobInfo(
                job_id=int(job_id),
                name=name,
                user=user,
                state=state,
                nodes="" if nodes in {"None assigned", "(null)"} else nodes,
                end_time=_slurm_time(ended),
                in_controller=False,
            )
        )
    return jobs


ACTIVE_STATES = _ACTIVE_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING"}
# A job in one of these has ended (its EndTime is when); it may still be requeued while
# slurmctld keeps it (MinJobAge).
ENDED_STATES = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
# Ended, with an EndTime that says when: the ended states, and COMPLETING (its nodes clean up).
_HAS_ENDED = ENDED_STATES | {"COMPLETING"}


_FIELD = re.compile(r"(?:^| )(NodeName|State|Partitions)=(\S*)")
_REASON = re.compile(r" Reason=(.*?)(?: \[[^\]]*\])?$")
# State flags that say how a node was made (``slurmd -Z``, ``-F``: Slinky's NodeSet pods are
# ``DYNAMIC_NORM``), not what is wrong with it: not reported as flags.
_ORIGIN_FLAGS = frozenset({"DYNAMIC_NORM", "DYNAMIC_FUTURE"})


def parse_node_record(line: str) -> NodeInfo:
    """One line of ``scontrol show -o node``: ``State=IDLE+DRAIN``, ``Reason=... [user@time]`` last.

    A dynamic node (``State=IDLE+DRAIN+DYNAMIC_NORM``) reads as a static one: its flag of origin is
    dropped, so an idle dynamic node has no flags."""
    fields = dict(_FIELD.findall(line))
    base, *words = fields.get("State", "UNKNOWN").split("+")
    flags = [word.upper() for word in words] + (["NOT_RESPONDING"] if base.endswith("*") else [])
    reason = _REASON.search(line.rstrip())
    partitions = fields.get("Partitions", "")
    return NodeInfo(
        name=fields["NodeName"],
        state=base.rstrip("*~#%$@^!").lower(),
        flags=[flag for flag in dict.fromkeys(flags) if flag not in _ORIGIN_FLAGS],
        reason=reason.group(1).strip() if reason else "",
        partitions=[p for p in partitions.split(",") if p and p != "(null)"],
    )


def checked_job_id(job_id: object) -> int:
    """``job_id`` when it is a Slurm job ID squeue accepts (an int in 1..2**31-1), else InvalidInput."""
    # squeue rejects a larger --jobs value ("Invalid job id"), and would fail the whole query for it.
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 0 < job_id < 2**31:
        raise InvalidInput(f"invalid job id {job_id!r}")
    return job_id


# Fields of ``squeue --Format``, in JobInfo's order. JobID is the job's own ID (an array task's
# too, never ``123_4``); State is job_state_string(): the same single word as 22.05's JSON.
_SQUEUE_FIELDS = (
    "JobID",
    "Name",
    "UserName",
    "State",
    "RestartCnt",
    "NodeList",
    "Requeue",
    "StartTime",
    "Comment",
    "STDOUT",
    "EndTime",
    # What the job holds (or, pending, asks for): its GPUs (gres/gpu), printed alike by 22.05 and 23.11+.
    "tres-alloc",
)


def parse_squeue_format(out: str, *, separator: str, terminator: str) -> list[JobInfo]:
    """``squeue --noheader --Format`` output whose fields end with ``separator``, records with ``terminator``."""
    records = out.split(terminator)
    if records.pop().strip():
        raise ClientError(f"squeue printed an unterminated record: {out[-200:]!r}")
    jobs = []
    for index, record in enumerate(records):
        # squeue ends each line with a newline, after our terminator.
        fields = (record.removeprefix("\n") if index else record).split(separator)
        if len(fields) != len(_SQUEUE_FIELDS):
            raise ClientError(f"squeue printed {len(fields)} fields where {len(_SQUEUE_FIELDS)} were asked for")
        job_id, name, user, state, restarts, nodes, requeue, started, comment, stdout, ended, tres = fields
        if not job_id.strip().isdigit() or not restarts.strip().isdigit():
            raise ClientError(f"squeue printed a malformed job record: {record[:200]!r}")
        nodes, state = nodes.strip(), state.strip().upper()
        jobs.append(
            JobInfo(
                job_id=int(job_id),
                name=name,
                user=user.strip(),
                state=state,
                restarts=int(restarts),
                nodes="" if nodes == "(null)" else nodes,
                requeue=_flag(requeue, default=True),
                stdout=stdout,
                start_time=_slurm_time(started),
                # A job that still runs (or waits) has an EndTime too: when its time limit ends.
                # A COMPLETING one has ended (its nodes clean up): its EndTime is when.
                end_time=_slurm_time(ended) if state in _HAS_ENDED else None,
                comment="" if comment.strip() == "(null)" else comment,
                gpus=gpus_allocated(tres),
            )
        )
    return jobs


def _slurm_time(text: str) -> datetime | None:
    """A time as Slurm prints it (``2026-12-03T19:20:00``, the controller's local time), in UTC;
    None for ``N/A``, ``Unknown`` or anything else that is not a time."""
    try:
        return datetime.fromisoformat(text.strip()).astimezone(UTC)
    except ValueError:
        return None


# job_state_string() of Slurm: a flag, when the job carries one of these, names the state
# before its base state does, in this order.
_STATE_FLAGS = (
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
)
_BASE_STATES = {
    "PENDING",
    "RUNNING",
    "SUSPENDED",
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}


def primary_state(job_state: object) -> str:
    """One state word from a job_state: 22.05's string, or 23.11+'s list of base state and flags.

    The list is reduced the way Slurm's own job_state_string() reduces the state bits, which
    is what 22.05's JSON and every version's ``squeue --Format=State`` print: a job in
    ``["PENDING", "REQUEUED"]`` is ``REQUEUED``, ``["RUNNING", "CONFIGURING"]`` is
    ``CONFIGURING``, ``["CANCELLED", "COMPLETING"]`` is ``COMPLETING``. The same job thus
    reads the same on every version, and the callers' sets stay right: REQUEUED counts as
    stopped and as already requeued, CONFIGURING and COMPLETING as still on the node, and only
    a plain RUNNING job counts as running (resumed, or to be signalled).
    """
    if isinstance(job_state, str):
        return job_state.strip().upper()
    if not isinstance(job_state, list | tuple):
        return ""
    states = [str(state).strip().upper() for state in job_state]
    for flag in _STATE_FLAGS:
        if flag in states:
            return flag
    for state in states:
        if state in _BASE_STATES:
            return state
    return states[0] if states else ""


def _number(value: object, *, default: int) -> int:
    """A count as 22.05 prints it (``3``) or as 23.11+ may (``{"set": true, "infinite": false, "number": 3}``)."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return default
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return default


def _flag(value: object, *, default: bool) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value != 0
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in {"1", "yes", "true"}:
            return True
        if lowered in {"0", "no", "false"}:
            return False
    return default


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def allocation_of(raw: dict[str, Any]) -> str:
    """The hostlist of every node a job was given (``job_resources``: a string in Slurm 22.05's
    JSON, an object with ``list`` after), which its ``nodes`` stop showing as they finish completing."""
    resources = raw.get("job_resources")
    nodes = resources.get("nodes") if isinstance(resources, dict) else None
    if isinstance(nodes, dict):
        nodes = nodes.get("list")
    return nodes if isinstance(nodes, str) else ""


def completing_on(name: str, records: list[dict[str, Any]], listed: set[int]) -> list[JobInfo]:
    """The COMPLETING jobs among ``records`` (``squeue --json``'s or slurmrestd's) whose
    allocation held ``name`` though the node's own listing (``listed``: its job IDs) leaves them out.

    While a job completes, Slurm shows it (``squeue --nodelist``, its NodeList, its ``nodes``) on
    the nodes still completing only: a job a failure ended on a node vanished from that node
    until its other nodes were done. Each record (an array task, a het component) carries its
    own allocation; the job comes back with that as its nodes. A record whose allocation is not
    a hostlist is skipped."""
    from clients.slurmrest_protocol import expand_hostlist  # (that module imports this one)

    found = []
    for raw in records:
        if primary_state(raw.get("job_state")) != "COMPLETING" or _number(raw.get("job_id"), default=-1) in listed:
            continue
        allocation = allocation_of(raw)
        try:
            held = name in expand_hostlist(allocation)
        except InvalidInput:
            _log.warning("job %s: its allocation %r is not a hostlist; not read", raw.get("job_id"), allocation)
            continue
        if held:
            found.append(job_from_json(raw).model_copy(update={"nodes": allocation}))
    return found


def job_from_json(raw: Mapping[str, Any]) -> JobInfo:
    """One job of ``squeue --json``, 22.05 (openapi v0.0.38) or 23.11+ (data_parser v0.0.40+)."""
    job_id = _number(raw.get("job_id"), default=0)
    if job_id <= 0:
        raise ClientError(f"squeue printed a job without an ID: {dict(raw)!r:.200}")
    state = primary_state(raw.get("job_state"))
    return JobInfo(
        job_id=job_id,
        name=_text(raw.get("name")),
        user=_text(raw.get("user_name")),
        state=state,
        restarts=_number(raw.get("restart_cnt"), default=0),
        nodes=_text(raw.get("nodes")),
        requeue=_flag(raw.get("requeue"), default=True),
        stdout=_text(raw.get("standard_output")),
        start_time=_epoch(_number(raw.get("start_time"), default=0)),
        end_time=_epoch(_number(raw.get("end_time"), default=0)) if state in _HAS_ENDED else None,
        comment=_text(raw.get("comment")),
        # Allocated once it runs; what it asked for while it waits (a requeued job, say).
        gpus=gpus_allocated(_text(raw.get("tres_alloc_str"))) or gpus_allocated(_text(raw.get("tres_req_str"))),
    )


def _epoch(seconds: int) -> datetime | None:
    return datetime.fromtimestamp(seconds, tz=UTC) if seconds > 0 else None


def parse_squeue_json(data: Mapping[str, Any]) -> list[JobInfo]:
    """Every job of a ``squeue --json`` document."""
    jobs: Iterable[Mapping[str, Any]] = data.get("jobs") or []
    return [job_from_json(raw) for raw in jobs]
