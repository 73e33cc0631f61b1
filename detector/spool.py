"""A bounded on-disk spool: events wait here, in order, until Temporal takes them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from models.xid import XidEvent

log = logging.getLogger("gpufleet.detector")


class SpoolFull(RuntimeError):
    """The spool holds its maximum; the event was not kept."""


class Spool:
    """One JSON file per event, named by a sequence number, written atomically."""

    def __init__(self, folder: Path, *, max_events: int = 10000) -> None:
        self.folder = folder
        self.max_events = max_events
        folder.mkdir(parents=True, exist_ok=True)
        existing = self._files()
        self._next = int(existing[-1].stem) + 1 if existing else 0
        self.dropped = 0

    def _files(self) -> list[Path]:
        return sorted(self.folder.glob("*.json"), key=lambda p: int(p.stem))

    def __len__(self) -> int:
        return len(self._files())

    def put(self, event: XidEvent) -> Path:
        """Keep the event; raise SpoolFull (after logging loudly) when the spool is full."""
        if len(self) >= self.max_events:
            self.dropped += 1
            log.error(
                "SPOOL FULL (%d events in %s): Xid %d on %s NOT KEPT (%d dropped so far). Temporal has been "
                "unreachable too long; fix the connection or raise --spool-max.",
                self.max_events,
                self.folder,
                event.xid,
                event.node,
                self.dropped,
            )
            raise SpoolFull(f"spool {self.folder} is full ({self.max_events} events)")
        path = self.folder / f"{self._next:012d}.json"
        self._next += 1
        tmp = path.with_suffix(".tmp")
        tmp.write_text(event.model_dump_json())
        os.replace(tmp, path)
        return path

    def pending(self) -> list[tuple[Path, XidEvent]]:
        """Spooled events, oldest first."""
        return [(path, XidEvent.model_validate_json(path.read_text())) for path in self._files()]

    def done(self, path: Path) -> None:
        path.unlink(missing_ok=True)
