"""Heartbeats for synchronous activities, so a dead worker is noticed in seconds.

A Slurm or Kubernetes call blocks its thread; a thread beside it heartbeats meanwhile. When the
worker process dies the heartbeats stop, and Temporal retries the activity elsewhere after the
heartbeat timeout instead of its whole start-to-close timeout. A call that hangs in a live
worker is bounded by the call's own timeout, and that by the start-to-close timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import ParamSpec, TypeVar

from temporalio import activity

P = ParamSpec("P")
R = TypeVar("R")

# Well inside the workflow's heartbeat timeout (5 s), and the SDK throttles what it sends.
HEARTBEAT_EVERY = 1.0


def heartbeating(fn: Callable[P, R]) -> Callable[P, R]:
    """Heartbeat every second while ``fn`` runs (apply below ``@activity.defn``)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        context = contextvars.copy_context()  # the activity's context, for the heartbeat thread
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_EVERY):
                try:
                    context.run(activity.heartbeat)
                except RuntimeError:  # the activity is over (or not an activity at all)
                    return
                except Exception:  # noqa: S112 - a slow hand-off to the SDK: beat again next time
                    continue

        try:
            threading.Thread(target=beat, name=f"heartbeat-{fn.__name__}", daemon=True).start()
            return fn(*args, **kwargs)
        finally:
            done.set()

    return wrapper


@contextlib.asynccontextmanager
async def heartbeats() -> AsyncIterator[None]:
    """Heartbeat every second while the body runs, so that a dead worker is noticed in seconds."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_EVERY)

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()
