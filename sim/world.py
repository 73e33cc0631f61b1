"""The simulated fleet of a what-if run (docs/whatif.md#the-model): nodes, spares, jobs, in memory.

The world is the ground truth the what-if measures goodput from. It never runs on its own: each
stand-in activity (sim/activities.py) first brings it up to the activity's own time
(:meth:`World.advance`), which applies in order what happened meanwhile: a node back from a repair
in place, a retired node back from its repair as a spare, a signalled job exiting once its
checkpoint is written, a pending job starting once enough nodes are free. Times are seconds since
the run's start.

A job runs on whole nodes. Each run begins with a start-up (loading the checkpoint) that trains
nothing; after it the job trains ``steps_per_second`` optimizer steps a second and saves a
checkpoint every ``checkpoint_seconds``. A crash loses the work since the last one (the steps
trained since, to compute again); a SIGTERM makes the job write one (``checkpoint_write_seconds``)
and exit, so it loses nothing. Every second a job does not train counts against the failure that
stopped it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from models.policy import Action

START_CAUSE = "start"


# The longest time any modelled wait may take (a year): beyond it a timer cannot be set, and
# nothing in a what-if of at most 366 days needs more.
LONGEST = 366 * 86400.0
Seconds = Annotated[float, Field(ge=0, le=LONGEST)]


class JobSpec(BaseModel):
    """One training job of the simulated fleet."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # Nodes it runs on (0: the whole training fleet).
    nodes: int = Field(default=0, ge=0)
    checkpoint_seconds: float = Field(default=1800.0, gt=0, le=LONGEST)
    # Start-up of each run until it trains again: scheduling, loading the checkpoint, warm-up.
    restart_seconds: Seconds = 600.0
    # How long writing a checkpoint takes after SIGTERM (within the incident's grace).
    checkpoint_write_seconds: Seconds = 60.0
    # Optimizer steps per second of training (after the start-up): one every 8 s by default.
    steps_per_second: float = Field(default=0.125, gt=0, le=1e6)


class FleetSpec(BaseModel):
    """The simulated fleet and its outside world: what a what-if case runs on."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    nodes: int = Field(default=2048, ge=1)
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    spares: int = Field(default=0, ge=0)
    jobs: list[JobSpec] = Field(default_factory=lambda: [JobSpec()])
    # From the failure until gpufleet's detector reports it (the kernel log line, the intake).
    detection_seconds: Seconds = 30.0
    # How long each action keeps the node out: a reset or a reboot in place, or (REPLACE_NODE) the
    # retired node's repair until it is back in the pool as a spare.
    repair_seconds: dict[Action, Seconds] = Field(
        default_factory=lambda: {
            Action.RESET_GPU: 300.0,
            Action.REBOOT_NODE: 900.0,
            Action.REPLACE_NODE: 3 * 86400.0,
        }
    )
    # Per cause: the least action that fixes the node (a lesser repair does not hold and the
    # incident escalates). A cause not named here is fixed by any action.
    needs: dict[str, Action] = Field(default_factory=dict)

    def repair_time(self, action: Action) -> float:
        return self.repair_seconds.get(action, 0.0)


class Where(StrEnum):
    PARTITION = "partition"  # a training node (or a spare that joined the partition)
    POOL = "pool"  # a free spare
    REPAIR = "repair"  # retired, being repaired; back in the pool at ``back_at``
    QUARANTINED = "quarantined"  # retired for good (a lemon)


@dataclass
class Node:
    name: str
    where: Where
    drained: str = ""  # the Slurm drain reason ("" when not drained)
    # A failure gpufleet saw and nothing fixed yet: the least action that fixes it.
    fault: Action | None = None
    fault_cause: str = ""
    busy_until: float = 0.0  # a repair in place keeps it until then
    back_at: float = math.inf  # in repair: back in the pool then
    quarantine: str = ""
    job: int | None = None
    claimed_by: str = ""

    def usable(self, now: float) -> bool:
        return self.where is Where.PARTITION and not self.drained and self.fault is None and self.busy_until <= now


@dataclass
class Job:
    job_id: int
    spec: JobSpec
    size: int
    gpus: int
    state: str = "PENDING"
    nodes: list[str] = field(default_factory=list)
    restarts: int = 0
    start: float = 0.0  # the current run's start (allocation)
    productive: float = 0.0  # when the current run trains (start + restart_seconds)
    checkpointed: float = 0.0  # the last checkpoint's time
    exit_at: float = math.inf  # signalled: exits once its checkpoint is written
    ended_at: float | None = None
    pending_since: float = 0.0
    # Why it is not training now (the cause of the failure that stopped it), and since when.
    down_cause: str = ""
    down_since: float = 0.0
    # The cause charged with the current run's start-up.
    run_cause: str = ""
    # Seconds that trained and were kept.
    trained: float = 0.0

    @property
    def steps_trained(self) -> float:
        """Optimizer steps trained and kept (``trained`` seconds at the job's step rate)."""
        return self.trained * self.spec.steps_per_second


@dataclass
class FailureRecord:
    at: float
    cause: str
    node: str | None
    visible: bool
    kills_job: bool
    job: int | None = None  # the job it stopped
    lost_work: float = 0.0  # seconds of training lost since the last checkpoint
    lost_steps: float = 0.0  # the steps trained in those seconds, to compute again
    incident: tuple[str, str] | None = None  # (workflow ID, run ID) of the incident it opened
    # The job it stopped: when it was stopped (SIGTERM, or the crash), ran again, trained again.
    stopped_at: float | None = None
    running_again_at: float | None = None
    training_again_at: float | None = None


class World:
    """One case's fleet: ``spec``'s nodes, spares and jobs, started at second 0 with every job
    training."""

    def __init__(self, spec: FleetSpec, *, seed: int = 0) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.now = 0.0
        width = max(4, len(str(spec.nodes)))
        self.nodes: dict[str, Node] = {}
        for index in range(spec.nodes):
            name = f"gpu{index + 1:0{width}d}"
            self.nodes[name] = Node(name=name, where=Where.PARTITION)
        for index in range(spec.spares):
            name = f"spare{index + 1:03d}"
            self.nodes[name] = Node(name=name, where=Where.POOL)
        self.jobs: dict[int, Job] = {}
        free = [name for name, node in self.nodes.items() if node.where is Where.PARTITION]
        for index, job_spec in enumerate(spec.jobs):
            size = job_spec.nodes or spec.nodes
            job = Job(job_id=1000 + index, spec=job_spec, size=size, gpus=size * spec.gpus_per_node)
            self.jobs[job.job_id] = job
            if len(free) >= size:  # running from the start, training at once
                job.nodes, free = free[:size], free[size:]
                for name in job.nodes:
                    self.nodes[name].job = job.job_id
                job.state = "RUNNING"
        # What happened, for the report.
        self.failures: list[FailureRecord] = []
        self.lost_by_cause: dict[str, float] = {}  # GPU-seconds
        self.lost_work_by_cause: dict[str, float] = {}
        self.lost_steps_by_cause: dict[str, float] = {}  # steps trained since a checkpoint, lost
        self.spares_claimed = 0
        self.spare_waits: dict[str, float] = {}  # incident: since when it waited for a spare
        self.waiting_nodes: dict[str, str] = {}  # incident: its node, while it waits for a spare
        self.spare_waited: float = 0.0  # seconds incidents waited for a spare, all together
        self.repairs: dict[Action, int] = {}
        self.retired = 0
        # A trace's own node names, each given one of the fleet's nodes as it first appears.
        self.aliases: dict[str, str] = {}

    # -- time ------------------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Apply, in order, what happened up to ``now``."""
        now = max(now, self.now)
        while True:
            moments = [node.busy_until for node in self.nodes.values() if self.now < node.busy_until <= now]
            moments += [node.back_at for node in self.nodes.values() if node.back_at <= now]
            moments += [job.exit_at for job in self.jobs.values() if job.exit_at <= now]
            if not moments:
                break
            moment = max(min(moments), self.now)
            for node in self.nodes.values():
                if node.back_at <= moment:
                    node.back_at = math.inf
                    node.fault = None
                    node.where = Where.QUARANTINED if node.quarantine else Where.POOL
            for job in self.jobs.values():
                if job.exit_at <= moment:
                    self._exit(job, job.exit_at)
            self.now = moment
            self._schedule(moment)
        self.now = now
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        """Start the pending jobs that fit on the usable free nodes, in order of their IDs."""
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            if job.state != "PENDING":
                continue
            free = [node for node in self.nodes.values() if node.job is None and node.usable(now)]
            if len(free) < job.size:
                continue
            job.nodes = [node.name for node in free[: job.size]]
            for name in job.nodes:
                self.nodes[name].job = job.job_id
            job.state = "RUNNING"
            job.restarts += 1
            job.ended_at = None
            self._run(job, now)

    def _run(self, job: Job, start: float) -> None:
        """A run of ``job`` begins at ``start``: it trains after its start-up; the time it did not
        train goes to the cause that stopped it."""
        job.start = start
        job.productive = start + job.spec.restart_seconds
        job.run_cause = job.down_cause or START_CAUSE
        self._lose(job.run_cause, (job.productive - job.down_since) * job.gpus)
        job.down_cause = ""
        for failure in self.failures:
            if failure.job == job.job_id and failure.running_again_at is None:
                failure.running_again_at, failure.training_again_at = start, job.productive

    def _lose(self, cause: str, gpu_seconds: float) -> None:
        """Charge ``cause`` (a negative figure gives back a start-up charged ahead and cut short)."""
        if gpu_seconds:
            self.lost_by_cause[cause] = self.lost_by_cause.get(cause, 0.0) + gpu_seconds

    def _stop(self, job: Job, at: float, cause: str, *, saved: bool) -> None:
        """The run ends at ``at``: what it trained is kept up to its last checkpoint (up to ``at``
        when ``saved``); the rest is lost work."""
        trained = max(0.0, at - job.productive)
        kept = trained if saved else self.saved(job, at)
        job.trained += kept
        if at >= job.productive and (saved or kept > 0):
            job.checkpointed = job.productive + kept
        lost = trained - kept
        steps = lost * job.spec.steps_per_second
        if lost > 0:
            self._lose(cause, lost * job.gpus)
            self.lost_work_by_cause[cause] = self.lost_work_by_cause.get(cause, 0.0) + lost * job.gpus
            self.lost_steps_by_cause[cause] = self.lost_steps_by_cause.get(cause, 0.0) + steps
        # A run stopped during its start-up already counted its start-up past ``at``: given back.
        if at < job.productive:
            self._lose(job.run_cause or START_CAUSE, -(job.productive - at) * job.gpus)
        job.productive = at
        job.down_cause, job.down_since = cause, at
        for failure in reversed(self.failures):
            if failure.job == job.job_id and failure.stopped_at is None:
                failure.lost_work, failure.lost_steps, failure.stopped_at = lost, steps, at
                break

    def saved(self, job: Job, at: float) -> float:
        """Seconds of the current run's training kept by its last checkpoint before ``at``."""
        trained = max(0.0, at - job.productive)
        interval = job.spec.checkpoint_seconds
        return math.floor(trained / interval + 1e-9) * interval

    def checkpoint_time(self, job: Job, at: float) -> float:
        """When ``job`` last wrote a checkpoint (as its Comment says: gpufleet:checkpoint:<unix>)."""
        if job.state == "RUNNING" and job.exit_at == math.inf and at >= job.productive and self.saved(job, at) > 0:
            return job.productive + self.saved(job, at)
        return job.checkpointed

    def _exit(self, job: Job, at: float) -> None:
        """A signalled job exits with its checkpoint written."""
        job.exit_at = math.inf
        job.state = "COMPLETED"
        job.ended_at = at
        self._release(job)

    def _release(self, job: Job) -> None:
        for name in job.nodes:
            if self.nodes[name].job == job.job_id:
                self.nodes[name].job = None

    # -- failures ----------------------------------------------------------------------------------

    def fail(self, at: float, *, cause: str, node: str | None, visible: bool, kills_job: bool) -> FailureRecord:
        """A failure at ``at`` on ``node`` (None: one of the usable training nodes, picked at
        random); a visible one leaves a fault only an action fixes."""
        self.advance(at)
        pick = self.rng.random()  # drawn whatever happens, so that every case draws alike
        candidates = [n for n in self.nodes.values() if n.usable(at)]
        if node is not None and node not in self.nodes:
            # A trace's node: the same fleet node each time it fails again (while usable).
            if node not in self.aliases and candidates:
                taken = set(self.aliases.values())
                free = [n for n in candidates if n.name not in taken] or candidates
                self.aliases[node] = free[int(pick * len(free))].name
            node = self.aliases.get(node)
        if node is None or not self.nodes[node].usable(at):
            node = candidates[int(pick * len(candidates))].name if candidates else None
        record = FailureRecord(at=at, cause=cause, node=node, visible=visible, kills_job=kills_job)
        self.failures.append(record)
        target = self.nodes.get(node) if node is not None else None
        if target is None:
            return record
        job = self.jobs.get(target.job) if target.job is not None else None
        if job is not None and job.state == "RUNNING" and job.exit_at == math.inf:
            record.job = job.job_id  # stopped now (a crash), or later by the incident
        if job is not None and job.state == "RUNNING" and job.exit_at == math.inf and kills_job:
            self._stop(job, at, cause, saved=False)
            if visible:
                # Slurm ends the job (NODE_FAIL): it waits in the queue once an incident requeues it.
                job.state = "NODE_FAIL"
                job.ended_at = at
                self._release(job)
            else:
                # Nothing for gpufleet to see: the job restarts at once on its own nodes.
                job.restarts += 1
                self._run(job, at)
        if visible:
            target.fault = self.spec.needs.get(cause, Action.RESET_GPU)
            target.fault_cause = cause
        self._schedule(at)
        return record

    # -- what the stand-in activities do --------------------------------------------------------

    def drain(self, node: str, reason: str) -> Node:
        target = self.nodes[node]
        target.drained = reason
        return target

    def resume(self, node: str) -> Node:
        target = self.nodes[node]
        target.drained = ""
        self._schedule(self.now)
        return target

    def signal(self, job_id: int) -> bool:
        """SIGTERM: the job writes its checkpoint and exits (at once when it is still starting)."""
        job = self.jobs[job_id]
        if job.state != "RUNNING" or job.exit_at < math.inf:
            return job.state == "RUNNING"
        now = self.now
        writing = job.spec.checkpoint_write_seconds if now >= job.productive else 0.0
        cause = self._cause_on(job)
        self._stop(job, now, cause, saved=True)
        job.exit_at = now + writing
        if writing == 0:
            self._exit(job, now)
        return True

    def _cause_on(self, job: Job) -> str:
        """The cause of the failure that made an incident stop ``job`` (the fault on its nodes)."""
        for name in job.nodes:
            if self.nodes[name].fault_cause and (self.nodes[name].fault is not None or self.nodes[name].drained):
                return self.nodes[name].fault_cause
        return "drained"

    def requeue(self, job_id: int) -> bool:
        """Back in the queue (killed first when still running: its unsaved work is lost)."""
        job = self.jobs[job_id]
        now = self.now
        if job.state == "RUNNING":
            if job.exit_at < math.inf:
                self._exit(job, now)  # killed while writing its checkpoint: it was kept up to SIGTERM
            else:
                self._stop(job, now, self._cause_on(job), saved=False)
                self._release(job)
        if job.state == "PENDING":
            return True
        job.state = "PENDING"
        job.pending_since = now
        self._schedule(now)
        return True

    def announce(self) -> list[str]:
        """The nodes of incidents waiting for a spare, as many as there are free spares: told now."""
        free = sum(1 for node in self.nodes.values() if node.where is Where.POOL and not node.claimed_by)
        waiting = sorted(self.spare_waits, key=lambda incident: self.spare_waits[incident])
        return [self.waiting_nodes[incident] for incident in waiting[:free] if incident in self.waiting_nodes]

    def next_return(self) -> float:
        """When to look for returned spares next: the next return from repair, at the latest the
        repair time from now (a node retired after now returns no sooner)."""
        later = self.now + max(60.0, self.spec.repair_time(Action.REPLACE_NODE))
        return min([later] + [node.back_at for node in self.nodes.values() if node.back_at > self.now])

    def claim(self, incident: str, failed: str = "") -> str | None:
        """A free spare joins the partition; None when none is free. Asked again for the same
        incident, the spare it claimed already (as the real claim_spare answers a retry)."""
        for node in self.nodes.values():
            if node.claimed_by == incident and node.where in (Where.POOL, Where.PARTITION):
                return node.name
        for node in self.nodes.values():
            if node.where is Where.POOL and not node.claimed_by:
                node.where = Where.PARTITION
                node.claimed_by = incident
                node.drained = ""
                self.spares_claimed += 1
                self.waiting_nodes.pop(incident, None)
                since = self.spare_waits.pop(incident, None)
                if since is not None:
                    self.spare_waited += self.now - since
                self._schedule(self.now)
                return node.name
        self.spare_waits.setdefault(incident, self.now)
        if failed:
            self.waiting_nodes[incident] = failed
        return None

    def retire(self, node: str) -> None:
        target = self.nodes[node]
        if target.where is not Where.PARTITION:
            return
        self.retired += 1
        target.where = Where.REPAIR
        target.drained = ""
        target.claimed_by = ""
        target.back_at = self.now + self.spec.repair_time(Action.REPLACE_NODE)

    def repair(self, node: str, action: Action) -> bool:
        """A reset or reboot in place: it holds when it is at least what the fault needs."""
        target = self.nodes[node]
        self.repairs[action] = self.repairs.get(action, 0) + 1
        if target.fault is not None and target.fault.severity > action.severity:
            return False
        target.fault = None
        target.busy_until = max(target.busy_until, self.now + self.spec.repair_time(action))
        return True

    def jobs_on(self, node: str, *, since: float | None = None) -> list[Job]:
        """The jobs on ``node`` now, and (``since``) those that ended there since then."""
        found = []
        for job in self.jobs.values():
            if node not in job.nodes:
                continue
            if job.state == "RUNNING" or (since is not None and job.ended_at is not None and job.ended_at >= since):
                found.append(job)
        return found

    # -- the end -----------------------------------------------------------------------------------

    def finish(self, end: float) -> None:
        """The run's end: the training of running jobs is kept; the time pending jobs waited goes to
        the cause that stopped them."""
        self.advance(end)
        for job in self.jobs.values():
            if job.state == "RUNNING" and job.exit_at == math.inf:
                if end < job.productive:  # still starting: the start-up past the end is not lost
                    self._lose(job.run_cause or START_CAUSE, -(job.productive - end) * job.gpus)
                else:
                    job.trained += end - job.productive
                job.productive = end
            else:
                self._lose(job.down_cause or "drained", (end - job.down_since) * job.gpus)
                job.down_since = end
        for since in self.spare_waits.values():
            self.spare_waited += end - since
        self.spare_waits.clear()

    def trained_gpu_seconds(self) -> float:
        return sum(job.trained * job.gpus for job in self.jobs.values())

    def steps_trained(self) -> float:
        """Optimizer steps the jobs trained and kept, all together."""
        return sum(job.steps_trained for job in self.jobs.values())

    def steps_lost(self) -> float:
        """Optimizer steps trained since a checkpoint and lost to a crash, to compute again."""
        return sum(self.lost_steps_by_cause.values())
