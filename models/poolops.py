"""Pool rebalancing as Temporal sees it: what the workflow carries, observes, and reports."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from models.rebalance import Decision, Demand, PoolLimits

POOL_WORKFLOW = "PoolRebalance"
SET_DEMAND_SIGNAL = "set_demand"
POOL_PAUSE_SIGNAL = "pause"
POOL_RESUME_SIGNAL = "resume"
REBALANCE_SIGNAL = "rebalance"
# Iterations per run before continuing as new (each is a handful of events).
ITERATIONS_PER_RUN = 200


def pool_workflow_id(name: str) -> str:
    return f"pool-{name}"


class PoolSettings(BaseModel):
    name: str
    cluster: str
    partition: str
    limits: PoolLimits = Field(default_factory=PoolLimits)
    query: str = ""  # PromQL measuring inference load ('' : demand from the override only)
    per_node: float = Field(default=32.0, gt=0)  # the load one inference node carries
    interval_seconds: float = Field(default=30.0, gt=0, le=3600)
    # How long a move to inference waits for the node's running jobs before it checkpoints
    # (SIGTERM, the grace) and requeues them.
    drain_deadline_seconds: float = Field(default=600.0, ge=0, le=86400)
    # How long a move to training waits for its evictions (PodDisruptionBudgets) before it is
    # undone and the node serves inference on.
    eviction_deadline_seconds: float = Field(default=600.0, ge=0, le=86400)


class Move(BaseModel):
    seq: int = 0  # its number in the pool's life (1, 2, ...): `rebalance --wait` follows these
    node: str
    to: str  # inference | training
    at: datetime
    outcome: str = ""  # moved | skipped: ... | failed: ...
    seconds: float | None = None


class PoolState(BaseModel):
    """What a run hands the next (continue-as-new) and what `pool status` shows."""

    settings: PoolSettings
    override: float | None = None  # nodes inference wants, set by a person; None: measured
    override_by: str = ""
    paused: bool = False
    last_move: datetime | None = None
    moves: list[Move] = Field(default_factory=list)  # the latest, newest last
    seq: int = 0  # the last move's number
    manual: int = 0  # nodes a person asked to move now (+ to inference, - to training)
    in_flight: Move | None = None  # a move started and not known to have ended in one pool
    # Moves an incident took over halfway: each node is settled into one pool once it is free.
    handed_over: list[Move] = Field(default_factory=list)
    # Nodes whose PodDisruptionBudget kept them serving inference, and until when they are left be.
    kept: dict[str, datetime] = Field(default_factory=dict)
    refusals: dict[str, int] = Field(default_factory=dict)  # budget refusals in a row, per node
    # Requests the workflow ignored (models/trust.py), the latest, newest last: when and why.
    refused: list[str] = Field(default_factory=list)


class PoolView(BaseModel):
    """One look at the pool: who is where, who must not be moved, and the demand."""

    training: list[str] = Field(default_factory=list)
    inference: list[str] = Field(default_factory=list)
    busy: dict[str, str] = Field(default_factory=dict)  # node: why it may not move now
    demand: Demand = Field(default_factory=Demand)


class PoolStatus(BaseModel):
    state: PoolState
    view: PoolView | None = None
    decision: Decision | None = None
    observed_at: datetime | None = None


class PoolRequest(BaseModel):
    settings: PoolSettings


class MoveRequest(BaseModel):
    settings: PoolSettings
    node: str
    to: str  # inference | training
    workflow_id: str
    # A node an incident took over mid-move, now free: leave it if it is wholly in one pool,
    # else finish the move.
    settle: bool = False
    # The move's ID, the same on every retry and settle of it: the marks its jobs carry in Slurm.
    move_id: str = ""


class Stopped(StrEnum):
    """Why a move did not end with the node in its new pool."""

    HELD = "held"  # someone else holds or drained the node: nothing was changed
    HANDED_OVER = "handed-over"  # an incident took it over after the move had changed it
    BUDGET = "budget"  # a PodDisruptionBudget kept it serving inference: the move was undone
    OUT_OF_POOL = "out-of-pool"  # it left the shared pool (retired, gone): nothing left to do
    FAILED = "failed"  # the move failed (after its retries): the node may be between pools


class MoveResult(BaseModel):
    moved: bool
    detail: str = ""
    stopped: Stopped | None = None  # set when not moved
