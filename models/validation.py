"""The validation ladder a node climbs before it goes back into service (docs/validation.md).

``gpufleet nodes return NODE`` and the end of a repair in place (a GPU reset, a reboot) run the
ladder's rungs in order, each as a Kubernetes Job pinned to the node: the quick health check,
DCGM's diagnostics, an NCCL all-reduce across the node's GPUs, and a site command of the
operator's. A rung passes when its Job completes (and, for NCCL, when the bus bandwidth it
reports reaches the threshold); the first rung that fails keeps the node out. A node that
passes is on probation for a while: an event in that time replaces and quarantines it at once.

Commands are argv lists (no shell of gpufleet's making); ``{node}``, ``{gpus}`` (the node's GPU
count) and ``{level}`` (DCGM's run level) are filled in.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.numbers import Finite, Whole

# A rung's name goes into its Job's name: a short DNS-1123 label.
_RUNG_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?$")
_PLACEHOLDERS = {"{node}", "{gpus}", "{level}"}
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
# A node type as a ConfigMap key: [-._a-zA-Z0-9]+.
_KEY_CHAR = re.compile(r"[^-._a-zA-Z0-9]")

# How many of its own NCCL passes per node type gpufleet keeps (the median is of these).
BASELINE_KEPT = 20
# The node type of a node that names none (no nvidia.com/gpu.product label).
DEFAULT_NODE_TYPE = "default"
# The exit status of a shell whose command is not found: the rung's tool is not on the node.
TOOL_MISSING_EXIT = 127


class RungKind(StrEnum):
    """What a rung checks; the kind decides how its result is read."""

    QUICK = "quick"  # `gpufleet health-check`: quick NVML checks; passes when it exits 0
    DCGM = "dcgm"  # `dcgmi diag -r {level}`; skipped where DCGM is not installed
    NCCL = "nccl"  # all_reduce_perf across the node's GPUs; passes at the bus bandwidth threshold
    SITE = "site"  # the site's own command (a short burn-in); passes when it exits 0


class Rung(BaseModel):
    """One rung of the ladder: a Job pinned to the node, run once, within ``timeout_seconds``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: RungKind
    image: str
    command: list[str]
    timeout_seconds: Finite = Field(default=600.0, gt=0, le=86400)
    # The rung's tool is not on the node when its command exits with this (a shell's "command not
    # found"): the rung is skipped, saying so. None: every failure is a failure.
    skip_exit_code: Whole | None = Field(default=None, ge=1, le=255)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _RUNG_NAME.match(name):
            raise ValueError(f"{name!r}: a rung's name is 1 to 16 of a-z, 0-9 and '-' (it names its Job)")
        return name

    @field_validator("image")
    @classmethod
    def _image(cls, image: str) -> str:
        if not image or any(c.isspace() for c in image):
            raise ValueError(f"{image!r}: an image reference, with no spaces")
        return image

    @field_validator("command")
    @classmethod
    def _argv(cls, command: list[str]) -> list[str]:
        if not command or not all(isinstance(part, str) and part for part in command):
            raise ValueError("a command is a non-empty list of non-empty strings (argv, no shell)")
        for part in command:
            unknown = set(_PLACEHOLDER.findall(part)) - _PLACEHOLDERS
            if unknown:
                known = ", ".join(sorted(_PLACEHOLDERS))
                raise ValueError(f"{part!r} names {', '.join(sorted(unknown))}: the placeholders are {known}")
        return command


def _default_rungs() -> list[Rung]:
    return [
        Rung(
            name="quick",
            kind=RungKind.QUICK,
            image="ghcr.io/gpufleet/gpufleet:latest",
            command=["gpufleet", "health-check"],
            timeout_seconds=120,
        ),
        Rung(
            name="dcgm",
            kind=RungKind.DCGM,
            image="nvcr.io/nvidia/cloud-native/dcgm:3.3.7-1-ubuntu22.04",
            # Not installed: exit 127, and the rung is skipped.
            command=["sh", "-c", 'command -v dcgmi >/dev/null || exit 127; exec dcgmi diag -r "$0"', "{level}"],
            timeout_seconds=1800,
            skip_exit_code=TOOL_MISSING_EXIT,
        ),
        Rung(
            name="nccl",
            kind=RungKind.NCCL,
            image="ghcr.io/coreweave/nccl-tests:12.4.1-cudnn-devel-ubuntu22.04-nccl2.21.5-1-85f9143",
            # nccl-tests' summary line ("# Avg bus bandwidth : 181.3") is the container's
            # termination message, which gpufleet reads.
            command=[
                "sh",
                "-c",
                'all_reduce_perf -b 256M -e 2G -f 2 -g "$0" > /tmp/nccl.log 2>&1; rc=$?; cat /tmp/nccl.log; '
                'grep "Avg bus bandwidth" /tmp/nccl.log > /dev/termination-log; exit $rc',
                "{gpus}",
            ],
            timeout_seconds=900,
        ),
    ]


class ValidationSettings(BaseModel):
    """The ladder (``validation:`` in the policy file). Off by default: its images must be
    reachable from the nodes, and its NCCL floor fit the fleet's GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    rungs: list[Rung] = Field(default_factory=_default_rungs)
    # `dcgmi diag -r LEVEL`: 1 quick (seconds), 2 medium (~2 min), 3 long (~15 min), 4 extended.
    dcgm_level: Whole = Field(default=2, ge=1, le=4)
    # The NCCL rung's threshold (bus bandwidth, GB/s) until gpufleet has ``nccl_own_passes`` passes
    # of its own for the node's type; from then on ``nccl_median_fraction`` of their median.
    nccl_floor_gbps: Finite = Field(default=100.0, gt=0, le=100000)
    nccl_own_passes: Whole = Field(default=5, ge=1, le=BASELINE_KEPT)
    nccl_median_fraction: Finite = Field(default=0.9, gt=0, le=1)
    # The node label that names a node's type (its passes are compared with those of its type).
    node_type_label: str = "nvidia.com/gpu.product"
    # The node label with its GPU count ({gpus}), else ``default_gpus``.
    gpu_count_label: str = "nvidia.com/gpu.count"
    default_gpus: Whole = Field(default=8, ge=1, le=1024)
    # A node that passed is on probation this long (label gpufleet.io/probation): an event in that
    # time replaces and quarantines it at once. 0: no probation.
    probation_seconds: Finite = Field(default=86400.0, ge=0, le=30 * 86400)

    @model_validator(mode="after")
    def _distinct(self) -> ValidationSettings:
        names = [rung.name for rung in self.rungs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"rungs: each rung needs a name of its own; {', '.join(twice)} named twice")
        if self.enabled and not self.rungs:
            raise ValueError("rungs: validation is enabled but has no rungs; add some or set enabled: false")
        return self


def node_type_key(node_type: str) -> str:
    """A node type as the baselines ConfigMap's key (``NVIDIA-H100-80GB-HBM3``)."""
    key = _KEY_CHAR.sub("-", node_type.strip())[:253].strip("-.")
    return key or DEFAULT_NODE_TYPE


class RungOutcome(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class RungRequest(BaseModel):
    """Run one rung on a node. ``request_id`` + ``attempt`` + the rung's name make its Job's
    name: a retry of the activity finds its own Job."""

    node: str
    request_id: str
    attempt: int = 1
    rung: Rung
    settings: ValidationSettings = Field(default_factory=ValidationSettings)
    namespace: str = "gpufleet"
    runtime_class: str | None = None


class RungResult(BaseModel):
    name: str
    kind: RungKind
    outcome: RungOutcome
    job: str = ""
    # NCCL: the bus bandwidth read (GB/s) and the threshold it was held to, and where that came from.
    figure: float | None = None
    threshold: float | None = None
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome is not RungOutcome.FAILED

    def line(self) -> str:
        """One line for a person: the rung, how it went, its figure."""
        figure = ""
        if self.figure is not None:
            figure = f" {self.figure:g} GB/s" + (
                f" (threshold {self.threshold:g})" if self.threshold is not None else ""
            )
        return f"{self.name}: {self.outcome}{figure}" + (f": {self.detail}" if self.detail else "")


class ValidationResult(BaseModel):
    """The ladder's outcome: passed (or skipped by a person), else which rung failed and why."""

    node: str
    passed: bool
    rungs: list[RungResult] = Field(default_factory=list)
    skipped_by: str = ""  # `--skip-validation`: who, and why
    skip_reason: str = ""
    probation_until: datetime | None = None
    # While it climbs: the rung running now ("" when none).
    running: str = ""

    @property
    def failed(self) -> RungResult | None:
        return next((rung for rung in self.rungs if rung.outcome is RungOutcome.FAILED), None)

    def summary(self) -> str:
        """What a person reads: which rung failed with what figure, or that every rung passed."""
        if self.skipped_by:
            return f"validation skipped by {self.skipped_by}: {self.skip_reason}"
        failed = self.failed
        if failed is not None:
            return f"{self.node} failed validation at rung {failed.line()}"
        if not self.rungs:
            return f"{self.node}: validation is disabled"
        return f"{self.node} passed validation: " + "; ".join(rung.line() for rung in self.rungs)


class ProbationRequest(BaseModel):
    """Put a node on probation until ``until`` (label and annotation), or, with ``until`` None,
    take it off (only a probation that still ends at ``ending``, so an old timer leaves a newer
    probation alone)."""

    node: str
    until: datetime | None = None
    ending: datetime | None = None
    why: str = ""


class ProbationInput(BaseModel):
    """The probation's end, as a durable timer (ProbationWorkflow)."""

    node: str
    until: datetime
