"""The chaos scenario about failure domains (docs/domains.md), in a lab of its own: a storm on one
rack (Xid 79 on all three of rack a's nodes within a second) with a single Xid in rack b at the
same time. Rack a must make one domain incident and claim no spare while rack b's node is
replaced as usual and the fleet-wide breaker stays closed; `gpufleet domains confirm rack/a`
then replaces rack a's nodes one at a time, and the job the storm ended runs again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.service import RPCError

from lab.chaos.fleet import (
    chaos_lab,
    closed,
    double_claims,
    fleet_facts,
    gpufleet,
    job_lost,
    leaked_claims,
    record_and_stop,
    undrained_not_ours,
)
from lab.chaos.goodput import report_accounts
from lab.chaos.guard import _ran_again
from lab.chaos.outages import Say
from lab.drill import default_job, training_job
from models.constants import guard_workflow_id
from models.guard import GuardStatus
from models.incident import IncidentStatus, JobInfo, Outcome
from models.topology import Domain, DomainIncidentStatus, DomainKind, domain_workflow_id
from starters.temporal import connect
from workflows.domain import DomainIncidentWorkflow
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow

RACK_STORM = "rack_storm_one_domain_incident"
RACK_A, RACK_B = ["gpu1", "gpu2", "gpu3"], ["gpu4", "gpu5"]
SPARES = ["spare1", "spare2", "spare3", "spare4"]
RACK = Domain(kind=DomainKind.RACK, name="a")
# The rack's incidents drain, wait out their jobs' grace (60 s in a chaos lab) and requeue before
# they come to the replacement the domain holds.
HELD_WITHIN_S = 240.0


def _held(status: IncidentStatus | None) -> bool:
    return status is not None and f"held by the domain incident {RACK.key}" in (status.waiting_for_approval or "")


async def _until(check: Any, *, timeout: float, what: str) -> Any:
    """Poll the coroutine function ``check`` until it returns something true."""
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(0.5)


async def rack_storm(home: Path, *, say: Say) -> dict[str, Any]:
    racks = {"a": list(RACK_A), "b": list(RACK_B)}
    lab = chaos_lab(home, [*RACK_A, *RACK_B], spares=SPARES, racks=racks, domain_incidents=True, say=say)
    # Evictions a budget forbids are forced after 5 s, as in the main chaos lab (each replacement's
    # Kubernetes drain would wait 60 s for the training pods' PodDisruptionBudget otherwise).
    lab.policy_file.write_text(
        lab.policy_file.read_text().replace("remediation:\n", "remediation:\n  eviction_timeout_seconds: 5\n")
    )
    config = lab.config
    slurm = lab.slurm.client()
    result: dict[str, Any] = {"name": RACK_STORM}
    problems: list[str] = []
    job: JobInfo | None = None
    try:
        job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(lab), say=say)
        before = fleet_facts(lab)
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        handles = {
            node: client.get_workflow_handle(f"remediate-{config.cluster}-{node}", result_type=IncidentStatus)
            for node in [*RACK_A, "gpu4"]
        }
        domain = client.get_workflow_handle(domain_workflow_id(config.cluster, RACK), result_type=DomainIncidentStatus)
        guard = client.get_workflow_handle(guard_workflow_id(config.cluster))
        since = datetime.now(UTC)
        say(f"{RACK_STORM}: Xid 79 on {', '.join(RACK_A)} (all of rack a) and on gpu4 (rack b) at once")
        for node in [*RACK_A, "gpu4"]:
            lab.inject_xid(node, 79)

        other = await closed(handles["gpu4"], since=since, timeout=HELD_WITHIN_S)

        async def all_held() -> dict[str, IncidentStatus] | None:
            found = {}
            for node in RACK_A:
                with contextlib.suppress(RPCError):
                    found[node] = await handles[node].query(NodeRemediationWorkflow.status)
            return found if len(found) == len(RACK_A) and all(_held(s) for s in found.values()) else None

        held = await _until(all_held, timeout=HELD_WITHIN_S, what="rack a's incidents held by its domain incident")
        opened: DomainIncidentStatus = await domain.query(DomainIncidentWorkflow.status)
        notes = lab.notifications()
        told = [n for n in notes if n.get("kind") == "domain_incident"]
        pages = [n for n in notes if n.get("kind") == "breaker_tripped"]
        facts = fleet_facts(lab)
        claimed_for_rack = [s.spare for s in held.values() if s.spare]
        result.update(
            other_outcome=other.outcome.value,
            other_spare=other.spare,
            domain_failed=sorted(f.node for f in opened.failures),
            domain_told=len(told),
            pages=len(pages),
            spares_claimed_for_rack=claimed_for_rack,
        )
        if other.outcome != Outcome.RESOLVED or not other.spare:
            problems.append(f"gpu4 (rack b) was not replaced as usual: {other.outcome}, spare {other.spare!r}")
        if sorted(f.node for f in opened.failures) != RACK_A or not opened.notified:
            problems.append(f"the domain incident holds {result['domain_failed']}, told: {opened.notified}")
        if len(told) != 1:
            problems.append(f"the operators were told {len(told)} times of the domain incident, not once")
        if pages:
            problems.append("the fleet-wide breaker tripped")
        if claimed_for_rack:
            problems.append(f"spares were claimed for rack a's nodes before a decision: {claimed_for_rack}")
        if any(facts["pools"].get(node) != before["pools"].get(node) for node in RACK_A):
            problems.append("a rack a node was retired before a decision")

        say(f"{RACK_STORM}: one domain incident, no spare claimed for it; `gpufleet domains confirm rack/a`")
        await gpufleet(lab, "domains", "confirm", RACK.key, "--reason", "chaos: the nodes' own faults")
        statuses = [await closed(handles[node], since=since, timeout=600) for node in RACK_A]
        state: GuardStatus = await guard.query(FleetGuardWorkflow.status)
        shown = await gpufleet(lab, "domains", "show", RACK.key)
        spares = [s.spare for s in statuses]
        result.update(rack_outcomes=[s.outcome.value for s in statuses], rack_spares=spares)
        if not all(s.outcome == Outcome.RESOLVED for s in statuses) or len(set(spares)) != len(RACK_A):
            problems.append(f"rack a's nodes were not each replaced after the confirm: {result['rack_outcomes']}")
        if "confirmed by" not in shown:
            problems.append(f"`gpufleet domains show` does not say it was confirmed: {shown!r}")
        one_at_a_time = _one_at_a_time(state, {s.incident_id for s in statuses})
        result["one_at_a_time"] = one_at_a_time
        if not one_at_a_time:
            problems.append("two of rack a's nodes were replaced at once")
        after = fleet_facts(lab)
        result.update(
            double_claims=double_claims(after),
            claims_leaked=leaked_claims(after),
            nodes_undrained_not_ours=undrained_not_ours(before, after),
        )
        result["goodput"] = await report_accounts(lab, {s.incident_id for s in [*statuses, other]}, say=say)
        if not result["goodput"]["passed"]:
            problems.append("gpufleet report does not account for every incident")
    except Exception as exc:  # reported, and the run goes on
        result.update(outcome="error", error=f"{type(exc).__name__}: {exc}")
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        lost = 0
        if job is not None:
            lost = job_lost(job.restarts, await _ran_again(slurm, job, timeout=180 if not problems else 1))
        result["jobs_lost"] = lost
        await record_and_stop(lab)
    totals = ("jobs_lost", "double_claims", "claims_leaked", "nodes_undrained_not_ours")
    correct = not problems and not any(result.get(key, 0) for key in totals)
    result.update(passed=correct, correct=correct, outcome=result.get("outcome", "one domain incident, confirmed"))
    if problems:
        result["reason"] = "; ".join(problems)
    say(f"{RACK_STORM}: {'passed' if correct else 'FAILED'}" + (f" ({result['reason']})" if problems else ""))
    return result


def _one_at_a_time(state: GuardStatus, incidents: set[str]) -> bool:
    """Whether, from the confirm on, each of ``incidents`` was granted its replacement's slot only
    once the one before had given its slot back (the guard's own log)."""
    log = state.state.log
    start = next((i for i, e in enumerate(log) if e.event == "domain confirmed"), None)
    if start is None:
        return False
    fixing: set[str] = set()
    granted = 0
    for event in log[start:]:
        if event.incident_id not in incidents:
            continue
        if event.event == "granted":
            if fixing:
                return False
            fixing.add(event.incident_id)
            granted += 1
        elif event.event == "released":
            fixing.discard(event.incident_id)
    return granted == len(incidents)
