"""The chaos scenarios about the fleet guard, each in a four-node lab of its own: a storm of Xids on
every training node at once, and a guard saturated by incidents that wait for spares."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.service import RPCError

from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from lab.chaos.fleet import (
    chaos_lab,
    closed,
    double_claims,
    fleet_facts,
    gpufleet,
    job_lost,
    leaked_claims,
    met_gpu_fault,
    record_and_stop,
    return_retired,
    undrained_not_ours,
)
from lab.chaos.goodput import report_accounts
from lab.chaos.outages import Say
from lab.drill import default_job, running_and_checkpointed, submit_job, training_job
from lab.faults import Effect, default_effect
from lab.fleet import FleetLab
from lab.procs import wait_for
from models.constants import owned_reason
from models.incident import IncidentStatus, JobInfo, Outcome, Step
from starters.temporal import connect
from workflows.remediation import NodeRemediationWorkflow

STORM = "storm_four_nodes_at_once"
SATURATED = "guard_saturated"
# "At once": with the guard full, the third node is drained within this of its Xid (a clean drill
# drains in under a second), and the job its GPU ended is requeued within the second (the step's
# end takes up to KillWait, 10 s in the lab).
SATURATED_DRAIN_BUDGET_S = 5.0
SATURATED_REQUEUE_BUDGET_S = 30.0
# Only the guard's in-flight limit (its default, 2) is left on: no share limit, no lemon rules.
IN_FLIGHT_ONLY = "guard:\n  max_share: 0\n  cooldown_seconds: 0\n  quarantine_after: 0\n"
EVER = datetime.min.replace(tzinfo=UTC)


def _gpu_effect() -> str:
    return default_effect(79).value


def _fault_fired(lab: FleetLab, job_id: int, nodes: list[str], *, since: float) -> bool:
    """Whether a rank of the job met its GPU fault on one of ``nodes`` (Xid 79's own effect)."""
    effect = _gpu_effect()
    return effect == Effect.NONE.value or len(met_gpu_fault(lab, job_id, nodes, effect, since=since)) < len(nodes)


async def _ran_again(slurm: SlurmCli, job: JobInfo, *, timeout: float) -> JobInfo | None:
    """The job once it runs again on a later restart; None if it does not within ``timeout``."""
    try:
        found: JobInfo = await asyncio.to_thread(
            wait_for,
            lambda: (j := slurm.job(job.job_id)).state == "RUNNING" and j.restarts > job.restarts and j,
            timeout=timeout,
            what=f"job {job.job_id} to run again",
        )
    except TimeoutError:
        return None
    return found


async def storm(home: Path, *, say: Say) -> dict[str, Any]:
    """Xids on all four training nodes within a second, in a four-node lab of its own with the
    default fleet guard: every node drained at once (no new work on a failed GPU), one page, and
    at least the half past the share waiting at the breaker without killing a job; after
    `gpufleet breaker reset` the rest go on (and get spares once the first ones' retired nodes
    are returned), and the job the failure ended runs again."""
    lab = chaos_lab(home, ["gpu1", "gpu2", "gpu3", "gpu4"], say=say)
    config = lab.config
    result: dict[str, Any] = {"name": STORM, "jobs_lost": 0}
    try:
        slurm = lab.slurm.client()
        job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(lab), say=say)
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        handles = {
            node: client.get_workflow_handle(f"remediate-{config.cluster}-{node}", result_type=IncidentStatus)
            for node in config.training
        }
        say("storm: Xid 79 on gpu1..gpu4 at once")
        injected = time.time()
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
                    s.waiting_for_approval
                    or s.step == Step.CLOSED
                    or any(e.step == Step.GUARD and e.event == "finished" for e in s.timeline)
                    for s in statuses.values()
                ):
                    return statuses
                await asyncio.sleep(0.2)
            raise TimeoutError("the storm's incidents did not all reach the fleet guard within 120 s")

        statuses = await settled()
        waiting = sorted(node for node, s in statuses.items() if s.waiting_for_approval)
        granted = sorted(node for node in statuses if node not in waiting)
        # Let the granted ones finish (they take the two spares), then look again: the rest still wait.
        for node in granted:
            await closed(handles[node], since=EVER)
        after = fleet_facts(lab)
        drained = sorted(node for node, (is_drained, reason) in after["slurm"].items() if owned_reason(reason))
        # Held at the breaker: drained, the ended job requeued, but no running job signalled.
        still = [node for node in waiting if not (await handles[node].query(NodeRemediationWorkflow.status)).signalled]
        pages = [n for n in lab.notifications() if n.get("kind") == "breaker_tripped"]
        touched = len(waiting) - len(still)  # waiting incidents that signalled a job: none may
        fired = _fault_fired(lab, job.job_id, slurm.hostnames(job.nodes), since=injected)
        result.update(
            storm_drained=len(drained),
            storm_waiting=len(still),
            storm_paged=len(pages),
            drained_nodes=drained,
            waiting_nodes=waiting,
            storm_jobs_touched_on_waiting_nodes=touched,
            fault_fired=fired,
        )
        say(f"storm: drained {drained}, waiting {waiting}, pages {len(pages)}; `gpufleet breaker reset`")
        await gpufleet(lab, "breaker", "reset", "--reason", "chaos: storm over")
        rest = await _closed_returning_retired(lab, handles, waiting, say=say)
        resolved_after_reset = all(s.outcome == Outcome.RESOLVED for s in rest)
        result.update(resolved_after_reset=resolved_after_reset)
        storm_incidents = {status.incident_id for status in statuses.values()}
        result["goodput"] = await report_accounts(lab, storm_incidents, say=say)
        result["jobs_lost"] = job_lost(job.restarts, await _ran_again(slurm, job, timeout=120))
        if not fired:
            result["reason"] = f"the job's ranks never met their GPU fault ({_gpu_effect()})"
        correct = (
            len(drained) == len(config.training)
            and len(waiting) >= 2
            and len(still) == len(waiting)
            and len(pages) == 1
            and touched == 0
            and resolved_after_reset
            and fired
            and result["jobs_lost"] == 0
            and result["goodput"]["passed"]
        )
        result.update(passed=correct, correct=correct, outcome="tripped, then reset")
    except Exception as exc:  # reported, and the run goes on
        result.update(passed=False, correct=False, outcome="error", error=f"{type(exc).__name__}: {exc}")
    finally:
        await record_and_stop(lab)
    say(f"{STORM}: {'passed' if result.get('passed') else 'FAILED'}")
    return result


async def _closed_returning_retired(
    lab: FleetLab, handles: dict[str, Any], nodes: list[str], *, say: Say, timeout: float = 600
) -> list[IncidentStatus]:
    """Until the incidents of ``nodes`` close: the lab has fewer spares than failed nodes, so each
    node an incident retired and let go of comes back as a spare (as once repaired) for the next."""
    tasks = {node: asyncio.create_task(closed(handles[node], since=EVER, timeout=timeout)) for node in nodes}
    returned: set[str] = set()
    while not all(task.done() for task in tasks.values()):
        done = {node for node, task in tasks.items() if task.done()}
        returned |= set(await return_retired(lab, say, all_healthy=False, only=done - returned))
        await asyncio.wait(list(tasks.values()), timeout=2, return_when=asyncio.FIRST_COMPLETED)
    return [task.result() for task in tasks.values()]


async def _seconds_until(check: Callable[[], object], *, start: float, timeout: float) -> float | None:
    """Seconds from ``start`` until ``check`` holds (polled); None if it does not within ``timeout``."""
    try:
        await asyncio.to_thread(wait_for, check, timeout=timeout, what="it", interval=0.05)
    except TimeoutError:
        return None
    return round(time.monotonic() - start, 3)


async def _statuses(handles: dict[str, Any]) -> dict[str, IncidentStatus]:
    found = {}
    for node, handle in handles.items():
        with contextlib.suppress(RPCError):
            found[node] = await handle.query(NodeRemediationWorkflow.status)
    return found


def _where(status: IncidentStatus | None) -> str:
    if status is None:
        return "no incident"
    waits = f", waiting for approval: {status.waiting_for_approval}" if status.waiting_for_approval else ""
    return f"at {status.step.value}{waits}"


async def guard_saturated(home: Path, *, say: Say) -> dict[str, Any]:
    """Two incidents wait for spares (none is free), then a third Xid on another node: whatever the
    guard's in-flight limit (2), that node is drained at once and the job its GPU ended is
    requeued; once spares are free all three resolve and both jobs run again."""
    training, spares = ["gpu1", "gpu2", "gpu3", "gpu4"], ["spare1", "spare2", "spare3"]
    lab = chaos_lab(home, training, spares=spares, say=say)
    lab.policy_file.write_text(lab.policy_file.read_text() + IN_FLIGHT_ONLY)
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    slurm = lab.slurm.client()
    result: dict[str, Any] = {"name": SATURATED}
    problems: list[str] = []
    jobs: list[JobInfo] = []
    struck: list[JobInfo] = []  # the jobs an Xid hit
    try:
        for spare in spares:
            kube.set_unschedulable(spare, True)  # held by an operator: no spare is free
        kind = default_job(lab)
        # One after the other, not pinned (-w would pin their requeues to the failed nodes too):
        # Slurm places the first on gpu1 and gpu2, the second on gpu3 and gpu4.
        for _ in range(2):
            job_id = submit_job(lab, kind)
            jobs.append(await asyncio.to_thread(running_and_checkpointed, slurm, job_id))
        placed = [slurm.hostnames(job.nodes) for job in jobs]
        if placed != [["gpu1", "gpu2"], ["gpu3", "gpu4"]]:
            raise RuntimeError(f"the jobs were placed on {placed}, not on gpu1,gpu2 and gpu3,gpu4")
        before = fleet_facts(lab)
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        handles = {
            node: client.get_workflow_handle(f"remediate-{lab.config.cluster}-{node}", result_type=IncidentStatus)
            for node in ("gpu1", "gpu2", "gpu3")
        }
        since, injected = datetime.now(UTC), time.time()
        say(f"{SATURATED}: Xid 79 on gpu1 and gpu2, no spare free")
        for node in ("gpu1", "gpu2"):
            lab.inject_xid(node, 79)
        struck.append(jobs[0])
        first_two = {node: handles[node] for node in ("gpu1", "gpu2")}

        async def both_wait() -> bool:
            found = await _statuses(first_two)
            return len(found) == 2 and all(s.waiting_for_spare for s in found.values())

        deadline = time.monotonic() + 180
        while not await both_wait() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if not await both_wait():
            found = await _statuses(first_two)
            where = "; ".join(f"{node} {_where(found.get(node))}" for node in first_two)
            raise RuntimeError(f"the first two incidents did not both come to wait for a spare: {where}")

        say(f"{SATURATED}: both wait for a spare; Xid 79 on gpu3")
        started = time.monotonic()
        lab.inject_xid("gpu3", 79)
        struck.append(jobs[1])
        drained_s = await _seconds_until(
            lambda: (n := slurm.node("gpu3")).drained and owned_reason(n.reason), start=started, timeout=60
        )
        second = jobs[1]
        requeued_s = await _seconds_until(
            lambda: slurm.job(second.job_id).restarts > second.restarts, start=started, timeout=120
        )
        third = (await _statuses({"gpu3": handles["gpu3"]})).get("gpu3")
        result.update(third_drained_s=drained_s, third_job_requeued_s=requeued_s, third=_where(third))
        if drained_s is None or drained_s > SATURATED_DRAIN_BUDGET_S:
            problems.append(
                f"gpu3 was not drained within {SATURATED_DRAIN_BUDGET_S:g} s of its Xid "
                f"({'not in 60 s' if drained_s is None else f'{drained_s} s'}; the incident is {_where(third)})"
            )
        if requeued_s is None or requeued_s > SATURATED_REQUEUE_BUDGET_S:
            problems.append(
                f"job {second.job_id}, ended with gpu3's GPU, was not requeued within "
                f"{SATURATED_REQUEUE_BUDGET_S:g} s ({'not in 120 s' if requeued_s is None else f'{requeued_s} s'})"
            )
        if third is not None and third.waiting_for_approval:
            problems.append(f"the third incident waits for approval: {third.waiting_for_approval}")
        fired = {
            jobs[0].job_id: _fault_fired(lab, jobs[0].job_id, ["gpu1", "gpu2"], since=injected),
            second.job_id: _fault_fired(lab, second.job_id, ["gpu3"], since=injected),
        }
        result["fault_fired"] = all(fired.values())
        for job_id in (job_id for job_id, met in fired.items() if not met):
            problems.append(f"the fault did not fire: no rank of job {job_id} met its GPU's failure")

        say(f"{SATURATED}: spares free again")
        for spare in spares:
            kube.set_unschedulable(spare, False)
        for handle in handles.values():
            with contextlib.suppress(RPCError):
                await handle.signal(NodeRemediationWorkflow.spare_available)
        statuses = [await closed(handle, since=since) for handle in handles.values()]
        if not all(s.outcome == Outcome.RESOLVED for s in statuses):
            problems.append("not every incident resolved: " + ", ".join(s.outcome.value for s in statuses))
        after = fleet_facts(lab)
        result.update(
            outcome=",".join(s.outcome.value for s in statuses),
            double_claims=double_claims(after),
            claims_leaked=leaked_claims(after),
            nodes_undrained_not_ours=undrained_not_ours(before, after),
        )
    except Exception as exc:  # reported, and the run goes on
        result.update(outcome="error", error=f"{type(exc).__name__}: {exc}")
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        # A job the failure ended that does not run again is lost, however the scenario went.
        lost = 0
        for job in struck:
            timeout = 180 if "error" not in result else 1
            lost += job_lost(job.restarts, await _ran_again(slurm, job, timeout=timeout))
        result["jobs_lost"] = lost
        await record_and_stop(lab)
    totals = ("jobs_lost", "double_claims", "claims_leaked", "nodes_undrained_not_ours")
    correct = not problems and not any(result.get(key, 0) for key in totals)
    result.update(passed=correct, correct=correct)
    if problems:
        result["reason"] = "; ".join(problems)
    said = f" ({result['reason']})" if problems else ""
    say(f"{SATURATED}: {'passed' if correct else 'FAILED'}{said}")
    return result
