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
from temporalio.exceptions import ActivityError

from workflows.patches import INPUTS_CHECKED
from workflows.retries import POOL_LOOK, POOL_MOVE, POOL_MOVE_HEARTBEAT, POOL_RETRY

with workflow.unsafe.imports_passed_through():
    from models.names import safe_mark_part
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
        Stopped,
    )
    from models.rebalance import Decision, Demand, bounds, decide
    from models.trust import move_problem

KEEP_MOVES = 20
MAX_BACKOFF_SECONDS = 6 * 3600.0  # the longest a budget's refusal leaves a node be


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
            self._describe()
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._woken, timeout=every)
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._status.state)

    def _describe(self) -> None:
        """What the Temporal UI shows for the pool: the split, the decision, the last move."""
        status = self._status
        view, state = status.view, status.state
        split = f"training {len(view.training)}, inference {len(view.inference)}" if view else "not looked yet"
        last = state.moves[-1] if state.moves else None
        moved = f"; last move #{last.seq}: {last.node} to {last.to}, {last.outcome}" if last else ""
        waiting = f"; handed over: {', '.join(m.node for m in state.handed_over)}" if state.handed_over else ""
        why = status.decision.why if status.decision else "-"
        workflow.set_current_details(f"{split}; {why}{moved}{waiting}")

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
        override with ``set_demand`` to keep a split). A size that is not a whole number of
        nodes, is 0 or exceeds the pool (models/trust.py) is ignored, logged and noted."""
        view = self._status.view
        known = view is not None and view.demand.error == ""
        problem = move_problem(nodes, total=len(view.training) + len(view.inference) if view and known else None)
        if problem and workflow.patched(INPUTS_CHECKED):  # before the patch: cut to the limits
            self._refuse(problem)
            return
        self._status.state.manual = nodes
        self._woken = True

    def _refuse(self, problem: str) -> None:
        """An asked move that fails the checks: logged and noted in the status, nothing else changed."""
        workflow.logger.warning("rebalance ignored: %s", problem)
        state = self._status.state
        state.refused = [*state.refused, f"{workflow.now():%Y-%m-%d %H:%M:%S} rebalance ignored: {problem}"][
            -KEEP_MOVES:
        ]

    async def _iteration(self) -> None:
        status = self._status
        state = status.state
        try:
            view: PoolView = await workflow.execute_activity(
                "pool_observe",
                PoolRequest(settings=state.settings),
                result_type=PoolView,
                start_to_close_timeout=POOL_LOOK,
                retry_policy=POOL_RETRY,
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
        now = workflow.now()
        state.kept = {node: until for node, until in state.kept.items() if until > now}
        if state.in_flight is not None:
            if not await self._settle(state.in_flight):
                status.decision = Decision(
                    inference=inference,
                    move=0,
                    why=f"holding: {state.in_flight.node} is between pools after a failed move; a person must look",
                )
                return
            self._woken = True  # the look predates the settle: look again before deciding
            return
        if state.handed_over and await self._settle_handed_over():
            self._woken = True
            return
        problem = move_problem(state.manual, total=total) if state.manual else None
        if problem and workflow.patched(INPUTS_CHECKED):
            state.manual = 0  # asked before the look that shows the pool is smaller
            self._refuse(problem)
            decision = Decision(inference=inference, move=0, why=f"refused: {problem}")
        elif state.manual:
            asked, state.manual = state.manual, 0
            low, high = bounds(total, state.settings.limits)
            # As many as asked, in the direction asked, as far as the limits allow.
            wanted = max(0, min(asked, high - inference)) if asked > 0 else min(0, max(asked, low - inference))
            limited = "" if wanted == asked else f"; the limits (inference {low}-{high}) allow {wanted:+d}"
            decision = Decision(inference=inference + wanted, move=wanted, why=f"asked: {asked:+d} node(s){limited}")
        elif state.paused:
            decision = Decision(inference=inference, move=0, why="paused: no moves until `gpufleet pool resume`")
        else:
            decision = decide(
                total, inference, view.demand, state.settings.limits, now=workflow.now(), last_move=state.last_move
            )
        status.decision = decision
        if decision.move:
            await self._move(view, decision.move)

    async def _settle(self, move: Move) -> bool:
        """A move that failed halfway: finish it, else roll it back. True once the node is in
        one pool again (or someone else holds it now: an incident finishes it, and the node is
        settled once it lets go)."""
        state = self._status.state
        back = "training" if move.to == "inference" else "inference"
        for to, what in ((move.to, "finished"), (back, "rolled back")):
            result = await self._one(move.node, to, move_id=self._move_id(move))
            if result.stopped in (Stopped.HELD, Stopped.HANDED_OVER):
                self._record(Move(node=move.node, to=to, at=workflow.now(), outcome=f"handed over: {result.detail}"))
                self._hand_over(move)
                state.in_flight = None
                return True
            if result.stopped is Stopped.OUT_OF_POOL:
                self._record(Move(node=move.node, to=to, at=workflow.now(), outcome=f"left: {result.detail}"))
                state.in_flight = None
                return True
            self._record(Move(node=move.node, to=to, at=workflow.now(), outcome=f"{what}: {self._outcome(result)}"))
            if result.stopped is Stopped.BUDGET:  # undone: the node serves inference on
                self._keep(move.node)
            if result.moved:
                self._forget_refusals(move.node)
            if result.moved or result.stopped is Stopped.BUDGET:
                state.in_flight = None
                return True
        return False

    def _forget_refusals(self, node: str) -> None:
        """The node moved (or settled): its budget's refusals in a row start again from none."""
        state = self._status.state
        state.refusals = {n: c for n, c in state.refusals.items() if n != node}

    def _move_id(self, move: Move) -> str:
        """The move's ID, the same on its every retry and settle: the pool, the node, its start."""
        return safe_mark_part(f"{workflow.info().workflow_id}:{move.node}:{int(move.at.timestamp())}")

    def _hand_over(self, move: Move) -> None:
        state = self._status.state
        if all(m.node != move.node for m in state.handed_over):
            state.handed_over = [*state.handed_over, move]

    def _keep(self, node: str) -> None:
        """A budget kept the node serving inference: leave it be for a while, twice as long at
        each refusal in a row (up to six hours), rather than cordon it again at every look."""
        state = self._status.state
        refusals = state.refusals.get(node, 0) + 1
        base = max(state.settings.limits.cooldown_seconds, 5 * state.settings.interval_seconds)
        backoff = min(base * 2 ** min(refusals - 1, 20), MAX_BACKOFF_SECONDS)
        state.refusals = {**state.refusals, node: refusals}
        state.kept = {**state.kept, node: workflow.now() + timedelta(seconds=backoff)}

    async def _settle_handed_over(self) -> bool:
        """Nodes an incident took over mid-move, once it has let go: each goes into one pool at
        the least cost (clients/poolmoves.py, ``settle``). True when one changed (or left)."""
        state = self._status.state
        changed = False
        for move in list(state.handed_over):
            result = await self._one(move.node, move.to, settle=True, move_id=self._move_id(move))
            if result.moved or result.stopped in (Stopped.OUT_OF_POOL, Stopped.BUDGET):
                state.handed_over = [m for m in state.handed_over if m.node != move.node]
                what = "left" if result.stopped is Stopped.OUT_OF_POOL else "settled"
                self._record(Move(node=move.node, to=move.to, at=workflow.now(), outcome=f"{what}: {result.detail}"))
                if result.stopped is Stopped.BUDGET:
                    self._keep(move.node)
                else:
                    self._forget_refusals(move.node)
                changed = True
            else:
                self._say_once(Move(node=move.node, to=move.to, at=workflow.now(), outcome=f"waiting: {result.detail}"))
        return changed

    def _record(self, move: Move) -> None:
        """Keep the move (numbered) among the latest."""
        state = self._status.state
        state.seq += 1
        state.moves = [*state.moves, move.model_copy(update={"seq": state.seq})][-KEEP_MOVES:]

    def _say_once(self, move: Move) -> None:
        """Record a move's outcome unless it is what was said last about that node."""
        last = next((m for m in reversed(self._status.state.moves) if m.node == move.node), None)
        if last is None or last.outcome != move.outcome:
            self._record(move)

    @staticmethod
    def _outcome(result: MoveResult) -> str:
        """A move's outcome in words: moved | skipped: why | kept: why | handed over: why | failed: why."""
        if result.moved:
            return "moved"
        if result.stopped is Stopped.BUDGET:
            return f"kept: {result.detail}"
        if result.stopped is Stopped.HANDED_OVER:
            return f"handed over: {result.detail}"
        if result.stopped is Stopped.FAILED:
            return f"failed: {result.detail}"
        return f"skipped: {result.detail}"

    async def _one(self, node: str, to: str, *, settle: bool = False, move_id: str = "") -> MoveResult:
        """One move (or one settle) by the activity; a failure comes back as Stopped.FAILED."""
        state = self._status.state
        request = MoveRequest(
            settings=state.settings,
            node=node,
            to=to,
            workflow_id=workflow.info().workflow_id,
            settle=settle,
            move_id=move_id,
        )
        try:
            result: MoveResult = await workflow.execute_activity(
                "pool_move_node",
                request,
                result_type=MoveResult,
                start_to_close_timeout=POOL_MOVE,
                heartbeat_timeout=POOL_MOVE_HEARTBEAT,
                retry_policy=POOL_RETRY,
                summary=f"{'settle' if settle else 'move'} {node} to {to}",
            )
        except ActivityError as exc:
            return MoveResult(moved=False, detail=str(exc.cause or exc), stopped=Stopped.FAILED)
        if not result.moved and result.stopped is None:
            # From a worker older than ``stopped``: it said so only for a node it left untouched.
            result.stopped = Stopped.HELD
        return result

    async def _move(self, view: PoolView, count: int) -> None:
        """Move ``|count|`` nodes, one at a time, in the order the view gives (from training,
        the node that loses least first; from inference, the last to come first), leaving out
        the nodes that may not move now. A move that fails stops the batch and stays in flight
        until settled; one an incident takes over is settled once the incident lets go."""
        state = self._status.state
        to = "inference" if count > 0 else "training"
        source = view.training if count > 0 else view.inference
        waiting = {m.node for m in state.handed_over}
        busy = {
            **view.busy,
            **{node: f"its budget kept it serving until {until:%H:%M:%S}" for node, until in state.kept.items()},
            **{node: "handed over to an incident mid-move; settled once it lets go" for node in waiting},
        }
        candidates = [node for node in source if node not in busy]
        for node in candidates[: abs(count)]:
            started = workflow.now()
            # Recorded before it starts: a move that fails halfway is settled before anything else.
            state.in_flight = Move(node=node, to=to, at=started)
            result = await self._one(node, to, move_id=self._move_id(state.in_flight))
            seconds = (workflow.now() - started).total_seconds()
            self._record(Move(node=node, to=to, at=started, outcome=self._outcome(result), seconds=seconds))
            if result.stopped is Stopped.FAILED:
                return  # the node may be between pools: the next look settles it first
            state.in_flight = None
            if result.stopped is Stopped.HANDED_OVER:
                self._hand_over(Move(node=node, to=to, at=started))
            elif result.stopped is Stopped.BUDGET:
                self._keep(node)
            elif result.moved:
                state.last_move = workflow.now()
                self._forget_refusals(node)
        for node in source[: abs(count)]:
            if node in busy:
                self._say_once(Move(node=node, to=to, at=workflow.now(), outcome=f"skipped: {busy[node]}"))
