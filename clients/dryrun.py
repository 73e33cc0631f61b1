"""The dry-run switch: while it is on, no client call may change Slurm or Kubernetes.

A dry-run incident's activities turn it on (``dry_run(True)``) and compute what they would have
done from reads alone. The clients check it at their one door each (``SlurmCli._run`` for the
commands that change something, ``KubernetesApi._call`` for writes): a write that slipped
through would raise ``DryRunViolation`` instead of changing the fleet.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from clients.errors import ClientError

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("gpufleet_dry_run", default=False)


class DryRunViolation(ClientError):
    """A write attempted while the dry-run switch is on: a bug, never retried."""

    retryable = False


@contextmanager
def dry_run(on: bool) -> Iterator[None]:
    """Turn the switch on (or leave it off) for the calls made inside."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def refuse_writes(what: str) -> None:
    """Raise DryRunViolation when the switch is on: ``what`` would change the fleet."""
    if _ON.get():
        raise DryRunViolation(f"dry run: {what} would change the fleet, and was not done")
