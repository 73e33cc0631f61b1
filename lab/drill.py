"""The recovery drill: a training job runs, an Xid hits one of its nodes, gpufleet recovers it.

The result is one JSON-ready dict with the incident's outcome, the job's restart and the
step it resumed from, and timings measured from the moment the Xid was reported.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.service import RPCError, RPCStatusCode

from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from lab.access import DEFAULT_USER
from lab.faults import FAULTS_ENV, Effect, default_effect
from lab.fleet import REPO_ROOT, FleetLab, LabError
from lab.procs import wait_for
from lab.slinkylab import nodeset_pods
from models.constants import (
    CLAIMED_BY_ANNOTATION,
    GUARD_RESET_SIGNAL,
    POOL_LABEL,
    POOL_SPARE,
    guard_workflow_id,
    remediation_workflow_id,
)
from models.guard import GuardCommand
from models.incident import IncidentStatus, JobInfo, Outcome, Step
from models.names import InvalidName, validate_node_name
from models.policy import Action, load_policy
from starters.temporal import connect
from workflows.remediation import NodeRemediationWorkflow

JOBS = {
    "ddp": (REPO_ROOT / "lab" / "jobs" / "ddp.sbatch", "ddp-train"),
    "counter": (REPO_ROOT / "lab" / "jobs" / "counter.sbatch", "counter"),
}
RESUMED = re.compile(r"resumed from step (\d+)")
Say = Callable[[str], None]

# timing name -> the steps whose end marks it, the first the incident went through
MILESTONES = {
    "detect_to_drained": (Step.DRAIN_SLURM,),
    # After the checkpoint on SIGTERM; when the failure had ended the job already, right after the drain.
    "detect_to_requeued": (Step.REQUEUE, Step.REQUEUE_ENDED),
    "detect_to_replaced": (Step.CLAIM_SPARE,),
    "detect_to_resumed": (Step.RESUME,),
}


def default_job(lab: FleetLab | None = None) -> str:
    """PyTorch DDP where torch is installed and the lab's jobs run on the host's interpreter;
    else the counter (a newer Slurm's root has python3 and no torch)."""
    on_host = lab is None or lab.slurm.install.on_host
    return "ddp" if on_host and importlib.util.find_spec("torch") else "counter"


def log_path(job: JobInfo) -> Path:
    return Path(job.stdout.replace("%j", str(job.job_id)).replace("%x", job.name))


def submit_job(lab: FleetLab, job_kind: str, *sbatch_args: str) -> int:
    """Submit the lab's training job ``job_kind`` (its checkpoint and log under the lab's home,
    its ranks reading the nodes' GPU faults); returns the job ID."""
    script, name = JOBS[job_kind]
    if job_kind == "ddp" and not lab.slurm.install.on_host:
        raise LabError(
            f"the ddp job needs torch, which the lab's Slurm {lab.slurm.install.version} root lacks: use --job counter"
        )
    folder = lab.home / "drill"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    env = {
        # The interpreter the nodes have: the host's, or the Slurm root's (the checkout is bound there).
        "PYTHON": lab.slurm.install.python(),
        "CHECKPOINT": str(folder / f"{name}-{stamp}.ckpt"),
        "PYTHONPATH": str(REPO_ROOT),
        FAULTS_ENV: str(lab.faults.folder),
    }
    return lab.slurm.sbatch(script, "-o", str(folder / f"{name}-{stamp}-%j.log"), *sbatch_args, env=env)


def pod_hosts(lab: FleetLab) -> dict[str, str]:
    """On the slinky flavor, the Kubernetes node each NodeSet pod (Slurm node) runs on; else nothing."""
    if not lab.slinky:
        return {}
    pods = nodeset_pods(lab.state()["services"]["kubeapi"]["url"], lab.config.cluster, lab.partition)
    return {name: (pod.get("spec") or {}).get("nodeName") or "" for name, pod in pods.items()}


def running_and_checkpointed(slurm: SlurmCli, job_id: int) -> JobInfo:
    """Wait until the job runs and has saved a checkpoint in this run; returns it."""
    job: JobInfo = wait_for(
        lambda: (j := slurm.job(job_id)).state == "RUNNING" and j, timeout=120, what=f"job {job_id} to start"
    )
    log = log_path(job)
    wait_for(
        lambda: log.exists() and checkpointed_since_start(log.read_text()),
        timeout=180,
        what=f"job {job.job_id} to save a checkpoint ({log})",
    )
    return job


def training_job(lab: FleetLab, slurm: SlurmCli, *, job_kind: str, say: Say) -> JobInfo:
    """The drill's running training job; submits one and waits for its first checkpoint if none runs."""
    running = [j for j in slurm.jobs() if j.name in {n for _, n in JOBS.values()} and j.state == "RUNNING"]
    if running:
        job = running[0]
        say(f"using running job {job.job_id} ({job.name}) on {job.nodes}")
        return running_and_checkpointed(slurm, job.job_id)
    job_id = submit_job(lab, job_kind)
    say(f"submitted {JOBS[job_kind][1]} as job {job_id}; waiting for it to run and checkpoint")
    return running_and_checkpointed(slurm, job_id)


def resumed_step(job: JobInfo, restarts_before: int) -> int | None:
    """The step the job resumed from after a requeue, from its log (None: it did not run again)."""
    if job.restarts <= restarts_before:
        return None  # never requeued: ended (or hung) with its GPU
    log = log_path(job)
    try:
        text = wait_for(
            lambda: (t := log.read_text()).count("resumed from step") > restarts_before and t,
            timeout=60,
            what="the job to log its resume",
        )
    except TimeoutError:
        return None
    return int(RESUMED.findall(text)[-1])


def checkpointed_since_start(text: str) -> bool:
    """Whether the job's current run (after its last restart) has saved a checkpoint."""
    start = max(text.rfind("starting from scratch"), text.rfind("resumed from step"))
    return text.rfind("checkpoint saved") > start >= 0


async def _new_run(handle: Any, *, since: datetime, timeout: float, held: Callable[[], bool] | None = None) -> Any:
    """The incident run the detector started for this Xid (not an earlier one on the same node).

    ``timeout`` counts from now, or from when ``held`` last said True (an outage on purpose)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline or (held is not None and held()):
        if held is not None and held():
            deadline = time.monotonic() + timeout
        try:
            description = await handle.describe()
        except RPCError:
            description = None
        if description is not None and description.start_time >= since - timedelta(seconds=1):
            return description
        await asyncio.sleep(0.02)
    raise LabError(f"the detector did not open an incident within {timeout:.0f}s (see the lab's detector logs)")


OnStatus = Callable[[IncidentStatus], Awaitable[None]]


async def reset_breaker(lab: FleetLab, *, reason: str) -> bool:
    """`gpufleet breaker reset` for the lab's cluster, as the lab's operator between drills, through
    the lab's gpufleet API (False when no guard runs yet). The window starts again from now; the
    guard's history names lab-operator."""
    client = await lab.api_client()
    command = GuardCommand(by=DEFAULT_USER, reason=reason)  # the API records the authenticated user anyway
    try:
        await client.get_workflow_handle(guard_workflow_id(lab.config.cluster)).signal(GUARD_RESET_SIGNAL, command)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


async def _follow(handle: Any, *, timeout: float, say: Say, on_status: OnStatus | None = None) -> IncidentStatus:
    """Poll the incident until it closes; ``on_status`` sees every status (a chaos run acts on it).

    A query can fail while a worker or the server is down on purpose: it is tried again.
    """
    deadline = time.monotonic() + timeout
    last_step = None
    interval = 0.25 if on_status is None else 0.01
    while time.monotonic() < deadline:
        try:
            status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        except RPCError:
            await asyncio.sleep(0.1)
            continue
        if status.step != last_step:
            say(f"  step: {status.step}")
            last_step = status.step
        if on_status is not None:
            await on_status(status)
        elif status.waiting_for_approval:
            raise LabError(
                f"the incident waits for approval: {status.waiting_for_approval}. It goes on after "
                f"`gpufleet approve {status.incident_id}` (or a breaker reset); `gpufleet reject` closes it"
            )
        if status.step == Step.CLOSED or status.outcome == Outcome.FAILED:
            return status
        await asyncio.sleep(interval)
    raise LabError(f"the incident did not close within {timeout:.0f}s")


def timings(status: IncidentStatus, *, detected: datetime, workflow_start: datetime) -> dict[str, float | None]:
    def end_of(step: Step) -> float | None:
        ends = [e.at for e in status.timeline if e.step == step and e.event == "finished"]
        return round((ends[-1] - detected).total_seconds(), 3) if ends else None

    result: dict[str, float | None] = {"detect_to_workflow": round((workflow_start - detected).total_seconds(), 3)}
    for name, candidates in MILESTONES.items():
        result[name] = next((end for step in candidates if (end := end_of(step)) is not None), None)
    return result


def steps(status: IncidentStatus, *, detected: datetime) -> list[dict[str, Any]]:
    rows: dict[Step, dict[str, Any]] = {}
    for entry in status.timeline:
        offset = round((entry.at - detected).total_seconds(), 3)
        if entry.event == "started" and entry.step not in rows:
            rows[entry.step] = {"name": entry.step.value, "start": offset, "end": None}
        elif entry.event == "finished" and entry.step in rows:
            rows[entry.step]["end"] = offset
    return list(rows.values())


async def run_drill(
    lab: FleetLab,
    *,
    node: str | None = None,
    xid: int = 79,
    effect: Effect | None = None,
    job_kind: str | None = None,
    timeout: float = 600,
    say: Say = lambda _: None,
    on_status: OnStatus | None = None,
    require_running: bool = True,
    detect_timeout: float = 30,
    detect_held: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run one drill against a running lab; returns the result as a JSON-ready dict.

    Args:
        effect: what the failure does to the job's processes on the node (default: the Xid's own,
            lab/faults.py).
        on_status: called with each status seen while the incident runs (chaos scenarios act
            there: kill a worker at a step, approve an incident waiting for approval).
        require_running: refuse unless every lab process runs (a chaos run stops some on purpose).
        detect_timeout: how long the detector may take to open the incident, counted from the Xid,
            or from when ``detect_held`` last said True (a chaos run keeping the intake away).
    """
    if require_running and not lab.running():
        raise LabError("the lab is not running: start it with `gpufleet lab up`")
    slurm = lab.slurm.client()
    # On the slinky flavor a Slurm node is a pod, an Xid hits the Kubernetes node under it, and the
    # incident is keyed on that node: ``hosts`` says where each pod runs (else each is its own).
    hosts = pod_hosts(lab)
    if node is not None:
        try:
            validate_node_name(node)
        except InvalidName as exc:
            raise LabError(str(exc)) from None
        members = slurm.partition_nodes(lab.partition)
        targets = sorted({hosts.get(m, m) for m in members})
        if node not in targets:
            where = f"under partition {lab.partition}" if lab.slinky else f"in partition {lab.partition}"
            raise LabError(f"no node {node!r} {where}; nodes: {', '.join(targets)}")
    free = [
        node.name
        for node in KubernetesApi(kubeconfig=lab.home / "kubeconfig").list_nodes(
            label_selector=f"{POOL_LABEL}={POOL_SPARE}"
        )
        if CLAIMED_BY_ANNOTATION not in node.annotations
    ]
    # Only a replacement needs a spare (a GPU reset or a reboot is done in place).
    replaces = load_policy(lab.policy_file).action_for(xid) is Action.REPLACE_NODE
    if replaces and not free:
        raise LabError(
            "no free spare is left in the lab, so the incident would wait for one; "
            "start a fresh lab with `gpufleet lab down && rm -r $GPUFLEET_HOME && gpufleet lab up`"
        )
    job = training_job(lab, slurm, job_kind=job_kind or default_job(lab), say=say)
    job_nodes = slurm.hostnames(job.nodes)
    target = node or hosts.get(job_nodes[0], job_nodes[0])
    hit = sorted(n for n in job_nodes if hosts.get(n, n) == target)  # the job's Slurm nodes on it
    if not hit:
        say(f"note: {target} does not run job {job.job_id} (it runs on {job.nodes})")
    elif lab.slinky:
        say(f"{target} hosts the job's Slurm node(s) {', '.join(hit)}")
    restarts_before = job.restarts

    effect = default_effect(xid) if effect is None else effect
    client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
    say(
        f"injecting Xid {xid} on {target} (a driver line in {lab.kmsg_file(target)}); "
        f"the job's processes there: {effect.value}"
    )
    detected = datetime.now(UTC)
    lab.inject_xid(target, xid, effect)
    handle = client.get_workflow_handle(remediation_workflow_id(lab.config.cluster, target))
    description = await _new_run(handle, since=detected, timeout=detect_timeout, held=detect_held)
    status = await _follow(handle, timeout=timeout, say=say, on_status=on_status)

    after = slurm.job(job.job_id)
    resumed_from, job_resumed = None, None
    if hit:
        resumed_from = resumed_step(after, restarts_before) if status.outcome == Outcome.RESOLVED else None
        job_resumed = resumed_from is not None
        if not job_resumed:
            say(f"job {job.job_id} did not run again from its checkpoint (it is {after.state})")
    hits = [hit for hit in lab.faults.hits(job.job_id) if hit["at"] >= detected.timestamp() - 1]
    return {
        "incident_id": status.incident_id,
        "workflow_id": handle.id,
        "node": target,
        "xid": xid,
        "effect": effect.value,
        # What the job's ranks met: crash or hang on the node, stalled elsewhere (as in a collective).
        "gpu_fault_hits": [f"{hit['effect']} on {hit['node']}" for hit in hits],
        "action": status.action.value if status.action else None,
        "outcome": status.outcome.value,
        "job_id": job.job_id,
        "job_restarts": after.restarts,
        "resumed_from_step": resumed_from,
        "job_resumed": job_resumed,
        # The jobs the failure had ended when the incident looked, requeued right after the drain.
        "jobs_ended_by_failure": status.ended,
        "replacement_node": status.spare,
        "job_state": after.state,
        "restarts_before": restarts_before,
        "timings_s": timings(status, detected=detected, workflow_start=description.start_time),
        # Slinky: the job's Slurm nodes the failed node hosted, and where each runs now.
        **(
            {"flavor": "slinky", "slurm_nodes_moved": {n: pod_hosts(lab).get(n, "") for n in hit}} if lab.slinky else {}
        ),
        "steps": steps(status, detected=detected),
    }
