"""`gpufleet whatif --fleet FILE`: the simulated fleet a team describes (sim/world.py's FleetSpec
less ``spares``, which ``--spares`` sets), in YAML or JSON (docs/whatif.md#the-fleet-file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sim.world import FleetSpec


class FleetError(ValueError):
    """A fleet file that cannot be used: one line, naming the file and the field."""


def load_fleet(path: Path) -> FleetSpec:
    """The fleet file at ``path``, checked; its ``model_fields_set`` are the fields it gives.

    Raises:
        FleetError: the file is missing, not YAML or JSON, sets ``spares``, or has a bad field.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FleetError(f"--fleet: {path}: cannot read the fleet file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise FleetError(f"--fleet: {path}: not UTF-8 text: a fleet file is YAML or JSON") from None
    data = _parse(path, text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise FleetError(f"--fleet: {path}: a fleet file is a mapping of FleetSpec's fields, not {type(data).__name__}")
    if "spares" in data:
        raise FleetError(f"--fleet: {path}: spares: the spare counts come from --spares (each a case), not the file")
    try:
        return FleetSpec.model_validate(data)
    except ValidationError as exc:
        raise FleetError(f"--fleet: {path}: {_problems(exc)}") from None


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise FleetError(f"--fleet: {path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise FleetError(f"--fleet: {path}: not YAML{where}: {problem}") from None


def _problems(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        field = ".".join(str(part) for part in error["loc"]) or "(top)"
        parts.append(f"{field}: {error['msg']}")
    return "; ".join(parts)


def overlay(base: FleetSpec, given: FleetSpec) -> FleetSpec:
    """``base`` (the defaults, or a synthetic's fleet) with the fields ``given`` sets: each replaces
    the base's, but ``repair_seconds`` and ``needs``, whose entries add to the base's (a file naming
    only RESET_GPU keeps the base's time for a replacement)."""
    update: dict[str, Any] = {name: getattr(given, name) for name in given.model_fields_set if name != "spares"}
    if "repair_seconds" in update:
        update["repair_seconds"] = {**base.repair_seconds, **given.repair_seconds}
    if "needs" in update:
        update["needs"] = {**base.needs, **given.needs}
    return FleetSpec.model_validate({**base.model_dump(), **update})
