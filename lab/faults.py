"""What an Xid does to the job on its GPU, in the lab: the effect table and each node's GPU fault.

On a real Xid 79 the rank on the lost GPU dies within seconds (``RuntimeError: CUDA error:
unspecified launch failure``, exit status 1) and the ranks on the other nodes wait in their
collective until something kills them; after a GSP timeout the rank is stuck in a CUDA call and
acts on no signal but SIGKILL. The lab's kernel line alone hurts no process, so
``gpufleet lab inject-xid`` also writes the node's GPU fault, ``<home>/faults/<node>``, and the
lab's training jobs (``lab/jobs``) read it at every step (the folder comes in
``$GPUFLEET_LAB_FAULTS``):

- ``crash``: the rank on the node prints a CUDA error and exits 1; ``srun --kill-on-bad-exit=1``
  cancels the step and the job ends FAILED;
- ``hang``: the rank stops where it is and ignores SIGTERM; only the SIGKILL Slurm sends
  KillWait after the SIGTERM of a cancel or requeue ends it;
- ``none``: the Xid only warns; nothing happens to the job.

The counter job's ranks on the other nodes then stop as in a collective that never completes
(and ignore SIGTERM too); the DDP job's do so by themselves, in gloo's all-reduce.

A fault that breaks the GPU (``until_repair``) stands until the lab's repair stand-in resets the
GPU or reboots the node (``lab/repair.py``), ``gpufleet lab clear-fault NODE`` (a repair done by
hand), ``lab down`` or a fresh ``lab up``: a rank that starts on the node meanwhile meets it too.
A fault of the application alone (the GPU stays healthy) hits only the ranks already running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

from models.names import validate_node_name

FAULTS_ENV = "GPUFLEET_LAB_FAULTS"
# Where the operator stand-in records each pod's Kubernetes node (a dot first: no node is named so).
PLACEMENT = ".placement.json"
# Where the ranks record the faults they met (a dot first: no node is named so).
HITS_FILE = ".hits.jsonl"


class Effect(StrEnum):
    CRASH = "crash"
    HANG = "hang"
    NONE = "none"


@dataclass(frozen=True)
class XidEffect:
    """What the driver's failure does to a process using the GPU, and for how long."""

    effect: Effect
    # The GPU stays broken until a reset or reboot; else only the processes running then are hit.
    until_repair: bool
    why: str
    error: str = ""  # the CUDA error a crashing process reports


LAUNCH_FAILURE = "unspecified launch failure"
ILLEGAL_ADDRESS = "an illegal memory access was encountered"
ECC = "uncorrectable ECC error encountered"
NVLINK = "uncorrectable NVLink error was detected during the execution"
NO_DEVICE = "no CUDA-capable device is detected"


def _application(error: str, why: str) -> XidEffect:
    return XidEffect(Effect.CRASH, until_repair=False, why=why, error=error)


def _broken(error: str, why: str) -> XidEffect:
    return XidEffect(Effect.CRASH, until_repair=True, why=why, error=error)


def _stuck(why: str) -> XidEffect:
    return XidEffect(Effect.HANG, until_repair=True, why=why)


def _warns(why: str) -> XidEffect:
    return XidEffect(Effect.NONE, until_repair=False, why=why)


_UNUSED = _warns("not reported by current GPUs")
_NVLINK5 = _broken(
    NVLINK,
    "NVLink 5 error: its subcode decides, and the lab's line has none; taken as uncorrectable, as the "
    "policy's GPU reset takes it: the collective using the link fails",
)

# Every Xid of models/xid_catalog.csv. Crash or hang is what the failure does to a process on the
# GPU; until_repair is whether the GPU itself is broken (its catalog action resets, reboots or
# replaces) or only the application was (RESTART_APP: the GPU stays healthy).
EFFECTS: dict[int, XidEffect] = {
    13: _application(ILLEGAL_ADDRESS, "an exception in the application's kernel: its context is torn down"),
    31: _application(ILLEGAL_ADDRESS, "a page fault in the application's memory: its context is torn down"),
    32: _application(LAUNCH_FAILURE, "the driver kills the channel whose push buffer is corrupt"),
    38: _warns("a firmware error the driver recovers from"),
    43: _application(LAUNCH_FAILURE, "the application hit a fault and must end; the GPU stays healthy"),
    44: _application(LAUNCH_FAILURE, "the context being switched out is lost"),
    45: _warns("the driver cleaning up after a process that already ended, or beside the Xid that ended it"),
    48: _broken(ECC, "the process reading the double-bit error dies; the row is retired at the next reset"),
    54: _broken(NO_DEVICE, "a GPU without auxiliary power does not run"),
    56: _UNUSED,
    57: _UNUSED,
    58: _UNUSED,
    61: _UNUSED,
    62: _stuck("the GPU's micro-controller halted: work submitted to the GPU never completes"),
    63: _warns("a row marked for remapping; the remap takes effect at the next reset"),
    64: _warns("the remap failed and is recorded; the error that hit a process comes as its own Xid (48, 94, 95)"),
    68: _application(LAUNCH_FAILURE, "the application using the video decoder gets the error"),
    69: _application(LAUNCH_FAILURE, "a class error in the application's work: its context is torn down"),
    74: _broken(NVLINK, "the collective using the link fails; the link needs a GPU reset"),
    79: _broken(LAUNCH_FAILURE, "the GPU is gone: every CUDA call of the process fails"),
    92: _warns("corrected single-bit errors: nothing fails"),
    94: _application(ECC, "contained: the process using the memory dies, the GPU and other processes go on"),
    95: _broken(ECC, "uncontained: every process on the GPU dies and the GPU needs a reset"),
    109: _broken(LAUNCH_FAILURE, "the context that did not switch out in time is torn down; the GPU needs a reset"),
    110: _broken(LAUNCH_FAILURE, "a hardware security fault stops the GPU"),
    119: _stuck("GSP RPC timeout: calls into the GPU's firmware do not return, so CUDA calls block"),
    120: _stuck("GSP error: the GPU's firmware stops answering, so CUDA calls block"),
    121: _warns("a corrected C2C error"),
    123: _UNUSED,
    136: _broken(NVLINK, "a link that did not train carries no traffic: the collective using it fails"),
    140: _broken(ECC, "the process reading the unrecovered error dies; the GPU needs a reset"),
    143: _broken(NO_DEVICE, "the GPU did not initialise: no process can use it"),
    144: _NVLINK5,
    145: _NVLINK5,
    146: _NVLINK5,
    147: _NVLINK5,
    148: _NVLINK5,
    149: _NVLINK5,
    150: _NVLINK5,
    154: _warns("it names a recovery action; the Xid behind it carries the effect"),
    155: _broken(NVLINK, "the NVLink error fails the collective using the link; the GPU needs a reset"),
}
UNKNOWN = _warns("not in the lab's effect table")


def xid_effect(xid: int) -> XidEffect:
    """The table's row for ``xid`` (an Xid it does not know: ``UNKNOWN``, no effect)."""
    return EFFECTS.get(xid, UNKNOWN)


def default_effect(xid: int) -> Effect:
    """What the Xid does to a process on its GPU: crash, hang or none (an unknown Xid: none)."""
    return xid_effect(xid).effect


def parse_effect(value: str) -> Effect:
    """``crash``, ``hang`` or ``none``; anything else raises ValueError naming the choices."""
    try:
        return Effect(value)
    except ValueError:
        raise ValueError(f"unknown effect {value!r}; choose one of {', '.join(e.value for e in Effect)}") from None


@dataclass(frozen=True)
class Fault:
    """A node's GPU fault as its file holds it."""

    node: str
    xid: int
    effect: Effect
    at: float  # when it came (time.time())
    until_repair: bool
    error: str = ""

    def hits(self, started: float) -> bool:
        """Whether a rank that started at ``started`` meets this fault."""
        return self.effect is not Effect.NONE and (self.until_repair or started <= self.at)

    def describe(self) -> str:
        lasting = "until the GPU is reset or the node rebooted" if self.until_repair else "the ranks running then"
        return f"{self.effect.value} (Xid {self.xid}, {lasting})"


class GpuFaults:
    """The lab's per-node GPU faults: one small JSON file per node under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @classmethod
    def of_home(cls, home: Path) -> GpuFaults:
        return cls(home / "faults")

    def path(self, node: str) -> Path:
        return self.folder / validate_node_name(node)

    # On the slinky flavor a Slurm node is a pod, and a fault is its Kubernetes node's GPU: the
    # operator stand-in records where each pod runs, and a rank meets the fault of that node.
    @property
    def placement_file(self) -> Path:
        return self.folder / PLACEMENT

    def place(self, hosts: dict[str, str]) -> None:
        """Record the Kubernetes node each Slurm node (pod) runs on now (kept for others)."""
        current = self.placement()
        if all(current.get(k) == v for k, v in hosts.items()):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.placement_file.with_name(f".placement.tmp.{os.getpid()}")
        tmp.write_text(json.dumps({**current, **hosts}, sort_keys=True), encoding="utf-8")
        tmp.replace(self.placement_file)

    def placement(self) -> dict[str, str]:
        try:
            data = json.loads(self.placement_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def host_of(self, node: str) -> str:
        """Whose GPU a Slurm node uses: its Kubernetes node's on the slinky flavor, else its own."""
        return self.placement().get(node, node)

    def inject(self, node: str, xid: int, effect: Effect | None = None) -> Fault | None:
        """Give ``node``'s GPU the fault of ``xid`` (its default effect unless ``effect`` says).
        ``none`` writes nothing; a fault already standing on the node keeps it broken."""
        row = xid_effect(xid)
        effect = row.effect if effect is None else effect
        path = self.path(node)
        if effect is Effect.NONE:
            return None
        standing = self.get(node)
        fault = Fault(
            node=node,
            xid=xid,
            effect=effect,
            at=time.time(),
            until_repair=row.until_repair or bool(standing and standing.until_repair),
            error=row.error or LAUNCH_FAILURE,
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{node}.tmp.{os.getpid()}")
        tmp.write_text(json.dumps({**asdict(fault), "effect": effect.value}), encoding="utf-8")
        os.replace(tmp, path)
        return fault

    def get(self, node: str) -> Fault | None:
        try:
            data = json.loads(self.path(node).read_text(encoding="utf-8"))
            return Fault(**{**data, "effect": Effect(data["effect"])})
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def standing(self) -> dict[str, Fault]:
        """Every node's standing fault."""
        if not self.folder.is_dir():
            return {}
        found = {}
        for entry in sorted(self.folder.iterdir()):
            if not entry.name.startswith(".") and (fault := self.get(entry.name)) is not None:
                found[entry.name] = fault
        return found

    def clear(self, node: str) -> bool:
        """The node's GPU works again (reset, reboot, repaired); False when no fault stood."""
        try:
            self.path(node).unlink()
        except FileNotFoundError:
            return False
        return True

    def clear_all(self) -> list[str]:
        """Every node's GPU works (a fresh lab): the faults go, and the record of what met them."""
        cleared = list(self.standing())
        for node in cleared:
            self.clear(node)
        (self.folder / HITS_FILE).unlink(missing_ok=True)
        return cleared

    def record_hit(self, hit: dict[str, Any]) -> None:
        """One rank met a fault (appended whole: one short line per write)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(hit) + "\n").encode()
        fd = os.open(self.folder / HITS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def hits(self, job_id: int | None = None) -> list[dict[str, Any]]:
        """What the ranks met (of one job when given), oldest first."""
        try:
            lines = (self.folder / HITS_FILE).read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        found = []
        for line in lines:
            with contextlib.suppress(ValueError):
                hit = json.loads(line)
                if job_id is None or hit.get("job") == job_id:
                    found.append(hit)
        return found


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``gpu[1-2,4],spare1``) as names, in order."""
    names: list[str] = []
    depth, start = 0, 0
    for index, char in enumerate(hostlist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            if hostlist[start:index]:
                names.extend(_expand_one(hostlist[start:index]))
            start = index + 1
    return names


def _expand_one(name: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    prefix, body, rest = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    tails = _expand_one(rest)
    names: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part)
        if match is None:
            raise ValueError(f"not a host list: {name!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        for number in range(int(first), int(last) + 1):
            names.extend(f"{prefix}{number:0{len(first)}d}{tail}" for tail in tails)
    return names


class RankFaults:
    """What a lab training rank does at every step: meet its node's GPU fault, if one stands.

    ``wait_for_peers``: a fault on another node of the step stops this rank as a collective that
    never completes would (for a job without real collectives, such as the counter).
    """

    def __init__(
        self,
        faults: GpuFaults,
        *,
        node: str,
        nodes: Iterable[str] = (),
        rank: int = 0,
        job_id: int = 0,
        restart: int = 0,
        wait_for_peers: bool = False,
        started: float | None = None,
    ) -> None:
        self.faults = faults
        self.node = node
        self.peers = [peer for peer in nodes if peer != node] if wait_for_peers else []
        self.rank, self.job_id, self.restart = rank, job_id, restart
        self.started = time.time() if started is None else started

    @classmethod
    def from_env(cls, *, wait_for_peers: bool) -> RankFaults | None:
        """From the environment srun gives a task; None outside the lab (no ``$GPUFLEET_LAB_FAULTS``)."""
        folder = os.environ.get(FAULTS_ENV)
        if not folder:
            return None
        node = os.environ.get("SLURMD_NODENAME", "")
        hostlist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or node
        return cls(
            GpuFaults(Path(folder)),
            node=node,
            nodes=expand_hostlist(hostlist),
            rank=int(os.environ.get("SLURM_PROCID", "0")),
            job_id=int(os.environ.get("SLURM_JOB_ID", "0")),
            restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            wait_for_peers=wait_for_peers,
        )

    def due(self) -> tuple[Fault, Effect] | None:
        """The fault this rank meets now and what it does: its own node's first, else a peer's
        (which stops it as a collective waiting for that peer would)."""
        host = self.faults.host_of(self.node) if self.node else ""
        own = self.faults.get(host) if host else None
        if own is not None and own.hits(self.started):
            return own, own.effect
        for peer in self.peers:
            peer_host = self.faults.host_of(peer)
            fault = self.faults.get(peer_host) if peer_host != host else None
            if fault is not None and fault.hits(self.started):
                return fault, Effect.HANG
        return None

    def check(self, step: int) -> None:
        """Return when no fault is due; otherwise exit as a CUDA error makes a rank exit, or hang."""
        due = self.due()
        if due is None:
            return
        fault, effect = due
        self.faults.record_hit(
            {
                "job": self.job_id,
                "restart": self.restart,
                "rank": self.rank,
                "node": self.node,
                "fault_node": fault.node,
                "xid": fault.xid,
                "effect": effect.value if fault.node in (self.node, self.faults.host_of(self.node)) else "stalled",
                "step": step,
                "at": time.time(),
            }
        )
        if effect is Effect.CRASH:
            crash(fault.error or LAUNCH_FAILURE, rank=self.rank)
        hang()


def crash(error: str, *, rank: int) -> NoReturn:
    """Exit as PyTorch does on a CUDA error: the error on stderr, exit status 1, nothing saved."""
    sys.stdout.flush()
    sys.stderr.write(
        f"[rank{rank}]: RuntimeError: CUDA error: {error}\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, "
        "so the stacktrace below might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    )
    sys.stderr.flush()
    os._exit(1)


def hang() -> NoReturn:
    """Stop as a process stuck in a CUDA call or a collective: no progress, no SIGTERM or SIGINT
    acted on; SIGKILL alone ends it."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        time.sleep(3600)
