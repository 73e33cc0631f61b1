"""Pool rebalancing on the time-skipping server, its look at the pool and its moves stood in for:
demand up moves nodes to inference one at a time, demand down brings them back; Prometheus down
moves nothing; a node with an open incident is skipped; an override moves on it, pause holds;
a run continues as new with its state."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.poolops import (
    ITERATIONS_PER_RUN,
    MoveRequest,
    MoveResult,
    PoolRequest,
    PoolSettings,
    PoolState,
    PoolStatus,
    PoolView,
    Stopped,
)
from models.rebalance import Demand, PoolLimits
from workflows.pool import PoolRebalanceWorkflow

INTERVAL = 60.0


@dataclass
class Pool:
    training: list[str] = field(default_factory=lambda: ["gpu1", "gpu2", "gpu3", "gpu4"])
    inference: list[str] = field(default_factory=list)
    demand: float | None = 0.0  # nodes inference wants; None: Prometheus down
    busy: dict[str, str] = field(default_factory=dict)
    moves: list[tuple[str, str]] = field(default_factory=list)
    fail: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, to): failures before it works
    taken: dict[str, str] = field(default_factory=dict)  # node: the incident that took it over
    # node: the incident that takes it over when its move breaks halfway (an Xid mid-move)
    taken_when_broken: dict[str, str] = field(default_factory=dict)
    # node: the incident that takes it over once its move has changed it (the move stops there)
    taken_mid_move: dict[str, str] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)  # nodes whose budget refuses their move to training
    retired: set[str] = field(default_factory=set)  # nodes an incident retired (out of the pool)
    settles: list[str] = field(default_factory=list)
    move_ids: list[tuple[str, str]] = field(default_factory=list)  # (node, move_id) of every request
    not_found: set[str] = field(default_factory=set)  # nodes Slurm does not know (a NotFound mid-move)
    looks: int = 0
    task_queue: str = field(default_factory=lambda: f"pool-{uuid.uuid4().hex[:8]}")

    def activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name="pool_observe")
        async def observe(request: PoolRequest) -> PoolView:
            self.looks += 1
            demand = (
                Demand(inference=self.demand, source="test")
                if self.demand is not None
                else Demand(error="Prometheus at http://prometheus:9090 unreachable")
            )
            return PoolView(
                training=list(self.training),
                inference=sorted(self.inference, reverse=True),  # as the real look orders them
                busy=dict(self.busy),
                demand=demand,
            )

        @activity.defn(name="pool_move_node")
        async def move(request: MoveRequest) -> MoveResult:
            self.move_ids.append((request.node, request.move_id))
            if request.settle:
                return settle(request)
            self.moves.append((request.node, request.to))
            if request.node in self.not_found:
                raise ApplicationError(f"Slurm has no node named {request.node!r}", type="NotFound", non_retryable=True)
            if request.node in self.taken:
                return MoveResult(
                    moved=False, detail=f"{request.node} is held by {self.taken[request.node]}", stopped=Stopped.HELD
                )
            if request.node in self.kept and request.to == "training":
                return MoveResult(moved=False, detail=f"{request.node} stays in inference", stopped=Stopped.BUDGET)
            if request.node in self.taken_mid_move:
                # Out of the partition, not yet labelled: the incident holds it from here.
                self.taken[request.node] = self.taken_mid_move.pop(request.node)
                self.training.remove(request.node)
                return MoveResult(
                    moved=False,
                    detail=f"{request.node} was taken over by {self.taken[request.node]}",
                    stopped=Stopped.HANDED_OVER,
                )
            if self.fail.get((request.node, request.to), 0) > 0:
                self.fail[(request.node, request.to)] -= 1
                if request.node in self.taken_when_broken:
                    self.taken[request.node] = self.taken_when_broken[request.node]
                # Halfway: out of the partition, not yet labelled (neither pool, as a crash leaves it).
                if request.node in self.training:
                    self.training.remove(request.node)
                raise ApplicationError(f"{request.node}: broke halfway", type="StepFailed", non_retryable=True)
            if request.node not in self.training and request.node not in self.inference:
                # From halfway (in neither pool): the move finishes, or rolls back, into its target.
                (self.inference if request.to == "inference" else self.training).append(request.node)
                return MoveResult(moved=True, detail=f"{request.node} serves {request.to}")
            source, target = (
                (self.training, self.inference) if request.to == "inference" else (self.inference, self.training)
            )
            source.remove(request.node)
            target.append(request.node)
            return MoveResult(moved=True, detail=f"{request.node} serves {request.to}")

        def settle(request: MoveRequest) -> MoveResult:
            self.settles.append(request.node)
            if request.node in self.retired:
                return MoveResult(moved=False, detail=f"{request.node} is retired", stopped=Stopped.OUT_OF_POOL)
            if request.node in self.taken:
                return MoveResult(
                    moved=False, detail=f"{request.node} is held by {self.taken[request.node]}", stopped=Stopped.HELD
                )
            for name, side in (("training", self.training), ("inference", self.inference)):
                if request.node in side:
                    return MoveResult(moved=True, detail=f"{request.node} is wholly in {name} already")
            (self.inference if request.to == "inference" else self.training).append(request.node)
            return MoveResult(moved=True, detail=f"{request.node} serves {request.to}")

        return [observe, move]


def state(pool: Pool, **limits: Any) -> PoolState:
    settings = PoolSettings(
        name="shared",
        cluster="lab",
        partition="train",
        limits=PoolLimits(**{"cooldown_seconds": 0, **limits}),
        interval_seconds=INTERVAL,
    )
    return PoolState(settings=settings)


async def start(env: WorkflowEnvironment, pool: Pool, **limits: Any) -> WorkflowHandle[Any, Any]:
    return await env.client.start_workflow(
        PoolRebalanceWorkflow.run,
        state(pool, **limits),
        id=f"pool-shared-{uuid.uuid4().hex[:6]}",
        task_queue=pool.task_queue,
    )


async def intervals(env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any], count: int) -> PoolStatus:
    """Let ``count`` intervals pass on the server's clock; the status after them."""
    for _ in range(count):
        await env.sleep(timedelta(seconds=INTERVAL + 1))
    status: PoolStatus = await handle.query(PoolRebalanceWorkflow.status)
    return status


def worker(env: WorkflowEnvironment, pool: Pool) -> Worker:
    return Worker(
        env.client, task_queue=pool.task_queue, workflows=[PoolRebalanceWorkflow], activities=pool.activities()
    )


async def test_demand_up_moves_nodes_to_inference_one_at_a_time_and_down_brings_them_back(
    env: WorkflowEnvironment,
) -> None:
    pool = Pool(demand=2.0)
    async with worker(env, pool):
        handle = await start(env, pool, hysteresis=0.5)
        status = await intervals(env, handle, 3)
        assert pool.moves == [("gpu1", "inference"), ("gpu2", "inference")]  # idle first, one at a time
        assert status.decision is not None and status.decision.move == 0  # settled at 2
        pool.demand = 0.0
        status = await intervals(env, handle, 3)
        # What the Temporal UI shows for the pool.
        metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
        await handle.terminate("test over")
    assert metadata.current_details.startswith("training 4, inference 0; steady"), metadata.current_details
    assert "last move #4: gpu1 to training, moved" in metadata.current_details
    assert pool.moves[2:] == [("gpu2", "training"), ("gpu1", "training")]  # the last to come leaves first
    assert sorted(pool.training) == ["gpu1", "gpu2", "gpu3", "gpu4"] and not pool.inference
    assert [m.outcome for m in status.state.moves] == ["moved"] * 4


async def test_prometheus_down_moves_nothing_and_says_so(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=None)
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 3)
        await handle.terminate("test over")
    assert pool.looks >= 3 and pool.moves == []
    assert status.decision is not None and "holding" in status.decision.why and "unreachable" in status.decision.why


async def test_a_node_with_an_open_incident_is_skipped(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=1.0, busy={"gpu1": "open incident remediate-lab-gpu1"})
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert pool.moves == [("gpu2", "inference")]
    assert "gpu1" in pool.training
    assert any(
        m.node == "gpu1" and m.outcome == "skipped: open incident remediate-lab-gpu1" for m in status.state.moves
    )


async def test_an_override_moves_without_data_and_pause_holds(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=None)
    async with worker(env, pool):
        handle = await start(env, pool)
        await handle.signal(PoolRebalanceWorkflow.pause)
        await handle.signal(PoolRebalanceWorkflow.set_demand, args=[1.0, "ops"])
        status = await intervals(env, handle, 2)
        assert pool.moves == [] and status.decision is not None and "paused" in status.decision.why
        await handle.signal(PoolRebalanceWorkflow.resume)
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert pool.moves == [("gpu1", "inference")]
    assert status.view is not None and status.view.demand.source == "override by ops"


async def test_asked_moves_go_now_cooldown_or_not(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=0.0)
    async with worker(env, pool):
        handle = await start(env, pool, batch=1)
        await handle.signal(PoolRebalanceWorkflow.rebalance, 2)
        status = await intervals(env, handle, 1)
        await handle.terminate("test over")
    assert pool.moves[:2] == [("gpu1", "inference"), ("gpu2", "inference")]
    assert status.state.manual == 0


async def test_an_override_that_is_not_a_number_is_ignored(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=None)
    async with worker(env, pool):
        handle = await start(env, pool)
        await handle.signal(PoolRebalanceWorkflow.set_demand, args=[float("inf"), "ops"])
        await handle.signal(PoolRebalanceWorkflow.set_demand, args=[-1.0, "ops"])
        status = await intervals(env, handle, 1)  # the workflow still answers: nothing jammed it
        await handle.terminate("test over")
    assert status.state.override is None and pool.moves == []


async def test_a_move_that_fails_halfway_is_finished_before_anything_else(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=2.0, fail={("gpu1", "inference"): 1})
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 3)
        await handle.terminate("test over")
    assert pool.moves[:2] == [("gpu1", "inference"), ("gpu1", "inference")]  # failed, then finished
    assert status.state.in_flight is None and sorted(pool.inference) == ["gpu1", "gpu2"]
    assert [m.outcome.split(":")[0] for m in status.state.moves][:2] == ["failed", "finished"]


async def test_a_move_that_cannot_be_finished_is_rolled_back_and_one_that_cannot_be_either_holds(
    env: WorkflowEnvironment,
) -> None:
    pool = Pool(demand=1.0, fail={("gpu1", "inference"): 2})
    async with worker(env, pool):
        handle = await start(env, pool, cooldown_seconds=3600)
        status = await intervals(env, handle, 2)
        assert pool.moves[:3] == [("gpu1", "inference"), ("gpu1", "inference"), ("gpu1", "training")]
        assert status.state.in_flight is None and "gpu1" in pool.training  # one pool again: training
        await handle.terminate("test over")
    stuck = Pool(demand=1.0, fail={("gpu1", "inference"): 10, ("gpu1", "training"): 10})
    async with worker(env, stuck):
        handle = await start(env, stuck)
        status = await intervals(env, handle, 3)
        await handle.terminate("test over")
    assert status.state.in_flight is not None and status.state.in_flight.node == "gpu1"
    assert status.decision is not None and "between pools" in status.decision.why
    assert all(node == "gpu1" for node, _ in stuck.moves)  # no other node moved meanwhile


async def test_a_node_an_incident_took_over_halfway_is_settled_once_it_lets_go(env: WorkflowEnvironment) -> None:
    # Its GPU fails mid-move: the move breaks halfway and the incident holds the node.
    pool = Pool(demand=2.0, fail={("gpu1", "inference"): 1}, taken_when_broken={"gpu1": "remediate-lab-gpu1"})
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 3)
        assert pool.moves[:2] == [("gpu1", "inference"), ("gpu1", "inference")]  # failed, then found taken
        outcomes = [m.outcome for m in status.state.moves]
        assert outcomes[1] == "handed over: gpu1 is held by remediate-lab-gpu1"
        assert status.state.in_flight is None  # not holding the pool: the next moves go on
        assert sorted(pool.inference) == ["gpu2", "gpu3"]
        assert [m.node for m in status.state.handed_over] == ["gpu1"]  # in neither pool: not forgotten
        del pool.taken["gpu1"]  # the incident repaired it in place and let go
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert "gpu1" in pool.inference and not status.state.handed_over  # the move finished: one pool
    assert any(m.node == "gpu1" and m.outcome == "settled: gpu1 serves inference" for m in status.state.moves)


async def test_a_move_an_incident_stops_midway_waits_for_it_then_settles_or_lets_go(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=1.0, taken_mid_move={"gpu1": "remediate-lab-gpu1", "gpu2": "remediate-lab-gpu2"})
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 4)
        # Both were taken mid-move, and wait; gpu3 went instead, and the pool holds at one.
        assert {m.node for m in status.state.handed_over} == {"gpu1", "gpu2"}
        assert pool.inference == ["gpu3"] and "gpu1" not in pool.training
        waits = [m for m in status.state.moves if m.outcome.startswith("waiting")]
        assert len([m for m in waits if m.node == "gpu1"]) == 1  # said once, not at every look
        pool.retired.add("gpu2")  # its incident retired it: out of the pool, nothing to settle
        pool.taken.clear()
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert not status.state.handed_over
    assert "gpu1" in pool.inference  # its move finished
    outcomes = {m.node: m.outcome for m in status.state.moves}
    assert outcomes["gpu2"] == "left: gpu2 is retired"


async def test_a_budget_that_keeps_a_node_serving_is_left_be_longer_at_each_refusal(
    env: WorkflowEnvironment,
) -> None:
    pool = Pool(training=["gpu1"], inference=["inf1"], demand=0.0, kept={"inf1"})
    async with worker(env, pool):
        handle = await start(env, pool, cooldown_seconds=0)
        status = await intervals(env, handle, 3)
        # Tried once, then left be for five looks rather than cordoned again at every one.
        assert pool.moves == [("inf1", "training")] and set(status.state.kept) == {"inf1"}
        status = await intervals(env, handle, 8)
        # Tried again once the five looks had passed, refused again: left be twice as long.
        assert pool.moves == [("inf1", "training")] * 2 and status.state.refusals == {"inf1": 2}
        status = await intervals(env, handle, 6)
        await handle.terminate("test over")
    # The third try came ten looks after the second, and the next is twenty looks after it.
    tries = [m.at for m in status.state.moves if m.node == "inf1" and m.outcome.startswith("kept")]
    assert len(tries) == len(pool.moves) == 3 and status.state.refusals == {"inf1": 3}
    assert round((tries[2] - tries[1]).total_seconds() / INTERVAL) == 10
    assert round((status.state.kept["inf1"] - tries[2]).total_seconds() / INTERVAL) == 20
    assert pool.inference == ["inf1"]


async def test_an_asked_move_goes_only_the_way_asked(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=None)
    async with worker(env, pool):
        # Paused, and inference below its minimum: asked for training, nothing goes to inference.
        handle = await start(env, pool, min_inference=1)
        await handle.signal(PoolRebalanceWorkflow.pause)
        await handle.signal(PoolRebalanceWorkflow.rebalance, -1)
        status = await intervals(env, handle, 1)
        await handle.terminate("test over")
    assert pool.moves == []
    assert status.decision is not None and "paused" in status.decision.why


async def test_an_asked_move_stays_within_the_limits_and_says_so(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=None)  # nothing measured: only the asked move moves anything
    async with worker(env, pool):
        handle = await start(env, pool, max_inference=1)
        await handle.signal(PoolRebalanceWorkflow.rebalance, 3)
        await intervals(env, handle, 1)
        await handle.signal(PoolRebalanceWorkflow.rebalance, -4)
        await intervals(env, handle, 1)
        await handle.terminate("test over")
    # +3 asked, the maximum of one allows +1; then -4 asked, all of one allowed back.
    assert pool.moves == [("gpu1", "inference"), ("gpu1", "training")]


async def test_a_signal_sent_with_the_start_is_kept(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=2.0)
    async with worker(env, pool):
        handle = await env.client.start_workflow(
            PoolRebalanceWorkflow.run,
            state(pool),
            id=f"pool-shared-{uuid.uuid4().hex[:6]}",
            task_queue=pool.task_queue,
            start_signal="pause",
        )
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert status.state.paused and pool.moves == []


async def test_a_run_continues_as_new_with_its_state(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=None)
    async with worker(env, pool):
        handle = await start(env, pool)
        first_run = (await handle.describe()).run_id
        await handle.signal(PoolRebalanceWorkflow.set_demand, args=[1.0, "ops"])
        status = await intervals(env, handle, ITERATIONS_PER_RUN + 2)
        later_run = (await env.client.get_workflow_handle(handle.id).describe()).run_id
        await env.client.get_workflow_handle(handle.id).terminate("test over")
    assert later_run != first_run  # continued as new
    assert status.state.override == 1.0 and status.state.override_by == "ops"  # carried over
    assert pool.moves == [("gpu1", "inference")]  # and not redone


async def test_moves_are_numbered_and_a_busy_node_is_said_once(env: WorkflowEnvironment) -> None:
    pool = Pool(demand=2.0, busy={"gpu1": "open incident remediate-lab-gpu1"})
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 4)
        await handle.terminate("test over")
    numbers = [m.seq for m in status.state.moves]
    assert numbers == list(range(1, len(numbers) + 1)) and status.state.seq == numbers[-1]
    skipped = [m for m in status.state.moves if m.node == "gpu1"]
    assert len(skipped) == 1  # said once, not one line per look


async def test_a_move_failing_on_something_not_found_stays_in_flight_with_one_move_id(env: WorkflowEnvironment) -> None:
    # Kubernetes has the node, Slurm does not: the move fails, it did not leave the pool.
    pool = Pool(demand=1.0, not_found={"gpu1"})
    async with worker(env, pool):
        handle = await start(env, pool)
        status = await intervals(env, handle, 2)
        await handle.terminate("test over")
    assert status.state.in_flight is not None and status.state.in_flight.node == "gpu1"
    assert status.decision is not None and "between pools" in status.decision.why
    assert [m.outcome.split(":")[0] for m in status.state.moves][:3] == ["failed", "finished", "rolled back"]
    # The move, its finishing and its rolling back all carry the one ID its jobs' marks use.
    ids = {move_id for node, move_id in pool.move_ids if node == "gpu1"}
    assert len(ids) == 1 and next(iter(ids)).endswith(f":gpu1:{int(status.state.in_flight.at.timestamp())}")
