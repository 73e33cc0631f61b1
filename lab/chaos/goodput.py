"""The chaos run's goodput check: `gpufleet report --json` over the run accounts for every incident
the scenarios opened, each with a ledger whose recovery phases add up to its recovery time
(docs/goodput.md#the-report)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from lab.chaos.fleet import gpufleet
from lab.chaos.leftovers import TERMINATED
from lab.chaos.outages import Say
from lab.fleet import FleetLab
from models.goodput import RECOVERY_PHASES

# How far a ledger's phases may be from its recovery time (floating-point sums of seconds).
ADD_UP_TOLERANCE_S = 0.01


def incidents_of(results: Iterable[dict[str, Any]]) -> set[str]:
    """The incident IDs the scenarios' results name, with a ledger to show: not the one a person
    terminated (incident_terminated_in_grace), whose run never closed itself."""
    found: set[str] = set()
    for result in results:
        for key in ("incident", "fresh_incident"):
            if key == "incident" and result.get("name") == TERMINATED:
                continue
            value = result.get(key)
            if isinstance(value, str) and value:
                found.add(value)
        found.update(str(incident) for incident in result.get("incidents", []) if incident)
    return found


def check_report(document: dict[str, Any], expected: set[str]) -> dict[str, Any]:
    """What the report left out or got wrong, from its JSON document and the incidents expected."""
    incidents = document.get("incidents", [])
    reported = {incident["incident_id"] for incident in incidents}
    not_adding_up = sorted(
        incident["incident_id"]
        for incident in incidents
        if abs(
            sum(incident["phases"][phase.value]["seconds"] for phase in RECOVERY_PHASES) - incident["recovery_seconds"]
        )
        > ADD_UP_TOLERANCE_S
    )
    missing = sorted(expected - reported)
    # A terminated run computed no ledger (Temporal ended it mid-incident): named, as it should be.
    without = [
        entry["workflow_id"] for entry in document.get("without_ledger", []) if entry.get("status") != "TERMINATED"
    ]
    flagged = list(document.get("phases_not_adding_up", []))
    counted = document.get("totals", {}).get("incidents")
    return {
        "incidents": len(incidents),
        "expected": len(expected),
        "missing": missing,
        "without_ledger": without,
        "phases_not_adding_up": sorted(set(not_adding_up) | set(flagged)),
        "open": list(document.get("open", [])),
        "gpu_hours_lost": document.get("totals", {}).get("gpu_hours_lost"),
        "effective_training_time": document.get("effective_training_time"),
        "passed": not missing and not without and not not_adding_up and not flagged and counted == len(incidents),
    }


async def report_accounts(lab: FleetLab, expected: set[str], *, say: Say) -> dict[str, Any]:
    """Run `gpufleet report --json` on the lab's cluster (as the lab's viewer would) and check it."""
    try:
        out = await gpufleet(lab, "report", "--json", "--since", "1d", "--cluster", lab.config.cluster)
        checked = check_report(json.loads(out), expected)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # reported with the run; it goes on
        return {"passed": False, "expected": len(expected), "error": f"{type(exc).__name__}: {exc}"}
    say(
        f"goodput report: {checked['incidents']} incident(s) with ledgers, {len(checked['missing'])} missing, "
        f"{len(checked['without_ledger'])} without a ledger, {len(checked['phases_not_adding_up'])} not adding up"
    )
    return checked
