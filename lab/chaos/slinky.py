"""The chaos scenarios of the slinky flavor (``python -m lab.chaos --flavor slinky``), whose Slurm
nodes are NodeSet pods run by the operator stand-in and whose worker reaches Slurm through
slurmrestd: slurmrestd down for 30 s mid-incident, the operator stand-in down mid-incident, and
pod-protect blocking the eviction of the failed node's pod; beside them the flavor runs the
worker killed at each step and two incidents at once (lab/chaos/scenarios.py).

An incident there is keyed on the Kubernetes node under the job's pod (``remediate-lab-gpu1``);
its Slurm nodes are the pods it hosts (``lab-train-0``), which come back under their names on the
claimed spare.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from clients.kube import KubernetesApi
from clients.nodesets import POD_PROTECT
from lab.chaos.fleet import (
    closed,
    double_claims,
    fleet_facts,
    leaked_claims,
    pods_placed,
    return_failed,
    return_retired,
    undrained_not_ours,
)
from lab.chaos.outages import KILL_STEPS, Context, Scenario, kill_worker
from lab.drill import default_job, pod_hosts, training_job
from lab.faults import Effect
from lab.fleet import FleetLab
from lab.procs import alive, wait_for
from lab.slinkylab import nodeset_pods
from lab.slurmrest import start_slurmrestd
from models.constants import CLAIMED_BY_ANNOTATION, remediation_workflow_id
from models.incident import IncidentStatus, Outcome, Step
from models.slinky import cluster_namespace
from starters.temporal import connect

SLURMRESTD_STOPPED = "slurmrestd_down_30s"
OPERATOR_STOPPED = "operator_down_at_{step}"
POD_PROTECT_BLOCKS = "pod_protect_blocks_eviction"
SLURMRESTD_STOP = 30.0
# The chaos lab's eviction timeout (lab/chaos/__init__.py): where the pod stays protected on
# purpose, the incident fails after it.
PROTECTED_EVICTION_TIMEOUT = 5.0
# While the operator is down a busy pod's pod-protect label is stale (nobody takes it off once
# gpufleet's requeue left its Slurm node idle), and gpufleet never forces past it: for the
# operator's outage at the drain the incident has the production default, which the 20 s outage
# fits in.
OPERATOR_DOWN_EVICTION_TIMEOUT = 60.0
# How long the operator stand-in stays down: the evicted pod is not recreated meanwhile, so the
# spare's claim waits for it (the claim's own wait is 150 s).
OPERATOR_STOP = 20.0
# The blocker: a job that ignores SIGTERM and refuses a requeue, keeping its Slurm node busy.
BLOCKER_SCRIPT = """#!/bin/bash
#SBATCH --job-name=chaos-blocker
#SBATCH --nodes=1
#SBATCH --no-requeue
# Keeps its Slurm node busy: SIGTERM ignored (and so by its children), no requeue.
trap '' TERM
echo "blocker on $(hostname) as job ${SLURM_JOB_ID}"
while true; do sleep 1; done
"""


def slinky_scenarios(*, short: bool) -> list[Scenario]:
    """The scenarios run through a drill (lab/chaos/scenarios.py run_scenario) on the slinky flavor."""
    alive_at = {Step.CHECKPOINT, Step.REQUEUE}
    kills = [
        Scenario(
            name=f"worker_killed_at_{step.value}",
            fault=kill_worker,
            at=step,
            delay_budget_s=15.0,
            effect=Effect.NONE if step in alive_at else None,
        )
        for step in KILL_STEPS
    ]
    full = [
        *kills,
        Scenario(name=SLURMRESTD_STOPPED, fault=stop_slurmrestd, at=Step.CHECKPOINT, effect=Effect.NONE),
        # Down as the drain starts (the busy pod's pod-protect label goes stale: the eviction waits
        # for the operator's return, within the eviction timeout), and once the drain is done while
        # the claim waits for the evicted pod to come back on the spare (it is recreated only then).
        Scenario(
            name=OPERATOR_STOPPED.format(step="drain_kubernetes"),
            fault=stop_operator,
            at=Step.DRAIN_KUBERNETES,
            before=default_eviction_timeout,
            after=chaos_eviction_timeout,
        ),
        Scenario(
            name=OPERATOR_STOPPED.format(step="claim_spare"),
            fault=stop_operator,
            at=Step.CLAIM_SPARE,
            once_done=Step.DRAIN_KUBERNETES,
        ),
    ]
    if short:
        return [s for s in full if s.name in {"worker_killed_at_checkpoint", SLURMRESTD_STOPPED}]
    return full


# -- the faults ------------------------------------------------------------------------------------


async def stop_slurmrestd(ctx: Context) -> None:
    """slurmrestd killed, then started again 30 s later on the same address (the worker keeps the
    URL it was given, and every Slurm call it makes meanwhile is refused)."""
    lab = ctx.lab
    state = lab.state()
    service = state["services"]["slurmrestd"]
    pid, url = int(service["pid"]), str(service["url"])
    port = int(url.rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(wait_for, lambda: not alive(pid), timeout=30, what="slurmrestd to die")
    ctx.fired.append(f"slurmrestd {pid} killed: {url} refuses connections for {SLURMRESTD_STOP:.0f}s")
    try:
        await asyncio.sleep(SLURMRESTD_STOP)
    finally:
        restd = await asyncio.to_thread(start_slurmrestd, lab.slurm, port=port)
        if service.get("folder"):
            shutil.rmtree(service["folder"], ignore_errors=True)
        state = lab.state()
        state["services"]["slurmrestd"] = {"pid": restd.pid, "url": restd.url, "folder": str(restd.folder)}
        lab._save(state)
    ctx.fired.append(f"slurmrestd started again on {restd.url} as {restd.pid}")


async def stop_operator(ctx: Context) -> None:
    """The operator stand-in killed, then started again 20 s later: meanwhile no pod is recreated,
    no drain follows a cordon and no pod-protect label changes."""
    lab = ctx.lab
    pid = int(lab.state()["services"]["operator"]["pid"])
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(wait_for, lambda: not alive(pid), timeout=30, what="the operator stand-in to die")
    ctx.fired.append(f"operator stand-in {pid} SIGKILLed for {OPERATOR_STOP:.0f}s")
    await asyncio.sleep(OPERATOR_STOP)
    await asyncio.to_thread(lab.up, lambda line: None, keep_slurm=True)
    ctx.fired.append(f"operator stand-in restarted as {lab.state()['services']['operator']['pid']}")


# -- pod-protect blocks the eviction ---------------------------------------------------------------


def set_eviction_timeout(lab: FleetLab, seconds: float) -> str:
    """The lab's policy with ``remediation.eviction_timeout_seconds: SECONDS`` for the incidents
    started from now (each reads the policy as it starts); returns the policy as it was."""
    text = lab.policy_file.read_text()
    found = re.search(r"^  eviction_timeout_seconds: .*$", text, flags=re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{lab.policy_file} sets no remediation.eviction_timeout_seconds")
    lab.policy_file.write_text(text.replace(found.group(0), f"  eviction_timeout_seconds: {seconds:g}"))
    return text


@contextlib.contextmanager
def eviction_timeout(lab: FleetLab, seconds: float) -> Iterator[None]:
    """The eviction timeout SECONDS for the incidents started meanwhile; the lab's own afterwards."""
    text = set_eviction_timeout(lab, seconds)
    try:
        yield
    finally:
        lab.policy_file.write_text(text)


async def default_eviction_timeout(ctx: Context, node: str) -> None:
    set_eviction_timeout(ctx.lab, OPERATOR_DOWN_EVICTION_TIMEOUT)
    ctx.fired.append(f"eviction timeout {OPERATOR_DOWN_EVICTION_TIMEOUT:g} s for this incident (the default)")


async def chaos_eviction_timeout(ctx: Context) -> None:
    set_eviction_timeout(ctx.lab, PROTECTED_EVICTION_TIMEOUT)


def _pods(lab: FleetLab) -> dict[str, dict[str, Any]]:
    return nodeset_pods(lab.state()["services"]["kubeapi"]["url"], lab.config.cluster, lab.partition)


def _scancel(lab: FleetLab, job_id: int) -> None:
    subprocess.run(
        lab.slurm.argv(["scancel", str(job_id)]), env=lab.slurm.env, check=True, capture_output=True, timeout=30
    )


async def pod_protect_blocks_eviction(ctx: Context) -> dict[str, Any]:
    """A job that keeps its Slurm node busy and refuses a requeue (``--no-requeue``, SIGTERM
    ignored) on a pod beside the training job's; an Xid on that pod's Kubernetes node. The
    operator labels the busy pod ``pod-protect`` and its PodDisruptionBudget forbids the eviction:
    the incident must fail at ``drain_kubernetes`` after the eviction timeout, saying that the pod
    is protected and was not forced; the pod stays where it is (same UID, same node), the blocker
    still runs, the training job is untouched and no spare stays claimed.

    Then what the failure's message tells a person to do: the blocker ends (its owner cancels it),
    the pod is evicted once its Slurm node is idle, and the node is returned for training."""
    lab, say = ctx.lab, ctx.say
    ctx.fired = []
    result: dict[str, Any] = {"name": POD_PROTECT_BLOCKS}
    problems: list[str] = []
    slurm = lab.slurm.client()
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(lab), say=say)
    busy = set(slurm.hostnames(job.nodes))
    free = sorted(set(slurm.partition_nodes(lab.partition)) - busy)
    if not free:
        return _finish(result, [f"no pod free beside job {job.job_id} ({job.nodes})"], say)
    pod_name = free[0]
    node = pod_hosts(lab)[pod_name]
    namespace = cluster_namespace(lab.config.cluster)
    script = lab.home / "drill" / "blocker.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(BLOCKER_SCRIPT)
    blocker = lab.slurm.sbatch(script, "-w", pod_name, "-o", str(lab.home / "drill" / "blocker-%j.log"))
    result.update(node=node, pod=f"{namespace}/{pod_name}", blocker=blocker, job_id=job.job_id)
    ended = False
    try:
        await asyncio.to_thread(
            wait_for,
            lambda: (
                slurm.job(blocker).state == "RUNNING"
                and (_pods(lab)[pod_name]["metadata"].get("labels") or {}).get(POD_PROTECT) == "true"
            ),
            timeout=60,
            what=f"blocker job {blocker} to run on {pod_name} and the pod to be labelled {POD_PROTECT}",
        )
        before_pod = _pods(lab)[pod_name]
        uid = before_pod["metadata"]["uid"]
        say(f"blocker job {blocker} runs on {pod_name} (on {node}); the pod is labelled {POD_PROTECT}=true")
        ctx.fired.append(f"job {blocker} (--no-requeue, SIGTERM ignored) keeps {pod_name} busy: {POD_PROTECT}=true")
        before = fleet_facts(lab)
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        handle = client.get_workflow_handle(
            remediation_workflow_id(lab.config.cluster, node), result_type=IncidentStatus
        )
        with eviction_timeout(lab, PROTECTED_EVICTION_TIMEOUT):
            detected = datetime.now(UTC)
            lab.inject_xid(node, 79, Effect.NONE)
            say(
                f"injected Xid 79 on {node} (eviction timeout {PROTECTED_EVICTION_TIMEOUT:g} s); "
                "the incident should fail at drain_kubernetes"
            )
            status = await closed(handle, since=detected, timeout=300)
        failed_at = next((entry.step.value for entry in status.timeline if entry.event == "failed"), status.step.value)

        def offset(step: Step, event: str) -> float | None:
            at = next((e.at for e in status.timeline if e.step == step and e.event == event), None)
            return round((at - detected).total_seconds(), 3) if at is not None else None

        result.update(
            outcome=status.outcome.value,
            incident=status.incident_id,
            failed_at=failed_at,
            incident_error=status.error,
            unrequeued={str(k): v for k, v in status.unrequeued.items()},
            # The eviction is tried from the drain's start for the eviction timeout; the incident
            # fails once the spare's claim beside it has stopped too.
            detect_to_drain_kubernetes=offset(Step.DRAIN_KUBERNETES, "started"),
            detect_to_failed=offset(Step(failed_at), "failed"),
        )
        if status.outcome != Outcome.FAILED:
            problems.append(f"the incident ended {status.outcome.value}, not failed")
        if failed_at != Step.DRAIN_KUBERNETES.value:
            problems.append(f"the incident failed at {failed_at}, not at drain_kubernetes")
        error = status.error or ""
        if not ("PodDisruptionBudget protects" in error and "never forces" in error and pod_name in error):
            problems.append(f"the failure does not say that {pod_name} is protected and was not forced: {error!r}")
        sent = [n.kind for n in status.notifications]
        if "failed" not in sent:
            problems.append(f"no one was told of the failure (notifications: {', '.join(sent) or 'none'})")
        after_pod = _pods(lab).get(pod_name)
        where = (after_pod or {}).get("spec", {}).get("nodeName")
        if after_pod is None or after_pod["metadata"]["uid"] != uid or where != node:
            problems.append(f"{pod_name} was evicted or deleted: it is now {'gone' if after_pod is None else where}")
        blocked = slurm.job(blocker)
        if blocked.state != "RUNNING":
            problems.append(f"the blocker job {blocker} was ended ({blocked.state}): gpufleet must not kill it")
        trained = slurm.job(job.job_id)
        jobs_lost = 0 if trained.state == "RUNNING" and trained.restarts == job.restarts else 1
        if jobs_lost:
            problems.append(
                f"the training job {job.job_id}, on other nodes, was touched "
                f"({trained.state}, restart {trained.restarts})"
            )
        claimed = [n.name for n in kube.list_nodes() if n.annotations.get(CLAIMED_BY_ANNOTATION) == status.incident_id]
        if claimed:
            problems.append(f"the failed incident still claims {', '.join(claimed)}")
        after = fleet_facts(lab)
        result.update(
            jobs_lost=jobs_lost + (0 if blocked.state == "RUNNING" else 1),
            double_claims=double_claims(after),
            nodes_undrained_not_ours=undrained_not_ours(before, after),
            claims_leaked=leaked_claims(after),
            pod_kept=after_pod is not None and after_pod["metadata"]["uid"] == uid and where == node,
        )
        ctx.fired.append(f"{status.incident_id} failed at {failed_at}: {error[:120]}")
        result["fault_fired"] = True
        # What the message tells a person to do: the job holding the pod ends, the pod is evicted
        # once its Slurm node is idle, the node is returned.
        await asyncio.to_thread(_scancel, lab, blocker)
        ended = True
        say(f"cancelled the blocker job {blocker}, as its owner would")
        await return_failed(lab, node, say)
    except Exception as exc:  # reported, and the run goes on
        result.setdefault("outcome", "error")
        result["error"] = f"{type(exc).__name__}: {exc}"
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        if not ended:
            with contextlib.suppress(subprocess.SubprocessError):
                await asyncio.to_thread(_scancel, lab, blocker)
    result["faults"] = list(ctx.fired)
    try:
        await asyncio.to_thread(
            wait_for,
            lambda: (
                pods_placed(lab)
                and all(not n.flags and n.state in {"idle", "allocated", "mixed"} for n in slurm.nodes())
            ),
            timeout=90,
            what="every NodeSet pod back on a node and every Slurm node healthy",
        )
        await return_retired(lab, say)
    except (RuntimeError, TimeoutError) as exc:
        problems.append(f"after the scenario: {exc}")
    lab.faults.clear_all()
    return _finish(result, problems, say)


def _finish(result: dict[str, Any], problems: list[str], say: Any) -> dict[str, Any]:
    totals = ("jobs_lost", "double_claims", "nodes_undrained_not_ours", "claims_leaked")
    for key in totals:
        result.setdefault(key, 0)
    correct = not problems and not any(result[key] for key in totals)
    result.update(passed=correct, correct=correct)
    result.setdefault("fault_fired", False)
    if problems:
        result["reason"] = "; ".join(problems)
    said = f" ({result['reason']})" if problems else ""
    say(f"{result['name']}: {'passed' if correct else 'FAILED'} ({result.get('outcome')}){said}")
    return result
