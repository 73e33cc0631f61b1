"""``gpufleet detect``: the Xid detector daemon."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from detector.daemon import Delivery, Detector, KernelLogSource, Source
from detector.follow import open_source
from detector.nvml import NvmlSource
from detector.spool import Spool
from models.names import InvalidName, validate_cluster_name, validate_node_name
from models.policy import PolicyError, PolicyFile
from models.settings import Settings


def node_name(explicit: str | None) -> str:
    """--node, else NODE_NAME (the downward API in the DaemonSet), else the hostname."""
    return validate_node_name(explicit or os.environ.get("NODE_NAME") or socket.gethostname().split(".")[0])


def detect(
    kmsg: Annotated[
        Path | None, typer.Option(help="Kernel log to read: /dev/kmsg, a log file, or a journalctl/dmesg stream.")
    ] = None,
    nvml: Annotated[bool, typer.Option("--nvml", help="Also listen to NVML Xid events on every GPU.")] = False,
    node: Annotated[str | None, typer.Option(help="This node's name (default: $NODE_NAME, then the hostname).")] = None,
    cluster: Annotated[str | None, typer.Option(help="Cluster name (default: $GPUFLEET_CLUSTER or 'lab').")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Contact no server: print one JSON object per event.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print events as JSON lines.")] = False,
    once: Annotated[bool, typer.Option("--once", help="Read what the log holds now and exit.")] = False,
    from_start: Annotated[
        bool, typer.Option("--from-start", help="Following: read what the log already holds first.")
    ] = False,
    fold_seconds: Annotated[float, typer.Option(help="Fold identical repeats within this window.")] = 10.0,
    spool: Annotated[Path | None, typer.Option(help="Spool folder (default: $GPUFLEET_HOME/spool/NODE).")] = None,
    spool_max: Annotated[int, typer.Option(help="At most this many undelivered events on disk.")] = 10000,
    ready_file: Annotated[
        Path | None,
        typer.Option(help="Write this file (our PID) once every source is followed; wait for it, not a sleep."),
    ] = None,
) -> None:
    """Watch the kernel log (and NVML) for Xids and open or join the node's incident in Temporal.

    Events the policy marks OBSERVE are printed only. Anything else goes to Temporal with
    signal-with-start on remediate-CLUSTER-NODE, through an on-disk spool while Temporal is away.

    What a start reads: a log file from its end (lines already in it are not reported again;
    --from-start reads them), a file that does not exist yet from its start once it appears,
    /dev/kmsg from its newest record (--from-start: the whole ring buffer), a pipe or standard
    input from what is written next. Lines written before --ready-file appears may be missed.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s detector: %(message)s")
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)  # a stale one from an earlier run must not count
    settings = Settings()
    try:
        this_node = node_name(node)
        this_cluster = validate_cluster_name(cluster or settings.cluster)
        policy = PolicyFile(settings.policy_file)
    except (InvalidName, PolicyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if kmsg is None and not nvml:
        kmsg = Path("/dev/kmsg")
    sources: list[Source] = []
    if kmsg is not None:
        if str(kmsg) != "-" and not kmsg.exists() and once:
            typer.echo(f"error: {kmsg} does not exist", err=True)
            raise typer.Exit(2)
        try:
            follower = open_source(kmsg, from_start=from_start or once)
        except PermissionError:
            typer.echo(f"error: cannot read {kmsg}: run as root or grant CAP_SYSLOG", err=True)
            raise typer.Exit(2) from None
        sources.append(KernelLogSource(follower, once=once))
    if nvml:
        sources.append(NvmlSource(once=once))
    delivery = None
    if not dry_run:
        folder = spool or settings.home / "spool" / this_node
        delivery = Delivery(cluster=this_cluster, spool=Spool(folder, max_events=spool_max))
    detector = Detector(
        node=this_node,
        policy=policy,
        delivery=delivery,
        fold_seconds=fold_seconds,
        out=lambda line: print(line, flush=True),
        as_json=as_json or dry_run,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(detector.run(sources, once=once, ready_file=ready_file))
    if delivery is not None and len(delivery.spool):
        typer.echo(f"{len(delivery.spool)} event(s) still spooled in {delivery.spool.folder}", err=True)
        raise typer.Exit(1)
