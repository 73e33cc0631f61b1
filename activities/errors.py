"""The one place where client errors become retryable or non-retryable Temporal failures.

Retried (within each call's budget, workflows/retries.py): a service that cannot be reached or
times out, a 5xx, a lost race (409), a request to slow down (429) or to come again (408, 425), and
an error no one named. Not retried: a wrong request (bad input, an unsafe name), something that
does not exist, a refusal of our credentials, a node someone else holds, any other 4xx, and a
policy file that cannot be read as UTF-8 YAML (activities/policy.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from temporalio.exceptions import ApplicationError

from clients.errors import ClientError, error_for_status
from models.names import InvalidName

# The error types a retry never gets past, whoever raises them. Errors raised as non-retryable
# (a ClientError whose class says so, or ApplicationError(non_retryable=True)) are not retried
# either, listed here or not.
NON_RETRYABLE = ("NotFound", "InvalidInput", "NotOwned", "Forbidden", "Refused", "PolicyInvalid")


def classified(exc: ClientError) -> ClientError:
    """``exc``, or the error its HTTP status names when a client raised a plain ClientError for an
    answer it has no class for (clients/kube.py, for a 4xx other than 400, 401, 403, 404, 409,
    422 and 429: the API server's answer is the exception it was raised from)."""
    if type(exc) is ClientError:
        status = getattr(exc.__cause__ or exc.__context__, "status", None)
        if isinstance(status, int) and 400 <= status < 500:
            return error_for_status(status, str(exc))
    return exc


@contextmanager
def client_errors() -> Iterator[None]:
    """Re-raise a ClientError as an ApplicationError typed by its class, retryable or not; an
    unsafe name (InvalidName) as InvalidInput, not retryable."""
    try:
        yield
    except ClientError as exc:
        error = classified(exc)
        raise ApplicationError(str(exc), type=type(error).__name__, non_retryable=not error.retryable) from exc
    except InvalidName as exc:
        raise ApplicationError(str(exc), type="InvalidInput", non_retryable=True) from exc
