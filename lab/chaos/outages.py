"""The faults a chaos scenario injects besides the GPU's own: a worker or the Temporal server
killed, slurmctld stopped, the Kubernetes API failing in bursts, a PodDisruptionBudget in the
way, the webhook down or hanging, a node an operator drained first."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from temporalio.api.enums.v1 import EventType
from temporalio.contrib.pydantic import pydantic_data_converter

from lab.access import DEFAULT_USER
from lab.faults import Effect
from lab.fleet import REPO_ROOT, FleetLab
from lab.procs import alive, spawn, wait_for
from models.incident import Approval, Step
from starters.temporal import connect_temporal

Say = Callable[[str], None]

# Steps where the worker is killed, in the order an incident passes them.
KILL_STEPS = [
    Step.CLASSIFY,
    Step.DRAIN_SLURM,
    Step.CHECKPOINT,
    Step.REQUEUE,
    Step.APPROVE,
    Step.DRAIN_KUBERNETES,
    Step.CLAIM_SPARE,
    Step.RESUME,
]
STEP_ORDER = [
    Step.CLASSIFY,
    Step.NOTIFY,
    Step.DRAIN_SLURM,  # at once since v0.3.0: before the guard's first slot
    Step.REQUEUE_ENDED,
    Step.WAIT_FOR_JOBS,
    Step.GUARD,
    Step.AWAITING_APPROVAL,
    Step.CHECKPOINT,
    Step.REQUEUE,
    Step.APPROVE,
    Step.DRAIN_KUBERNETES,
    Step.CLAIM_SPARE,
    Step.WAIT_FOR_SPARE,
    Step.RETIRE_NODE,
    Step.RESUME,
    Step.CLOSED,
]
OPERATOR_REASON = "operator: reseating the NVLink bridge"
WORKER_RESTART_DELAY = 2.0
SLURMCTLD_STOP = 30.0
INTAKE_DOWN = 30.0


@dataclass
class Context:
    """What a scenario's fault acts on."""

    lab: FleetLab
    say: Say
    fired: list[str] = field(default_factory=list)
    extra_workers: list[int] = field(default_factory=list)
    # A fault's part that runs on beside the incident (a service brought back later), awaited after it.
    pending: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass
class Scenario:
    name: str
    # Called once the incident reaches ``at``: the fault itself. A fault that never fires, or
    # fires only after the incident passed ``at``, fails the scenario.
    fault: Callable[[Context], Awaitable[None]] | None = None
    at: Step | None = None
    # And only once this step has finished (``at`` runs beside it: the spare's claim once the
    # Kubernetes drain beside it is done).
    once_done: Step | None = None
    # Before the Xid is injected (with the target node) and after the incident closed.
    before: Callable[[Context, str], Awaitable[None]] | None = None
    after: Callable[[Context], Awaitable[None]] | None = None
    expect_approval: bool = False
    # Once the incident closed (before ``after``): what it and the fleet must show besides the
    # usual checks; each problem returned fails the scenario.
    verify: Callable[[Context, dict[str, Any]], Awaitable[list[str]]] | None = None
    # What the Xid does to the job's processes on the node (None: the Xid's own, lab/faults.py).
    effect: Effect | None = None
    # Added delay allowed against the baseline (None: only correctness is checked).
    delay_budget_s: float | None = None
    drained_budget_s: float | None = None
    # How long the detector may take to open the incident after the Xid, or after the service
    # ``before`` took away is back (``Context.pending`` done).
    detect_timeout_s: float = 30.0


def _pid(lab: FleetLab, service: str) -> int:
    return int(lab.state()["services"][service]["pid"])


def _slurm_news(ctx: Context) -> Say:
    """What ``lab up`` says about Slurm, when it brings a service back (a daemon found down)."""
    return lambda line: ctx.say(line) if "down" in line else None


async def kill_worker(ctx: Context) -> None:
    pid = _pid(ctx.lab, "worker")
    os.kill(pid, signal.SIGKILL)
    ctx.fired.append(f"worker {pid} SIGKILLed")
    await asyncio.sleep(WORKER_RESTART_DELAY)  # the scenario: a worker back 2 s later
    await asyncio.to_thread(ctx.lab.up, _slurm_news(ctx), keep_slurm=True)
    ctx.fired.append(f"worker restarted as {_pid(ctx.lab, 'worker')}")


async def kill_temporal(ctx: Context) -> None:
    pid = _pid(ctx.lab, "temporal")
    os.kill(pid, signal.SIGKILL)
    ctx.fired.append("Temporal dev server SIGKILLed")
    await asyncio.to_thread(wait_for, lambda: not alive(pid), timeout=30, what="the server to die")
    await asyncio.sleep(WORKER_RESTART_DELAY)
    await asyncio.to_thread(ctx.lab.up, _slurm_news(ctx), keep_slurm=True)
    ctx.fired.append("Temporal dev server restarted on the same port and database")


async def intake_down(ctx: Context, node: str) -> None:
    """The intake killed just before the Xid, back ``INTAKE_DOWN`` seconds later on its port: the
    detector keeps the event in its spool meanwhile, and the incident opens once it is back."""
    pid = _pid(ctx.lab, "intake")
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(wait_for, lambda: not alive(pid), timeout=30, what="the intake to die")
    ctx.fired.append(f"intake {pid} SIGKILLed for {INTAKE_DOWN:.0f}s")

    async def back() -> None:
        await asyncio.sleep(INTAKE_DOWN)
        await asyncio.to_thread(ctx.lab.up, _slurm_news(ctx), keep_slurm=True)
        ctx.fired.append(f"intake restarted as {_pid(ctx.lab, 'intake')}")

    ctx.pending.append(asyncio.create_task(back()))


async def intake_back(ctx: Context) -> None:
    """Wait for what ``intake_down`` left running (the intake brought back)."""
    while ctx.pending:
        await ctx.pending.pop()


async def spooled_while_intake_down(ctx: Context, drill: dict[str, Any]) -> list[str]:
    """The detector must have kept the event while the intake was away, not have lost it."""
    node = str(drill.get("node"))
    log = ctx.lab.home / "logs" / f"detector-{node}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    if "did not answer" not in text:
        return [f"{log} never says the intake did not answer: was the event sent while it was down?"]
    return []


async def stop_slurmctld(ctx: Context) -> None:
    pid = ctx.lab.slurm.pids()["slurmctld"]
    os.kill(pid, signal.SIGSTOP)
    ctx.fired.append(f"slurmctld stopped for {SLURMCTLD_STOP:.0f}s")
    try:
        await asyncio.sleep(SLURMCTLD_STOP)
    finally:
        os.kill(pid, signal.SIGCONT)


def _kube_url(lab: FleetLab) -> str:
    return str(lab.state()["services"]["kubeapi"]["url"])


def kube_faults(status: int, count: int, retry_after: int | None = None) -> Callable[[Context], Awaitable[None]]:
    async def fault(ctx: Context) -> None:
        body: dict[str, Any] = {"status": status, "count": count}
        if retry_after is not None:
            body["retry_after"] = retry_after
        httpx.put(f"{_kube_url(ctx.lab)}/_faults", json=body, timeout=5).raise_for_status()
        ctx.fired.append(f"Kubernetes API answers the next {count} requests with HTTP {status}")

    return fault


def _core(lab: FleetLab) -> tuple[k8s.CoreV1Api, k8s.PolicyV1Api]:
    api = k8s_config.new_client_from_config(config_file=str(lab.home / "kubeconfig"))
    return k8s.CoreV1Api(api), k8s.PolicyV1Api(api)


async def pdb_blocks(ctx: Context, node: str) -> None:
    """An inference pod on the target node whose budget allows no disruption at all."""
    core, policy = _core(ctx.lab)
    name = f"chaos-inference-{node}"
    pod: Any = {
        "metadata": {"name": name, "namespace": "serving", "labels": {"app": "chaos-inference"}},
        "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm/vllm-openai"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    budget: Any = {
        "metadata": {"name": "chaos-inference", "namespace": "serving"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "chaos-inference"}}},
    }
    core.create_namespaced_pod("serving", pod)
    policy.create_namespaced_pod_disruption_budget("serving", budget)
    ctx.fired.append(f"PodDisruptionBudget forbids evicting {name}")


async def pdb_cleanup(ctx: Context) -> None:
    _, policy = _core(ctx.lab)
    policy.delete_namespaced_pod_disruption_budget("chaos-inference", "serving")


async def webhook_refuses(ctx: Context, node: str) -> None:
    pid = _pid(ctx.lab, "webhook")
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(wait_for, lambda: not alive(pid), timeout=30, what="the webhook to die")
    ctx.fired.append("webhook receiver killed: connections refused")


async def webhook_back(ctx: Context) -> None:
    """Start the receiver again on its old address (the worker keeps the URL it was given)."""
    services = ctx.lab.state()["services"]
    url = services["webhook"]["url"]
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    ready = ctx.lab.home / "webhook.url"
    ready.unlink(missing_ok=True)
    pid = spawn(
        [
            sys.executable,
            "-m",
            "lab.webhook",
            "--port",
            str(port),
            "--record",
            str(ctx.lab.notifications_file),
            "--ready-file",
            str(ready),
        ],
        log=ctx.lab.home / "logs" / "webhook.log",
        env=ctx.lab.env(),
        cwd=REPO_ROOT,
    )
    await asyncio.to_thread(wait_for, ready.exists, timeout=30, what="the webhook receiver")
    state = ctx.lab.state()
    state["services"]["webhook"]["pid"] = pid
    ctx.lab._save(state)


async def webhook_hangs(ctx: Context, node: str) -> None:
    os.kill(_pid(ctx.lab, "webhook"), signal.SIGSTOP)
    ctx.fired.append("webhook receiver stopped (SIGSTOP): connections hang")


async def webhook_continues(ctx: Context) -> None:
    os.kill(_pid(ctx.lab, "webhook"), signal.SIGCONT)


async def operator_drains(ctx: Context, node: str) -> None:
    slurm_update(ctx.lab, node, "State=DRAIN", f"Reason={OPERATOR_REASON}")
    ctx.fired.append(f"{node} drained by an operator: {OPERATOR_REASON!r}")


async def approved_by_the_operator(ctx: Context, drill: dict[str, Any]) -> list[str]:
    """The incident's approval went through the lab's gpufleet API as its operator: its history
    names lab-operator, as the signal's identity and the approval's ``by``."""
    client = await connect_temporal(address=ctx.lab.env()["TEMPORAL_ADDRESS"])
    history = await client.get_workflow_handle(str(drill["workflow_id"])).fetch_history()
    said = []
    for event in history.events:
        if event.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            continue
        signalled = event.workflow_execution_signaled_event_attributes
        if signalled.signal_name == "decide":
            [answer] = pydantic_data_converter.payload_converter.from_payloads(
                list(signalled.input.payloads)[:1], [Approval]
            )
            said.append((signalled.identity, answer.by))
    if said != [(DEFAULT_USER, DEFAULT_USER)]:
        return [f"the incident's approvals name (identity, by) {said}, not one by {DEFAULT_USER} through the API"]
    return []


def slurm_update(lab: FleetLab, node: str, *fields: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", *fields], env=lab.env(), check=True, capture_output=True)
