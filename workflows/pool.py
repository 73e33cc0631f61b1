"""PoolRebalanceWorkflow: one per shared pool (``pool-{name}``), for ever, continuing as new.

Every interval it looks at the pool (who serves training, who serves inference, who may not be
moved, and the demand), decides the split (models/rebalance.py) and moves nodes one at a time,
each move an activity that takes the node's lease, so that remediation and rebalancing never
hold one node at once. A node with an open incident or a lease is skipped. A person may
override the demand, pause the moves, or ask for N nodes to move now.
"""

from __future__ import annotations

import contextlib
import math
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from models.poolops import (
        ITERATIONS_PER_RUN,
        POOL_PAUSE_SIGNAL,
        POOL_RESUME_SIGNAL,
        POOL_WORKFLOW,
        REBALANCE_SIGNAL,
        SET_DEMAND_SIGNAL,
        Move,
        MoveRequest,
        MoveResult,
        PoolRequest,
        PoolState,
        PoolStatus,
        PoolView,
    )
    from models.rebalance import Decision, Demand, decide

KEEP_MOVES = 20
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=["InvalidInput", "NotFound", "Forbidden", "NotOwned"],
)


@workflow.defn(name=POOL_WORKFLOW)
class PoolRebalanceWorkflow:
    @workflow.init
    def __init__(self, state: PoolState) -> None:
        # Set before any signal is handled: a signal may come with the start itself.
        self._status: PoolStatus = PoolStatus(state=state)
        self._woken = False

    @workflow.run
    async def run(self, state: PoolState) -> None:
        every = timedelta(seconds=state.settings.interval_seconds)
        for _ in range(ITERATIONS_PER_RUN):
            # Cleared before the look, so a signal during a long move wakes the next one at once.
            self._woken = False
            await self._iteration()
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._woken, timeout=every)
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._status.state)

    @workflow.query
    def status(self) -> PoolStatus:
        return self._status

    @workflow.signal(name=SET_DEMAND_SIGNAL)
    def set_demand(self, nodes: float | None, by: str = "") -> None:
        """Inference wants this many nodes, whatever is measured (None: measure again). A value
        that is not a finite number of nodes, 0 or more, is ignored (and logged)."""
        if nodes is not None and not (math.isfinite(nodes) and nodes >= 0):
            workflow.logger.warning("set_demand ignored: %r is not a number of nodes", nodes)
            return
        self._status.state.override = nodes
        self._status.state.override_by = by if nodes is not None else ""
        self._woken = True

    @workflow.signal(name=POOL_PAUSE_SIGNAL)
    def pause(self) -> None:
        self._status.state.paused = True

    @workflow.signal(name=POOL_RESUME_SIGNAL)
    def resume(self) -> None:
        self._status.state.paused = False
        self._woken = True

    @workflow.signal(name=REBALANCE_SIGNAL)
    def rebalance(self, nodes: int) -> None:
        """Move ``nodes`` now (+ to inference, - to training), cooldown, hysteresis and pause
        aside. It is a one-off: once the cooldown after it ends, demand decides again (set an
        override with ``set_demand`` to keep a split)."""
        self._status.state.manual = nodes
        self._woken = True

    async def _iteration(self) -> None:
        status = self._status
        state = status.state
        try:
            view: PoolView = await workflow.execute_activity(
                "pool_observe",
                PoolRequest(settings=state.settings),
                result_type=PoolView,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RETRY,
                summary=f"look at pool {state.settings.name}",
            )
        except ActivityError as exc:
            view = PoolView(demand=Demand(error=f"could not look at the pool: {exc.cause or exc}"))
            status.view, status.observed_at = view, workflow.now()
            known = status.decision.inference if status.decision else 0
            status.decision = Decision(inference=known, move=0, why=f"holding: {view.demand.error}")
            return
        status.view, status.observed_at = view, workflow.now()
        if state.override is not None:
            view.demand = Demand(
                inference=state.override,
                training=view.demand.training,
                source=f"override by {state.override_by or '?'}",
            )
        total, inference = len(view.training) + len(view.inference), len(view.inference)
        if state.manual:
            wanted, state.manual = state.manual, 0
            decision = Decision(inference=inference + wanted, move=wanted, why=f"asked: {wanted:+d} node(s)")
        elif state.paused:
            decision = Decision(inference=inference, move=0, why="paused: no moves until `gpufleet pool resume`")
        else:
            decision = decide(
                total, inference, view.demand, state.settings.limits, now=workflow.now(), last_move=state.last_move
            )
        status.decision = decision
        if state.in_flight is not None and not await self._settle(state.in_flight):
            status.decision = Decision(
                inference=inference,
                move=0,
                why=f"holding: {state.in_flight.node} is between pools after a failed move; a person must look",
            )
            return
        if decision.move:
            await self._move(view, decision.move)

    async def _settle(self, move: Move) -> bool:
        """A move that failed halfway: finish it, else roll it back. True once the node is in
        one pool again."""
        state = self._status.state
        back = "training" if move.to == "inference" else "inference"
        for to, what in ((move.to, "finished"), (back, "rolled back")):
            outcome = await self._one(move.node, to)
            if outcome.startswith("skipped"):
                # Someone else holds the node now (an incident took it over): it is theirs to
                # finish, and this workflow lets it be.
                what, outcome = "left", outcome.removeprefix("skipped: ")
            self._record(Move(node=move.node, to=to, at=workflow.now(), outcome=f"{what}: {outcome}"))
            if what == "left" or outcome == "moved":
                state.in_flight = None
                return True
        return False

    def _record(self, move: Move) -> None:
        """Keep the move (numbered) among the latest."""
        state = self._status.state
        state.seq += 1
        state.moves = [*state.moves, move.model_copy(update={"seq": state.seq})][-KEEP_MOVES:]

    async def _one(self, node: str, to: str) -> str:
        """One move by the activity: moved | skipped: why | failed: why."""
        state = self._status.state
        try:
            result: MoveResult = await workflow.execute_activity(
                "pool_move_node",
                MoveRequest(settings=state.settings, node=node, to=to, workflow_id=workflow.info().workflow_id),
                result_type=MoveResult,
                start_to_close_timeout=timedelta(hours=2),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=RETRY,
                summary=f"move {node} to {to}",
            )
        except ActivityError as exc:
            return f"failed: {exc.cause or exc}"
        return "moved" if result.moved else f"skipped: {result.detail}"

    async def _move(self, view: PoolView, count: int) -> None:
        """Move ``|count|`` nodes, one at a time, in the order the view gives: from training,
        idle nodes first (then by name); from inference, in reverse name order. A move that
        fails stops the batch and stays in flight until settled."""
        status = self._status
        state = status.state
        to = "inference" if count > 0 else "training"
        source = view.training if count > 0 else view.inference
        candidates = [node for node in source if node not in view.busy]
        for node in candidates[: abs(count)]:
            started = workflow.now()
            # Recorded before it starts: a move that fails halfway is settled before anything else.
            state.in_flight = Move(node=node, to=to, at=started)
            outcome = await self._one(node, to)
            seconds = (workflow.now() - started).total_seconds()
            self._record(Move(node=node, to=to, at=started, outcome=outcome, seconds=seconds))
            if outcome.startswith("failed"):
                return  # the node may be between pools: the next look settles it first
            state.in_flight = None  # moved, or skipped before anything changed
            if outcome == "moved":
                state.last_move = workflow.now()
        for node in source[: abs(count)]:
            if node in view.busy:
                outcome = f"skipped: {view.busy[node]}"
                last = next((m for m in reversed(state.moves) if m.node == node), None)
                if last is None or last.outcome != outcome:  # said once, not at every look
                    self._record(Move(node=node, to=to, at=workflow.now(), outcome=outcome))
