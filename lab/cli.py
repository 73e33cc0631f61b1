"""``gpufleet lab``: the local fleet lab."""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from lab.access import DEFAULT_USER, USERS
from lab.faults import EFFECTS, Effect, Fault, xid_effect
from lab.fleet import FleetLab, LabConfig, LabError
from lab.slinkylab import FLAVORS, SLINKY_RELEASE
from lab.slurmroots import DEFAULT_RELEASE, RELEASES
from models.settings import Settings
from starters.cli import fail

lab_app = typer.Typer(
    help="The local fleet lab: Temporal, Slurm, emulated Kubernetes, webhook, worker.", no_args_is_help=True
)
console = Console()


def _lab(home: Path | None) -> FleetLab:
    return FleetLab(home or Settings().home)


@lab_app.command()
def up(
    home: Annotated[Path | None, typer.Option(help="State folder (default $GPUFLEET_HOME or ./.gpufleet).")] = None,
    slurm: Annotated[
        str | None,
        typer.Option(
            help=f"Slurm release: {', '.join(RELEASES)} (default: what the lab last ran, else {DEFAULT_RELEASE}). "
            "A release the host does not carry runs in a Debian root made once (about a minute, as root) "
            "and cached in $GPUFLEET_SLURM_ROOTS (default ~/.cache/gpufleet).",
        ),
    ] = None,
    flavor: Annotated[
        str | None,
        typer.Option(
            help=f"What the lab runs: default (static Slurm nodes) or slinky (a Slinky cluster: NodeSet pods as "
            f"dynamic Slurm {SLINKY_RELEASE} nodes, slurmrestd; docs/lab.md). Default: what the lab last ran, "
            "else default.",
        ),
    ] = None,
) -> None:
    """Start the lab, detached; a second call reuses what already runs."""
    lab = _lab(home)
    if flavor is not None and flavor not in FLAVORS:
        fail(f"no lab flavor {flavor!r}; choose one of {', '.join(FLAVORS)}", code=2)
    wanted = flavor or lab.config.flavor
    if wanted == "slinky" and slurm not in (None, SLINKY_RELEASE):
        fail(f"the slinky flavor runs Slurm {SLINKY_RELEASE} (dynamic nodes); --slurm {slurm} is refused", code=2)
    if wanted != lab.config.flavor:
        if lab.running():
            fail(f"the lab runs the {lab.config.flavor} flavor; stop it first (gpufleet lab down) to run {wanted}")
        release = SLINKY_RELEASE if wanted == "slinky" else (slurm or LabConfig().slurm)
        lab = FleetLab(lab.home, replace(lab.config, flavor=wanted, slurm=release))
    if slurm is not None and slurm != lab.config.slurm:
        if slurm not in RELEASES:
            fail(f"no Slurm release {slurm!r} in the lab; choose one of {', '.join(RELEASES)}")
        if lab.running():
            fail(f"the lab runs Slurm {lab.config.slurm}; stop it first (gpufleet lab down) to run Slurm {slurm}")
        lab = FleetLab(lab.home, replace(lab.config, slurm=slurm))
    try:
        state = lab.up(say=console.print)
    except (LabError, TimeoutError, RuntimeError) as exc:
        fail(str(exc))
    console.print(f"lab is up. Temporal UI: {state['services']['temporal']['ui']}")


@lab_app.command()
def down(home: Annotated[Path | None, typer.Option(help="State folder.")] = None) -> None:
    """Stop everything the lab started."""
    try:
        pids = _lab(home).down(say=console.print)
    except LabError as exc:
        fail(str(exc))
    console.print(f"lab is down ({len(pids)} processes stopped)")


@lab_app.command()
def status(
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object for scripts.")] = False,
) -> None:
    """Each node (Slurm state and reason, Kubernetes, pool, GPU fault), the jobs and the open incidents."""
    from lab.status import lab_status

    result = lab_status(_lab(home))
    if as_json:
        print(json.dumps(result))
        return
    if not result["running"]:
        fail("the lab is not running (start it with `gpufleet lab up`)")
    slurm = result["slurm"]
    where = f"a Debian root, {slurm['root']}" if slurm.get("root") else "the host's packages"
    console.print(f"flavor {result['flavor']}; Slurm {slurm.get('version') or slurm['release']} ({where})")
    nodes = Table("node", "Slurm", "reason", "partitions", "pod", "Kubernetes node", "Kubernetes", "pool", "GPU fault")
    for n in result["nodes"]:
        nodes.add_row(
            n["name"],
            n["slurm_state"],
            n["reason"],
            ",".join(n["partitions"]),
            n["pod"] or "-",
            n["kubernetes_node"] or "-",
            n["kubernetes"],
            n["pool"],
            n["gpu_fault"],
        )
    console.print(nodes)
    if result.get("kubernetes_only"):
        console.print(f"Kubernetes nodes with no Slurm node: {', '.join(result['kubernetes_only'])}")
    jobs = Table("job", "name", "state", "nodes", "restarts")
    for j in result["jobs"]:
        jobs.add_row(str(j["job_id"]), j["name"], j["state"], j["nodes"], str(j["restarts"]))
    console.print(jobs)
    console.print(f"open incidents: {', '.join(i['id'] for i in result['incidents']) or 'none'}")
    console.print(f"Temporal UI: {result['services']['temporal']['ui']}")
    api = result.get("api")
    if api is not None:
        console.print(f"gpufleet API: {api['address']} (CA {api['ca']}); its users' kubeconfigs:")
        for name, kubeconfig in api["users"].items():
            console.print(f"  {name}: {kubeconfig}")


@lab_app.command()
def drill(
    node: Annotated[
        str | None, typer.Option(help="Node to fail (default: the first node of the training job).")
    ] = None,
    xid: Annotated[int, typer.Option(help="The Xid to inject.")] = 79,
    effect: Annotated[
        Effect | None,
        typer.Option(help="What the failure does to the job's processes on the node (default: the Xid's own)."),
    ] = None,
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
        fail(f"unknown job {job!r}; choose one of {', '.join(JOBS)}", code=2)
    lab = _lab(home)
    say = (lambda _: None) if as_json else console.print
    try:
        result = asyncio.run(run_drill(lab, node=node, xid=xid, effect=effect, job_kind=job, timeout=timeout, say=say))
    except (LabError, TemporalUnreachable, TimeoutError) as exc:
        fail(str(exc))
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
        if result["job_resumed"] is False:
            console.print(
                f"[red]job {result['job_id']} did not run again[/] (it is {result['job_state']}; "
                f"its ranks met: {', '.join(result['gpu_fault_hits']) or 'nothing'})"
            )
    print(json.dumps(result))
    if result["outcome"] != "resolved" or result["job_resumed"] is False:
        raise typer.Exit(1)


@lab_app.command("env")
def env_lines(
    user: Annotated[str, typer.Option(help="The lab user to act as: lab-viewer, lab-approver or lab-operator.")] = (
        DEFAULT_USER
    ),
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
) -> None:
    """Print the shell lines that send `gpufleet` commands to the lab's gpufleet API as USER:
    eval "$(gpufleet lab env --user lab-viewer)"."""
    lab = _lab(home)
    names = [known.name for known in USERS]
    if user not in names:
        fail(f"no lab user {user!r}; users: {', '.join(names)}", code=2)
    api = lab.state().get("services", {}).get("api")
    if not lab.running() or api is None:
        fail("the lab's gpufleet API is not running (start the lab with `gpufleet lab up`)")
    values = {
        "GPUFLEET_API_ADDRESS": api["address"],
        "GPUFLEET_API_CA_FILE": api["ca"],
        "GPUFLEET_API_KUBECONFIG": str(lab.user_kubeconfig(user)),
    }
    for name, value in values.items():
        print(f"export {name}={shlex.quote(value)}")


@lab_app.command("inject-xid")
def inject_xid(
    node: Annotated[str, typer.Argument(help="The lab node whose kernel log gets the Xid line.")],
    xid: Annotated[int, typer.Option(help="The Xid, e.g. 79 (fallen off the bus).")] = 79,
    effect: Annotated[
        Effect | None,
        typer.Option(
            help="What the failure does to the job's processes on NODE: crash (a CUDA error, exit 1), "
            "hang (stuck, deaf to SIGTERM) or none (default: the Xid's own, docs/lab.md)."
        ),
    ] = None,
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
) -> None:
    """Fail NODE's GPU as the Xid does: the job's processes there crash or hang (or not), and a
    driver-format Xid line goes to NODE's kernel log, where its detector sees it."""
    lab = _lab(home)
    if not lab.running():
        fail("the lab is not running (start it with `gpufleet lab up`)")
    try:
        line = lab.inject_xid(node, xid, effect)
    except LabError as exc:
        fail(str(exc))
    console.print(f"{node}: {line}")
    console.print(f"{node}: {effect_said(xid, effect, lab.faults.get(node))}")


def effect_said(xid: int, effect: Effect | None, fault: Fault | None) -> str:
    """What the injection does to the job's processes on the node, in one line."""
    row = xid_effect(xid)
    if effect is None and xid not in EFFECTS:
        return f"Xid {xid} is not in the lab's effect table: the job's processes are left alone (--effect chooses)"
    why = f"Xid {xid}'s own: {row.why}" if effect in (None, row.effect) else "chosen with --effect"
    if (effect or row.effect) is Effect.NONE or fault is None:
        return f"the job's processes are left alone ({why})"
    lasting = "until the GPU is reset or the node rebooted" if fault.until_repair else "those running now"
    return f"the job's processes {fault.effect.value} ({why}); {lasting}"


@lab_app.command("clear-fault")
def clear_fault(
    node: Annotated[str, typer.Argument(help="The lab node whose GPU was repaired by hand.")],
    home: Annotated[Path | None, typer.Option(help="State folder.")] = None,
) -> None:
    """Clear NODE's injected GPU fault, as a repair outside gpufleet would (before `gpufleet nodes return`)."""
    lab = _lab(home)
    if node not in lab.all_nodes:
        fail(f"no lab node {node!r}; nodes: {', '.join(lab.all_nodes)}", code=2)
    fault = lab.faults.get(node)
    if fault is None or not lab.faults.clear(node):
        console.print(f"{node}: no GPU fault stands")
        return
    console.print(f"{node}: GPU fault cleared ({fault.describe()})")


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
        fail("the lab is not running (start it with `gpufleet lab up`)")
    write_load(lab.load_file, requests)
    console.print(
        f"inference load: {requests:g} request(s) in flight "
        f"({requests / RUNNING_PER_REPLICA:g} node(s) at {RUNNING_PER_REPLICA} a node, the vllm preset's figure)"
    )
