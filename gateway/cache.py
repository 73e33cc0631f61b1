"""A small map of answers reused for a few seconds: token reviews and permission checks.

A token revoked, or a binding removed, takes effect after CACHE_SECONDS at most (Kubernetes' own
webhook authenticators and authorizers cache likewise); in exchange, a client that repeats itself
(a detector's backlog, a CLI's long poll) costs the API server one review, not one per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CACHE_SECONDS = 10.0
# Past this many live entries (distinct tokens or questions within CACHE_SECONDS), start afresh:
# the memory stays bounded whatever a caller sends.
CACHE_ENTRIES = 4096


class ExpiringCache:
    """Entries expire ``seconds`` after they were put; at most ``entries`` are kept."""

    def __init__(
        self,
        *,
        seconds: float = CACHE_SECONDS,
        entries: int = CACHE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._seconds = seconds
        self._max = entries
        self._clock = clock
        self._entries: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any) -> Any:
        found = self._entries.get(key)
        if found is None or found[0] < self._clock():
            return None
        return found[1]

    def put(self, key: Any, value: Any) -> None:
        if len(self._entries) >= self._max:
            now = self._clock()
            self._entries = {k: v for k, v in self._entries.items() if v[0] >= now}
            if len(self._entries) >= self._max:
                self._entries.clear()
        self._entries[key] = (self._clock() + self._seconds, value)
