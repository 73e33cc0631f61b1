"""The detector: sources feed Xid reports, the policy decides, the intake (or Temporal) gets the incidents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from temporalio.client import Client
from temporalio.service import RPCError

from detector.cursor import CursorFile, Position
from detector.follow import JournalCursorRejected, JournalReader, KmsgReader, LineReader, SourceStats
from detector.inbox import InboxItem
from detector.intake import IntakePoster, PostFailed
from detector.parse import KernelLogParser, XidReport, line_time
from detector.spool import Spool, SpoolFull
from models.policy import Action, Policy, PolicyFile
from models.xid import GpuEventKind, XidEvent
from starters.temporal import TemporalUnreachable, connect_temporal, report_xid

log = logging.getLogger("gpufleet.detector")
STALE_LOOP_SECONDS = 10.0  # /healthz fails when the main loop has not come round for this long


@dataclass(frozen=True)
class Checkpoint:
    """Save ``position`` in ``cursor`` once everything the source emitted before it is handled.

    It travels through the same queue as the reports, so the main loop reaches it only after
    their events are printed and spooled.
    """

    cursor: CursorFile
    position: Position


Item = XidReport | Checkpoint | InboxItem
Emit = Callable[[Item, str], None]
Ready = Callable[[], None]


class Source(Protocol):
    name: str

    def run(self, emit: Emit, stop: threading.Event, ready: Ready) -> None:
        """Feed reports to ``emit`` until ``stop``; call ``ready`` once nothing new can be missed."""
        ...


_LINES_BETWEEN_CLOCK_LOOKS = 1024  # a burst of chatter: one look at the clock per this many lines


class KernelLogSource:
    """Kernel-log lines (a file, a stream, /dev/kmsg or the journal) through the driver-line parser.

    With a ``cursor``, the reader's position is saved after each line that produced an event,
    and otherwise at most every ``save_seconds`` (a burst of other lines costs no fsync each),
    and when the source stops.

    ``replay_cutoff`` (Unix time) guards a start without a cursor the reader accepted (lost,
    unreadable, refused by journalctl): what it reads may have been handled before, so an event
    whose record carries an older time is skipped, not reported again. Records read after a
    cursor the reader accepted, and records whose time is unknown, are always reported.
    """

    def __init__(
        self,
        reader: LineReader,
        *,
        once: bool,
        name: str = "kmsg",
        cursor: CursorFile | None = None,
        save_seconds: float = 0.5,
        replay_cutoff: float | None = None,
    ) -> None:
        self.name = name
        self._reader = reader
        self._once = once
        # The kernel's own records (kmsg facility 0, journal transport kernel) are the message itself.
        self._parser = KernelLogParser(strict=isinstance(reader, KmsgReader | JournalReader))
        if isinstance(reader, KmsgReader):
            reader.on_skipped = self._parser.learn  # GPU UUIDs announced at boot, before the cursor
        self._cursor = cursor
        self._save_seconds = save_seconds
        self._saved: Position | None = None
        self._saved_at = float("-inf")
        self._cutoff = replay_cutoff
        self.skipped = 0  # events older than the cutoff, not reported
        self._skipped_said = 0

    @property
    def stats(self) -> SourceStats:
        return self._reader.stats

    def run(self, emit: Emit, stop: threading.Event, ready: Ready) -> None:
        self._reader.prime()
        ready()
        cutoff = None if self._reader.resumed else self._cutoff
        if cutoff is not None:
            log.info(
                "%s: no saved cursor to resume from: events whose records are older than %s are taken as "
                "handled before and not reported",
                self.name,
                datetime.fromtimestamp(cutoff, UTC).isoformat(timespec="seconds"),
            )

        def idle() -> None:
            self._say_skipped()
            self._checkpoint(emit, now=False)

        try:
            lines = self._reader.read_available() if self._once else self._reader.follow(stop=stop.is_set, idle=idle)
            feed, countdown = self._parser.feed, _LINES_BETWEEN_CLOCK_LOOKS
            for line in lines:
                reports = feed(line)
                if reports:
                    if cutoff is not None and self._older(line, cutoff):
                        self.skipped += len(reports)
                    else:
                        for report in reports:
                            emit(report, self.name)
                    self._checkpoint(emit, now=True)
                    continue
                countdown -= 1
                if not countdown:  # the clock is looked at every so many lines, not for each
                    countdown = _LINES_BETWEEN_CLOCK_LOOKS
                    self._checkpoint(emit, now=False)
            self._checkpoint(emit, now=True)
            self._say_skipped()
        except JournalCursorRejected as exc:
            if self._cursor is not None:  # so that the restart this failure brings does not fail again
                self._cursor.drop(str(exc))
            raise
        finally:
            self._reader.close()

    def _older(self, line: str, cutoff: float) -> bool:
        """Whether the record of ``line`` carries a time before ``cutoff`` (unknown: not older)."""
        when = self._reader.last_time
        if when is None:
            when = line_time(line)
        return when is not None and when < cutoff

    def _say_skipped(self) -> None:
        """Say how many events were skipped as older than the cutoff, when that number has grown."""
        if self.skipped > self._skipped_said:
            log.warning(
                "%s: %d event(s) older than the replay cutoff skipped: read again without a cursor, they "
                "were most likely handled before",
                self.name,
                self.skipped,
            )
            self._skipped_said = self.skipped

    def _checkpoint(self, emit: Emit, *, now: bool) -> None:
        """Ask for the position to be saved: ``now``, or if the last save is ``save_seconds`` old."""
        if self._cursor is None:
            return
        if not now and time.monotonic() - self._saved_at < self._save_seconds:
            return  # checked first: most lines cost no position at all
        position = self._reader.position()
        if position is None or position == self._saved:
            return
        emit(Checkpoint(self._cursor, position), self.name)
        self._saved, self._saved_at = position, time.monotonic()


class SourceFailed(RuntimeError):
    """A source raised: the detector would be deaf to it, so it stops (and is restarted)."""

    def __init__(self, source: str, error: BaseException) -> None:
        super().__init__(f"source {source} failed: {type(error).__name__}: {error}")
        self.source = source
        self.error = error


class SourceThread(threading.Thread):
    """Runs one source and keeps what it raised, for the main loop to act on."""

    def __init__(self, source: Source, emit: Emit, stop: threading.Event, ready: Ready) -> None:
        super().__init__(name=f"source-{source.name}", daemon=True)  # a source blocked in a read must not hold exit
        self.source = source
        self._args = (emit, stop, ready)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.source.run(*self._args)
        except BaseException as exc:
            self.error = exc


# What the NVML source polls for (detector.degradation): each its own event per GPU and key.
_DEGRADATION_KINDS = frozenset(
    {
        GpuEventKind.PCIE_LINK,
        GpuEventKind.CLOCKS_THROTTLED,
        GpuEventKind.ROW_REMAP,
        GpuEventKind.RETIRED_PAGES,
        GpuEventKind.NVLINK_ERRORS,
        GpuEventKind.GPU_MISSING,
        GpuEventKind.FABRIC_MANAGER,
    }
)


@dataclass
class Folder:
    """Folds identical repeats (same node, Xid and GPU) seen within ``window`` seconds.

    A degradation (the NVML source's polling, which reports each once already) is one repeat of
    another only with the same message: two NVLinks of one GPU, or its pending and its failed
    row remapping, are two events. The kernel log's events without a code (an init failure, a
    power cable) fold by kind and GPU alone, whatever their wording.
    """

    window: float = 10.0
    _seen: dict[tuple[str, str, int | None, str | None, str], float] = field(default_factory=dict)
    folded: int = 0

    def fresh(self, event: XidEvent) -> bool:
        said = event.message if event.kind in _DEGRADATION_KINDS else ""
        key = (event.node, event.kind.value, event.xid, event.pci, said)
        now = time.monotonic()
        last = self._seen.get(key)
        self._seen[key] = now
        if last is not None and now - last < self.window:
            self.folded += 1
            return False
        return True


# How long a delivery waits after a failure: doubled at each, from the first to the cap.
FIRST_BACKOFF_SECONDS = 0.5
TEMPORAL_BACKOFF_CAP_SECONDS = 30.0
# Short, so that a backlog drains within seconds of the intake coming back.
INTAKE_BACKOFF_CAP_SECONDS = 10.0
RETRY_AFTER_CAP_SECONDS = 60.0


class Delivery:
    """Each spooled event, in order, to the node's incident: posted to the intake (``intake``), else
    signal-with-start into Temporal directly (development, without an intake).

    Whatever fails keeps the event spooled and retried with backoff, the intake's Retry-After
    honoured; a refusal of the node's token (401, 403) is said as an error, and the events are
    kept for when the token is fixed.
    """

    def __init__(
        self,
        *,
        cluster: str,
        spool: Spool,
        connect_timeout: float = 5.0,
        dry_run: bool = False,
        intake: IntakePoster | None = None,
    ) -> None:
        self.cluster = cluster
        # Incidents opened as dry runs (GPUFLEET_DRY_RUN): recorded in Temporal, nothing changed.
        self.dry_run = dry_run
        self.spool = spool
        self.intake = intake
        self._client: Client | None = None
        self._connect_timeout = connect_timeout
        self._retry_at = 0.0
        self._backoff = FIRST_BACKOFF_SECONDS
        self._cap = INTAKE_BACKOFF_CAP_SECONDS if intake is not None else TEMPORAL_BACKOFF_CAP_SECONDS
        self.delivered = 0
        # Why the intake refuses this node's events (401, 403), until it takes one again.
        self.refused: str | None = None

    def put(self, event: XidEvent) -> None:
        self.spool.put(event)

    async def flush(self, *, max_seconds: float = 1.0, max_events: int = 200) -> int:
        """Deliver what the spool holds, oldest first; stop at the first failure (kept for later).

        A backlog goes out in slices (``max_events`` or ``max_seconds``, whichever comes first), so
        the main loop keeps coming round (new events, liveness, SIGTERM) while it drains.
        """
        if time.monotonic() < self._retry_at:
            return 0
        sent = 0
        until = time.monotonic() + max_seconds
        for path, event in self.spool.pending(limit=max_events):
            if time.monotonic() > until:
                break
            try:
                incident = await self._send(event)
            except PostFailed as exc:
                if exc.unreadable:  # this event, not the path: set it aside, go on with the next
                    self.spool.set_aside_refused(path, str(exc))
                    continue
                self._failed(event, exc)
                return sent
            self.spool.done(path)
            self._backoff = FIRST_BACKOFF_SECONDS
            self.refused = None
            sent += 1
            self.delivered += 1
            log.info("%s on %s -> incident %s", event.label, event.node, incident)
        return sent

    async def _send(self, event: XidEvent) -> str:
        """The incident ``event`` opened or joined; PostFailed when it was not taken."""
        if self.intake is not None:
            return await self.intake.post(event, cluster=self.cluster, dry_run=self.dry_run)
        try:
            if self._client is None:
                self._client = await connect_temporal(timeout_seconds=self._connect_timeout)
            handle = await report_xid(self._client, event, cluster=self.cluster, dry_run=self.dry_run)
        except (TemporalUnreachable, RPCError, RuntimeError, OSError) as exc:
            self._client = None if isinstance(exc, TemporalUnreachable) else self._client
            raise PostFailed(f"Temporal unreachable ({exc})") from None
        return str(handle.id)

    def _failed(self, event: XidEvent, exc: PostFailed) -> None:
        """Keep the event; say why, and when the next try is."""
        if exc.retry_after is not None:  # the intake said when (429, 503): that, not our own backoff
            wait = min(max(exc.retry_after, FIRST_BACKOFF_SECONDS), RETRY_AFTER_CAP_SECONDS)
        else:
            wait = self._backoff
            self._backoff = min(self._backoff * 2, self._cap)
        self._retry_at = time.monotonic() + wait
        kept = len(self.spool)
        if exc.refused:
            self.refused = str(exc)
            log.error(
                "%s: the intake refuses the events of node %s. Its token (%s) must be the projected "
                "ServiceAccount token of this detector's pod, on node %s, with audience gpufleet: check the "
                "DaemonSet's token volume and the intake's TokenReview permission. %d event(s) kept spooled; "
                "retrying in %.1fs",
                exc,
                event.node,
                self.intake.token_file if self.intake is not None else "?",
                event.node,
                kept,
                wait,
            )
        else:
            log.warning("%s; %d event(s) spooled, retrying in %.1fs", exc, kept, wait)

    async def close(self) -> None:
        """Close the connection to the intake (made again at the next post)."""
        if self.intake is not None:
            await self.intake.close()


class Detector:
    def __init__(
        self,
        *,
        node: str,
        policy: Policy | PolicyFile,
        delivery: Delivery | None,
        fold_seconds: float = 10.0,
        out: Callable[[str], None] = print,
        as_json: bool = True,
    ) -> None:
        self.node = node
        self.policy = policy
        self.delivery = delivery
        self.folder = Folder(fold_seconds)
        self._out = out
        self._as_json = as_json
        self._queue: queue.Queue[tuple[Item, str]] = queue.Queue()
        self._threads: list[SourceThread] = []
        self._cursor_errors: set[Path] = set()
        # For /healthz and /metrics, read from the HTTP server's threads.
        self.last_tick: float | None = None  # time.monotonic() when the main loop last came round
        self.stats: dict[str, SourceStats] = {}
        self.last_event_at: float | None = None  # the Unix time of the last event reported
        self._events: Counter[tuple[str, str]] = Counter()  # (kind, action) -> events reported
        self._events_lock = threading.Lock()

    def emit(self, item: Item, source: str) -> None:
        self._queue.put((item, source))

    def events_reported(self) -> dict[tuple[str, str], int]:
        """Events reported so far by (kind, action); folded repeats are not counted."""
        with self._events_lock:
            return dict(self._events)

    def health(self) -> tuple[bool, str]:
        """Whether the detector still listens: the main loop comes round and every source runs."""
        if self.last_tick is None:
            return False, "not started yet"
        age = time.monotonic() - self.last_tick
        if age > STALE_LOOP_SECONDS:
            return False, f"the main loop has not come round for {age:.0f}s"
        for thread in self._threads:
            if thread.error is not None:
                return False, str(SourceFailed(thread.source.name, thread.error))
            # A source that ended without an error had nothing to follow (NVML without a driver):
            # the others carry on, and a restart would not bring it back.
        if self.delivery is not None and self.delivery.refused:
            # Still live (a restart would not fix a token), but said: the events stay spooled.
            return True, f"listening, but the intake refuses this node's events: {self.delivery.refused}"
        return True, "ok"

    def handle(self, report: XidReport, source: str) -> XidEvent | None:
        event = XidEvent(
            node=self.node,
            kind=GpuEventKind(report.kind),
            xid=report.xid,
            pci=report.pci,
            gpu_uuid=report.gpu_uuid,
            pid=report.pid,
            process=report.process,
            message=report.message,
            source=source,
            timestamp=datetime.now(UTC),
            gpu_instance=report.gpu_instance,
            compute_instance=report.compute_instance,
        )
        return self.consider(event)

    def consider(self, event: XidEvent) -> XidEvent | None:
        """Fold, decide, print and spool ``event`` (found by a source, or dropped into the inbox)."""
        if not self.folder.fresh(event):
            return None
        if isinstance(self.policy, PolicyFile):
            policy = self.policy.current()
            if self.policy.reload_error:
                log.error("policy file not reloaded, still using the last good one: %s", self.policy.reload_error)
        else:
            policy = self.policy
        action = policy.decide([event])
        record = {
            "node": event.node,
            "kind": event.kind.value,
            "xid": event.xid,
            "pci": event.pci,
            "gpu_uuid": event.gpu_uuid,
            "pid": event.pid,
            "process": event.process,
            "message": event.message,
            "source": event.source,
            "timestamp": event.timestamp.isoformat(),
            "action": action.value,
        }
        if self._as_json:
            self._out(json.dumps(record))
        else:
            self._out(f"{event.timestamp:%H:%M:%S} {event.node} {event.label} ({event.pci}) -> {action.value}")
        if self.delivery is not None and action is not Action.OBSERVE:
            with contextlib.suppress(SpoolFull):  # the spool reports it loudly
                self.delivery.put(event)
        with self._events_lock:
            self._events[(event.kind.value, action.value)] += 1
            self.last_event_at = event.timestamp.timestamp()
        return event

    async def run(
        self,
        sources: list[Source],
        *,
        once: bool = False,
        stop: threading.Event | None = None,
        ready_file: Path | None = None,
    ) -> None:
        """Run the sources until they end (``once``) or ``stop`` is set; SourceFailed if one raises.

        Args:
            ready_file: written (with the PID) once every source follows its input, so that
                whoever starts the detector can wait for it instead of guessing.
        """
        stop = stop or threading.Event()
        pending = len(sources)
        lock = threading.Lock()

        def source_ready() -> None:
            nonlocal pending
            with lock:
                pending -= 1
                if pending == 0 and ready_file is not None:
                    write_ready_file(ready_file)

        self.stats = {s.name: s.stats if isinstance(s, KernelLogSource) else SourceStats() for s in sources}
        self._threads = [SourceThread(s, self.emit, stop, source_ready) for s in sources]
        for thread in self._threads:
            thread.start()
        taken = 0
        try:
            while True:
                self.last_tick = time.monotonic()
                self._raise_if_a_source_failed()
                try:
                    item, source = await asyncio.to_thread(self._queue.get, True, 0.05)
                    self._take(item, source)
                    taken += 1
                    if taken % 1000:
                        continue  # drain the queue before delivering, but not forever in a flood
                except queue.Empty:
                    pass
                if self.delivery is not None:
                    await self.delivery.flush()
                sources_done = not any(thread.is_alive() for thread in self._threads)
                if (once and sources_done and self._queue.empty()) or stop.is_set():
                    break
            self._raise_if_a_source_failed()
        finally:
            stop.set()
            await self._wind_down()
        if self.delivery is not None:
            if once and len(self.delivery.spool):
                await self.delivery.flush()
            await self.delivery.close()

    def _raise_if_a_source_failed(self) -> None:
        for thread in self._threads:
            if thread.error is not None:
                self.stats[thread.source.name].errors += 1
                raise SourceFailed(thread.source.name, thread.error) from thread.error

    async def _wind_down(self) -> None:
        """After ``stop``: let the sources end (their last cursor position), then take what they queued."""
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 2.0)  # one blocked in a read (standard input) is left behind
        while True:
            try:
                item, source = self._queue.get_nowait()
            except queue.Empty:
                return
            self._take(item, source)

    def _take(self, item: Item, source: str) -> None:
        if isinstance(item, Checkpoint):
            self._save_cursor(item)
            return
        if isinstance(item, InboxItem):  # spooled first, then its file removed: a crash repeats it
            self.consider(item.event)
            item.done()
            return
        try:
            self.handle(item, source)
        except ValueError as exc:  # a record no event can hold (pydantic's errors included): said, counted
            self.stats.setdefault(source, SourceStats()).errors += 1
            log.error("%s: a record that is no valid event was dropped: %s", source, str(exc).splitlines()[0])

    def _save_cursor(self, checkpoint: Checkpoint) -> None:
        """Every event before ``checkpoint`` is handled: its position may now be saved."""
        path = checkpoint.cursor.path
        try:
            checkpoint.cursor.save(checkpoint.position)
        except OSError as exc:
            if path not in self._cursor_errors:  # said once, not at every save
                log.error("cannot save cursor %s (%s); a restart reads again what followed the last save", path, exc)
            self._cursor_errors.add(path)
        else:
            self._cursor_errors.discard(path)


def write_ready_file(path: Path) -> None:
    """Write ``path`` atomically (a reader never sees it half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{os.getpid()}\n")
    partial.replace(path)
