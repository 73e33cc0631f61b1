"""How many of a shared pool's nodes serve inference: a pure decision, from demand and limits.

Inference demand is a number of nodes: the load a PromQL query measures, divided by the load one
node carries (``per_node``). The split follows it within each side's minimum and maximum, with
two brakes against flapping:

- **hysteresis**: more nodes only when demand is above the current count by more than
  ``hysteresis`` nodes; fewer only down to the count that still leaves ``hysteresis`` to spare
  (or none, when there is no demand at all);
- **cooldown**: no move within ``cooldown_seconds`` of the last one.

Training's demand is the nodes its pending jobs ask for (from Slurm). Inference's demand comes
first; while training jobs wait, inference gives back the spare that hysteresis keeps (down to
the nodes its demand needs), and it never keeps more.

A move is at most ``batch`` nodes. Missing data (Prometheus down, an empty answer) holds the
split: nothing ever moves on a guess. A manual override replaces the measured demand until it
is cleared. Every node is in exactly one pool: the decision is a count of inference nodes
between 0 and the pool's size, never more or less.
"""

from __future__ import annotations

import math
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

# PromQL that measures an inference server's load, and the load one node carries. The load per
# node is the figure to tune for a given model and GPU; these are starting points.
PRESETS: dict[str, tuple[str, float]] = {
    # vLLM: requests being served or waiting, across every replica.
    "vllm": ("sum(vllm:num_requests_running) + sum(vllm:num_requests_waiting)", 32.0),
    # vLLM by KV-cache use: one node's worth is one full cache.
    "vllm-kv-cache": ("sum(vllm:kv_cache_usage_perc)", 1.0),
    # Text Generation Inference: the batch in flight plus its queue.
    "tgi": ("sum(tgi_batch_current_size) + sum(tgi_queue_size)", 32.0),
    # Triton: requests waiting to be scheduled.
    "triton": ("sum(nv_inference_pending_request_count)", 16.0),
}


class PoolLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_inference: int = Field(default=0, ge=0)
    max_inference: int | None = Field(default=None, ge=0)
    min_training: int = Field(default=0, ge=0)
    max_training: int | None = Field(default=None, ge=0)
    batch: int = Field(default=1, ge=1)
    hysteresis: float = Field(default=0.5, ge=0, le=10)
    cooldown_seconds: float = Field(default=300.0, ge=0, le=86400)

    @model_validator(mode="after")
    def _ordered(self) -> PoolLimits:
        if self.max_inference is not None and self.max_inference < self.min_inference:
            raise ValueError("max_inference is below min_inference")
        if self.max_training is not None and self.max_training < self.min_training:
            raise ValueError("max_training is below min_training")
        return self


class Demand(BaseModel):
    """What each side wants, in nodes (None: not known, and so no move)."""

    model_config = ConfigDict(allow_inf_nan=False)

    inference: float | None = None
    training: float | None = None
    training_jobs: int = 0  # the pending jobs behind ``training`` (nodes)
    training_gpus: int = 0  # and the GPUs they ask for
    source: str = ""  # where it came from: the query, or "override by ..."
    error: str = ""  # why a figure is missing


class Decision(BaseModel):
    inference: int  # nodes that should serve inference after this decision
    move: int  # + to inference, - to training, 0 to hold
    why: str


def bounds(total: int, limits: PoolLimits) -> tuple[int, int]:
    """The range the inference count may take: each side's minimum and maximum, within the pool.
    Where the limits cannot all hold (the pool is too small), inference's minimum wins."""
    low = max(limits.min_inference, total - (limits.max_training if limits.max_training is not None else total))
    high = min(
        limits.max_inference if limits.max_inference is not None else total,
        total - limits.min_training,
    )
    low = min(max(low, 0), total)
    high = max(min(high, total), low)
    return low, high


def decide(
    total: int,
    inference: int,
    demand: Demand,
    limits: PoolLimits,
    *,
    now: datetime,
    last_move: datetime | None = None,
) -> Decision:
    """The split to move towards now, from ``inference`` nodes of ``total`` serving inference."""
    low, high = bounds(total, limits)
    if not low <= inference <= high:  # out of bounds already (limits changed): back inside first
        goal = min(max(inference, low), high)
        step = max(-limits.batch, min(limits.batch, goal - inference))
        return Decision(inference=inference + step, move=step, why=f"limits: inference must be {low}-{high}")
    if demand.inference is None:
        return Decision(inference=inference, move=0, why=f"holding: no inference demand ({demand.error or 'no data'})")
    wanted = demand.inference
    pending = demand.training or 0.0  # nodes training's pending jobs ask for
    why_more = ""
    # Fewest nodes that serve the demand with ``hysteresis`` to spare (none for no demand at all).
    enough = 0 if wanted <= 0 else math.ceil(wanted + limits.hysteresis)
    if wanted > inference + limits.hysteresis or (inference == 0 and wanted > 0):
        # From none, any demand at all calls for a node: nothing serves it otherwise.
        goal = min(max(math.ceil(wanted - limits.hysteresis), 1), high)
    elif enough < inference:
        goal = max(enough, low)
    elif pending > 0 and (needed := 0 if wanted <= 0 else math.ceil(wanted)) < inference:
        # Training jobs wait for nodes: inference gives back the spare it keeps against flapping.
        goal = max(needed, low)
        why_more = f"; training waits for {pending:g} node(s)"
    else:
        waiting = f"; training waits for {pending:g} node(s)" if pending > 0 else ""
        return Decision(inference=inference, move=0, why=f"steady: demand {wanted:.2f} nodes for {inference}{waiting}")
    if goal == inference:
        side = "maximum" if goal == high and wanted > inference else "minimum"
        return Decision(inference=inference, move=0, why=f"at the {side}: demand {wanted:.2f} nodes, {inference} serve")
    # In float seconds: a timedelta would round the cooldown to microseconds, ending it early.
    if last_move is not None and (now - last_move).total_seconds() < limits.cooldown_seconds:
        left = limits.cooldown_seconds - (now - last_move).total_seconds()
        return Decision(inference=inference, move=0, why=f"cooling down ({left:.0f}s left): demand {wanted:.2f} nodes")
    step = max(-limits.batch, min(limits.batch, goal - inference))
    direction = "to inference" if step > 0 else "to training"
    return Decision(
        inference=inference + step,
        move=step,
        why=f"demand {wanted:.2f} nodes for {inference}: {abs(step)} {direction} (goal {goal}){why_more}",
    )


def inference_nodes(load: float, per_node: float) -> float:
    """Nodes that a measured load needs."""
    return max(load, 0.0) / per_node
