"""The one place where client errors become retryable or non-retryable Temporal failures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from temporalio.exceptions import ApplicationError

from clients.errors import ClientError

NON_RETRYABLE = ("NotFound", "InvalidInput", "NotOwned", "Forbidden")


@contextmanager
def client_errors() -> Iterator[None]:
    """Re-raise a ClientError as an ApplicationError typed by its class, retryable or not."""
    try:
        yield
    except ClientError as exc:
        raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=not exc.retryable) from exc
