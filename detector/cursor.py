"""Where each source stopped reading, kept on disk so that a restart neither loses nor repeats lines.

One small JSON file per source in the state folder (``--state-dir``):

- ``/dev/kmsg``: ``{"kind": "kmsg", "boot_id": ..., "seq": N}``, the last record handled in this boot;
- a log file: ``{"kind": "file", "path": ..., "dev": ..., "ino": ..., "offset": N}``, the end of the last
  line handled in that very file (device and inode, so a rotated or replaced file is not mistaken for it);
- the journal: ``{"kind": "journal", "cursor": "s=...;i=..."}``, journald's ``__CURSOR``.

A position is saved only once the events of its line are handled (printed and spooled), so a
crash loses nothing; at most the line being handled at that moment is read again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from detector.durable import write_durably

log = logging.getLogger("gpufleet.detector")

Position = dict[str, Any]


class CursorFile:
    """The saved position of one source: ``STATE_DIR/NAME.json``."""

    def __init__(self, folder: Path, name: str) -> None:
        self.path = folder / f"{name}.json"

    def load(self) -> Position | None:
        """The saved position; None when there is none or it cannot be read (said once).

        An unreadable cursor must not stop the detector: it starts as on a first start instead.
        Whether the position fits the source (same kind, boot, file) is for the reader to judge.
        """
        try:
            position = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("cursor %s is unreadable (%s); starting as on a first start", self.path, exc)
            return None
        if not isinstance(position, dict):
            log.error("cursor %s is not a JSON object; starting as on a first start", self.path)
            return None
        return position

    def drop(self, why: str) -> None:
        """Forget the saved position (the next start is a first start), saying why."""
        log.error("cursor %s dropped: %s; the next start reads its source as on a first start", self.path, why)
        self.path.unlink(missing_ok=True)

    def save(self, position: Position) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(self.path, json.dumps(position, sort_keys=True).encode() + b"\n")
