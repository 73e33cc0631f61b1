"""Slurm through its CLI (``scontrol``, ``squeue``, ``scancel``), JSON where 22.05 has it.

Nodes are read with ``scontrol show -o node``: ``sinfo`` only lists nodes that belong to a
partition, and a spare outside every partition must still be visible. 22.05's scontrol has
no JSON, so its one-line records are parsed here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any, Protocol

from clients.errors import ClientError, InvalidInput, NotFound, NotOwned, Unavailable, checked_node_name
from models.constants import DRAIN_REASON_PREFIX
from models.incident import JobInfo, NodeInfo

_UNREACHABLE = (
    "unable to contact slurm controller",
    "connection refused",
    "socket timed out",
    "communication connection failure",
    "zero bytes were transmitted",
    "munge",
)
_NOT_FOUND = ("invalid node name", "invalid job id", "does not exist", "invalid partition name", "not found")
_REFUSED = ("presently disabled", "only batch jobs", "not requeueable", "access/permission denied")


class SlurmClient(Protocol):
    """What gpufleet needs from a Slurm controller."""

    def node(self, name: str) -> NodeInfo: ...
    def nodes(self) -> list[NodeInfo]: ...
    def drain(self, name: str, *, reason: str) -> NodeInfo: ...
    def down(self, name: str, *, reason: str) -> None: ...
    def resume(self, name: str) -> None: ...
    def jobs_on_node(self, name: str) -> list[JobInfo]: ...
    def job(self, job_id: int) -> JobInfo: ...
    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None: ...
    def requeue(self, job_id: int) -> None: ...
    def partition_nodes(self, partition: str) -> list[str]: ...
    def add_to_partition(self, partition: str, node: str) -> None: ...
    def remove_from_partition(self, partition: str, node: str) -> None: ...


def owned_reason(reason: str) -> bool:
    """Whether a drain reason was written by gpufleet."""
    return reason.strip().startswith(DRAIN_REASON_PREFIX)


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

    def _run(self, argv: list[str]) -> str:
        program = str(self._bin_dir / argv[0]) if self._bin_dir else argv[0]
        try:
            done = subprocess.run(
                [program, *argv[1:]],
                capture_output=True,
                text=True,
                timeout=self._timeout,
                env=self._env,
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
        if current.drained and not owned_reason(current.reason):
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
        name = checked_node_name(name)
        # Filter on the expanded host list ourselves: it works the same across Slurm versions.
        jobs = self._json(["squeue", "--json"]).get("jobs", [])
        active = [_job_from_json(raw) for raw in jobs if raw.get("job_state") in _ACTIVE_STATES]
        return [job for job in active if name in self._hostnames(job.nodes)]

    def job(self, job_id: int) -> JobInfo:
        for job in self.jobs():
            if job.job_id == job_id:
                return job
        raise NotFound(f"Slurm has no job {job_id}")

    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None:
        """Signal each running step of the job, or its batch shell when it runs no step.

        The tasks are what must see the signal to save a checkpoint. A job-wide SIGTERM is
        a cancel to slurmctld, and signalling the batch shell with srun in it (``--full``)
        makes srun force its step down: both kill the tasks before they could save.
        """
        if signal not in {"TERM", "INT", "USR1", "USR2", "HUP"}:
            raise InvalidInput(f"refusing to send signal {signal!r}")
        job = str(int(job_id))
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
            self._run(["scontrol", "requeue", str(int(job_id))])
        except ClientError as exc:
            # Between our read and the requeue the job may already have gone back to pending.
            if "pending execution" not in str(exc).lower():
                raise

    def _hostnames(self, hostlist: str) -> list[str]:
        if not hostlist:
            return []
        if "[" not in hostlist:
            return hostlist.split(",")
        return self._run(["scontrol", "show", "hostnames", hostlist]).split()

    # -- partitions -------------------------------------------------------------------------------

    def jobs(self) -> list[JobInfo]:
        """Every job Slurm still knows, finished ones included (within MinJobAge)."""
        return [_job_from_json(raw) for raw in self._json(["squeue", "--json", "--states=all"]).get("jobs", [])]

    def hostnames(self, hostlist: str) -> list[str]:
        """``gpu[1-2],spare1`` as ``["gpu1", "gpu2", "spare1"]``."""
        return self._hostnames(hostlist)

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
                    raise InvalidInput(f"{node} is the last node of partition {partition}")
                self._set_partition(partition, remaining)


_ACTIVE_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING"}


_FIELD = re.compile(r"(?:^| )(NodeName|State|Partitions)=(\S*)")
_REASON = re.compile(r" Reason=(.*?)(?: \[[^\]]*\])?$")


def parse_node_record(line: str) -> NodeInfo:
    """One line of ``scontrol show -o node``: ``State=IDLE+DRAIN``, ``Reason=... [user@time]`` last."""
    fields = dict(_FIELD.findall(line))
    base, *flags = fields.get("State", "UNKNOWN").split("+")
    reason = _REASON.search(line.rstrip())
    partitions = fields.get("Partitions", "")
    return NodeInfo(
        name=fields["NodeName"],
        state=base.rstrip("*~#%$@^!").lower(),
        flags=[flag.upper() for flag in flags] + (["NOT_RESPONDING"] if base.endswith("*") else []),
        reason=reason.group(1).strip() if reason else "",
        partitions=[p for p in partitions.split(",") if p and p != "(null)"],
    )


def _job_from_json(raw: dict[str, Any]) -> JobInfo:
    return JobInfo(
        job_id=int(raw["job_id"]),
        name=raw.get("name", ""),
        user=raw.get("user_name", ""),
        state=raw.get("job_state", ""),
        restarts=int(raw.get("restart_cnt", 0) or 0),
        nodes=raw.get("nodes", "") or "",
        requeue=bool(raw.get("requeue", True)),
        stdout=raw.get("standard_output", "") or "",
    )
