"""A simulated Slurm cluster in memory, behind the same Protocol as the CLI client (clients.slurm).

``make bench-scale`` needs a fleet of ten thousand nodes. Real ``slurmd`` daemons do not scale to
that on one machine (each is a process with its own port), so the scale bench drives gpufleet's
worker against this simulation instead: every call the worker makes is answered as slurmctld
would answer it, with the semantics gpufleet relies on and the errors it must handle:

- nodes are ``idle`` or ``allocated``, with the ``DRAIN`` flag and a reason; a node drained by
  someone else keeps their reason, and only gpufleet's own (or no) reason is resumed;
- a job signalled with SIGTERM saves its checkpoint and exits after ``checkpoint_seconds``
  (``COMPLETED``); requeued, it is ``PENDING`` with one more restart, and runs again as soon as
  a node of its partition is idle and not drained (the spare gpufleet brought in);
- a finished job cannot be marked (``mark_job`` returns False), a pending one is not requeued
  twice, a job submitted with ``--no-requeue`` is refused;
- Slurm keeps a partition's last node (LastNodeOfPartition); an unknown node or job is NotFound;
  names are checked as the CLI client checks them.

It is thread-safe: the worker's activities call it from many threads at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import BaseModel

from clients.errors import InvalidInput, LastNodeOfPartition, NotFound, NotOwned, checked_node_name
from clients.slurm import Pending, SlurmTopology, checked_job_id, owned_reason
from models.constants import takes_over
from models.incident import JobInfo, NodeInfo

_FINISHED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL"}
_ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"}


class SimulatedFleet(BaseModel):
    """A simulated fleet as the scale bench describes it to its worker (and seeds Kubernetes with)."""

    partition: str = "train"
    training: list[str]
    spares: list[str] = []
    checkpoint_seconds: float = 0.5

    def slurm(self) -> SimulatedSlurm:
        return SimulatedSlurm(
            partition=self.partition,
            training=self.training,
            spares=self.spares,
            checkpoint_seconds=self.checkpoint_seconds,
        )


@dataclass
class _Node:
    name: str
    drained: bool = False
    down: bool = False
    reason: str = ""
    jobs: set[int] = field(default_factory=set)


@dataclass
class _Job:
    job_id: int
    partition: str
    user: str
    state: str = "PENDING"
    node: str = ""
    restarts: int = 0
    requeue: bool = True
    start_time: datetime | None = None
    exits_at: float | None = None  # signalled: when it will have saved and exited
    admin_comment: str = ""
    gpus: int = 8  # its TRES gres/gpu: one whole node's GPUs

    def info(self) -> JobInfo:
        return JobInfo(
            job_id=self.job_id,
            name=f"train-{self.job_id}",
            user=self.user,
            state=self.state,
            restarts=self.restarts,
            nodes=self.node,
            requeue=self.requeue,
            start_time=self.start_time,
            gpus=self.gpus,
        )


class SimulatedSlurm:
    """An in-memory slurmctld: ``training`` nodes each running one job in ``partition``, and
    ``spares`` outside every partition, idle (what a warm spare is)."""

    def __init__(
        self,
        *,
        partition: str,
        training: Iterable[str],
        spares: Iterable[str] = (),
        checkpoint_seconds: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        gpus_per_node: int = 8,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._checkpoint = checkpoint_seconds
        self._nodes: dict[str, _Node] = {}
        # Membership in order, as scontrol lists it (a dict is an ordered set).
        self._partitions: dict[str, dict[str, None]] = {partition: {}}
        self._jobs: dict[int, _Job] = {}
        self._queue: deque[int] = deque()  # pending jobs, first come first served
        self._exiting: dict[int, float] = {}
        # Nodes that may have become free since the scheduler last looked (checked there): a
        # scan of ten thousand busy nodes per pending job would be the bench's bound, not gpufleet.
        self._maybe_free: set[str] = set()
        self.counts = {"drains": 0, "signals": 0, "requeues": 0, "restarts": 0, "partition_edits": 0}
        for name in training:
            self._nodes[checked_node_name(name)] = _Node(name)
            self._partitions[partition][name] = None
            job = _Job(job_id=len(self._jobs) + 1, partition=partition, user="researcher", gpus=gpus_per_node)
            self._jobs[job.job_id] = job
            self._start(job, name)
        for name in spares:
            self._nodes[checked_node_name(name)] = _Node(name)

    # -- the simulation ---------------------------------------------------------------------------

    def _start(self, job: _Job, node: str) -> None:
        job.state, job.node, job.start_time = "RUNNING", node, datetime.now(UTC)
        self._nodes[node].jobs.add(job.job_id)

    def _advance(self) -> None:
        """What slurmctld did since the last call: signalled jobs that exited, pending jobs started."""
        now = self._clock()
        for job_id, at in list(self._exiting.items()):
            if at <= now:
                del self._exiting[job_id]
                job = self._jobs[job_id]
                job.state, job.exits_at = "COMPLETED", None
                self._nodes[job.node].jobs.discard(job_id)
                self._maybe_free.add(job.node)
        if not self._queue or not self._maybe_free:
            return
        self._maybe_free = {name for name in self._maybe_free if self._free(name) and self._in_one(name)}
        waiting: deque[int] = deque()
        while self._queue:
            job = self._jobs[self._queue.popleft()]
            if job.state != "PENDING":
                continue
            members = self._partitions.get(job.partition, {})
            free = next((name for name in self._maybe_free if name in members), None)
            if free is None:
                waiting.append(job.job_id)
                continue
            self._maybe_free.discard(free)
            self._start(job, free)
        self._queue = waiting

    def _in_one(self, name: str) -> bool:
        return any(name in members for members in self._partitions.values())

    def _free(self, name: str) -> bool:
        node = self._nodes[name]
        return not node.jobs and not node.drained and not node.down

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(checked_node_name(name))
        if node is None:
            raise NotFound(f"Slurm has no node named {name!r}")
        return node

    def _job(self, job_id: int) -> _Job:
        job = self._jobs.get(checked_job_id(job_id))
        if job is None:
            raise NotFound(f"Slurm has no job {job_id}")
        return job

    def _info(self, node: _Node) -> NodeInfo:
        state = "down" if node.down else "allocated" if node.jobs else "idle"
        return NodeInfo(
            name=node.name,
            state=state,
            flags=["DRAIN"] if node.drained else [],
            reason=node.reason,
            partitions=[p for p, members in self._partitions.items() if node.name in members],
        )

    # -- nodes ------------------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            self._advance()
            return [self._info(node) for node in self._nodes.values()]

    def node(self, name: str) -> NodeInfo:
        with self._lock:
            self._advance()
            return self._info(self._node(name))

    def drain(self, name: str, *, reason: str) -> NodeInfo:
        with self._lock:
            self._advance()
            node = self._node(name)
            theirs = not owned_reason(node.reason) and not takes_over(node.reason, reason)
            if not (node.drained and (theirs or node.reason == reason)):
                node.drained, node.reason = True, reason
                self.counts["drains"] += 1
            return self._info(node)

    def down(self, name: str, *, reason: str) -> None:
        with self._lock:
            node = self._node(name)
            if node.reason and not owned_reason(node.reason):
                raise NotOwned(f"{name} is held by someone else ({node.reason!r}); leaving it as it is")
            node.down, node.reason = True, reason

    def resume(self, name: str) -> None:
        with self._lock:
            self._advance()
            node = self._node(name)
            if not node.drained and not node.down:
                return
            if node.reason and not owned_reason(node.reason):
                raise NotOwned(f"{name} was taken out by someone else ({node.reason!r}); not resuming it")
            node.drained, node.down, node.reason = False, False, ""
            self._maybe_free.add(node.name)
            self._advance()

    # -- jobs -------------------------------------------------------------------------------------

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        with self._lock:
            self._advance()
            node = self._node(name)
            return [self._jobs[job_id].info() for job_id in sorted(node.jobs)]

    def recent_jobs_on_node(self, name: str) -> list[JobInfo]:
        with self._lock:
            self._advance()
            self._node(name)
            return [job.info() for job in self._jobs.values() if job.node == name]

    def accounted_jobs(self, name: str, since: datetime) -> list[JobInfo] | None:
        return None  # no accounting database

    def pending(self, partition: str) -> Pending:
        with self._lock:
            self._advance()
            jobs = [self._jobs[job_id] for job_id in self._queue if self._jobs[job_id].partition == partition]
            return Pending(jobs=len(jobs), nodes=len(jobs), gpus=8 * len(jobs))

    def partition_jobs(self, partition: str) -> list[JobInfo]:
        with self._lock:
            self._advance()
            members = self._partitions.get(checked_node_name(partition), {})
            return [self._jobs[job_id].info() for name in members for job_id in sorted(self._nodes[name].jobs)]

    def hostnames(self, hostlist: str) -> list[str]:
        if "[" in hostlist:
            raise InvalidInput(f"the simulated cluster names no node ranges: {hostlist!r}")
        return [name for name in hostlist.split(",") if name]

    def jobs_by_id(self, job_ids: list[int]) -> dict[int, JobInfo]:
        wanted = {checked_job_id(job_id) for job_id in job_ids}
        with self._lock:
            self._advance()
            return {job_id: self._jobs[job_id].info() for job_id in wanted if job_id in self._jobs}

    def job(self, job_id: int) -> JobInfo:
        with self._lock:
            self._advance()
            return self._job(job_id).info()

    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None:
        if signal not in {"TERM", "INT", "USR1", "USR2", "HUP"}:
            raise InvalidInput(f"refusing to send signal {signal!r}")
        with self._lock:
            self._advance()
            job = self._job(job_id)
            if job.state != "RUNNING":
                raise InvalidInput(f"job {job_id} is not running ({job.state})")
            self.counts["signals"] += 1
            if signal == "TERM" and job.exits_at is None:
                job.exits_at = self._clock() + self._checkpoint
                self._exiting[job.job_id] = job.exits_at

    def requeue(self, job_id: int) -> None:
        with self._lock:
            self._advance()
            job = self._job(job_id)
            if job.state == "PENDING":
                return
            if not job.requeue:
                raise InvalidInput(f"job {job_id} was submitted with --no-requeue")
            if job.node:
                self._nodes[job.node].jobs.discard(job.job_id)
                self._maybe_free.add(job.node)
            self._exiting.pop(job.job_id, None)
            job.state, job.node, job.exits_at, job.start_time = "PENDING", "", None, None
            job.restarts += 1
            self.counts["requeues"] += 1
            self._queue.append(job.job_id)
            self._advance()

    def job_marks(self, job_id: int) -> list[str]:
        with self._lock:
            comment = self._job(job_id).admin_comment
            return [part.strip() for part in comment.split(";") if part.strip().startswith("gpufleet:")]

    def mark_job(self, job_id: int, mark: str) -> bool:
        with self._lock:
            self._advance()
            job = self._job(job_id)
            if mark in job.admin_comment.split("; "):
                return True
            if job.state in _FINISHED:
                return False  # slurmctld: "Job has already finished"
            job.admin_comment = f"{job.admin_comment}; {mark}" if job.admin_comment else mark
            return True

    def topology(self) -> SlurmTopology:
        """The simulated cluster has no switches."""
        return SlurmTopology(note="the simulated Slurm has no switch topology")

    # -- partitions -------------------------------------------------------------------------------

    def partition_nodes(self, partition: str) -> list[str]:
        with self._lock:
            return list(self._partitions.get(checked_node_name(partition), {}))

    def add_to_partition(self, partition: str, node: str) -> None:
        with self._lock:
            self._node(node)
            members = self._partitions.setdefault(checked_node_name(partition), {})
            if node not in members:
                members[node] = None
                self.counts["partition_edits"] += 1
                self._maybe_free.add(node)
            self._advance()

    def remove_from_partition(self, partition: str, node: str) -> None:
        with self._lock:
            self._node(node)
            members = self._partitions.get(checked_node_name(partition), {})
            if node in members:
                if len(members) == 1:
                    raise LastNodeOfPartition(f"{node} is the last node of partition {partition}")
                del members[node]
                self.counts["partition_edits"] += 1

    # -- for the bench ----------------------------------------------------------------------------

    def running_again(self) -> int:
        """Jobs that restarted and run again now (each a job the bench's incidents requeued)."""
        with self._lock:
            self._advance()
            return sum(1 for job in self._jobs.values() if job.restarts and job.state in _ACTIVE)
