"""Kubernetes label and field selectors, as the API server evaluates them."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

_TERM_SPLIT = re.compile(r",(?![^()]*\))")
_SET_TERM = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*$")

Predicate = Callable[[Mapping[str, str]], bool]


class SelectorError(ValueError):
    """A selector the API server would reject with 400."""


def _label_term(term: str) -> Predicate:
    if match := _SET_TERM.match(term):
        key, op, raw = match.groups()
        values = {value.strip() for value in raw.split(",") if value.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQ_TERM.match(term):
        key, op, value = match.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTS_TERM.match(term):
        negate, key = match.groups()
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise SelectorError(f"unable to parse requirement: {term!r}")


def label_selector(selector: str) -> Predicate:
    """A predicate over a label mapping; the empty selector selects everything."""
    terms = [_label_term(term) for term in _TERM_SPLIT.split(selector) if term.strip()]
    return lambda labels: all(term(labels) for term in terms)


def _lookup(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def field_selector(selector: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate over a whole object, for selectors such as ``spec.nodeName=gpu1``."""
    checks: list[tuple[str, bool, str]] = []
    for term in selector.split(","):
        if not term.strip():
            continue
        match = _EQ_TERM.match(term)
        if not match:
            raise SelectorError(f"invalid field selector: {term!r}")
        path, op, value = match.groups()
        checks.append((path, op == "!=", value))
    return lambda obj: all((_lookup(obj, path) == value) != negate for path, negate, value in checks)
