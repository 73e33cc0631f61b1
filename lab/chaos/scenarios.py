"""The scenarios on the chaos run's main lab: one incident each on a node of the running job, with
one fault on purpose, and two workers racing over two incidents at once."""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import UTC, datetime
from typing import Any

from clients.errors import ClientError
from lab.access import DEFAULT_USER
from lab.chaos.fleet import (
    closed,
    double_claims,
    fleet_facts,
    host_of,
    job_lost,
    leaked_claims,
    met_gpu_fault,
    on_node,
    return_failed,
    return_retired,
    step_end,
    undrained_not_ours,
)
from lab.chaos.leftovers import CONFIGMAP_BAD, configmap_kept_last_good, configmap_nan, configmap_restored
from lab.chaos.outages import (
    KILL_STEPS,
    STEP_ORDER,
    Context,
    Scenario,
    approved_by_the_operator,
    intake_back,
    intake_down,
    kill_temporal,
    kill_worker,
    kube_faults,
    operator_drains,
    pdb_blocks,
    pdb_cleanup,
    spooled_while_intake_down,
    stop_slurmctld,
    webhook_back,
    webhook_continues,
    webhook_hangs,
    webhook_refuses,
)
from lab.drill import default_job, run_drill, training_job
from lab.faults import Effect, default_effect
from lab.fleet import REPO_ROOT
from lab.procs import spawn, stop, wait_for
from models.constants import remediation_workflow_id
from models.incident import Approval, IncidentStatus, JobInfo, Outcome, Step
from starters.temporal import connect
from workflows.remediation import NodeRemediationWorkflow
from workflows.remediation.timeline import open_steps

RACE = "two_workers_two_incidents"


def scenarios(*, short: bool) -> list[Scenario]:
    # A fault timed at the checkpoint or the requeue needs a job still running there: its Xid is
    # one that leaves the job alive (the crash and the hang have scenarios of their own).
    alive = {Step.CHECKPOINT, Step.REQUEUE}
    kills = [
        Scenario(
            name=f"worker_killed_at_{step.value}",
            fault=kill_worker,
            at=step,
            delay_budget_s=15.0,
            effect=Effect.NONE if step in alive else None,
        )
        for step in KILL_STEPS
    ]
    full = [
        *kills,
        Scenario(name="temporal_killed_and_restarted", fault=kill_temporal, at=Step.CHECKPOINT, effect=Effect.NONE),
        Scenario(name="slurmctld_stopped_30s", fault=stop_slurmctld, at=Step.CHECKPOINT, effect=Effect.NONE),
        # The Xid posted while the intake is down: the detector's spool keeps it, nothing is lost.
        Scenario(
            name="intake_down_30s",
            before=intake_down,
            after=intake_back,
            verify=spooled_while_intake_down,
            # Counted from the intake's return (its outage held the clock), as long as any other detection.
            detect_timeout_s=30,
        ),
        Scenario(name="kubernetes_500_burst", fault=kube_faults(500, 12), at=Step.APPROVE),
        Scenario(name="kubernetes_429_burst", fault=kube_faults(429, 12, retry_after=1), at=Step.APPROVE),
        Scenario(name="pdb_blocks_eviction", before=pdb_blocks, after=pdb_cleanup),
        Scenario(name="webhook_refuses_connections", before=webhook_refuses, after=webhook_back, drained_budget_s=1.0),
        Scenario(name="webhook_hangs", before=webhook_hangs, after=webhook_continues, drained_budget_s=1.0),
        Scenario(
            name="operator_drained_before_xid",
            before=operator_drains,
            expect_approval=True,
            verify=approved_by_the_operator,
        ),
        # The GPU's own effect on the job, whatever the Xid's default: the rank on the node dies
        # with a CUDA error and srun cancels the step (the job has ended FAILED before remediation
        # looks), or it hangs deaf to SIGTERM until the requeue's SIGKILL.
        Scenario(name="job_crashes_with_its_gpu", effect=Effect.CRASH),
        Scenario(name="job_hangs_with_its_gpu", effect=Effect.HANG),
        # A bad value in the cluster's ConfigMap: the incident keeps the last good grace, spent
        # on the job's checkpoint (the job lives on after its Xid, to be signalled).
        Scenario(
            name=CONFIGMAP_BAD,
            effect=Effect.NONE,
            before=configmap_nan,
            after=configmap_restored,
            verify=configmap_kept_last_good,
        ),
    ]
    if short:
        names = {"worker_killed_at_checkpoint", "webhook_hangs"}
        return [s for s in full if s.name in names]
    return full


def at_or_after(step: Step, target: Step) -> bool:
    if step not in STEP_ORDER:
        return False
    return STEP_ORDER.index(step) >= STEP_ORDER.index(target)


def fault_missed(scenario: Scenario, ctx: Context, fired_at: list[str], seen: list[str]) -> list[str]:
    """Why the scenario's own fault did not happen as it says (empty: it did)."""
    if scenario.fault is not None and scenario.at is not None:
        if not fired_at:
            return [
                f"its fault never fired: the incident was never seen at {scenario.at.value} or after "
                f"(steps seen: {', '.join(seen) or 'none'})"
            ]
        if fired_at[0] != scenario.at.value:
            return [f"its fault fired at {fired_at[0]}: the incident passed {scenario.at.value} between two looks"]
    if (scenario.fault is not None or scenario.before is not None) and not ctx.fired:
        return ["its fault never fired"]
    if scenario.expect_approval and "approved" not in ctx.fired:
        return ["the incident never waited for approval"]
    return []


def repaired_in_place(ctx: Context) -> None:
    """A GPU fault the incident left standing (its node not retired) is repaired before the next
    scenario, so that no scenario's job lands on the last one's broken GPU."""
    cleared = ctx.lab.faults.clear_all()
    if cleared:
        ctx.say(f"repaired the GPUs of {', '.join(cleared)} in place")


async def run_scenario(ctx: Context, scenario: Scenario, baseline: dict[str, Any] | None) -> dict[str, Any]:
    lab, say = ctx.lab, ctx.say
    ctx.fired = []
    slurm = lab.slurm.client()
    job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(lab), say=say)
    job_nodes = slurm.hostnames(job.nodes)
    # The node the Xid hits (on the slinky flavor the Kubernetes node under the job's first pod)
    # and the job's Slurm nodes there, whose ranks meet its GPU's failure.
    target = host_of(lab, job_nodes[0])
    hit = on_node(lab, target, job_nodes)
    if scenario.before is not None:
        await scenario.before(ctx, target)
    before = fleet_facts(lab)
    fired_at: list[str] = []
    seen: list[str] = []
    # The approval a person gives, through the lab's gpufleet API as its operator (the history names them).
    operator = await lab.api_client() if scenario.expect_approval else None

    async def on_status(status: IncidentStatus) -> None:
        if not seen or seen[-1] != status.step.value:
            seen.append(status.step.value)
        # Steps run side by side (the Kubernetes drain beside the spare's claim): the incident is
        # at the scenario's step while it runs, whichever of them it entered last.
        step = scenario.at if scenario.at is not None and scenario.at in open_steps(status.timeline) else status.step
        due = scenario.at is not None and at_or_after(step, scenario.at) and status.step != Step.CLOSED
        if scenario.once_done is not None:
            due = due and any(e.step == scenario.once_done and e.event == "finished" for e in status.timeline)
        if scenario.fault is not None and due and not fired_at:
            fired_at.append(step.value)
            await scenario.fault(ctx)
        if operator is not None and status.waiting_for_approval and "approved" not in ctx.fired:
            ctx.fired.append("approved")
            handle = operator.get_workflow_handle(remediation_workflow_id(lab.config.cluster, status.node))
            wait, incident = status.approval_wait, status.incident_id
            answer = Approval(approved=True, by=DEFAULT_USER, reason="drill", wait=wait, incident_id=incident)
            await handle.signal(NodeRemediationWorkflow.decide, answer)

    result: dict[str, Any] = {"name": scenario.name}
    injected = time.time()
    verified: list[str] = []
    try:
        drill = await run_drill(
            lab,
            node=target,
            effect=scenario.effect,
            job_kind=default_job(lab),
            timeout=300,
            say=say,
            on_status=on_status,
            require_running=False,
            detect_timeout=scenario.detect_timeout_s,
            # A service the scenario brings back later (the intake): its outage is not the detector's time.
            detect_held=lambda: any(not task.done() for task in ctx.pending),
        )
        if scenario.verify is not None:
            verified = await scenario.verify(ctx, drill)
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
    missed = fault_missed(scenario, ctx, fired_at, seen) + verified
    if drill is not None:
        effect = drill["effect"]
        if effect != Effect.NONE.value and met_gpu_fault(lab, drill["job_id"], hit, effect, since=injected):
            missed.append(f"the job's rank on {', '.join(hit)} never met its GPU fault ({effect})")
        timings = drill["timings_s"]
        now = JobInfo(job_id=drill["job_id"], state=drill["job_state"], restarts=drill["job_restarts"])
        resumed_once = now.state == "RUNNING" and now.restarts == drill["restarts_before"] + 1
        checks["jobs_lost"] = job_lost(drill["restarts_before"], now)
        added = None
        drained_added = None
        if baseline is not None and timings["detect_to_resumed"] is not None:
            added = round(timings["detect_to_resumed"] - baseline["detect_to_resumed"], 3)
            drained_added = round(timings["detect_to_drained"] - baseline["detect_to_drained"], 3)
        correct = (
            drill["outcome"] == Outcome.RESOLVED.value
            and resumed_once
            and (drill["resumed_from_step"] or 0) > 0
            and not any(checks.values())
            and not missed
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
            effect=effect,
            gpu_fault_hits=drill["gpu_fault_hits"],
            job_state=drill["job_state"],
            detect_to_drained=timings["detect_to_drained"],
            detect_to_resumed=timings["detect_to_resumed"],
            added_delay_s=added,
            added_to_drained_s=drained_added,
            incident=drill["incident_id"],
        )
    elif missed:
        result.update(passed=False, correct=False)
    if fired_at:
        result["fault_at_step"] = fired_at[0]
    result["faults"] = list(ctx.fired)
    result["fault_fired"] = not missed
    if missed:
        result["reason"] = "; ".join(missed)
    result.update(checks)
    try:
        if lab.slinky and result.get("outcome") in (Outcome.FAILED.value, "error"):
            await return_failed(lab, target, say)  # the next scenario needs its node back
        await return_retired(lab, say)
    except (ClientError, RuntimeError, TimeoutError) as exc:  # reported with the scenario; the run goes on
        result.update(passed=False, error=f"after the scenario: {exc}")
    repaired_in_place(ctx)
    said = f" ({result['reason']})" if missed else ""
    say(f"{scenario.name}: {'passed' if result.get('passed') else 'FAILED'} ({result.get('outcome')}){said}")
    return result


async def race_two_incidents(ctx: Context, baseline: dict[str, Any]) -> dict[str, Any]:
    """Two workers at once, Xids on both nodes of the job at once: two spares, one requeue."""
    lab, say = ctx.lab, ctx.say
    slurm = lab.slurm.client()
    job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(lab), say=say)
    job_nodes = slurm.hostnames(job.nodes)
    # On the slinky flavor the Kubernetes nodes under the job's pods; their pods meet the failure.
    targets = list(dict.fromkeys(host_of(lab, node) for node in job_nodes))[:2]
    hit = [node for target in targets for node in on_node(lab, target, job_nodes)]
    second = spawn(
        [sys.executable, "-m", "workers.entry", "worker"],
        log=lab.home / "logs" / "worker-2.log",
        env=lab.env(),
        cwd=REPO_ROOT,
    )
    before = fleet_facts(lab)
    client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
    result: dict[str, Any] = {"name": RACE, "nodes": targets}
    injected = time.time()
    try:
        detected = datetime.now(UTC)
        for node in targets:
            lab.inject_xid(node, 79)
        statuses = []
        for node in targets:
            handle = client.get_workflow_handle(f"remediate-{lab.config.cluster}-{node}", result_type=IncidentStatus)
            statuses.append(await closed(handle, since=detected))
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
        "jobs_lost": job_lost(job.restarts, after_job),
        "double_claims": double_claims(after) + (1 if len(set(spares)) != len(spares) else 0),
        "nodes_undrained_not_ours": undrained_not_ours(before, after),
        "claims_leaked": leaked_claims(after),
    }
    # A rank that saw its peer fail first may have stopped before its own GPU failed: one is enough.
    effect = default_effect(79).value
    missing = met_gpu_fault(lab, job.job_id, hit, effect, since=injected) if effect != "none" else []
    missing = missing if len(missing) == len(hit) else []
    if missing:
        result["reason"] = f"no rank of the job met its GPU fault ({effect}) on {', '.join(targets)}"
    result["fault_fired"] = not missing
    if statuses:
        partition = set(after["partition"])
        in_place = all(s.spare in partition for s in statuses) and not partition & set(targets)
        resumed_at = max(step_end(s, Step.RESUME) for s in statuses)
        drained_at = max(step_end(s, Step.DRAIN_SLURM) for s in statuses)
        once = after_job is not None and after_job.restarts == job.restarts + 1
        correct = (
            all(s.outcome == Outcome.RESOLVED for s in statuses)
            and in_place
            and once
            and not missing
            and not any(checks.values())
        )
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
    say(f"{RACE}: {'passed' if result.get('passed') else 'FAILED'}")
    try:
        await return_retired(lab, say)
    except (RuntimeError, TimeoutError) as exc:  # reported with the scenario
        result.update(passed=False, error=f"after the scenario: {exc}")
    repaired_in_place(ctx)
    return result
