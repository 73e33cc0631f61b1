"""``gpufleet lab``: the local fleet lab."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

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
