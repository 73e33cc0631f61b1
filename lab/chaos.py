"""``make chaos``: remediation on a bad day, in a lab of its own, with a training job running.

Each scenario is a fresh incident on a node of the running job, with one fault on purpose:
the worker SIGKILLed at each step (and restarted 2 s later), the Temporal server killed and
restarted, slurmctld stopped for 30 s, the Kubernetes API answering 500 and 429 in bursts, a
PodDisruptionBudget blocking the eviction, the webhook refusing connections or hanging, two
workers racing over two incidents at once, and a node an operator drained before its Xid.
Last, in a four-node lab of its own with the default fleet guard, a storm: Xids on every
training node at once (``storm_drained``, ``storm_waiting``, ``storm_paged``).
A clean drill in the same run is the baseline. Between scenarios the retired nodes are
returned as spares (``gpufleet nodes return``), as an operator would after a repair.

The last line printed is one JSON object: per scenario its name, whether it passed (it is
``correct``: resolved, the job resumed once, nothing lost; and ``within_budget``: a worker
kill adds at most 15 s, a dead or hanging webhook at most 1 s before the drain), the
outcome, ``detect_to_drained``, ``detect_to_resumed`` and ``added_delay_s`` (against the
baseline); totals ``jobs_lost``, ``double_claims``, ``nodes_undrained_not_ours``,
``claims_leaked`` and ``max_added_delay_s``.

Run it as ``python -m lab.chaos [--short] [--home DIR] [--output FILE]``; ``make chaos`` keeps its
JSON, with the commit, date and machine (``provenance``), in docs/results/chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from temporalio.service import RPCError

from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from lab.drill import default_job, run_drill, training_job
from lab.fleet import REPO_ROOT, FleetLab, LabConfig
from lab.histories import record_histories_async
from lab.procs import alive, free_port, spawn, stop, wait_for
from lab.provenance import provenance, write_result
from models.constants import CLAIMED_BY_ANNOTATION, POOL_LABEL, POOL_RETIRED, owned_reason
from models.incident import Approval, IncidentStatus, Outcome, Step
from starters.temporal import connect
from workflows.remediation import NodeRemediationWorkflow

Say = Callable[[str], None]
OnStatus = Callable[[IncidentStatus], Awaitable[None]]

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
    Step.GUARD,
    Step.AWAITING_APPROVAL,
    Step.DRAIN_SLURM,
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


@dataclass
class Context:
    """What a scenario's fault acts on."""

    lab: FleetLab
    say: Say
    fired: list[str] = field(default_factory=list)
    extra_workers: list[int] = field(default_factory=list)


@dataclass
class Scenario:
    name: str
    # Called once the incident reaches ``at`` (or a later step): the fault itself.
    fault: Callable[[Context], Awaitable[None]] | None = None
    at: Step | None = None
    # Before the Xid is injected (with the target node) and after the incident closed.
    before: Callable[[Context, str], Awaitable[None]] | None = None
    after: Callable[[Context], Awaitable[None]] | None = None
    expect_approval: bool = False
    # Added delay allowed against the baseline (None: only correctness is checked).
    delay_budget_s: float | None = None
    drained_budget_s: float | None = None


# -- faults ----------------------------------------------------------------------------------------


def _pid(lab: FleetLab, service: str) -> int:
    return int(lab.state()["services"][service]["pid"])


async def kill_worker(ctx: Context) -> None:
    pid = _pid(ctx.lab, "worker")
    os.kill(pid, signal.SIGKILL)
    ctx.fired.append(f"worker {pid} SIGKILLed")
    await asyncio.sleep(WORKER_RESTART_DELAY)  # the scenario: a worker back 2 s later
    await asyncio.to_thread(ctx.lab.up)
    ctx.fired.append(f"worker restarted as {_pid(ctx.lab, 'worker')}")


async def kill_temporal(ctx: Context) -> None:
    pid = _pid(ctx.lab, "temporal")
    os.kill(pid, signal.SIGKILL)
    ctx.fired.append("Temporal dev server SIGKILLed")
    await asyncio.to_thread(wait_for, lambda: not alive(pid), timeout=30, what="the server to die")
    await asyncio.sleep(WORKER_RESTART_DELAY)
    await asyncio.to_thread(ctx.lab.up)
    ctx.fired.append("Temporal dev server restarted on the same port and database")


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


def slurm_update(lab: FleetLab, node: str, *fields: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", *fields], env=lab.env(), check=True, capture_output=True)


# -- the run ---------------------------------------------------------------------------------------


RACE = "two_workers_two_incidents"


def scenarios(*, short: bool) -> list[Scenario]:
    kills = [
        Scenario(name=f"worker_killed_at_{step.value}", fault=kill_worker, at=step, delay_budget_s=15.0)
        for step in KILL_STEPS
    ]
    full = [
        *kills,
        Scenario(name="temporal_killed_and_restarted", fault=kill_temporal, at=Step.CHECKPOINT),
        Scenario(name="slurmctld_stopped_30s", fault=stop_slurmctld, at=Step.CHECKPOINT),
        Scenario(name="kubernetes_500_burst", fault=kube_faults(500, 12), at=Step.APPROVE),
        Scenario(name="kubernetes_429_burst", fault=kube_faults(429, 12, retry_after=1), at=Step.APPROVE),
        Scenario(name="pdb_blocks_eviction", before=pdb_blocks, after=pdb_cleanup),
        Scenario(name="webhook_refuses_connections", before=webhook_refuses, after=webhook_back, drained_budget_s=1.0),
        Scenario(name="webhook_hangs", before=webhook_hangs, after=webhook_continues, drained_budget_s=1.0),
        Scenario(name="operator_drained_before_xid", before=operator_drains, expect_approval=True),
    ]
    if short:
        names = {"worker_killed_at_checkpoint", "webhook_hangs"}
        return [s for s in full if s.name in names]
    return full


def fleet_facts(lab: FleetLab) -> dict[str, Any]:
    """What the totals are computed from: claims on nodes, pools, Slurm reasons, the jobs."""
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    slurm = SlurmCli(slurm_conf=lab.slurm.conf)
    nodes = {node.name: node for node in kube.list_nodes()}
    return {
        "claims": {n: k.annotations.get(CLAIMED_BY_ANNOTATION) for n, k in nodes.items()},
        "pools": {n: k.labels.get(POOL_LABEL, "") for n, k in nodes.items()},
        "slurm": {node.name: (node.drained, node.reason) for node in slurm.nodes()},
        "partition": slurm.partition_nodes(lab.config.partition),
    }


def double_claims(facts: dict[str, Any]) -> int:
    incidents = [claim for claim in facts["claims"].values() if claim]
    return len(incidents) - len(set(incidents))


def leaked_claims(facts: dict[str, Any]) -> int:
    """A claim on a node that did not join the partition: claimed and never used."""
    return sum(1 for node, claim in facts["claims"].items() if claim and node not in facts["partition"])


def undrained_not_ours(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Nodes someone else had drained that are no longer drained with their reason."""
    lost = 0
    for node, (drained, reason) in before["slurm"].items():
        if drained and reason and not owned_reason(reason):
            still = after["slurm"].get(node)
            if still is None or not still[0] or still[1] != reason:
                lost += 1
    return lost


async def gpufleet(lab: FleetLab, *args: str) -> str:
    """Run a `gpufleet` command as an operator would, against the lab; its output (raises when it fails)."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "workers.entry", *args],
        env=lab.env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"gpufleet {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


async def return_retired(lab: FleetLab, say: Say, *, all_healthy: bool = True) -> None:
    """Every retired node comes back as a spare, as after a repair; an operator's drain is lifted first.
    Then waits until every node (or, without ``all_healthy``, every returned one) is healthy in Slurm."""
    facts = fleet_facts(lab)
    returned = []
    for node, pool in facts["pools"].items():
        if pool != POOL_RETIRED:
            continue
        drained, reason = facts["slurm"][node]
        if drained and not owned_reason(reason):
            slurm_update(lab, node, "State=RESUME")  # the operator finishes their work
        await gpufleet(lab, "nodes", "return", node, "--as", "spare")
        returned.append(node)
        say(f"returned {node} as a spare")
    # A returned node is briefly "not responding" after its resume: wait until Slurm shows it idle.
    slurm = SlurmCli(slurm_conf=lab.slurm.conf)
    await asyncio.to_thread(
        wait_for,
        lambda: all(
            not n.flags and n.state in {"idle", "allocated", "mixed"}
            for n in slurm.nodes()
            if all_healthy or n.name in returned
        ),
        timeout=60,
        what="every node to be healthy in Slurm" if all_healthy else f"{', '.join(returned)} to be healthy in Slurm",
    )


def at_or_after(step: Step, target: Step) -> bool:
    return STEP_ORDER.index(step) >= STEP_ORDER.index(target)


async def run_scenario(ctx: Context, scenario: Scenario, baseline: dict[str, Any] | None) -> dict[str, Any]:
    lab, say = ctx.lab, ctx.say
    ctx.fired = []
    slurm = SlurmCli(slurm_conf=lab.slurm.conf)
    job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(), say=say)
    target = slurm.hostnames(job.nodes)[0]
    if scenario.before is not None:
        await scenario.before(ctx, target)
    before = fleet_facts(lab)
    fired_at: list[str] = []
    client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])

    async def on_status(status: IncidentStatus) -> None:
        due = scenario.at is not None and at_or_after(status.step, scenario.at) and status.step != Step.CLOSED
        if scenario.fault is not None and due and not fired_at:
            fired_at.append(status.step.value)
            await scenario.fault(ctx)
        if scenario.expect_approval and status.waiting_for_approval and "approved" not in ctx.fired:
            ctx.fired.append("approved")
            handle = client.get_workflow_handle(f"remediate-{lab.config.cluster}-{status.node}")
            await handle.signal(NodeRemediationWorkflow.decide, Approval(approved=True, by="chaos", reason="drill"))

    result: dict[str, Any] = {"name": scenario.name}
    try:
        drill = await run_drill(
            lab, node=target, job_kind=default_job(), timeout=300, say=say, on_status=on_status, require_running=False
        )
    except Exception as exc:  # a scenario that breaks is reported, and the run goes on
        result.update(passed=False, correct=False, outcome="error", error=f"{type(exc).__name__}: {exc}")
        drill = None
    finally:
        if scenario.after is not None:
            await scenario.after(ctx)
    after = fleet_facts(lab)
    checks: dict[str, int] = {
        "jobs_lost": 0,
        "double_claims": double_claims(after),
        "nodes_undrained_not_ours": undrained_not_ours(before, after),
        "claims_leaked": leaked_claims(after),
    }
    if drill is not None:
        timings = drill["timings_s"]
        resumed = drill["job_state"] == "RUNNING" and drill["job_restarts"] == drill["restarts_before"] + 1
        checks["jobs_lost"] = 0 if resumed else 1
        added = None
        drained_added = None
        if baseline is not None and timings["detect_to_resumed"] is not None:
            added = round(timings["detect_to_resumed"] - baseline["detect_to_resumed"], 3)
            drained_added = round(timings["detect_to_drained"] - baseline["detect_to_drained"], 3)
        correct = (
            drill["outcome"] == Outcome.RESOLVED.value
            and resumed
            and (drill["resumed_from_step"] or 0) > 0
            and not any(checks.values())
            and (not scenario.expect_approval or "approved" in ctx.fired)
        )
        within_budget = (scenario.delay_budget_s is None or added is None or added <= scenario.delay_budget_s) and (
            scenario.drained_budget_s is None or drained_added is None or drained_added <= scenario.drained_budget_s
        )
        result.update(
            passed=correct and within_budget,
            correct=correct,
            within_budget=within_budget,
            outcome=drill["outcome"],
            node=drill["node"],
            detect_to_drained=timings["detect_to_drained"],
            detect_to_resumed=timings["detect_to_resumed"],
            added_delay_s=added,
            added_to_drained_s=drained_added,
            incident=drill["incident_id"],
        )
    if fired_at:
        result["fault_at_step"] = fired_at[0]
    result["faults"] = list(ctx.fired)
    result.update(checks)
    try:
        await return_retired(lab, say)
    except (RuntimeError, TimeoutError) as exc:  # reported with the scenario; the run goes on
        result.update(passed=False, error=f"after the scenario: {exc}")
    say(f"{scenario.name}: {'passed' if result.get('passed') else 'FAILED'} ({result.get('outcome')})")
    return result


async def race_two_incidents(ctx: Context, baseline: dict[str, Any]) -> dict[str, Any]:
    """Two workers at once, Xids on both nodes of the job at once: two spares, one requeue."""
    lab, say = ctx.lab, ctx.say
    slurm = SlurmCli(slurm_conf=lab.slurm.conf)
    job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(), say=say)
    targets = slurm.hostnames(job.nodes)[:2]
    second = spawn(
        [sys.executable, "-m", "workers.entry", "worker"],
        log=lab.home / "logs" / "worker-2.log",
        env=lab.env(),
        cwd=REPO_ROOT,
    )
    before = fleet_facts(lab)
    client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
    result: dict[str, Any] = {"name": RACE, "nodes": targets}
    try:
        detected = datetime.now(UTC)
        for node in targets:
            lab.inject_xid(node, 79)
        statuses = []
        for node in targets:
            handle = client.get_workflow_handle(f"remediate-{lab.config.cluster}-{node}", result_type=IncidentStatus)
            statuses.append(await _closed(handle, since=detected))
        after_job = await asyncio.to_thread(
            wait_for,
            lambda: (j := slurm.job(job.job_id)).state == "RUNNING" and j.restarts > job.restarts and j,
            timeout=120,
            what="the job to run again",
        )
    except Exception as exc:  # reported, and the run goes on
        result.update(passed=False, correct=False, outcome="error", error=f"{type(exc).__name__}: {exc}")
        statuses, after_job = [], None
    finally:
        stop([second])
    after = fleet_facts(lab)
    spares = [status.spare for status in statuses]
    checks = {
        "jobs_lost": 0 if after_job is not None and after_job.restarts == job.restarts + 1 else 1,
        "double_claims": double_claims(after) + (1 if len(set(spares)) != len(spares) else 0),
        "nodes_undrained_not_ours": undrained_not_ours(before, after),
        "claims_leaked": leaked_claims(after),
    }
    if statuses:
        partition = set(after["partition"])
        in_place = all(s.spare in partition for s in statuses) and not partition & set(targets)
        resumed_at = max(_end(s, Step.RESUME) for s in statuses)
        drained_at = max(_end(s, Step.DRAIN_SLURM) for s in statuses)
        correct = all(s.outcome == Outcome.RESOLVED for s in statuses) and in_place and not any(checks.values())
        result.update(
            passed=correct,
            correct=correct,
            outcome=",".join(s.outcome.value for s in statuses),
            spares=spares,
            partition=sorted(partition),
            detect_to_drained=round((drained_at - detected).total_seconds(), 3),
            detect_to_resumed=round((resumed_at - detected).total_seconds(), 3),
            added_delay_s=round((resumed_at - detected).total_seconds() - baseline["detect_to_resumed"], 3),
        )
    result.update(checks)
    say(f"two_workers_two_incidents: {'passed' if result.get('passed') else 'FAILED'}")
    await return_retired(lab, say)
    return result


STORM = "storm_four_nodes_at_once"


def chaos_lab(home: Path, training: list[str], *, say: Say) -> FleetLab:
    """A lab of the chaos run's own: these training nodes, two spares, a 60 s grace, free ports."""
    config = LabConfig(
        training=training,
        spares=["spare1", "spare2"],
        temporal_port=free_port(),
        ui_port=free_port(),
        grace_seconds=60,
    )
    lab = FleetLab(home, config)
    lab.up(say=say)
    return lab


async def _record_and_stop(lab: FleetLab) -> None:
    """Stop the lab, its workflows' histories first written where $GPUFLEET_RECORD_HISTORIES says."""
    try:
        await record_histories_async(lab.env()["TEMPORAL_ADDRESS"])
    finally:
        lab.down()


async def storm(home: Path, *, say: Say) -> dict[str, Any]:
    """Xids on all four training nodes within a second, in a four-node lab of its own with the
    default fleet guard: at most its limit drained, one page, the rest waiting with their jobs
    untouched; after `gpufleet breaker reset` the rest go on (and get spares once the first
    ones' retired nodes are returned)."""
    lab = chaos_lab(home, ["gpu1", "gpu2", "gpu3", "gpu4"], say=say)
    config = lab.config
    result: dict[str, Any] = {"name": STORM}
    try:
        slurm = SlurmCli(slurm_conf=lab.slurm.conf)
        job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(), say=say)
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        handles = {
            node: client.get_workflow_handle(f"remediate-{config.cluster}-{node}", result_type=IncidentStatus)
            for node in config.training
        }
        say("storm: Xid 79 on gpu1..gpu4 at once")
        for node in config.training:
            lab.inject_xid(node, 79)

        async def settled() -> dict[str, IncidentStatus]:
            """Every incident past the guard or waiting at it."""
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 120
            while loop.time() < deadline:
                statuses = {}
                for node, handle in handles.items():
                    with contextlib.suppress(RPCError):
                        statuses[node] = await handle.query(NodeRemediationWorkflow.status)
                if len(statuses) == len(handles) and all(
                    s.guard_slot or s.waiting_for_approval or s.step == Step.CLOSED for s in statuses.values()
                ):
                    return statuses
                await asyncio.sleep(0.2)
            raise TimeoutError("the storm's incidents did not all reach the fleet guard within 120 s")

        statuses = await settled()
        waiting = sorted(node for node, s in statuses.items() if s.waiting_for_approval)
        granted = sorted(node for node in statuses if node not in waiting)
        # Let the granted ones finish (they take the two spares), then look again: the rest still wait.
        for node in granted:
            await _closed(handles[node], since=datetime.min.replace(tzinfo=UTC))
        after = fleet_facts(lab)
        drained = sorted(node for node, (is_drained, reason) in after["slurm"].items() if owned_reason(reason))
        still = [node for node in waiting if (await handles[node].query(NodeRemediationWorkflow.status)).jobs == []]
        pages = [n for n in lab.notifications() if n.get("kind") == "breaker_tripped"]
        job_now = slurm.job(job.job_id)
        only_waiting = set(slurm.hostnames(job.nodes)) <= set(waiting)
        touched = 1 if only_waiting and job_now.restarts != job.restarts else 0
        result.update(
            storm_drained=len(drained),
            storm_waiting=len(still),
            storm_paged=len(pages),
            drained_nodes=drained,
            waiting_nodes=waiting,
            storm_jobs_touched_on_waiting_nodes=touched,
        )
        say(f"storm: drained {drained}, waiting {waiting}, pages {len(pages)}; `gpufleet breaker reset`")
        await gpufleet(lab, "breaker", "reset", "--reason", "chaos: storm over")
        await return_retired(lab, say, all_healthy=False)  # the rest need spares: the first ones' nodes, repaired
        rest = [await _closed(handles[node], since=datetime.min.replace(tzinfo=UTC)) for node in waiting]
        resolved_after_reset = all(s.outcome == Outcome.RESOLVED for s in rest)
        result.update(resolved_after_reset=resolved_after_reset)
        correct = (
            len(drained) <= 2
            and len(still) == len(waiting) == 2
            and len(pages) == 1
            and touched == 0
            and resolved_after_reset
        )
        result.update(passed=correct, correct=correct, outcome="tripped, then reset")
    except Exception as exc:  # reported, and the run goes on
        result.update(passed=False, correct=False, outcome="error", error=f"{type(exc).__name__}: {exc}")
    finally:
        await _record_and_stop(lab)
    say(f"{STORM}: {'passed' if result.get('passed') else 'FAILED'}")
    return result


def _end(status: IncidentStatus, step: Step) -> datetime:
    return [e.at for e in status.timeline if e.step == step and e.event == "finished"][-1]


async def _closed(handle: Any, *, since: datetime, timeout: float = 300) -> IncidentStatus:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            description = await handle.describe()
        except RPCError:  # not started yet
            description = None
        if description is not None and description.start_time >= since and description.close_time is not None:
            status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
            return status
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{handle.id} did not close within {timeout:.0f}s")


async def chaos(home: Path, *, short: bool, say: Say, only: set[str] | None = None) -> dict[str, Any]:
    lab = chaos_lab(home, ["gpu1", "gpu2"], say=say)
    # Evictions a budget forbids are forced after 5 s here (60 s by default), to keep the run short;
    # the partition has two nodes, each hit again and again (returned between scenarios), so the
    # fleet guard's share limit and its lemon rules are off here (the storm scenario runs the
    # default guard in a four-node lab of its own).
    lab.policy_file.write_text(
        lab.policy_file.read_text().replace("remediation:\n", "remediation:\n  eviction_timeout_seconds: 5\n")
        + "guard:\n  max_share: 0\n  cooldown_seconds: 0\n  quarantine_after: 0\n"
    )
    ctx = Context(lab=lab, say=say)
    results: list[dict[str, Any]] = []
    baseline: dict[str, Any] = {}
    try:
        say("baseline: a clean drill")
        clean = await run_scenario(ctx, Scenario(name="baseline"), None)
        results.append(clean)
        baseline = {key: clean.get(key) for key in ("detect_to_drained", "detect_to_resumed")}
        if None in baseline.values():
            raise RuntimeError(f"the baseline drill did not resolve: {clean}")
        for scenario in scenarios(short=short):
            if only is None or scenario.name in only:
                say(f"scenario: {scenario.name}")
                results.append(await run_scenario(ctx, scenario, baseline))
        if not short and (only is None or RACE in only):
            say("scenario: two workers, two incidents at once")
            results.append(await race_two_incidents(ctx, baseline))
    finally:
        await _record_and_stop(lab)
    if not short and (only is None or STORM in only):
        say(f"scenario: {STORM} (a four-node lab of its own, the default fleet guard)")
        results.append(await storm(home / "storm", say=say))
    delays = [r["added_delay_s"] for r in results if r.get("added_delay_s") is not None]
    totals = {
        key: sum(r.get(key, 0) for r in results)
        for key in ("jobs_lost", "double_claims", "nodes_undrained_not_ours", "claims_leaked")
    }
    return {
        "scenarios": results,
        "passed": all(r.get("passed") for r in results) and not any(totals.values()),
        **totals,
        "max_added_delay_s": max(delays) if delays else None,
        "baseline": baseline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the baseline and two scenarios (part of make test)")
    parser.add_argument("--home", type=Path, help="the chaos lab's state folder (default: a new temporary one)")
    parser.add_argument(
        "--only", metavar="NAMES", help="comma-separated scenario names to run after the baseline (default: all)"
    )
    parser.add_argument(
        "--output", type=Path, help="also write the JSON here, passed or not (make chaos: docs/results/chaos.json)"
    )
    args = parser.parse_args()
    started = provenance()  # the code this run loaded, the machine it runs on
    only = {name.strip() for name in args.only.split(",") if name.strip()} if args.only else None
    known = {scenario.name for scenario in scenarios(short=False)} | {RACE, STORM}
    if only is not None and only - known:
        parser.error(f"unknown scenario(s): {', '.join(sorted(only - known))}; known: {', '.join(sorted(known))}")
    home = args.home or Path(tempfile.mkdtemp(prefix="gpufleet-chaos-"))

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"chaos lab in {home}")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = asyncio.run(chaos(home, short=args.short, say=say, only=only))
    finally:
        lab = FleetLab(home)
        if lab.state().get("services"):
            lab.down()  # never leave a lab running, however the run ended
    result = {"provenance": started, **result}
    if args.output is not None:
        write_result(result, args.output)
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
