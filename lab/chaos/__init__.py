"""``make chaos``: remediation on a bad day, in a lab of its own, with a training job running.

Each scenario is a fresh incident on a node of the running job, with one fault on purpose:
the worker SIGKILLed at each step (and restarted 2 s later), the Temporal server killed and
restarted, slurmctld stopped for 30 s, the Kubernetes API answering 500 and 429 in bursts, a
PodDisruptionBudget blocking the eviction, the webhook refusing connections or hanging, two
workers racing over two incidents at once, a node an operator drained before its Xid, the
job crashing or hanging with its GPU, a ``grace_seconds: nan`` in the cluster's ConfigMap, an
incident terminated by a person in its grace period (the reaper gives back what it held), and a
detector restarted without its cursor (old Xids not reported again, a fresh one reported).
Every Xid does to the job's processes on its node what the real failure does (lab/faults.py:
for Xid 79, the rank dies with a CUDA error). Last, each in a four-node lab of its own: a
storm, Xids on every training node at once with the default fleet guard (``storm_drained``,
``storm_waiting``, ``storm_paged``); a guard saturated by two incidents waiting for spares
when a third Xid comes, whose node must be drained at once and whose ended job requeued; and a
rack storm (lab/chaos/domains.py), Xids on all of one rack's nodes and one node of the other
rack at once: one domain incident, no spare claimed for it, the other rack's node replaced as
usual, then `gpufleet domains confirm` replacing the rack's nodes one at a time. A drill
in the same run is the baseline. Between scenarios the retired nodes are returned as spares
(``gpufleet nodes return``), as an operator would after a repair.

A scenario whose fault did not fire (never, or only after the incident passed the step it was
meant for, or a job that never met its GPU's failure) fails, saying so in ``reason``.

The last line printed is one JSON object: per scenario its name, whether it passed (it is
``correct``: its fault fired, the incident resolved, the job resumed once, nothing lost; and
``within_budget``: a worker kill adds at most 15 s, a dead or hanging webhook at most 1 s before
the drain), the outcome, ``detect_to_drained``, ``detect_to_resumed`` and ``added_delay_s``
(against the baseline); totals ``jobs_lost`` (jobs the failure ended, or left hanging, that did
not run again), ``double_claims``, ``nodes_undrained_not_ours``, ``claims_leaked`` and
``max_added_delay_s``; and ``goodput``: `gpufleet report --json` over the main lab's run accounts
for every incident its scenarios opened, each with a ledger whose phases add up to its recovery
time (lab/chaos/goodput.py; the storm checks its own lab's the same way).

With ``--flavor slinky`` (``make chaos FLAVOR=slinky``) the lab is the slinky flavor's (Slurm
nodes that are NodeSet pods run by the operator stand-in, the worker on slurmrestd; three training
nodes, so that a pod stays free beside the two-node job) and the scenarios are its own
(lab/chaos/slinky.py): the worker killed at each step, slurmrestd down for 30 s, the operator
stand-in down at the Kubernetes drain and at the spare's claim, pod-protect blocking the eviction
(the incident must fail at ``drain_kubernetes``, the pod not forced), and two workers, two
incidents at once; the same totals, claims and partitions read on Kubernetes nodes, drains on the
pods' Slurm nodes.

Run it as ``python -m lab.chaos [--flavor default|slinky] [--short] [--only NAMES] [--home DIR]
[--output FILE]``; ``make chaos`` keeps its JSON, with the commit, date and machine
(``provenance``), in docs/results/chaos.json (``make chaos FLAVOR=slinky`` in
docs/results/chaos-slinky.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from lab.chaos.domains import RACK_STORM, rack_storm
from lab.chaos.fleet import chaos_lab, record_and_stop
from lab.chaos.goodput import incidents_of, report_accounts
from lab.chaos.guard import SATURATED, STORM, guard_saturated, storm
from lab.chaos.leftovers import CURSOR_LOST, TERMINATED, detector_cursor_lost, terminated_in_grace
from lab.chaos.outages import Context, Say, Scenario
from lab.chaos.scenarios import RACE, race_two_incidents, run_scenario, scenarios
from lab.chaos.slinky import POD_PROTECT_BLOCKS, pod_protect_blocks_eviction, slinky_scenarios
from lab.fleet import FleetLab
from lab.provenance import provenance, write_result
from lab.slinkylab import FLAVORS, SLINKY_RELEASE
from lab.slurmroots import DEFAULT_RELEASE, LAB_SLURM_ENV, RELEASES

__all__ = [
    "CURSOR_LOST",
    "POD_PROTECT_BLOCKS",
    "RACE",
    "RACK_STORM",
    "SATURATED",
    "STORM",
    "TERMINATED",
    "Scenario",
    "chaos",
    "main",
    "scenario_names",
    "scenarios",
    "slinky_scenarios",
]

TOTALS = ("jobs_lost", "double_claims", "nodes_undrained_not_ours", "claims_leaked")


def scenario_names(flavor: str) -> set[str]:
    """Every scenario a full run of the flavor has, besides the baseline."""
    if flavor == "slinky":
        return {scenario.name for scenario in slinky_scenarios(short=False)} | {POD_PROTECT_BLOCKS, RACE}
    return {scenario.name for scenario in scenarios(short=False)} | {
        RACE,
        TERMINATED,
        CURSOR_LOST,
        STORM,
        SATURATED,
        RACK_STORM,
    }


async def chaos(
    home: Path, *, short: bool, say: Say, only: set[str] | None = None, flavor: str = "default"
) -> dict[str, Any]:
    slinky = flavor == "slinky"
    # On the slinky flavor a third training node keeps a NodeSet pod free beside the two-node job
    # (for the job that pod-protect keeps there).
    lab = chaos_lab(home, ["gpu1", "gpu2", "gpu3"] if slinky else ["gpu1", "gpu2"], say=say, flavor=flavor)
    # Evictions a budget forbids are forced after 5 s here (60 s by default), to keep the run short
    # (on the slinky flavor a NodeSet pod is never forced: its incident fails after 5 s, unless a
    # scenario sets another timeout); the partition has two nodes (three on slinky), each hit again
    # and again (returned between scenarios), so the fleet guard's share limit and its lemon rules
    # are off here (the storm scenario runs the default guard in a four-node lab of its own).
    lab.policy_file.write_text(
        lab.policy_file.read_text().replace("remediation:\n", "remediation:\n  eviction_timeout_seconds: 5\n")
        + "guard:\n  max_share: 0\n  cooldown_seconds: 0\n  quarantine_after: 0\n"
    )
    ctx = Context(lab=lab, say=say)
    results: list[dict[str, Any]] = []
    baseline: dict[str, Any] = {}
    goodput: dict[str, Any] = {"passed": False, "error": "the run stopped before the report"}
    try:
        say("baseline: a drill, the GPU failing as Xid 79 does")
        clean = await run_scenario(ctx, Scenario(name="baseline"), None)
        results.append(clean)
        baseline = {key: clean.get(key) for key in ("detect_to_drained", "detect_to_resumed")}
        if None in baseline.values():
            raise RuntimeError(f"the baseline drill did not resolve: {clean}")
        for scenario in slinky_scenarios(short=short) if slinky else scenarios(short=short):
            if only is None or scenario.name in only:
                say(f"scenario: {scenario.name}")
                results.append(await run_scenario(ctx, scenario, baseline))
        if slinky and not short and (only is None or POD_PROTECT_BLOCKS in only):
            say(f"scenario: {POD_PROTECT_BLOCKS}")
            results.append(await pod_protect_blocks_eviction(ctx))
        if not short and (only is None or RACE in only):
            say("scenario: two workers, two incidents at once")
            results.append(await race_two_incidents(ctx, baseline))
        if not slinky and not short and (only is None or TERMINATED in only):
            say(f"scenario: {TERMINATED}")
            results.append(await terminated_in_grace(ctx))
        if not slinky and not short and (only is None or CURSOR_LOST in only):
            say(f"scenario: {CURSOR_LOST}")
            results.append(await detector_cursor_lost(ctx))
        say("goodput: gpufleet report --json over the run")
        goodput = await report_accounts(lab, incidents_of(results), say=say)
    finally:
        await record_and_stop(lab)
    if not slinky and not short and (only is None or STORM in only):
        say(f"scenario: {STORM} (a four-node lab of its own, the default fleet guard)")
        results.append(await storm(home / "storm", say=say))
    if not slinky and not short and (only is None or SATURATED in only):
        say(f"scenario: {SATURATED} (a four-node lab of its own, the guard's in-flight limit)")
        results.append(await guard_saturated(home / "saturated", say=say))
    if not slinky and not short and (only is None or RACK_STORM in only):
        say(f"scenario: {RACK_STORM} (a lab of its own, two racks)")
        results.append(await rack_storm(home / "rack-storm", say=say))
    delays = [r["added_delay_s"] for r in results if r.get("added_delay_s") is not None]
    totals = {key: sum(r.get(key, 0) for r in results) for key in TOTALS}
    return {
        "scenarios": results,
        "passed": all(r.get("passed") for r in results) and not any(totals.values()) and goodput["passed"],
        "goodput": goodput,
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
    parser.add_argument(
        "--slurm",
        choices=list(RELEASES),
        help=f"the Slurm release of every chaos lab (default {DEFAULT_RELEASE}, or ${LAB_SLURM_ENV}; "
        f"the slinky flavor runs {SLINKY_RELEASE} only; lab/slurmroots.py)",
    )
    parser.add_argument(
        "--flavor",
        choices=list(FLAVORS),
        default="default",
        help="the lab's flavor: default (static Slurm nodes), or slinky (NodeSet pods, slurmrestd) and its "
        "own scenarios (default: default)",
    )
    args = parser.parse_args()
    if args.flavor == "slinky":
        if args.slurm not in (None, SLINKY_RELEASE):
            parser.error(f"the slinky flavor runs Slurm {SLINKY_RELEASE}, not {args.slurm}")
        args.slurm = SLINKY_RELEASE
    elif args.slurm is None:
        args.slurm = os.environ.get(LAB_SLURM_ENV) or DEFAULT_RELEASE
    os.environ[LAB_SLURM_ENV] = args.slurm  # read by chaos_lab for each of its labs
    started = provenance()  # the code this run loaded, the machine it runs on
    only = {name.strip() for name in args.only.split(",") if name.strip()} if args.only else None
    known = scenario_names(args.flavor)
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
        result = asyncio.run(chaos(home, short=args.short, say=say, only=only, flavor=args.flavor))
    finally:
        for folder in (home, home / "storm", home / "saturated"):
            lab = FleetLab(folder)
            if lab.state().get("services"):
                lab.down()  # never leave a lab running, however the run ended
    result = {"provenance": started, "slurm": args.slurm, "flavor": args.flavor, **result}
    if args.output is not None:
        write_result(result, args.output)
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["passed"] else 1)
