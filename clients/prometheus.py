"""Demand from the Prometheus HTTP API (``/api/v1/query``) over httpx.

A query's answer is a number or nothing. Nothing (an empty vector, NaN, a non-numeric value)
is not zero: the caller holds its split rather than move on missing data. An unreachable
server, an HTTP error or a query Prometheus refuses raises Unavailable, saying which.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

from clients.errors import InvalidInput, Unavailable


class PrometheusApi:
    def __init__(self, url: str, *, timeout_seconds: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidInput(f"Prometheus URL {url!r}: an http:// or https:// address is needed")
        self._url = url.rstrip("/")
        self._timeout = timeout_seconds

    def query(self, promql: str) -> float | None:
        """The query's value now: a scalar, or the sum of an instant vector; None when empty."""
        try:
            answer = httpx.get(f"{self._url}/api/v1/query", params={"query": promql}, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise Unavailable(f"Prometheus at {self._url} unreachable: {exc}") from None
        try:
            body: dict[str, Any] = answer.json()
        except ValueError:
            raise Unavailable(f"Prometheus at {self._url} answered HTTP {answer.status_code} without JSON") from None
        if answer.status_code != 200 or body.get("status") != "success":
            error = body.get("error") or f"HTTP {answer.status_code}"
            if answer.status_code == 400:
                raise InvalidInput(f"Prometheus refused the query {promql!r}: {error}")
            raise Unavailable(f"Prometheus at {self._url}: {error}")
        return _value(body.get("data") or {})


def _number(sample: Any) -> float | None:
    try:
        value = float(sample[1])
    except (TypeError, ValueError, IndexError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def _value(data: dict[str, Any]) -> float | None:
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return _number(result)
    if kind == "vector" and isinstance(result, list):
        values = [_number(series.get("value")) for series in result if isinstance(series, dict)]
        known = [v for v in values if v is not None]
        return sum(known) if known else None
    return None
