"""docs/benchmarks.md, made from the JSON results in docs/results/ and from nothing else.

``make bench``, ``make bench FLAVOR=slinky``, ``make chaos``, ``make chaos FLAVOR=slinky`` and
``make bench-scale`` each keep their last run's JSON there (bench.json, bench-slinky.json,
chaos.json, chaos-slinky.json, bench-scale.json), with its provenance (the commit, the date, the
machine: lab/provenance.py), and regenerate the page; ``make benchmarks-doc`` regenerates it alone.
The slinky flavor's drills are set beside the default flavor's, each with the commit it was
measured at. A result that is missing is said to be missing, never filled in. Every word of the
page comes from here: change this script, not the page (tests/bench/test_report.py compares them).

``python -m bench.report`` writes the page; ``--check`` only says whether it is up to date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "docs" / "results"
PAGE = REPO_ROOT / "docs" / "benchmarks.md"
COMMAND = "make benchmarks-doc"
NONE = "n/a"  # a figure the run did not measure

Result = dict[str, Any]


# -- formatting ------------------------------------------------------------------------------------


def cell(text: object) -> str:
    """Text safe in a table cell: one line, no column breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def number(value: Any) -> str:
    if value is None:
        return NONE
    if isinstance(value, bool) or not isinstance(value, int | float):
        return cell(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    size = abs(value)
    return f"{value:,.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}"


def times(count: Any, noun: str = "time") -> str:
    """``count`` with its noun, "once" for a single time."""
    if count == 1:
        return "once" if noun == "time" else f"1 {noun}"
    return f"{number(count)} {noun}s"


def seconds(value: Any) -> str:
    return NONE if value is None else f"{number(value)} s"


def rate(value: Any) -> str:
    """Lines per second, in millions."""
    return NONE if value is None else f"{value / 1e6:.2f} M lines/s"


def each(values: Iterable[Any], unit: str = " s") -> str:
    shown = [number(value) for value in values]
    return f"{', '.join(shown)}{unit}" if shown else NONE


def sentence(text: object) -> str:
    """Text as a sentence of its own: one line, a capital first, a full stop last."""
    said = cell(text)
    said = said[:1].upper() + said[1:]
    return said if said.endswith((".", "!", "?")) else f"{said}."


def met(value: Any) -> str:
    return {True: "yes", False: "**no**", None: "not measured"}.get(value, cell(value))


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(part) for part in row) + " |" for row in rows]


def provenance_line(result: Result) -> str:
    """Where the figures come from: commit, date, machine (as recorded; never guessed)."""
    found = result.get("provenance")
    if not isinstance(found, dict):
        return "Provenance: not recorded in this result (a run from before it was)."
    commit = found.get("commit")
    where = f"commit `{commit[:12]}`" if commit else "an unknown commit (not a git checkout)"
    if found.get("dirty"):
        where += " with uncommitted changes"
    machine = found.get("machine") or {}
    memory = machine.get("memory_total_mb")
    parts = [
        f"{machine['cores']} cores" if machine.get("cores") else "cores unknown",
        cell(machine.get("cpu_model") or "CPU model unknown"),
        f"{memory / 1024:.1f} GiB of memory" if memory else "memory unknown",
        f"Python {machine['python']}" if machine.get("python") else "Python unknown",
    ]
    return f"Measured at {where}, on {found.get('date') or 'an unknown date'}; machine: {', '.join(parts)}."


# -- make bench ------------------------------------------------------------------------------------

DRILL_FIGURES = {
    "detect_to_workflow": "Xid → workflow started",
    "detect_to_drained": "Xid → node drained in Slurm",
    "detect_to_requeued": "Xid → jobs requeued, after their checkpoint on SIGTERM",
    "detect_to_replaced": "Xid → spare in the partition (`detect_to_replaced`)",
    "detect_to_resumed": "Xid → job running again (`detect_to_resumed`)",
}


def _detector(result: Result) -> list[str]:
    rows: list[list[str]] = []
    parse = result.get("parse")
    if isinstance(parse, dict):
        target = parse.get("target_non_driver_lines_per_second")
        count = number(parse.get("lines"))
        mixed = parse.get("mixed_1_in_1000") or {}
        rows += [
            [
                f"parser throughput, kernel chatter without driver lines ({count} lines)",
                rate((parse.get("non_driver") or {}).get("lines_per_second")),
                f"≥ {rate(target)}" if target else "",
            ],
            [
                f"parser throughput, one driver line in 1,000 ({number(mixed.get('events'))} events found "
                f"of {number(mixed.get('events_expected'))})",
                rate(mixed.get("lines_per_second")),
                "",
            ],
        ]
        source = parse.get("source")
        if isinstance(source, dict):
            rows.append(
                [
                    "the detector's whole file source: read, decode, parse, keep the cursor "
                    f"({number(source.get('lines'))} lines)",
                    rate(source.get("lines_per_second")),
                    "",
                ]
            )
    idle = result.get("detector_idle")
    if isinstance(idle, dict):
        rows.append(
            [
                f"detector idle CPU (a real `gpufleet detect` on a quiet log, {number(idle.get('seconds'))} s)",
                f"{number(idle.get('cpu_percent_of_one_core'))} % of a core",
                "",
            ]
        )
    check = result.get("health_check")
    if isinstance(check, dict):
        target = check.get("target_median_s")
        rows.append(
            [
                f"`gpufleet health-check` as a Slurm prolog, whole process, median of {number(check.get('runs'))} "
                f"runs (p95 {seconds(check.get('p95_s'))}; a bare interpreter starts in "
                f"{seconds(check.get('interpreter_start_median_s'))})",
                seconds(check.get("median_s")),
                f"≤ {seconds(target)}" if target is not None else "",
            ]
        )
    latency = result.get("detector")
    if isinstance(latency, dict):
        target = latency.get("target_median_s")
        rows.append(
            [
                f"kernel-log line → Xid in its incident, median of {number(latency.get('samples'))} samples",
                seconds(latency.get("median_line_to_incident_s")),
                f"≤ {seconds(target)}" if target is not None else "",
            ]
        )
    lines = ["### The detector", ""]
    if not rows:
        return [*lines, "Not in this run (its options skipped it).", ""]
    lines.append(
        "The parser on one core, the detector's CPU while its log is quiet, and a kernel-log line's way "
        "to its incident through a real detector and Temporal."
    )
    return [*lines, "", *table(["figure", "measured", "target"], rows), ""]


def _drills(result: Result) -> list[str]:
    lines = ["### Recovery drills", ""]
    drills = result.get("drills")
    if not isinstance(drills, list) or not drills:
        return [*lines, "Not in this run (its options skipped it).", ""]
    medians = result.get("medians_s") or {}
    targets = result.get("targets_s") or {}
    lines.append(
        f"{len(drills)} drills in a fresh lab, each timed from the moment the Xid line was written: the median, "
        "then each drill. The control-plane overhead is gpufleet's own share, from each incident's workflow history."
    )
    rows = []
    for name, median in medians.items():
        target = targets.get(name)
        rows.append(
            [
                DRILL_FIGURES.get(name, f"`{name}`"),
                seconds(median),
                each(drill.get("timings_s", {}).get(name) for drill in drills),
                f"≤ {seconds(target)}" if target is not None else "",
            ]
        )
    overhead = targets.get("control_plane_overhead")
    histories = [drill.get("history") or {} for drill in drills]
    rows += [
        [
            "control-plane overhead per incident",
            seconds(result.get("median_control_plane_overhead_s")),
            each(history.get("control_plane_overhead_s") for history in histories),
            f"≤ {seconds(overhead)}" if overhead is not None else "",
        ],
        [
            "of which a bound on gpufleet's own polling",
            seconds(result.get("median_polling_delay_bound_s")),
            each(history.get("polling_delay_bound_s") for history in histories),
            "",
        ],
    ]
    outcomes = ", ".join(cell(drill.get("outcome", NONE)) for drill in drills)
    return [*lines, "", *table(["figure", "median", "each drill", "target"], rows), "", f"Outcomes: {outcomes}.", ""]


def _clusters(result: Result) -> list[str]:
    lines = ["### Cluster creation and deletion", ""]
    clusters = result.get("clusters")
    if not isinstance(clusters, dict):
        return [*lines, "Not in this run (its options skipped it).", ""]
    backend = clusters.get("backend")
    lines.append(
        f"`{cell(clusters.get('spec', 'the example spec'))}` created and deleted {times(clusters.get('rounds'))} "
        "on the lab's free pool, through the CLI"
        + (f", with `--backend {cell(backend)}`" if backend else "")
        + ": from the spec to the smoke test passed, and back to free nodes."
    )
    if backend == "slinky" and clusters.get("note"):
        lines.append(sentence(clusters["note"]))
    rows = [
        [
            "`cluster_create_seconds`",
            seconds(clusters.get("cluster_create_seconds")),
            each(clusters.get("create_s", [])),
        ],
        [
            "`cluster_delete_seconds`",
            seconds(clusters.get("cluster_delete_seconds")),
            each(clusters.get("delete_s", [])),
        ],
    ]
    if "torn_down_after_delete_s" in clusters:
        rows.append(
            [
                "its daemons stopped, after the deletion ended",
                seconds(clusters.get("median_torn_down_after_delete_s")),
                each(clusters["torn_down_after_delete_s"]),
            ]
        )
    return [*lines, "", *table(["figure", "median", "rounds"], rows), ""]


def _pool(result: Result) -> list[str]:
    lines = ["### Shared-pool moves", ""]
    pool = result.get("pool")
    if not isinstance(pool, dict):
        return [*lines, "Not in this run (its options skipped it).", ""]
    lines.append(
        f"A training node carrying a checkpointing job moved to inference and back by `gpufleet pool rebalance`, "
        f"{times(pool.get('rounds'), 'round')}: from the decision to the node serving on the other side, and the "
        "training steps lost."
    )
    if pool.get("flavor") == "slinky":
        lines.append(
            "On the slinky flavor a move scales the NodeSet in (the node's pod first) and out again, and no "
            "partition is edited; back in training is a NodeSet pod on the node, its Slurm node in the partition "
            "and not drained."
        )
    rows = [
        [
            "`pool_move_to_inference_seconds`",
            seconds(pool.get("pool_move_to_inference_seconds")),
            each(pool.get("to_inference_s", [])),
        ],
        [
            "`pool_move_to_training_seconds`",
            seconds(pool.get("pool_move_to_training_seconds")),
            each(pool.get("to_training_s", [])),
        ],
        [
            "`training_steps_lost_per_move`",
            number(pool.get("training_steps_lost_per_move")),
            each(pool.get("steps_lost", []), unit=""),
        ],
    ]
    return [*lines, "", *table(["figure", "median", "rounds"], rows), ""]


def _setup(result: Result) -> list[str]:
    """What the drills ran on, where the run recorded it (a run from before it did says nothing)."""
    setup = result.get("lab")
    if not isinstance(setup, dict):
        return []
    return [
        f"The drills ran on the {cell(setup.get('flavor', NONE))} flavor: Slurm {cell(setup.get('slurm') or NONE)}, "
        f"the worker on its `{cell(setup.get('slurm_backend') or NONE)}` backend, partition "
        f"`{cell(setup.get('partition') or NONE)}`, the `{cell(setup.get('job') or NONE)}` training job.",
        "",
    ]


def render_bench(result: Result) -> list[str]:
    return [
        "What each figure means and what it is held to: [performance.md](performance.md).",
        "",
        *_detector(result),
        *_setup(result),
        *_drills(result),
        *_clusters(result),
        *_pool(result),
    ]


# -- make bench FLAVOR=slinky ----------------------------------------------------------------------

SKIPPED_PARTS = {
    "parse": "the parser's throughput",
    "detector_idle": "the detector's idle CPU",
    "health_check": "gpufleet health-check's wall time",
    "detector": "kernel-log line to incident",
    "clusters": "cluster creation and deletion",
    "pool": "shared-pool moves",
}
# The cluster and pool parts' medians, set beside the other flavor's where either run has them.
BESIDE_PARTS = (
    "cluster_create_seconds",
    "cluster_delete_seconds",
    "pool_move_to_inference_seconds",
    "pool_move_to_training_seconds",
    "training_steps_lost_per_move",
)
# An activity's running time is set beside the other flavor's when either median is at least this.
ACTIVITY_SHOWN_S = 0.1
SETUP_ROWS = {
    "slurm": "Slurm",
    "slurm_backend": "the worker's Slurm backend",
    "partition": "partition",
    "job": "training job",
}


def _commit(result: Result) -> str:
    found = result.get("provenance")
    commit = found.get("commit") if isinstance(found, dict) else None
    return f"`{commit[:12]}`" if commit else "an unknown commit"


def _activity_medians(result: Result) -> dict[str, float]:
    """Each activity's running time, the median over the drills that ran it."""
    runs: dict[str, list[float]] = {}
    for drill in result.get("drills") or []:
        for name, spent in ((drill.get("history") or {}).get("activity_running_s") or {}).items():
            runs.setdefault(name, []).append(spent)
    return {name: round(statistics.median(values), 3) for name, values in sorted(runs.items())}


def _nodes(result: Result) -> str:
    return cell(", ".join(str(drill.get("node") or NONE) for drill in result.get("drills") or []) or NONE)


def _ended(result: Result) -> str:
    drills = result.get("drills") or []
    ended = sum(1 for drill in drills if drill.get("jobs_ended_by_failure"))
    return f"{ended} of {len(drills)}" if drills else NONE


def _difference(default: Any, other: Any) -> str:
    if not isinstance(default, int | float) or not isinstance(other, int | float):
        return ""
    change = other - default
    return f"+{seconds(change)}" if change > 0 else seconds(change)


def _part_figure(result: Result, key: str) -> Any:
    """A cluster or pool figure: at the top of the JSON, or in its part's (``clusters``, ``pool``)."""
    if key in result:
        return result[key]
    for part in ("clusters", "pool"):
        found = result.get(part)
        if isinstance(found, dict) and key in found:
            return found[key]
    return None


def _beside(result: Result, default: Result | None) -> list[str]:
    """The slinky flavor's medians beside the default flavor's (bench.json), figure by figure."""
    lines = ["### Beside the default flavor", ""]
    if default is None:
        return [
            *lines,
            "The default flavor is not measured yet: run `make bench` (it writes `docs/results/bench.json`).",
            "",
        ]
    count = len(default.get("drills") or [])
    apart = (
        "The two were measured at different commits. "
        if _commit(default) != _commit(result) or _commit(result) == "an unknown commit"
        else ""
    )
    lines += [
        f"Medians: the default flavor's from `docs/results/bench.json` ({count} drills, commit {_commit(default)}), "
        f"the slinky flavor's from this run ({len(result.get('drills') or [])} drills, commit {_commit(result)}). "
        f"{apart}The drills time the same steps from the Xid line written; what they ran on (the rows below) "
        "may differ beside the flavor.",
        "",
    ]
    rows: list[list[str]] = []
    here, there = result.get("lab") or {}, default.get("lab") or {}
    rows.append(["lab flavor", cell(there.get("flavor") or "default"), cell(here.get("flavor") or "slinky"), "", ""])
    for key, label in SETUP_ROWS.items():
        rows.append([label, cell(there.get(key) or "not recorded"), cell(here.get(key) or "not recorded"), "", ""])
    for label, shown in (
        ("nodes failed, drill by drill", _nodes),
        ("drills whose job the failure had ended before the incident looked (else SIGTERM, checkpoint)", _ended),
    ):
        rows.append([label, shown(default), shown(result), "", ""])
    medians, theirs = result.get("medians_s") or {}, default.get("medians_s") or {}
    targets = result.get("targets_s") or {}
    for name in dict.fromkeys([*theirs, *medians]):
        target = targets.get(name)
        rows.append(
            [
                DRILL_FIGURES.get(name, f"`{name}`"),
                seconds(theirs.get(name)),
                seconds(medians.get(name)),
                _difference(theirs.get(name), medians.get(name)),
                f"≤ {seconds(target)}" if target is not None else "",
            ]
        )
    for key, label, target in (
        (
            "median_control_plane_overhead_s",
            "control-plane overhead per incident",
            targets.get("control_plane_overhead"),
        ),
        ("median_polling_delay_bound_s", "of which a bound on gpufleet's own polling", None),
    ):
        rows.append(
            [
                label,
                seconds(default.get(key)),
                seconds(result.get(key)),
                _difference(default.get(key), result.get(key)),
                f"≤ {seconds(target)}" if target is not None else "",
            ]
        )
    for key in BESIDE_PARTS:
        there_fig, here_fig = _part_figure(default, key), _part_figure(result, key)
        if there_fig is None and here_fig is None:
            continue
        steps = key == "training_steps_lost_per_move"
        figure: Callable[[Any], str] = number if steps else seconds
        change = "" if steps else _difference(there_fig, here_fig)
        rows.append([f"`{key}`", figure(there_fig), figure(here_fig), change, ""])
    ours, others = _activity_medians(result), _activity_medians(default)
    for name in sorted(set(ours) | set(others)):
        if max(ours.get(name, 0.0), others.get(name, 0.0)) < ACTIVITY_SHOWN_S:
            continue
        rows.append(
            [
                f"activity `{name}` running",
                seconds(others.get(name)),
                seconds(ours.get(name)),
                _difference(others.get(name), ours.get(name)),
                "",
            ]
        )
    header = ["figure (median)", "default flavor", "slinky flavor", "slinky minus default", "target"]
    note = (
        f"Activities are those that ran at least {seconds(ACTIVITY_SHOWN_S)} at the median on either flavor "
        "(the JSON has every one); n/a: not run on that flavor."
    )
    return [*lines, *table(header, rows), "", note, ""]


def render_bench_slinky(result: Result, kept: Mapping[str, Result]) -> list[str]:
    lines = [
        "What each figure means and what it is held to: [performance.md](performance.md). The lab's slinky "
        "flavor: NodeSet pods as dynamic Slurm nodes, the operator stand-in, the worker on slurmrestd "
        "([lab.md](lab.md#the-slinky-flavor)).",
        "",
    ]
    skipped = result.get("skipped")
    if isinstance(skipped, dict) and skipped:
        lines += ["### Not run on this flavor", ""]
        lines += [f"- {SKIPPED_PARTS.get(part, cell(part))}: {cell(why)}." for part, why in skipped.items()]
        lines.append("")
    return [
        *lines,
        *_beside(result, kept.get("bench.json")),
        *_setup(result),
        *_drills(result),
        *_clusters(result),
        *_pool(result),
    ]


# -- make chaos ------------------------------------------------------------------------------------

TOTALS = {
    "jobs_lost": "jobs lost",
    "double_claims": "spares claimed twice",
    "nodes_undrained_not_ours": "nodes someone else drained, found undrained",
    "claims_leaked": "spares claimed that never joined the partition",
}


def _notes(scenario: Result) -> str:
    notes = []
    if "storm_drained" in scenario:
        notes.append(
            f"drained {number(scenario.get('storm_drained'))}, waiting {number(scenario.get('storm_waiting'))}, "
            f"paged {number(scenario.get('storm_paged'))}"
        )
    if scenario.get("fault_at_step"):
        notes.append(f"fault at {scenario['fault_at_step']}")
    if scenario.get("failed_at"):
        notes.append(
            f"incident failed at {scenario['failed_at']}"
            + (f", {seconds(scenario['detect_to_failed'])} after the Xid" if scenario.get("detect_to_failed") else "")
        )
    if "pod_kept" in scenario:
        notes.append("pod kept on its node" if scenario["pod_kept"] else "pod evicted or deleted")
    if scenario.get("within_budget") is False:
        notes.append("over its delay budget")
    if scenario.get("error"):
        notes.append(f"error: {scenario['error']}")
    return "; ".join(notes)


def render_chaos(result: Result) -> list[str]:
    lines = ["What each scenario does and what passing means: [chaos.md](chaos.md).", ""]
    scenarios = result.get("scenarios") or []
    passed = result.get("passed")
    verdict = (
        "every scenario passed and the four totals are 0"
        if passed
        else "some scenario failed or a total is not 0"
        if passed is False
        else "not recorded"
    )
    lines += [f"Passed: {met(passed)} ({verdict}), {len(scenarios)} scenarios.", ""]
    baseline = result.get("baseline") or {}
    if baseline:
        lines.append(
            f"Baseline, a clean drill: node drained {seconds(baseline.get('detect_to_drained'))} and job running "
            f"again {seconds(baseline.get('detect_to_resumed'))} after the Xid."
        )
    lines += ["", "### Totals", "", "Over every scenario; the first four must be 0.", ""]
    rows = [[f"`{key}`: {label}", number(result.get(key))] for key, label in TOTALS.items()]
    rows.append(
        ["`max_added_delay_s`: the most a scenario added to the recovery", seconds(result.get("max_added_delay_s"))]
    )
    lines += [*table(["total", "value"], rows), "", "### Scenarios", ""]
    lines += [
        "One fresh incident per fault, on a node of the running job; what each added to the baseline's "
        "`detect_to_resumed` and `detect_to_drained`.",
        "",
    ]
    if result.get("flavor") == "slinky":
        lines += [
            "The slinky flavor: the job's Slurm nodes are NodeSet pods, each incident is keyed on the Kubernetes "
            "node under one, and the worker reaches Slurm through slurmrestd.",
            "",
        ]
    rows = [
        [
            f"`{cell(scenario.get('name', '?'))}`",
            met(scenario.get("passed")),
            cell(scenario.get("outcome", NONE)),
            seconds(scenario.get("added_delay_s")),
            seconds(scenario.get("added_to_drained_s")),
            _notes(scenario),
        ]
        for scenario in scenarios
    ]
    header = ["scenario", "passed", "outcome", "added to resumed", "added to drained", "notes"]
    return [*lines, *table(header, rows), ""]


# -- make bench-scale ------------------------------------------------------------------------------


def render_scale(result: Result) -> list[str]:
    lines = ["What each figure means and what it is held to: [performance.md](performance.md).", ""]
    fleet = result.get("fleet") or {}
    lines.append(
        f"A burst of {number(result.get('burst'))} Xids on {number(fleet.get('nodes'))} nodes "
        f"({number(fleet.get('training'))} training, {number(fleet.get('spares'))} spares); the worker with a "
        f"sticky timeout of {seconds(fleet.get('sticky_timeout_seconds'))}, "
        f"{number(fleet.get('max_cached_workflows'))} workflows cached and the "
        f"`{cell(fleet.get('workflow_sandbox', NONE))}` sandbox. "
        + sentence(fleet.get("slurm") or "How Slurm ran is not recorded")
    )
    targets = result.get("targets") or {}
    judged = targets.get("met") or {}
    opened = result.get("open_guard") or {}
    guarded = result.get("default_guard") or {}
    limit = guarded.get("guard_limit")
    rows = [
        [
            "`incidents_started_per_s`",
            f"{number(result.get('incidents_started_per_s'))} /s",
            cell(targets.get("incidents_started_per_s", "")),
            met(judged.get("incidents_started_per_s")),
        ],
        ["`burst_drain_seconds`", seconds(result.get("burst_drain_seconds")), "", ""],
        ["`open_after_timeout`", number(result.get("open_after_timeout")), "", ""],
        ["`overhead_p50_s`", seconds(result.get("overhead_p50_s")), "", ""],
        ["`overhead_p99_s`", seconds(result.get("overhead_p99_s")), "", ""],
        [
            "`history_events_per_incident` (the largest; the median beside it)",
            f"{number(result.get('history_events_per_incident'))} "
            f"(median {number(opened.get('history_events_per_incident_p50'))})",
            cell(targets.get("history_events_per_incident", "")),
            met(judged.get("history_events_per_incident")),
        ],
        [
            "`worker_peak_rss_mb`",
            f"{number(result.get('worker_peak_rss_mb'))} MB",
            cell(targets.get("worker_peak_rss_mb", "")),
            met(judged.get("worker_peak_rss_mb")),
        ],
        ["`guard_held`: the most incidents the default guard held waiting", number(result.get("guard_held")), "", ""],
        [
            "`default_guard.past_guard_max`: the most ever past it at once",
            number(guarded.get("past_guard_max")),
            f"≤ its limit ({number(limit)})" if limit is not None else "≤ its limit",
            met(judged.get("guard_never_exceeded")),
        ],
        [
            "every incident of the open burst resolved",
            cell(", ".join(f"{k}: {number(v)}" for k, v in (opened.get("outcomes") or {}).items()) or NONE),
            "all resolved",
            met(judged.get("all_resolved")),
        ],
    ]
    counted = [value for value in judged.values() if value is not None]
    lines += [
        "",
        "### Headline figures",
        "",
        "The open burst (the fleet guard wide open), then the guard at its defaults; `met` as the run judged "
        f"each figure against its target: {sum(1 for v in counted if v is True)} of {len(counted)} judged met"
        f"{f', {len(judged) - len(counted)} not measured' if len(judged) > len(counted) else ''}.",
        "",
        *table(["figure", "measured", "target", "met"], rows),
        "",
        "### What limited the burst",
        "",
        sentence(f"As the run names it: {result['bound']}") if result.get("bound") else "Not named in this result.",
        "",
    ]
    return lines


# -- the page --------------------------------------------------------------------------------------

# A section's renderer: its result, and every result kept (a section may set another's beside it).
Renderer = Callable[[Result, Mapping[str, Result]], list[str]]


def alone(renderer: Callable[[Result], list[str]]) -> Renderer:
    """A renderer of its own result only."""
    return lambda result, _kept: renderer(result)


SOURCES: tuple[tuple[str, str, Renderer], ...] = (
    ("bench.json", "make bench", alone(render_bench)),
    ("bench-slinky.json", "make bench FLAVOR=slinky", render_bench_slinky),
    ("chaos.json", "make chaos", alone(render_chaos)),
    ("chaos-slinky.json", "make chaos FLAVOR=slinky", alone(render_chaos)),
    ("bench-scale.json", "make bench-scale", alone(render_scale)),
)


def _load(path: Path) -> Result:
    result = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a JSON object")
    return result


def render(results: Path = RESULTS) -> str:
    """The page, from the JSON files in ``results`` alone."""
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `{COMMAND}` (python -m bench.report) from docs/results/*.json: do not edit by hand. -->",
        "",
        "The figures of the last run kept in `docs/results/`, each with the commit, date and machine it was "
        "measured on. `make bench`, `make bench FLAVOR=slinky`, `make chaos` (`make chaos FLAVOR=slinky`) and "
        "`make bench-scale` write their "
        f"JSON there and regenerate this page; `{COMMAND}` regenerates it alone.",
        "",
    ]
    kept = {name: _load(results / name) for name, _, _ in SOURCES if (results / name).exists()}
    for file_name, command, renderer in SOURCES:
        lines += [f"## `{command}`", ""]
        result = kept.get(file_name)
        if result is None:
            lines += [f"Not measured yet: run `{command}` (it writes `docs/results/{file_name}`).", ""]
            continue
        lines += [f"From `docs/results/{file_name}`. {provenance_line(result)}", "", *renderer(result, kept)]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON results (docs/results)")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write (docs/benchmarks.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is not up to date")
    args = parser.parse_args(argv)
    text = render(args.results)
    if args.check:
        current = args.page.read_text(encoding="utf-8") if args.page.exists() else None
        if current != text:
            print(f"{args.page} is not what {args.results} gives: run `{COMMAND}`", file=sys.stderr)
            sys.exit(1)
        return
    args.page.parent.mkdir(parents=True, exist_ok=True)
    args.page.write_text(text, encoding="utf-8")
    print(f"wrote {args.page}", file=sys.stderr)


if __name__ == "__main__":
    main()
