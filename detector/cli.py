"""``gpufleet detect``: the Xid detector daemon."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from detector.cursor import CursorFile, Position
from detector.daemon import Delivery, Detector, KernelLogSource, Source, SourceFailed
from detector.follow import JournalctlMissing, open_journal, open_source
from detector.health import HealthServer
from detector.inbox import INBOX_ENV, InboxSource
from detector.intake import IntakePoster
from detector.nvml import NvmlSource
from detector.spool import Spool
from models.intake import IntakeSettings
from models.names import validate_node_name
from models.policy import PolicyError, PolicyFile
from models.settings import CLUSTER_HELP, ClusterNotSet, Settings, settings_error
from starters.cli import fail


def node_name(explicit: str | None) -> str:
    """--node, else NODE_NAME (the downward API in the DaemonSet), else the hostname."""
    return validate_node_name(explicit or os.environ.get("NODE_NAME") or socket.gethostname().split(".")[0])


def _wrong_numbers(*, fold_seconds: float, spool_max: int, health_port: int, expect_gpus: int = 0) -> list[str]:
    """What is wrong with the detector's numeric options (empty: nothing)."""
    wrong = []
    if not math.isfinite(fold_seconds) or fold_seconds < 0:
        wrong.append(f"--fold-seconds {fold_seconds:g}: give a number of seconds, 0 or more")
    if expect_gpus < 0:
        wrong.append(f"--expect-gpus {expect_gpus}: give the node's GPU count, or 0 not to check it")
    if spool_max < 1:
        wrong.append(f"--spool-max {spool_max}: give a number of events, 1 or more")
    if not 0 <= health_port <= 65535:
        wrong.append(f"--health-port {health_port}: give a TCP port (1..65535), or 0 for none")
    return wrong


def detect(
    kmsg: Annotated[
        Path | None,
        typer.Option(help="Kernel log to read: /dev/kmsg (the default), a log file, or a stream ('-': stdin)."),
    ] = None,
    journal: Annotated[
        bool, typer.Option("--journal", help="Also read the kernel's records from the journal (journalctl -k).")
    ] = False,
    nvml: Annotated[
        bool,
        typer.Option(
            "--nvml",
            help="Also listen to NVML Xid events on every GPU, and read every GPU for silent degradation "
            "(the policy's degradation.poll_seconds).",
        ),
    ] = False,
    expect_gpus: Annotated[
        int,
        typer.Option(
            envvar="GPUFLEET_DETECTOR_EXPECT_GPUS",
            help="With --nvml: the GPUs this node advertises; NVML seeing fewer is a gpu_missing event "
            "(0: not checked).",
        ),
    ] = 0,
    node: Annotated[str | None, typer.Option(help="This node's name (default: $NODE_NAME, then the hostname).")] = None,
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
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
    inbox: Annotated[
        Path | None,
        typer.Option(
            help="Folder where other processes on the node (gpufleet health-check) drop events "
            f"(default: ${INBOX_ENV}, else $GPUFLEET_HOME/inbox/NODE; not read with --dry-run)."
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where each source's cursor is kept (default: $GPUFLEET_HOME/detector/NODE; "
            "with --dry-run, no cursor unless given)."
        ),
    ] = None,
    health_port: Annotated[int, typer.Option(help="Serve /healthz and /metrics on this TCP port (0: off).")] = 0,
    health_host: Annotated[str, typer.Option(help="The address --health-port listens on.")] = "0.0.0.0",  # noqa: S104
    ready_file: Annotated[
        Path | None,
        typer.Option(help="Write this file (our PID) once every source is followed; wait for it, not a sleep."),
    ] = None,
) -> None:
    """Watch the kernel log (and NVML) for Xids and open or join the node's incident in Temporal.

    Events the policy marks OBSERVE are printed only. Anything else goes, through an on-disk spool
    while it is away, to the intake (GPUFLEET_INTAKE_URL, with the token in
    GPUFLEET_INTAKE_TOKEN_FILE, the intake's CA in GPUFLEET_INTAKE_CA_FILE): production. Without
    an intake URL (development) it goes to Temporal directly, with signal-with-start on
    remediate-CLUSTER-NODE.

    Whom to believe: /dev/kmsg and --journal yield only records the kernel wrote (kernel facility 0,
    journal transport "kernel"); others are counted and dropped. A plain text file (kern.log) or a
    stream is forgeable by any local user who can write to syslog (logger -t kernel "NVRM: Xid ..."):
    use one for tests and dry runs. The DaemonSet reads /dev/kmsg or the journal.

    What a start reads: with a cursor in --state-dir for the same boot (/dev/kmsg, the journal) or
    the same file, right after the last line handled, so a restart neither loses nor repeats events.
    A log file rotated while the detector was away is read whole (all of it came after the cursor).
    Otherwise (a first start, another boot): a log file from its end
    (--from-start: from its start), a file that does not exist yet from its start once it appears,
    /dev/kmsg and the journal the whole of this boot, a pipe or standard input from what is written
    next. --from-start ignores the cursor. --once reads what there is (a file from its start, or
    from its cursor) and exits. Lines written before --ready-file appears may be missed.

    Keeping cursors, a source that starts without one it can resume from (a first start, a
    cursor lost or refused) skips events whose records are older than the detector's start less
    $GPUFLEET_DETECTOR_REPLAY_CUTOFF_SECONDS (300), by the record's own time, and says how many:
    they were most likely reported before. --from-start skips nothing.

    The inbox (--inbox): events that other processes on the node drop there (gpufleet health-check
    in Slurm's Prolog, Epilog and HealthCheckProgram; docs/health-check.md) go out the same way,
    in order; a file that is no health_check event for this node is set aside as NAME.rejected.

    A source that fails ends the detector (exit code 1), so that its supervisor restarts it.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s detector: %(message)s")
    for wrong in _wrong_numbers(
        fold_seconds=fold_seconds, spool_max=spool_max, health_port=health_port, expect_gpus=expect_gpus
    ):
        fail(wrong, code=2)
    started = time.time()
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)  # a stale one from an earlier run must not count
    settings = Settings()
    try:
        this_node = node_name(node)
        this_cluster = settings.command_cluster(cluster)
        policy = PolicyFile(settings.policy_file)
    except ClusterNotSet as exc:
        fail(f"{exc}: give --cluster NAME or set GPUFLEET_CLUSTER", code=2)
    except (ValueError, PolicyError) as exc:  # ValueError: InvalidName, or disagreeing defaults
        fail(str(exc), code=2)
    if kmsg is None and not nvml and not journal:
        kmsg = Path("/dev/kmsg")
    if kmsg is not None and str(kmsg) != "-" and not kmsg.exists() and once:
        fail(f"{kmsg} does not exist", code=2)
    state = state_dir
    if state is None and not dry_run:  # a dry run must not move the daemon's cursors
        state = settings.home / "detector" / this_node
    delivery = None
    if not dry_run:
        folder = spool or settings.home / "spool" / this_node
        try:
            intake_settings = IntakeSettings()
        except ValidationError as exc:
            fail(settings_error(exc).replace("GPUFLEET_", "GPUFLEET_INTAKE_"), code=2)
        poster = None
        if intake_settings.url:  # production: the intake checks this node's token; never Temporal
            poster = IntakePoster(
                intake_settings.url, token_file=intake_settings.token_file, ca_file=intake_settings.ca_file
            )
            logging.getLogger("gpufleet.detector").info(
                "events go to the intake at %s (token %s)", intake_settings.url, intake_settings.token_file
            )
        delivery = Delivery(
            cluster=this_cluster,
            spool=Spool(folder, max_events=spool_max),
            dry_run=settings.dry_run,
            intake=poster,
        )
    detector = Detector(
        node=this_node,
        policy=policy,
        delivery=delivery,
        fold_seconds=fold_seconds,
        out=lambda line: print(line, flush=True),
        as_json=as_json or dry_run,
    )
    health = None
    if health_port:
        try:
            health = HealthServer(detector, health_host, health_port).start()
        except OSError as exc:
            fail(f"--health-port {health_port} on {health_host}: {exc.strerror or exc}", code=2)
        logging.getLogger("gpufleet.detector").info(
            "liveness and metrics on http://%s:%d/healthz and /metrics", health_host, health.port
        )

    # Keeping cursors, a source that cannot resume from one may read records handled before:
    # those older than this are not reported again. --from-start asks for the whole log.
    cutoff = None if state is None or from_start else started - settings.detector_replay_cutoff_seconds

    def cursor(name: str) -> tuple[CursorFile | None, Position | None]:
        """The source's cursor file, and the position to resume from (none with --from-start)."""
        if state is None:
            return None, None
        file = CursorFile(state, name)
        return file, None if from_start else file.load()

    sources: list[Source] = []
    if kmsg is not None:
        kmsg_cursor, resume = cursor("kmsg")
        try:
            follower = open_source(kmsg, from_start=from_start or once, resume=resume)
        except PermissionError:
            fail(f"cannot read {kmsg}: run as root or grant CAP_SYSLOG", code=2)
        sources.append(KernelLogSource(follower, once=once, cursor=kmsg_cursor, replay_cutoff=cutoff))
    if journal:
        journal_cursor, resume = cursor("journal")
        try:
            reader = open_journal(resume=resume, follow=not once)
        except JournalctlMissing as exc:
            fail(str(exc), code=2)
        sources.append(KernelLogSource(reader, once=once, name="journal", cursor=journal_cursor, replay_cutoff=cutoff))
    if nvml:
        sources.append(NvmlSource(once=once, degradation=lambda: policy.current().degradation, expect_gpus=expect_gpus))
    if not dry_run:  # a dry run must not take the daemon's events
        env_inbox = os.environ.get(INBOX_ENV)
        folder = inbox or (Path(env_inbox) if env_inbox else settings.home / "inbox" / this_node)
        sources.append(InboxSource(folder, node=this_node, once=once))

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # a clean stop: queued events handled, cursors saved
        signal.signal(signum, lambda *_: stop.set())
    try:
        asyncio.run(detector.run(sources, once=once, stop=stop, ready_file=ready_file))
    except SourceFailed as exc:
        fail(f"{exc}; exiting so the DaemonSet restarts it")
    finally:
        if health is not None:
            health.stop()
    if delivery is not None and len(delivery.spool):
        fail(
            f"{len(delivery.spool)} event(s) still spooled in {delivery.spool.folder} "
            "(the intake or Temporal did not take them; the next start of the detector delivers them)"
        )
