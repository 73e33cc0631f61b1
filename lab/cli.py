"""``gpufleet lab``: the local fleet lab."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from lab.fleet import FleetLab, LabError
from models.settings import Settings

lab_app = typer.Typer(
    help="The local fleet lab: Temporal, Slurm, emulated Kubernetes, webhook, worker.", no_args_is_help=True
)
console = Console()


def _lab(home: Path | None) -> FleetLab:
    return FleetLab(home or Settings().home)


@lab_app.command()
def up(
    home: Annotated[Path | None, typer.Option(help="State folder (default $GPUFLEET_HOME or ./.gpufleet).")] = None,
) -> None:
    """Start the lab, detached; a second call reuses what already runs."""
    try:
        state = _lab(home).up(say=console.print)
    except (LabError, TimeoutError, RuntimeError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"lab is up. Temporal UI: {state['services']['temporal']['ui']}")


@lab_app.command()
def down(home: Annotated[Path | None, typer.Option(help="State folder.")] = None) -> None:
    """Stop everything the lab started."""
    try:
        pids = _lab(home).down(say=console.print)
    except LabError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"lab is down ({len(pids)} processes stopped)")


@lab_app.command()
def status(
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object for scripts.")] = False,
) -> None:
    """Each node (Slurm state and reason, Kubernetes, pool), the jobs and the open incidents."""
    from lab.status import lab_status

    result = lab_status(_lab(home))
    if as_json:
        print(json.dumps(result))
        return
    if not result["running"]:
        console.print("the lab is not running (start it with `gpufleet lab up`)")
        raise typer.Exit(1)
    nodes = Table("node", "Slurm", "reason", "partitions", "Kubernetes", "pool")
    for n in result["nodes"]:
        nodes.add_row(n["name"], n["slurm_state"], n["reason"], ",".join(n["partitions"]), n["kubernetes"], n["pool"])
    console.print(nodes)
    jobs = Table("job", "name", "state", "nodes", "restarts")
    for j in result["jobs"]:
        jobs.add_row(str(j["job_id"]), j["name"], j["state"], j["nodes"], str(j["restarts"]))
    console.print(jobs)
    console.print(f"open incidents: {', '.join(i['id'] for i in result['incidents']) or 'none'}")
    console.print(f"Temporal UI: {result['services']['temporal']['ui']}")


@lab_app.command()
def drill(
    node: Annotated[
        str | None, typer.Option(help="Node to fail (default: the first node of the training job).")
    ] = None,
    xid: Annotated[int, typer.Option(help="The Xid to inject.")] = 79,
    job: Annotated[
        str | None, typer.Option(help="Training job: ddp (PyTorch) or counter (default: ddp if torch is installed).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 600,
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Run a recovery drill: inject an Xid on a node of a running training job and time the recovery.

    The last line of output is one JSON object with the outcome and the timings.
    """
    from lab.drill import JOBS, run_drill
    from starters.temporal import TemporalUnreachable

    if job is not None and job not in JOBS:
        console.print(f"[red]error:[/] unknown job {job!r}; choose one of {', '.join(JOBS)}")
        raise typer.Exit(2)
    lab = _lab(home)
    say = (lambda _: None) if as_json else console.print
    try:
        result = asyncio.run(run_drill(lab, node=node, xid=xid, job_kind=job, timeout=timeout, say=say))
    except (LabError, TemporalUnreachable, TimeoutError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    if not as_json:
        table = Table("step", "start (s)", "end (s)")
        for step in result["steps"]:
            table.add_row(step["name"], f"{step['start']:.2f}", "-" if step["end"] is None else f"{step['end']:.2f}")
        console.print(table)
        ui = lab.state()["services"]["temporal"]["ui"]
        console.print(f"the incident in the Temporal UI: {ui}/namespaces/default/workflows/{result['workflow_id']}")
        console.print(
            f"incident {result['workflow_id']}: {result['outcome']}; job {result['job_id']} restarts "
            f"{result['job_restarts']}, resumed from step {result['resumed_from_step']}"
        )
    print(json.dumps(result))
    if result["outcome"] != "resolved":
        raise typer.Exit(1)


@lab_app.command("inject-xid")
def inject_xid(
    node: Annotated[str, typer.Argument(help="The lab node whose kernel log gets the Xid line.")],
    xid: Annotated[int, typer.Option(help="The Xid, e.g. 79 (fallen off the bus).")] = 79,
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
) -> None:
    """Append a driver-format Xid line to NODE's kernel log, where its detector sees it."""
    lab = _lab(home)
    if not lab.running():
        console.print("[red]error:[/] the lab is not running (start it with `gpufleet lab up`)")
        raise typer.Exit(1)
    try:
        line = lab.inject_xid(node, xid)
    except LabError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"{node}: {line}")


@lab_app.command()
def demand(
    requests: Annotated[float, typer.Argument(min=0, help="Requests in flight on the inference servers, e.g. 64.")],
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
) -> None:
    """Set the inference load the lab's servers report (vLLM's metrics, scraped by Prometheus).
    With the vllm preset's 32 requests a node, 64 asks for two inference nodes."""
    from lab.loadgen import RUNNING_PER_REPLICA, write_load

    lab = _lab(home)
    if not lab.running():
        console.print("[red]error:[/] the lab is not running (start it with `gpufleet lab up`)")
        raise typer.Exit(1)
    write_load(lab.load_file, requests)
    console.print(
        f"inference load: {requests:g} request(s) in flight "
        f"({requests / RUNNING_PER_REPLICA:g} node(s) at {RUNNING_PER_REPLICA} a node, the vllm preset's figure)"
    )
