"""``make bench``: K recovery drills in one lab, as JSON.

First the detector's figures: parse throughput over a large mixed kernel log (one core) and
a real detector's idle CPU (bench/parse_bench.py), and the line-to-incident latency.

Then cluster creation and deletion of examples/cluster.yaml on the lab's free pool
(``cluster_create_seconds``: spec to smoke test passed; ``cluster_delete_seconds``). Last, a
shared-pool node moved to inference and back with a checkpointing job on it
(``pool_move_to_inference_seconds`` and ``pool_move_to_training_seconds``: decision to serving
on the other side; ``training_steps_lost_per_move``).

Besides each drill's timings and their medians, it splits every incident's time using the
workflow history: the control-plane overhead (activities and workflow tasks waiting to be
picked up, and workflow tasks being decided) apart from the time spent in Slurm, Kubernetes
and the job itself (activities running, timers between checks).

``--flavor slinky`` (``make bench FLAVOR=slinky``) runs the drills, the cluster creation and the
pool moves on the lab's slinky flavor (NodeSet pods as dynamic Slurm 26.05 nodes, the worker on
slurmrestd): the cluster is created with ``--backend slinky`` (the operator stand-in brings it
up), and a pool move scales the NodeSet in and out. The JSON's ``clusters`` and ``pool`` say so
(``backend``, ``flavor``). The parts that do not depend on the flavor are skipped and the JSON
says why (``skipped``: ``SLINKY_SKIPS``).

Every lab's home is a folder of its own under /tmp, short and readable by all: a Slinky
cluster's users run their jobs from its spool, and a job step's socket there must fit in 108
bytes (docs/lab.md); the bench refuses to start where it would not (``cluster_home_problem``).

The JSON begins with its ``provenance`` (the commit, the date, the machine: lab/provenance.py),
then the ``flavor``; ``make bench`` keeps it in docs/results/bench.json (``FLAVOR=slinky``:
bench-slinky.json) and regenerates docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client
from temporalio.service import RPCError

from bench.health_bench import health_check_wall
from bench.parse_bench import detector_idle_cpu, parse_throughput, source_throughput
from clients.kube import KubernetesApi, PodRef
from lab.drill import default_job, log_path, reset_breaker, run_drill, training_job
from lab.fleet import LAB_POLL_SECONDS, REPO_ROOT, FleetLab, LabConfig
from lab.procs import free_port, port_in_use, spawn, stop, wait_for
from lab.provenance import provenance, write_result
from lab.slinkyclusters import too_deep
from lab.slinkylab import FLAVORS, SLINKY_RELEASE
from models.slinky import nodeset_name
from starters.server import dev_server_argv
from starters.temporal import connect

_SCHEDULED = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
_STARTED = EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
# The parts of the bench the slinky flavor skips (their option, why): the JSON's ``skipped``.
SLINKY_SKIPS = {
    "parse": (
        "--parse-lines",
        "the parser on one core runs no lab: the same code and figures on either flavor (make bench's)",
    ),
    "detector_idle": (
        "--idle-seconds",
        "a detector on a quiet log runs no lab: the same on either flavor (make bench's)",
    ),
    "health_check": (
        "--health-checks",
        "gpufleet health-check on the NVML stand-in runs no lab: the same on either flavor (make bench's)",
    ),
    "detector": (
        "--detector-samples",
        "a kernel-log line to its incident goes through a detector and Temporal alone, no lab: the same on "
        "either flavor (make bench's)",
    ),
}

_CLOSED = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
}


def _t(event: HistoryEvent) -> float:
    return event.event_time.ToDatetime().timestamp()


def breakdown(events: list[HistoryEvent], *, poll_seconds: float) -> dict[str, Any]:
    """Where an incident's time went, from its workflow history.

    The control-plane overhead is what is ours: activities and workflow tasks waiting,
    scheduled but not started, plus our polling delay (bounded: the last wait before the jobs
    were seen stopped, a timer or one worker poll, and the worker's poll while waiting for
    the resume).
    Workflow-task processing, activities running (Slurm, Kubernetes, the job) and timers
    are reported apart.
    """
    activity_type: dict[int, str] = {}
    scheduled: dict[int, float] = {}
    started: dict[int, float] = {}
    activity_queue = 0.0
    running: dict[str, float] = defaultdict(float)
    wf_scheduled: dict[int, float] = {}
    wf_started: dict[int, float] = {}
    wf_queue = 0.0
    wf_processing = 0.0
    timers: dict[int, float] = {}
    timer_wait = 0.0
    last_timer = 0.0
    grace_check_delay: float | None = None
    for event in events:
        kind = event.event_type
        if kind == _SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            activity_type[event.event_id] = name
            scheduled[event.event_id] = _t(event)
            if name == "requeue_job" and grace_check_delay is None:
                # Seen stopping after a timer: late by at most that timer; else by one worker poll.
                grace_check_delay = last_timer or poll_seconds
        elif kind == _STARTED:
            sid = event.activity_task_started_event_attributes.scheduled_event_id
            started[sid] = _t(event)
            activity_queue += _t(event) - scheduled[sid]
        elif kind in _CLOSED:
            attrs = (
                event.activity_task_completed_event_attributes
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                else event.activity_task_failed_event_attributes
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                else None
            )
            if attrs is not None and attrs.scheduled_event_id in started:
                sid = attrs.scheduled_event_id
                running[activity_type[sid]] += _t(event) - started[sid]
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            wf_scheduled[event.event_id] = _t(event)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            sid = event.workflow_task_started_event_attributes.scheduled_event_id
            wf_started[sid] = _t(event)
            wf_queue += _t(event) - wf_scheduled.get(sid, _t(event))
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            sid = event.workflow_task_completed_event_attributes.scheduled_event_id
            wf_processing += _t(event) - wf_started.get(sid, _t(event))
        elif kind == EventType.EVENT_TYPE_TIMER_STARTED:
            timers[event.event_id] = _t(event)
        elif kind == EventType.EVENT_TYPE_TIMER_FIRED:
            sid = event.timer_fired_event_attributes.started_event_id
            last_timer = _t(event) - timers.get(sid, _t(event))
            timer_wait += last_timer
    resume_poll = poll_seconds if "jobs_resumed" in activity_type.values() else 0.0
    polling = (grace_check_delay or 0.0) + resume_poll
    return {
        "control_plane_overhead_s": round(activity_queue + wf_queue + polling, 3),
        "activity_queue_wait_s": round(activity_queue, 3),
        "workflow_task_queue_wait_s": round(wf_queue, 3),
        "polling_delay_bound_s": round(polling, 3),
        "workflow_task_processing_s": round(wf_processing, 3),
        "timers_s": round(timer_wait, 3),
        "activity_running_s": {name: round(seconds, 3) for name, seconds in sorted(running.items())},
    }


async def history_breakdown(client: Client, workflow_id: str, run_id: str | None = None) -> dict[str, Any]:
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    return breakdown(list(history.events), poll_seconds=float(LAB_POLL_SECONDS))


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


async def bench(drills: int, *, home: Path, job_kind: str | None, say: Any, flavor: str = "default") -> dict[str, Any]:
    config = LabConfig(
        training=["gpu1", "gpu2", "gpu3", "gpu4"],
        spares=[f"spare{i + 1}" for i in range(drills)],
        temporal_port=0,
        ui_port=0,
        flavor=flavor,
    )
    if flavor == "slinky":
        config.slurm = SLINKY_RELEASE  # its dynamic nodes need it
    lab = FleetLab(home, config)
    lab.up(say=say)
    results = []
    try:
        job_kind = job_kind or default_job(lab)
        # What the drills ran on: two flavors' figures differ by these as much as by the flavor.
        setup = {
            "flavor": flavor,
            "slurm": lab.slurm.install.version,
            "slurm_backend": "rest" if lab.slinky else "cli",  # slurmrestd, or the Slurm commands
            "job": job_kind,
            "partition": lab.partition,
        }
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        for index in range(drills):
            say(f"drill {index + 1} of {drills}")
            # Three drills on four nodes within ten minutes would trip the fleet guard's breaker (its
            # default: half the partition in ten minutes): reset between drills, as an operator would.
            await reset_breaker(lab, reason="bench: the next drill")
            result = await run_drill(lab, job_kind=job_kind, say=say)
            description = await client.get_workflow_handle(result["workflow_id"]).describe()
            result["history"] = await history_breakdown(client, result["workflow_id"], description.run_id)
            results.append(result)
    finally:
        lab.down(say=say)
    names = list(results[0]["timings_s"]) if results else []
    return {
        "lab": setup,
        "drills": results,
        "medians_s": {name: _median([r["timings_s"][name] for r in results]) for name in names},
        "median_control_plane_overhead_s": _median([r["history"]["control_plane_overhead_s"] for r in results]),
        "median_polling_delay_bound_s": _median([r["history"]["polling_delay_bound_s"] for r in results]),
        "targets_s": {"detect_to_replaced": 10, "detect_to_resumed": 30, "control_plane_overhead": 1},
    }


SPEC = REPO_ROOT / "examples" / "cluster.yaml"
# The cluster part's lab home, inside the bench's folder: a short name (see cluster_home_problem).
CLUSTERS_HOME = "c"


def bench_folder() -> Path:
    """The bench's own folder: under /tmp whatever $TMPDIR says, short, and readable by every
    user (a Slinky cluster's users run their jobs from its spool under it)."""
    folder = Path(tempfile.mkdtemp(prefix="gf-bench-", dir="/tmp"))
    folder.chmod(0o755)
    return folder


def cluster_home_problem(home: Path, spec: dict[str, Any]) -> str:
    """Why the Slinky cluster of ``spec`` could not run its jobs from the lab home ``home`` ('' when
    it can): a job step's socket in its spool, ``<home>/clusters/<name>/spool/<pod>/...``, must fit
    in 108 bytes (lab/slinkyclusters.py), and every folder down to the home must let its users in."""
    name = str(spec["name"])
    nodesets = [nodeset_name(name, str(p["name"])) for p in spec.get("partitions") or []]
    if problem := too_deep(home / "clusters" / name, nodesets):
        return problem
    for folder in [home, *home.parents]:
        if folder.exists() and not folder.stat().st_mode & 0o001:
            return f"{folder} is not reachable by other users: the cluster's users run their jobs from under it"
    return ""


def _cluster_cli(lab: FleetLab, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "workers.entry", "cluster", *args, "--json"],
        env=lab.env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"gpufleet cluster {' '.join(args)} failed: {done.stdout}{done.stderr}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def cluster_bench(rounds: int, *, home: Path, say: Any, flavor: str = "default") -> dict[str, Any]:
    """Create and delete the example cluster (examples/cluster.yaml) on the lab's free pool,
    ``rounds`` times, through the CLI as a user would: spec to smoke test passed, and back. On the
    slinky flavor with ``--backend slinky`` (the operator stand-in brings the cluster up from its
    objects); on the default flavor with the lab backend."""
    backend = "slinky" if flavor == "slinky" else "lab"
    config = LabConfig(training=["gpu1"], spares=["spare1"], temporal_port=0, ui_port=0, flavor=flavor)
    if flavor == "slinky":
        config.slurm = SLINKY_RELEASE
        if problem := cluster_home_problem(home, yaml.safe_load(SPEC.read_text())):
            raise RuntimeError(f"a Slinky cluster cannot run its jobs from the bench's lab home: {problem}")
    lab = FleetLab(home, config)
    lab.up(say=say)
    creates: list[float | None] = []
    deletes: list[float | None] = []
    torn_down: list[float | None] = []
    name = str(yaml.safe_load(SPEC.read_text())["name"])
    try:
        for index in range(rounds):
            say(f"cluster create and delete (backend {backend}), round {index + 1} of {rounds}")
            created = _cluster_cli(lab, "create", str(SPEC), "--backend", backend)
            if created.get("outcome") != "ready":
                raise RuntimeError(f"gpufleet cluster create ended {created.get('outcome')}: {created}")
            creates.append(created["seconds"])
            deleted = _cluster_cli(lab, "delete", name)
            if deleted.get("outcome") != "deleted":
                raise RuntimeError(f"gpufleet cluster delete ended {deleted.get('outcome')}: {deleted}")
            deletes.append(deleted["seconds"])
            if backend == "slinky":
                torn_down.append(_torn_down_after(lab.home / "clusters" / name, say=say))
    finally:
        lab.down(say=say)
    result: dict[str, Any] = {
        "spec": "examples/cluster.yaml",
        "backend": backend,
        "rounds": rounds,
        "cluster_create_seconds": _median(creates),
        "cluster_delete_seconds": _median(deletes),
        "create_s": creates,
        "delete_s": deletes,
    }
    if backend == "slinky":
        result["torn_down_after_delete_s"] = torn_down
        result["median_torn_down_after_delete_s"] = _median(torn_down)
        result["note"] = (
            "backend slinky: the cluster's Slinky objects applied to the emulated API, the operator stand-in "
            "bringing up Slurm 26.05 from them (slurmctld, slurmrestd, a slurmd -Z per NodeSet pod); the smoke "
            "jobs through its slurmrestd. The deletion ends once its objects are deleted and its nodes free; the "
            "operator stand-in stops the cluster's daemons after that, as slurm-operator does "
            "(torn_down_after_delete_s: from the deletion's end to its folder gone, daemons stopped; null: not "
            "within 120 s)"
        )
    return result


def _torn_down_after(folder: Path, *, say: Any) -> float | None:
    """Seconds from now until the operator stand-in has stopped a deleted Slinky cluster's daemons
    and removed ``folder`` (it does both, in that order); None when it has not within 120 s."""
    began = time.monotonic()
    try:
        wait_for(lambda: not folder.exists(), timeout=120, what=f"{folder} to be torn down")
    except TimeoutError:
        say(f"{folder} is still there 120 s after the deletion ended")
        return None
    return round(time.monotonic() - began, 3)


def slurm_nodes_on(node: str, pods: list[PodRef] | None) -> list[str]:
    """The Slurm nodes a Kubernetes node carries: itself on the default flavor (``pods`` None: the
    Slurm nodes are named after it), its NodeSet pods that are not going on Slinky."""
    if pods is None:
        return [node]
    return sorted(p.name for p in pods if p.owner_kind == "NodeSet" and not p.terminating)


def pool_bench(rounds: int, *, home: Path, say: Any, flavor: str = "default") -> dict[str, Any]:
    """Move a node from training to inference and back, ``rounds`` times, through the CLI as a
    person would (``pool rebalance``), with the checkpointing counter job running on it: each move
    from the decision to the node serving on the other side (inference: labelled and a vLLM pod
    running on it; training: a Slurm node of it in the partition, not drained, and resumed), and
    the training steps lost. On the slinky flavor the move scales the NodeSet in and out, and the
    node's Slurm node is its NodeSet pod."""
    config = LabConfig(
        training=["gpu1", "gpu2"],
        spares=[],
        inference=["inf1"],
        free=[],
        temporal_port=0,
        ui_port=0,
        grace_seconds=5,
        flavor=flavor,
    )
    if flavor == "slinky":
        config.slurm = SLINKY_RELEASE
    lab = FleetLab(home, config)
    lab.up(say=say)
    to_inference: list[float | None] = []
    to_training: list[float | None] = []
    lost: list[float | None] = []

    def cli(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "workers.entry", *args],
            env=lab.env(),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"gpufleet {' '.join(args)} failed: {done.stdout}{done.stderr}")

    try:
        kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
        slurm = lab.slurm.client()
        partition = lab.partition
        hosts = [*config.training, *config.inference]

        def carried(node: str) -> list[str]:
            return slurm_nodes_on(node, kube.pods_on_node(node) if lab.slinky else None)

        def training_hosts() -> set[str]:
            in_partition = set(slurm.partition_nodes(partition))
            return {node for node in hosts if in_partition & set(carried(node))}

        job = training_job(lab, slurm, job_kind="counter", say=say)  # on both training nodes
        log = log_path(job)
        # No query: demand comes from a person alone, so only the asked moves happen.
        cli("pool", "start", "--interval", "1", "--cooldown", "0", "--min-training", "1", "--drain-deadline", "1")
        for index in range(rounds):
            say(f"pool move to inference and back, round {index + 1} of {rounds}")
            training_before = training_hosts()
            began = time.monotonic()
            cli("pool", "rebalance", "--to-inference", "1")

            def serving_inference(training_before: set[str] = training_before) -> str | None:
                for name in training_before:
                    node = kube.get_node(name)
                    if node.labels.get("gpufleet.io/pool") == "inference" and any(
                        p.namespace == "serving" for p in kube.pods_on_node(name)
                    ):
                        return name
                return None

            moved = wait_for(serving_inference, timeout=300, what="a training node serving inference")
            to_inference.append(round(time.monotonic() - began, 3))
            say(f"{moved} serves inference")
            stopped = re.findall(r"SIGTERM: checkpoint saved at step (\d+)", log.read_text())
            training_now = training_hosts()
            began = time.monotonic()
            cli("pool", "rebalance", "--to-training", "1")

            def back_in_training(training_now: set[str] = training_now) -> str | None:
                in_partition = set(slurm.partition_nodes(partition))
                for name in set(hosts) - training_now:
                    if any(s in in_partition and not slurm.node(s).drained for s in carried(name)):
                        return name
                return None

            back = wait_for(back_in_training, timeout=300, what="an inference node back in training")
            say(f"{back} serves training")
            to_training.append(round(time.monotonic() - began, 3))
            seen = log.read_text().count("resumed from step")
            wait_for(
                lambda seen=seen: log.read_text().count("resumed from step") > seen,  # type: ignore[misc]
                timeout=300,
                what="the job to resume",
            )
            resumed = re.findall(r"resumed from step (\d+)", log.read_text())
            lost.append(float(int(stopped[-1]) - int(resumed[-1])) if stopped and resumed else None)
    finally:
        lab.down(say=say)
    note = (
        "decision (pool rebalance) to the node serving the other side; steps lost: the step the job "
        "reached when SIGTERMed minus the step it resumed from"
    )
    if lab.slinky:
        note += (
            "; flavor slinky: a move scales the NodeSet in (its pod on the node first) and out again, no "
            "partition edited; serving training: a NodeSet pod on the node whose Slurm node is in the "
            "partition, not drained"
        )
    return {
        "flavor": flavor,
        "rounds": rounds,
        "pool_move_to_inference_seconds": _median(to_inference),
        "pool_move_to_training_seconds": _median(to_training),
        "training_steps_lost_per_move": _median(lost),
        "to_inference_s": to_inference,
        "to_training_s": to_training,
        "steps_lost": lost,
        "note": note,
    }


async def detector_latency(samples: int, *, home: Path, say: Any) -> dict[str, Any]:
    """Kernel-log line written -> Xid signalled into the incident, through a real detector process.

    The first line starts the node's incident (signal-with-start); later lines, with other
    GPUs so that none is folded, join it. Timestamps come from the workflow history.
    """
    port = free_port()
    server = spawn(
        dev_server_argv(db_file=home / "latency.db", port=port, ui_port=free_port()), log=home / "latency-temporal.log"
    )
    log_file = home / "latency-kern.log"
    log_file.write_text("")
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
        "GPUFLEET_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
    }
    detector = spawn(
        [
            sys.executable,
            "-m",
            "workers.entry",
            "detect",
            "--kmsg",
            str(log_file),
            "--node",
            "bench1",
            "--cluster",
            "bench",
            "--ready-file",
            str(home / "latency-detector.ready"),
        ],
        log=home / "latency-detector.log",
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        wait_for(lambda: port_in_use(port), timeout=60, what="the Temporal dev server")
        client = await connect(address=f"127.0.0.1:{port}")
        handle = client.get_workflow_handle("remediate-bench-bench1")
        wait_for(lambda: (home / "latency-detector.ready").exists(), timeout=60, what="the detector")
        written: list[float] = []
        received: list[float] = []
        for index in range(samples):
            line = f"NVRM: Xid (PCI:0000:{index % 256:02x}:00): 79, GPU has fallen off the bus.\n"
            written.append(time.time())
            with open(log_file, "a") as out:
                out.write(line)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    history = await handle.fetch_history()
                except RPCError:
                    await asyncio.sleep(0.01)
                    continue
                signals = [
                    e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                ]
                if len(signals) > index:
                    received.append(_t(signals[index]))
                    break
                await asyncio.sleep(0.01)
            say(f"detector sample {index + 1} of {samples}")
        latencies = [round(r - w, 4) for w, r in zip(written, received, strict=False)]
    finally:
        stop([detector, server])
    return {
        "samples": len(latencies),
        "line_to_workflow_first_s": latencies[0] if latencies else None,
        "line_to_incident_s": latencies,
        "median_line_to_incident_s": _median(list(latencies)),
        "target_median_s": 1.0,
    }


# The parts' sizes where an option is not given (the slinky flavor's skipped parts apart).
_DEFAULTS: dict[str, float] = {
    "parse_lines": 1_000_000,
    "idle_seconds": 10,
    "detector_samples": 20,
    "health_checks": 20,
    "clusters": 1,
    "pool_moves": 1,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--drills", type=int, default=3, help="how many drills (default 3)")
    parser.add_argument(
        "--flavor",
        choices=FLAVORS,
        default="default",
        help="the lab's flavor (default: default); slinky skips the parts that run no lab (SLINKY_SKIPS)",
    )
    parser.add_argument(
        "--job", choices=["ddp", "counter"], help="training job (default: ddp if torch is there and Slurm on the host)"
    )
    parser.add_argument("--detector-samples", type=int, help="detector latency samples (default 20; 0: skip)")
    parser.add_argument(
        "--parse-lines", type=int, help="lines for the parse-throughput figure (default 1000000; 0: skip)"
    )
    parser.add_argument("--idle-seconds", type=float, help="detector idle-CPU sample (default 10; 0: skip)")
    parser.add_argument(
        "--health-checks", type=int, help="runs of gpufleet health-check, as a prolog (default 20; 0: skip)"
    )
    parser.add_argument("--clusters", type=int, help="cluster create/delete rounds (default 1; 0: skip)")
    parser.add_argument("--pool-moves", type=int, help="pool move rounds, there and back (default 1; 0: skip)")
    parser.add_argument(
        "--output",
        type=Path,
        help="also write the JSON here (make bench: docs/results/bench.json; FLAVOR=slinky: bench-slinky.json)",
    )
    args = parser.parse_args()
    skipped: dict[str, str] = {}
    for part, (option, why) in SLINKY_SKIPS.items():
        name = option.removeprefix("--").replace("-", "_")
        if args.flavor != "slinky":
            if getattr(args, name) is None:
                setattr(args, name, _DEFAULTS[name])
        elif getattr(args, name):  # asked for on the slinky flavor
            parser.error(f"{option} is not run on the slinky flavor: {why}")
        else:
            setattr(args, name, 0)
            skipped[part] = why
    for name, size in _DEFAULTS.items():  # the parts every flavor runs
        if getattr(args, name) is None:
            setattr(args, name, size)
    started = provenance()  # the code this run loaded, the machine it runs on

    def say(message: str) -> None:
        print(message, file=sys.stderr)

    folder = bench_folder()
    if args.flavor == "slinky" and args.clusters:
        problem = cluster_home_problem(folder / CLUSTERS_HOME, yaml.safe_load(SPEC.read_text()))
        if problem:
            shutil.rmtree(folder, ignore_errors=True)
            parser.error(f"a Slinky cluster cannot run its jobs from the bench's lab home: {problem}")
    try:
        tmp = str(folder)
        result: dict[str, Any] = {"provenance": started, "flavor": args.flavor}
        if skipped:
            result["skipped"] = skipped
            for part, why in skipped.items():
                say(f"skipped on the {args.flavor} flavor: {part} ({why})")
        if args.parse_lines:
            say(f"parse throughput over {args.parse_lines} lines")
            result["parse"] = parse_throughput(args.parse_lines)
            result["parse"]["source"] = source_throughput(args.parse_lines, home=Path(tmp))
        if args.idle_seconds:
            say(f"detector idle CPU over {args.idle_seconds:g} s")
            result["detector_idle"] = detector_idle_cpu(args.idle_seconds, home=Path(tmp))
        if args.health_checks:
            say(f"gpufleet health-check's wall time over {args.health_checks} runs")
            result["health_check"] = health_check_wall(args.health_checks, home=Path(tmp))
        if args.detector_samples:
            result["detector"] = asyncio.run(detector_latency(args.detector_samples, home=Path(tmp), say=say))
        if args.drills:
            drilled = bench(args.drills, home=Path(tmp) / "lab", job_kind=args.job, say=say, flavor=args.flavor)
            result.update(asyncio.run(drilled))
        if args.clusters:
            result["clusters"] = cluster_bench(args.clusters, home=folder / CLUSTERS_HOME, say=say, flavor=args.flavor)
            result["cluster_create_seconds"] = result["clusters"]["cluster_create_seconds"]
            result["cluster_delete_seconds"] = result["clusters"]["cluster_delete_seconds"]
        if args.pool_moves:
            result["pool"] = pool_bench(args.pool_moves, home=Path(tmp) / "pool", say=say, flavor=args.flavor)
            for key in ("pool_move_to_inference_seconds", "pool_move_to_training_seconds"):
                result[key] = result["pool"][key]
            result["training_steps_lost_per_move"] = result["pool"]["training_steps_lost_per_move"]
    finally:
        # A Slinky cluster's jobs may leave files of its users' uids: what cannot go stays.
        shutil.rmtree(folder, ignore_errors=True)
    if args.output:
        write_result(result, args.output)
    print(json.dumps(result, indent=2), flush=True)
    os._exit(0)  # skip interpreter teardown: see workers.entry.exit_now


if __name__ == "__main__":
    main()
