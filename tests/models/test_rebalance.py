"""The pool split as a pure decision, checked as properties: every node in exactly one pool,
within the limits; no move on missing data, in a cooldown, or inside the hysteresis band; at most
a batch per move; and with steady demand the split settles and stays (no flapping)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from models.rebalance import Demand, PoolLimits, bounds, decide, inference_nodes

NOW = datetime(2026, 12, 3, tzinfo=UTC)


@st.composite
def pools(draw: st.DrawFn) -> tuple[int, PoolLimits]:
    total = draw(st.integers(0, 40))
    min_inference = draw(st.integers(0, total))
    min_training = draw(st.integers(0, total))
    max_inference = draw(st.none() | st.integers(min_inference, total + 5))
    max_training = draw(st.none() | st.integers(min_training, total + 5))
    limits = PoolLimits(
        min_inference=min_inference,
        max_inference=max_inference,
        min_training=min_training,
        max_training=max_training,
        batch=draw(st.integers(1, 5)),
        hysteresis=draw(st.floats(0, 2)),
        cooldown_seconds=draw(st.just(0.0) | st.floats(1, 600)),
    )
    return total, limits


demands = st.none() | st.floats(0, 60, allow_nan=False)


@given(pools(), st.data(), demands)
def test_every_node_stays_in_exactly_one_pool_within_the_limits(
    pool: tuple[int, PoolLimits], data: st.DataObject, wanted: float | None
) -> None:
    total, limits = pool
    inference = data.draw(st.integers(0, total))
    decision = decide(total, inference, Demand(inference=wanted), limits, now=NOW)
    assert 0 <= decision.inference <= total  # the rest are training's: never both, never neither
    assert decision.inference == inference + decision.move and abs(decision.move) <= limits.batch
    low, high = bounds(total, limits)
    if low <= inference <= high:
        assert low <= decision.inference <= high
    else:  # out of bounds (the limits changed): each move goes back towards them
        assert abs(decision.inference - min(max(inference, low), high)) < abs(
            inference - min(max(inference, low), high)
        )


@given(pools(), st.data())
def test_missing_data_never_moves_a_node(pool: tuple[int, PoolLimits], data: st.DataObject) -> None:
    total, limits = pool
    low, high = bounds(total, limits)
    inference = data.draw(st.integers(low, high))
    decision = decide(total, inference, Demand(inference=None, error="Prometheus unreachable"), limits, now=NOW)
    assert decision.move == 0 and "Prometheus unreachable" in decision.why


@given(pools(), st.data(), st.floats(0, 60, allow_nan=False))
def test_no_move_within_the_cooldown(pool: tuple[int, PoolLimits], data: st.DataObject, wanted: float) -> None:
    total, limits = pool
    low, high = bounds(total, limits)
    inference = data.draw(st.integers(low, high))
    since = data.draw(st.floats(0, limits.cooldown_seconds, exclude_max=True)) if limits.cooldown_seconds else None
    if since is None:
        return
    last_move = NOW - timedelta(seconds=since)
    # A timedelta holds whole microseconds: a draw just under the cooldown may round up to it.
    assume((NOW - last_move).total_seconds() < limits.cooldown_seconds)
    decision = decide(total, inference, Demand(inference=wanted), limits, now=NOW, last_move=last_move)
    assert decision.move == 0


@given(pools(), st.data(), st.floats(0, 60, allow_nan=False))
def test_steady_demand_settles_and_stays(pool: tuple[int, PoolLimits], data: st.DataObject, wanted: float) -> None:
    total, limits = pool
    low, high = bounds(total, limits)
    inference = data.draw(st.integers(low, high))
    directions = set()
    for _ in range(total + 2):  # each move is at least one node towards the goal
        decision = decide(total, inference, Demand(inference=wanted), limits, now=NOW)
        if decision.move:
            directions.add(decision.move > 0)
        inference = decision.inference
    assert len(directions) <= 1  # never back and forth
    assert decide(total, inference, Demand(inference=wanted), limits, now=NOW).move == 0


@pytest.mark.parametrize(
    ("inference", "wanted", "move"),
    [
        (2, 2.5, 0),  # inside the band: c-1-h < d <= c+h
        (2, 0.6, 0),
        (2, 2.6, 1),  # above it: one more
        (2, 0.5, -1),  # one node still leaves h to spare: one fewer
        (2, 0.0, -2),  # no demand at all: none
        (2, 9.0, 2),  # a batch at most
    ],
)
def test_the_hysteresis_band(inference: int, wanted: float, move: int) -> None:
    limits = PoolLimits(hysteresis=0.5, batch=2)
    assert decide(8, inference, Demand(inference=wanted), limits, now=NOW).move == move


def test_load_becomes_nodes() -> None:
    assert inference_nodes(96, 32) == 3 and inference_nodes(-1, 32) == 0


def test_limits_that_contradict_each_other_are_refused() -> None:
    with pytest.raises(ValueError, match="max_inference is below min_inference"):
        PoolLimits(min_inference=3, max_inference=2)


def test_from_none_any_demand_calls_for_a_node() -> None:
    # Nothing serves inference, so its own metrics cannot grow past the hysteresis: any load moves one.
    assert decide(4, 0, Demand(inference=0.2), PoolLimits(hysteresis=0.5), now=NOW).move == 1
    assert decide(4, 0, Demand(inference=0.0), PoolLimits(hysteresis=0.5), now=NOW).move == 0


def test_a_demand_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError):
        Demand(inference=float("nan"))


@given(pools(), st.data(), st.floats(0, 60, allow_nan=False), st.floats(0.5, 40, allow_nan=False))
def test_waiting_training_jobs_take_back_only_inferences_spare(
    pool: tuple[int, PoolLimits], data: st.DataObject, wanted: float, pending: float
) -> None:
    total, limits = pool
    low, high = bounds(total, limits)
    inference = data.draw(st.integers(low, high))
    alone = decide(total, inference, Demand(inference=wanted), limits, now=NOW)
    both = decide(total, inference, Demand(inference=wanted, training=pending), limits, now=NOW)
    # Training waiting never gives inference more, and never takes from it what its demand needs.
    assert both.inference <= alone.inference
    needed = 0 if wanted <= 0 else math.ceil(wanted)
    assert both.inference >= min(inference, max(needed, low))


def test_waiting_training_jobs_take_the_spare_that_hysteresis_keeps() -> None:
    limits = PoolLimits(hysteresis=0.5, cooldown_seconds=0)
    # 3 nodes serve a demand of 1.8: enough with the spare (ceil(1.8 + 0.5) = 3), so it holds...
    assert decide(6, 3, Demand(inference=1.8), limits, now=NOW).move == 0
    # ...until training jobs wait for nodes: the spare goes back, down to what the demand needs.
    decision = decide(6, 3, Demand(inference=1.8, training=2), limits, now=NOW)
    assert decision.move == -1 and "training waits for 2 node(s)" in decision.why
    # What the demand needs stays: 2 nodes for 1.8.
    assert decide(6, 2, Demand(inference=1.8, training=2), limits, now=NOW).move == 0
