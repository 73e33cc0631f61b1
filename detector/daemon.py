"""The detector: sources feed Xid reports, the policy decides, Temporal gets the incidents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from temporalio.client import Client
from temporalio.service import RPCError

from detector.parse import KernelLogParser, XidReport
from detector.spool import Spool, SpoolFull
from models.policy import Action, Policy, PolicyFile
from models.xid import XidEvent
from starters.temporal import TemporalUnreachable, connect, report_xid

log = logging.getLogger("gpufleet.detector")
Emit = Callable[[XidReport, str], None]
Ready = Callable[[], None]


class Source(Protocol):
    name: str

    def run(self, emit: Emit, stop: threading.Event, ready: Ready) -> None:
        """Feed reports to ``emit`` until ``stop``; call ``ready`` once nothing new can be missed."""
        ...


class KernelLogSource:
    """Kernel-log lines (a file, a stream or /dev/kmsg) through the driver-line parser."""

    name = "kmsg"

    def __init__(self, follower: Any, *, once: bool) -> None:
        self._follower = follower
        self._once = once
        self._parser = KernelLogParser()

    def run(self, emit: Emit, stop: threading.Event, ready: Ready) -> None:
        self._follower.prime()
        ready()
        lines = self._follower.read_available() if self._once else self._follower.follow(stop=stop.is_set)
        for line in lines:
            for report in self._parser.feed(line):
                emit(report, self.name)


@dataclass
class Folder:
    """Folds identical repeats (same node, Xid and GPU) seen within ``window`` seconds."""

    window: float = 10.0
    _seen: dict[tuple[str, int, str | None], float] = field(default_factory=dict)
    folded: int = 0

    def fresh(self, event: XidEvent) -> bool:
        key = (event.node, event.xid, event.pci)
        now = time.monotonic()
        last = self._seen.get(key)
        self._seen[key] = now
        if last is not None and now - last < self.window:
            self.folded += 1
            return False
        return True


class Delivery:
    """Signal-with-start into the node's incident, through the spool, in order."""

    def __init__(self, *, cluster: str, spool: Spool, connect_timeout: float = 5.0) -> None:
        self.cluster = cluster
        self.spool = spool
        self._client: Client | None = None
        self._connect_timeout = connect_timeout
        self._retry_at = 0.0
        self._backoff = 0.5
        self.delivered = 0

    def put(self, event: XidEvent) -> None:
        self.spool.put(event)

    async def flush(self) -> int:
        """Deliver what the spool holds, oldest first; stop at the first failure (kept for later)."""
        if time.monotonic() < self._retry_at:
            return 0
        sent = 0
        for path, event in self.spool.pending():
            try:
                if self._client is None:
                    self._client = await connect(timeout_seconds=self._connect_timeout)
                handle = await report_xid(self._client, event, cluster=self.cluster)
            except (TemporalUnreachable, RPCError, RuntimeError, OSError) as exc:
                self._client = None if isinstance(exc, TemporalUnreachable) else self._client
                log.warning(
                    "Temporal unreachable (%s); %d event(s) spooled, retrying in %.1fs",
                    exc,
                    len(self.spool),
                    self._backoff,
                )
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 30.0)
                return sent
            self.spool.done(path)
            self._backoff = 0.5
            sent += 1
            self.delivered += 1
            log.info("Xid %d on %s -> incident %s", event.xid, event.node, handle.id)
        return sent


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
        self._queue: queue.Queue[tuple[XidReport, str]] = queue.Queue()

    def emit(self, report: XidReport, source: str) -> None:
        self._queue.put((report, source))

    def handle(self, report: XidReport, source: str) -> XidEvent | None:
        event = XidEvent(
            node=self.node,
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
            self._out(f"{event.timestamp:%H:%M:%S} {event.node} Xid {event.xid} ({event.pci}) -> {action.value}")
        if self.delivery is not None and action is not Action.OBSERVE:
            with contextlib.suppress(SpoolFull):  # the spool reports it loudly
                self.delivery.put(event)
        return event

    async def run(
        self,
        sources: list[Source],
        *,
        once: bool = False,
        stop: threading.Event | None = None,
        ready_file: Path | None = None,
    ) -> None:
        """Run the sources until they end (``once``) or ``stop`` is set.

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

        threads = [
            threading.Thread(target=s.run, args=(self.emit, stop, source_ready), name=s.name, daemon=True)
            for s in sources
        ]
        for thread in threads:
            thread.start()
        try:
            while True:
                try:
                    report, source = await asyncio.to_thread(self._queue.get, True, 0.05)
                    self.handle(report, source)
                    continue  # drain the queue before delivering
                except queue.Empty:
                    pass
                if self.delivery is not None:
                    await self.delivery.flush()
                sources_done = not any(thread.is_alive() for thread in threads)
                if (once and sources_done and self._queue.empty()) or stop.is_set():
                    break
        finally:
            stop.set()
        if once and self.delivery is not None and len(self.delivery.spool):
            await self.delivery.flush()


def write_ready_file(path: Path) -> None:
    """Write ``path`` atomically (a reader never sees it half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{os.getpid()}\n")
    partial.replace(path)
