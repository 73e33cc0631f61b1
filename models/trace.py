"""A failure trace: what failed, where and when, in a form a team can keep and replay
(docs/goodput.md#the-trace-format).

`gpufleet report --export-trace FILE` writes one from the incidents Temporal still keeps;
`gpufleet whatif --trace FILE` runs one through gpufleet's own workflows under other policies and
spare counts; `gpufleet whatif --synthetic NAME` builds one from published figures. Failures
gpufleet cannot see (a software bug, a network switch) are kept with no event: they still stop
the job, and the what-if counts them under their cause.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.names import validate_node_name
from models.xid import GpuEventKind

TRACE_FORMAT = "gpufleet-trace/1"


class TraceEvent(BaseModel):
    """The event gpufleet's detector would report for a failure."""

    model_config = ConfigDict(extra="forbid")

    kind: GpuEventKind = GpuEventKind.XID
    xid: int | None = Field(default=None, ge=0, le=65535)


class TraceFailure(BaseModel):
    """One failure of the trace."""

    model_config = ConfigDict(extra="forbid")

    # Seconds since the trace's start.
    at: float = Field(ge=0)
    # The node that failed; None: the simulator picks one of the fleet's training nodes.
    node: str | None = None
    # What failed, in a word ("gpu_faulty", "gpu_hbm", "software", "network_switch").
    cause: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")
    # What gpufleet would see of it; None: nothing (software, network): no incident opens.
    event: TraceEvent | None = None
    # Whether the failure ended the job running on the node (a crash), or left it running.
    kills_job: bool = True

    @model_validator(mode="after")
    def _node_is_safe(self) -> TraceFailure:
        if self.node is not None:
            validate_node_name(self.node)
        return self


class Trace(BaseModel):
    """A fleet's failures over a span of time."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["gpufleet-trace/1"] = "gpufleet-trace/1"
    # Where it comes from: "report <namespace> <cluster>", "synthetic llama3 (seed 1)", ...
    source: str = ""
    # The wall-clock time of second 0, where known.
    start: datetime | None = None
    # The span it covers, in seconds.
    seconds: float = Field(gt=0)
    # The fleet it was seen on (None: unknown; the what-if's fleet then comes from its options).
    nodes: int | None = Field(default=None, ge=1)
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    failures: list[TraceFailure] = Field(default_factory=list)

    @model_validator(mode="after")
    def _in_order_and_in_span(self) -> Trace:
        for before, after in zip(self.failures, self.failures[1:], strict=False):
            if after.at < before.at:
                raise ValueError(f"failures must be in order of time: {after.at} comes after {before.at}")
        for failure in self.failures:
            if failure.at > self.seconds:
                raise ValueError(f"a failure at {failure.at} s is past the trace's end ({self.seconds} s)")
        return self
