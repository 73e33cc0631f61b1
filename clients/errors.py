"""Typed errors at the client boundary; activities map them once to retryable or not."""

from __future__ import annotations

import re

from models.names import InvalidName, validate_node_name


class ClientError(Exception):
    """Base of every error a client raises on purpose."""

    retryable = True


class NotFound(ClientError):
    """The node, job, pod or object does not exist."""

    retryable = False


class InvalidInput(ClientError):
    """The request itself is wrong (a bad name, an impossible change)."""

    retryable = False


class Forbidden(ClientError):
    """The API refused our credentials or permissions (401/403): a person must fix the RBAC."""

    retryable = False


class Refused(ClientError):
    """The server refused the request for good: an HTTP 4xx with no name of its own above (405,
    410, 413, 415, ...). Asking again gets the same answer."""

    retryable = False


class LastNodeOfPartition(InvalidInput):
    """Slurm refuses a partition with no node: its last node stays in it."""


class NotOwned(ClientError):
    """The object is held by someone else (a node drained by an operator, a spare claimed elsewhere)."""

    retryable = False


class Conflict(ClientError):
    """A write lost a race (resourceVersion precondition); read again and retry."""


class TooManyRequests(ClientError):
    """The server refused for now (an eviction a PodDisruptionBudget forbids, a rate limit)."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        # Seconds the server asked us to wait (HTTP Retry-After), when it said.
        self.retry_after = retry_after


class Unavailable(ClientError):
    """The service cannot be reached or timed out; retry with backoff."""


# The 4xx answers that a retry may get past: the server timed out waiting for the request (408),
# a write lost a race and is made again on a fresh read (409), the server asks to be asked later
# (425, 429). Every other 4xx says the request itself is wrong, and is not retried.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})


def error_for_status(status: int, detail: str) -> ClientError:
    """The error for an HTTP answer ``status`` (0: none came): retried for 5xx, no answer and
    RETRYABLE_4XX, not retried for any other 4xx."""
    if status == 404:
        return NotFound(detail)
    if status == 409:
        return Conflict(detail)
    if status == 429:
        return TooManyRequests(detail)
    if status in (400, 422):
        return InvalidInput(detail)
    if status in (401, 403):
        return Forbidden(detail)
    if status >= 500 or status == 0 or status in RETRYABLE_4XX:
        return Unavailable(detail)
    if 400 <= status < 500:
        return Refused(detail)
    return ClientError(detail)


def checked_node_name(name: str) -> str:
    """``name`` when it is safe for a command line or an API path, else InvalidInput."""
    try:
        return validate_node_name(name)
    except InvalidName as exc:
        raise InvalidInput(str(exc)) from None


# What looks like a JWT (header.claims.signature, base64url), whole or cut short.
_JWT = re.compile(r"eyJ[\w-]+(?:\.[\w-]*){0,2}")
# A token header quoted back: X-SLURM-USER-TOKEN: value (or = value, or as a JSON pair).
_TOKEN_HEADER = re.compile(r"""(?i)(x-slurm-user-token["']?\s*[:=]\s*["']?)[^\s"',}]+""")


def redact(text: str, *secrets: str, limit: int = 300) -> str:
    """A server's words fit for an error message: each secret, anything shaped like a JWT and any
    token header it quoted back replaced by ``[token]``, then cut to ``limit`` characters (in
    that order, so a cut never leaves part of a secret)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[token]")
    text = _TOKEN_HEADER.sub(r"\1[token]", _JWT.sub("[token]", text))
    return text[:limit]
