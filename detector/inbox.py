"""The detector's inbox: events written by other processes on the node (``gpufleet health-check``).

A writer drops one JSON event per file (``write_event``: written whole, fsync'd, renamed into
place); the detector's ``InboxSource`` takes the files in the order of their names, checks each
(an event, for this node, of a kind the inbox accepts) and hands it to the main loop, which spools
it and only then removes the file. A crash in between delivers it again, with the same timestamp:
the incident folds the copy. A file that is no acceptable event is set aside as ``NAME.rejected``.

This module is imported by ``gpufleet health-check`` too: the writer's half needs nothing but the
standard library (no pydantic, no Temporal), so a Slurm prolog stays fast.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from detector.durable import fsync_folder, write_durably

log = logging.getLogger("gpufleet.detector")

# The inbox folder, for the writer (the detector takes --inbox): the DaemonSet and the slurmd
# container share it as a host folder.
INBOX_ENV = "GPUFLEET_INBOX"
# Only events no kernel record stands for: a process that can write here must not forge an Xid.
INBOX_KINDS = frozenset({"health_check"})
POLL_SECONDS = 0.2
# An event's file is a few hundred bytes; anything larger is set aside unread.
MAX_EVENT_BYTES = 64 * 1024


def default_inbox(node: str) -> Path:
    """``$GPUFLEET_INBOX``, else ``$GPUFLEET_HOME/inbox/NODE`` (GPUFLEET_HOME: ``.gpufleet``)."""
    explicit = os.environ.get(INBOX_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("GPUFLEET_HOME") or ".gpufleet") / "inbox" / node


def write_event(folder: Path, event: dict[str, Any]) -> Path:
    """Drop ``event`` (an XidEvent's fields, as JSON) into the inbox ``folder``, durably.

    Names sort in the order they were written (nanoseconds, then the writer's PID), and a reader
    never sees a file half written (it takes ``*.json`` only; the writer renames into place).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time_ns():020d}-{os.getpid()}.json"
    write_durably(path, json.dumps(event, separators=(",", ":")).encode())
    return path


@dataclass(frozen=True)
class InboxItem:
    """An event taken from the inbox; its file is removed once the event is spooled."""

    event: Any  # models.xid.XidEvent (imported where it is read, not by the writer's half)
    path: Path

    def done(self) -> None:
        """The event is spooled: remove its file, durably (a crash before this repeats it once)."""
        self.path.unlink(missing_ok=True)
        fsync_folder(self.path.parent)


class InboxSource:
    """Feeds the events dropped into ``folder`` to the detector, oldest name first.

    Args:
        folder: the inbox (created if missing).
        node: this detector's node; an event for another node is set aside.
        once: take what is there now and end.
    """

    name = "inbox"

    def __init__(self, folder: Path, *, node: str, once: bool = False, poll_seconds: float = POLL_SECONDS) -> None:
        self.folder = folder
        self.node = node
        self._once = once
        self._poll = poll_seconds
        self.rejected = 0
        self._handed: set[str] = set()  # names queued for the main loop, not yet removed by it

    def run(self, emit: Callable[[Any, str], None], stop: threading.Event, ready: Callable[[], None]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        ready()
        while True:
            for item in self.take():
                emit(item, self.name)
            if self._once or stop.wait(self._poll):
                return

    def take(self) -> list[InboxItem]:
        """The events waiting that were not handed over yet, in order; bad files set aside."""
        from models.xid import XidEvent  # the reader's half only

        names = sorted(p.name for p in self.folder.glob("*.json"))
        self._handed &= set(names)  # removed by the main loop: forget them
        items = []
        for name in names:
            if name in self._handed:
                continue
            path = self.folder / name
            try:
                event = XidEvent.model_validate_json(_read(path))
            except FileNotFoundError:
                continue
            except _Unfit as exc:
                self._reject(path, str(exc))
                continue
            except ValueError as exc:  # pydantic's ValidationError included
                self._reject(path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                continue
            if event.node != self.node:
                self._reject(path, f"it names node {event.node!r}, this detector is {self.node!r}'s")
                continue
            if event.kind.value not in INBOX_KINDS:
                self._reject(path, f"kind {event.kind.value!r}: the inbox takes only {', '.join(sorted(INBOX_KINDS))}")
                continue
            self._handed.add(name)
            items.append(InboxItem(event, path))
        return items

    def _reject(self, path: Path, why: str) -> None:
        rejected = path.with_name(path.name + ".rejected")
        try:
            path.replace(rejected)
        except FileNotFoundError:
            return
        self.rejected += 1
        log.error("inbox file %s is no event this detector takes (%s); set aside as %s", path, why, rejected.name)


class _Unfit(Exception):
    """An inbox entry that cannot be an event's file (why, in words)."""


def _read(path: Path) -> bytes:
    """The bytes of the inbox file ``path``: a regular file of at most MAX_EVENT_BYTES, opened
    without following a symbolic link and without blocking (a FIFO named so would stop the
    detector's inbox for good, a link to a huge file or a device would fill its memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a symbolic link (ELOOP), no permission...
        raise _Unfit(f"cannot open it: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Unfit("not a regular file")
        data = os.read(fd, MAX_EVENT_BYTES + 1)
    except OSError as exc:
        raise _Unfit(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_EVENT_BYTES:
        raise _Unfit(f"larger than {MAX_EVENT_BYTES} bytes")
    return data


def now_iso() -> str:
    return datetime.now(UTC).isoformat()
