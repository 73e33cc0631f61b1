"""`gpufleet whatif`: what a policy and a spare pool would have saved, over a trace of failures
(docs/whatif.md). Registered by workers/entry.py."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from models.policy import PolicyError, load_policy
from models.trace import Trace
from sim.fleet import FleetError, load_fleet, overlay
from sim.trace import DAY, TraceError, load_synthetic, load_trace, synthetic_names
from sim.whatif import NamedPolicy, WhatIfError, WhatIfResult, run_whatif, server_binary
from sim.world import FleetSpec
from starters.cli import fail

DEFAULT_NODES = 2048
DEFAULT_DAYS = 30.0
MAX_CASES = 40
MAX_DAYS = 366
MAX_NODES = 100000


def parse_spares(text: str) -> list[int]:
    """``0,1,2,4,8``: distinct counts of spare nodes, in the order given.

    Raises:
        ValueError: saying what is wrong.
    """
    counts: list[int] = []
    for part in text.split(","):
        word = part.strip()
        if not word.isdigit():
            raise ValueError(f"--spares: {word!r} is not a count of nodes: give counts like 0,1,2,4,8")
        count = int(word)
        if count > 100000:
            raise ValueError(f"--spares: {count} spares is more than the simulator takes (100000)")
        if count in counts:
            raise ValueError(f"--spares: {count} is given twice")
        counts.append(count)
    return counts


def whatif(
    policy: Annotated[
        list[Path],
        typer.Option(help="A policy file (the worker's own YAML); again for each policy to compare."),
    ],
    trace: Annotated[
        Path | None, typer.Option(help="A failure trace (JSON, gpufleet-trace/1; `gpufleet report --export-trace`).")
    ] = None,
    synthetic: Annotated[
        str | None, typer.Option(help="A built-in synthetic trace instead: llama3 (Llama 3's published failures).")
    ] = None,
    spares: Annotated[str, typer.Option(help="Spare counts to compare, comma-separated.")] = "0,1,2,4,8",
    days: Annotated[
        float | None, typer.Option(help="Days to simulate (synthetic: default 30; a trace: its first N days).")
    ] = None,
    nodes: Annotated[
        int | None, typer.Option(help="Training nodes (default: the fleet file's, else the trace's, else 2048).")
    ] = None,
    fleet_file: Annotated[
        Path | None,
        typer.Option(
            "--fleet",
            help="The fleet (YAML or JSON: jobs, detection, repair times, what each cause needs; "
            "examples/fleet.yaml): overrides the defaults, or the synthetic's.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic trace and of the nodes picked to fail.")] = 1,
    json_output: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    png: Annotated[Path | None, typer.Option(help="Draw effective training time against spares to this PNG.")] = None,
) -> None:
    """Run a trace's failures through gpufleet's own workflows under each policy and spare count, in
    simulated time, and report effective training time, GPU-hours and steps lost, and the spares'
    use. A month of a large fleet (2,048 nodes) takes minutes; progress goes to stderr. For example,
    a month of Llama 3's failures with no spare and with 8:

    gpufleet whatif --synthetic llama3 --policy examples/policy.yaml --spares 0,8
    """
    run_trace, fleet = _inputs(trace=trace, synthetic=synthetic, days=days, nodes=nodes, seed=seed, fleet=fleet_file)
    try:
        counts = parse_spares(spares)
    except ValueError as exc:
        fail(str(exc), code=2)
    policies = []
    for path in policy:
        try:
            policies.append(NamedPolicy(name=path.name, policy=load_policy(path)))
        except PolicyError as exc:
            fail(str(exc), code=2)
    if not policies:
        fail("--policy: name at least one policy file (examples/policy.yaml is a start)", code=2)
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        policies = [NamedPolicy(name=str(path), policy=p.policy) for path, p in zip(policy, policies, strict=True)]
    if len(policies) * len(counts) > MAX_CASES:
        fail(f"{len(policies)} policies x {len(counts)} spare counts is more than {MAX_CASES} cases: give fewer", 2)
    if png is not None:
        _check_png(png)
    try:
        server_binary()
    except WhatIfError as exc:
        fail(str(exc), code=2)

    def progress(line: str) -> None:
        print(f"whatif: {line}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(run_whatif(run_trace, fleet, policies, counts, seed=seed, progress=progress))
    except WhatIfError as exc:
        fail(str(exc))
    if png is not None:
        draw(result, png)
    if json_output:
        print(result.model_dump_json(indent=2))
    else:
        print(text(result))


def _inputs(
    *,
    trace: Path | None,
    synthetic: str | None,
    days: float | None,
    nodes: int | None,
    seed: int,
    fleet: Path | None = None,
) -> tuple[Trace, FleetSpec]:
    """The trace and the fleet to run it on, checked; a one-line error (exit 2) when not usable.

    The fleet is the defaults (a trace) or the synthetic's, with what ``fleet``'s file gives over
    it; its nodes are --nodes, else the file's, else the trace's, else 2,048.
    """
    if (trace is None) == (synthetic is None):
        fail("give one of --trace FILE or --synthetic NAME (" + ", ".join(synthetic_names()) + ")", code=2)
    if days is not None and not 0 < days <= MAX_DAYS:
        fail(f"--days: {days:g} is not between 0 and {MAX_DAYS}", code=2)
    if nodes is not None and not 1 <= nodes <= MAX_NODES:
        fail(f"--nodes: {nodes} is not between 1 and {MAX_NODES}", code=2)
    given: FleetSpec | None = None
    if fleet is not None:
        try:
            given = load_fleet(fleet)
        except FleetError as exc:
            fail(str(exc), code=2)
        if "nodes" in given.model_fields_set and given.nodes > MAX_NODES and nodes is None:
            fail(f"--fleet: {fleet}: nodes: {given.nodes} is more than {MAX_NODES}: give fewer, or --nodes", code=2)
    if synthetic is not None:
        try:
            spec = load_synthetic(synthetic)
        except TraceError as exc:
            fail(str(exc), code=2)
        built = spec.fleet_spec(nodes=DEFAULT_NODES, gpus_per_node=spec.reference.gpus_per_node)
        built = _sized(built, given, fleet, nodes)
        _check_needs(given, fleet, {cause.cause for cause in spec.causes}, f"the {synthetic} synthetic", refuse=True)
        made = spec.trace(nodes=built.nodes, gpus_per_node=built.gpus_per_node, days=days or DEFAULT_DAYS, seed=seed)
        return made, built
    assert trace is not None
    try:
        loaded = load_trace(trace)
    except TraceError as exc:
        fail(str(exc), code=2)
    _check_needs(given, fleet, {failure.cause for failure in loaded.failures}, f"the trace {trace}", refuse=False)
    if days is not None:
        if days * DAY > loaded.seconds:
            fail(f"--days: the trace covers {loaded.seconds / DAY:g} days, fewer than {days:g}", code=2)
        loaded = loaded.model_copy(
            update={"seconds": days * DAY, "failures": [f for f in loaded.failures if f.at <= days * DAY]}
        )
    elif loaded.seconds > MAX_DAYS * DAY:
        fail(f"--trace: {trace} covers {loaded.seconds / DAY:g} days, more than {MAX_DAYS}: give --days", code=2)
    size = loaded.nodes or DEFAULT_NODES
    if size > MAX_NODES and nodes is None and (given is None or "nodes" not in given.model_fields_set):
        fail(f"--trace: {trace} has {size} nodes, more than {MAX_NODES}: give --nodes", code=2)
    return loaded, _sized(FleetSpec(nodes=size, gpus_per_node=loaded.gpus_per_node), given, fleet, nodes)


def _check_needs(given: FleetSpec | None, path: Path | None, causes: set[str], source: str, *, refuse: bool) -> None:
    """The causes the fleet file's ``needs`` names should be the run's: a misspelled one never
    matches, and its failures would be fixed by any action without a word. A synthetic's causes
    are all known (refused); a trace may just lack a cause a shared file names (a warning)."""
    if given is None or "needs" not in given.model_fields_set:
        return
    for cause in sorted(set(given.needs) - causes):
        known = ", ".join(sorted(causes)) or "none"
        line = f"--fleet: {path}: needs.{cause}: no failure of {source} has this cause (its causes: {known})"
        if refuse:
            fail(line, code=2)
        print(f"warning: {line}", file=sys.stderr)


def _sized(base: FleetSpec, given: FleetSpec | None, path: Path | None, nodes: int | None) -> FleetSpec:
    """``base`` with the fleet file's fields over it and ``--nodes`` over both; a job larger than
    the fleet refused (it would never run)."""
    built = overlay(base, given) if given is not None else base
    if nodes is not None:
        built = built.model_copy(update={"nodes": nodes})
    for index, job in enumerate(built.jobs):
        if job.nodes > built.nodes:
            source = f"--fleet: {path}: jobs.{index}.nodes" if path is not None else f"jobs.{index}.nodes"
            fail(f"{source}: {job.nodes} nodes, more than the fleet's {built.nodes}: give a smaller job", code=2)
    # A job of 0 nodes spans the fleet: only one such job, and alone, fits.
    wanted = sum(job.nodes or built.nodes for job in built.jobs)
    if wanted > built.nodes:
        source = f"--fleet: {path}: jobs" if path is not None else "jobs"
        fail(
            f"{source}: the jobs need {wanted} nodes together, more than the fleet's {built.nodes} "
            "(a job of 0 nodes spans the fleet): a job that could never start would be counted as lost",
            code=2,
        )
    return built


def _check_png(path: Path) -> None:
    """Before the run (minutes): matplotlib is there, and ``path`` can be written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("--png needs matplotlib: install it with `pip install 'gpufleet[whatif]'`", code=2)
    folder = path.parent
    if path.is_dir():
        fail(f"--png: {path} is a directory: name the picture's file", code=2)
    if not folder.is_dir():
        fail(f"--png: no folder {folder} to write {path.name} in: create it first", code=2)
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"--png: cannot write {path}: permission denied", code=2)


def text(result: WhatIfResult) -> str:
    """The results as a table, with each case's largest losses."""
    lines = [
        f"{result.source}",
        f"{result.nodes} nodes x {result.gpus_per_node} GPUs, {result.days:g} days, {result.failures} failures "
        f"({result.visible_failures} visible to gpufleet), seed {result.seed}; {result.wall_seconds:g} s",
        "",
        f"{'policy':<24} {'spares':>6} {'effective':>9} {'lost GPU-h':>11} {'steps':>9} {'lost steps':>10} "
        f"{'per stop':>11} {'claimed':>7} {'waited h':>8} {'incidents':>9} {'closed':>6}",
    ]
    for case in result.cases:
        lines.append(
            f"{case.policy[:24]:<24} {case.spares:>6} {case.effective_training_time:>9.2%} "
            f"{case.lost_gpu_hours:>11,.0f} {case.steps_trained:>9,} {case.steps_lost:>10,} "
            f"{case.steps_lost_per_failure:>11,.1f} {case.spares_claimed:>7} {case.spare_wait_hours:>8.1f} "
            f"{case.incidents:>9} {case.incidents_closed:>6}"
        )
    lines.append("")
    for case in result.cases:
        top = sorted(case.lost_gpu_hours_by_cause.items(), key=lambda item: -item[1])[:4]
        causes = ", ".join(f"{cause} {hours:,.0f}" for cause, hours in top)
        lines.append(f"{case.policy[:24]} with {case.spares} spares lost (GPU-h): {causes or 'nothing'}")
    return "\n".join(lines)


def draw(result: WhatIfResult, path: Path) -> None:
    """Effective training time against the spare count, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for name in dict.fromkeys(case.policy for case in result.cases):
        cases = sorted((c for c in result.cases if c.policy == name), key=lambda c: c.spares)
        axes.plot([c.spares for c in cases], [100 * c.effective_training_time for c in cases], marker="o", label=name)
    axes.set_xlabel("spare nodes")
    axes.set_ylabel("effective training time (%)")
    axes.set_title(
        f"{result.nodes} nodes x {result.gpus_per_node} GPUs, {result.days:g} days, {result.failures} failures"
    )
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120, format="png")
    except OSError as exc:
        fail(f"--png: cannot write {path}: {exc.strerror or exc}")
    finally:
        plt.close(figure)
