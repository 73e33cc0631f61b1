"""A bounded on-disk spool: events wait here, in order, until Temporal takes them."""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from detector.durable import write_durably
from models.xid import XidEvent

log = logging.getLogger("gpufleet.detector")


class SpoolFull(RuntimeError):
    """The spool holds its maximum; the event was not kept."""


def _sequence(path: Path) -> int | None:
    """The sequence number that names a spool file (``000000000042.json...``), None if it has none."""
    head = path.name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())
    return str(exc)


class Spool:
    """One JSON file per event, named by a sequence number, written durably (fsync'd, renamed into place).

    A file that does not hold an event (empty, cut short, not JSON) is renamed ``NAME.corrupt``
    and said once: it must not block the events behind it, nor stop the detector at every start.
    """

    def __init__(self, folder: Path, *, max_events: int = 10000) -> None:
        self.folder = folder
        self.max_events = max_events
        folder.mkdir(parents=True, exist_ok=True)
        for partial in folder.glob("*.tmp"):  # a put that never finished: its line is read again
            partial.unlink(missing_ok=True)
        numbers = [n for p in folder.iterdir() if (n := _sequence(p)) is not None]
        self._next = max(numbers) + 1 if numbers else 0
        self.dropped = 0
        self.set_aside = 0
        self.pending()  # sets aside, now, what a crash or a full disk left unreadable: len() counts events

    def _files(self) -> list[Path]:
        files = [p for p in self.folder.glob("*.json") if _sequence(p) is not None]
        return sorted(files, key=lambda p: _sequence(p) or 0)

    def __len__(self) -> int:
        return len(self._files())

    def put(self, event: XidEvent) -> Path:
        """Keep the event; raise SpoolFull (after logging loudly) when the spool is full."""
        if len(self) >= self.max_events:
            self.dropped += 1
            log.error(
                "SPOOL FULL (%d events in %s): %s on %s NOT KEPT (%d dropped so far). Temporal has been "
                "unreachable too long; fix the connection or raise --spool-max.",
                self.max_events,
                self.folder,
                event.label,
                event.node,
                self.dropped,
            )
            raise SpoolFull(f"spool {self.folder} is full ({self.max_events} events)")
        path = self.folder / f"{self._next:012d}.json"
        self._next += 1
        write_durably(path, event.model_dump_json().encode())
        return path

    def pending(self, limit: int | None = None) -> list[tuple[Path, XidEvent]]:
        """Spooled events, oldest first (at most ``limit``); a file that holds none is set aside."""
        events: list[tuple[Path, XidEvent]] = []
        for path in self._files():
            if limit is not None and len(events) >= limit:
                break
            try:
                events.append((path, XidEvent.model_validate_json(path.read_bytes())))
            except FileNotFoundError:
                continue  # delivered meanwhile
            except ValueError as exc:  # pydantic's ValidationError included: empty, cut short, not an event
                self._set_aside(path, exc)
        return events

    def _set_aside(self, path: Path, exc: Exception) -> None:
        corrupt = path.with_name(path.name + ".corrupt")
        path.replace(corrupt)
        self.set_aside += 1
        log.error("spool file %s holds no event (%s); set aside as %s", path, _one_line(exc), corrupt.name)

    def set_aside_refused(self, path: Path, why: str) -> Path:
        """Keep an event its receiver cannot read (``NAME.refused``), out of the way of those behind
        it: one unreadable event must not hold back a later fatal Xid. A person can post it again."""
        refused = path.with_name(path.name + ".refused")
        path.replace(refused)
        self.set_aside += 1
        log.error("spooled event %s refused as unreadable (%s); set aside as %s", path, why, refused.name)
        return refused

    def done(self, path: Path) -> None:
        path.unlink(missing_ok=True)
