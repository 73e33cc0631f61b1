"""The what-if's failures: a team's own trace (models/trace.py, JSON), or a synthetic one shaped on
published figures (sim/data/NAME.yaml, each parameter with its source)."""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.policy import Action
from models.trace import Trace, TraceEvent, TraceFailure
from models.xid import GpuEventKind
from sim.world import FleetSpec, JobSpec

DAY = 86400.0


class TraceError(ValueError):
    """A trace or a synthetic's parameters that cannot be used: one line, naming the file."""


class SyntheticEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: GpuEventKind = GpuEventKind.XID
    xid: int | None = None
    share: float = Field(gt=0, le=1)


class SyntheticCause(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cause: str = Field(pattern=r"^[a-z0-9_.-]+$")
    count: int = Field(ge=0)
    category: str = ""
    needs: Action | None = None
    kills_job: bool = True
    events: list[SyntheticEvent] = Field(default_factory=list)

    @model_validator(mode="after")
    def _shares(self) -> SyntheticCause:
        if self.events and abs(sum(event.share for event in self.events) - 1) > 1e-6:
            raise ValueError(f"{self.cause}: the events' shares add up to 1")
        return self


class Reference(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    days: float = Field(gt=0)


class SyntheticFleet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    detection_seconds: float = Field(default=30.0, ge=0)
    repair_seconds: dict[Action, float] = Field(default_factory=dict)


class Synthetic(BaseModel):
    """A synthetic trace's parameters (sim/data/NAME.yaml)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    source: str
    reference: Reference
    fleet: SyntheticFleet = Field(default_factory=SyntheticFleet)
    job: JobSpec = Field(default_factory=JobSpec)
    causes: list[SyntheticCause]

    @property
    def interruptions(self) -> int:
        return sum(cause.count for cause in self.causes)

    def fleet_spec(self, *, nodes: int, gpus_per_node: int) -> FleetSpec:
        """The simulated fleet the synthetic describes, on ``nodes`` nodes (no spares yet)."""
        base = FleetSpec()
        repair = {**base.repair_seconds, **self.fleet.repair_seconds}
        needs = {cause.cause: cause.needs for cause in self.causes if cause.needs is not None}
        return FleetSpec(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            jobs=[self.job],
            detection_seconds=self.fleet.detection_seconds,
            repair_seconds=repair,
            needs=needs,
        )

    def trace(self, *, nodes: int, gpus_per_node: int, days: float, seed: int) -> Trace:
        """Failures at the reference's rate per GPU, scaled to ``nodes`` x ``gpus_per_node`` GPUs
        and ``days``: a Poisson process, each failure's cause drawn by the reference's counts."""
        rng = random.Random(seed)
        seconds = days * DAY
        per_gpu_second = self.interruptions / (self.reference.gpus * self.reference.days * DAY)
        rate = per_gpu_second * nodes * gpus_per_node
        weights = [cause.count for cause in self.causes]
        failures: list[TraceFailure] = []
        at = 0.0
        while rate > 0:
            at += rng.expovariate(rate)
            if at > seconds:
                break
            cause = rng.choices(self.causes, weights=weights)[0]
            event = None
            if cause.events:
                chosen = rng.choices(cause.events, weights=[e.share for e in cause.events])[0]
                event = TraceEvent(kind=chosen.kind, xid=chosen.xid)
            failures.append(TraceFailure(at=round(at, 3), cause=cause.cause, event=event, kills_job=cause.kills_job))
        return Trace(
            source=f"synthetic {self.name} (seed {seed}): {self.source}",
            seconds=seconds,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            failures=failures,
        )


def synthetic_names() -> list[str]:
    folder = resources.files("sim") / "data"
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def load_synthetic(name: str) -> Synthetic:
    """The synthetic named ``name`` (sim/data/NAME.yaml)."""
    names = synthetic_names()
    if name not in names:
        raise TraceError(f"no synthetic trace named {name!r}: choose one of {', '.join(names)}")
    text = (resources.files("sim") / "data" / f"{name}.yaml").read_text(encoding="utf-8")
    try:
        return Synthetic.model_validate(yaml.safe_load(text))
    except ValidationError as exc:
        raise TraceError(f"sim/data/{name}.yaml: {_problems(exc)}") from None


def load_trace(path: Path) -> Trace:
    """A trace file (JSON, format gpufleet-trace/1).

    Raises:
        TraceError: the file is missing, not JSON, or not a trace; one line naming the file.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text: a trace is JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: a trace is a JSON object (format gpufleet-trace/1), not {type(data).__name__}")
    try:
        return Trace.model_validate(data)
    except ValidationError as exc:
        raise TraceError(f"{path}: not a gpufleet trace: {_problems(exc)}") from None


def save_trace(trace: Trace, path: Path) -> None:
    path.write_text(trace.model_dump_json(indent=2) + "\n", encoding="utf-8")


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(part) for part in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()[:3])
