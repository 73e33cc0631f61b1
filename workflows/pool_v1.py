"""How PoolRebalanceWorkflow decided and moved before hand-overs were settled (patch
``pool-settle``): kept for the runs that started before it, which must replay as they ran.
Once none is left (a pool continues as new every 200 looks), this module goes, with the patch.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from models.poolops import Move, MoveRequest, MoveResult, PoolStatus, PoolView
    from models.rebalance import Decision, decide


class PoolV1:
    """The old path, mixed into PoolRebalanceWorkflow: ``_status`` and ``_record`` are its."""

    _status: PoolStatus
    _RETRY: RetryPolicy

    def _record(self, move: Move) -> None:
        raise NotImplementedError

    async def _v1_decide_and_move(self, view: PoolView, total: int, inference: int) -> None:
        status = self._status
        state = status.state
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
        if state.in_flight is not None and not await self._v1_settle(state.in_flight):
            status.decision = Decision(
                inference=inference,
                move=0,
                why=f"holding: {state.in_flight.node} is between pools after a failed move; a person must look",
            )
            return
        if decision.move:
            await self._v1_move(view, decision.move)

    async def _v1_settle(self, move: Move) -> bool:
        state = self._status.state
        back = "training" if move.to == "inference" else "inference"
        for to, what in ((move.to, "finished"), (back, "rolled back")):
            outcome = await self._v1_one(move.node, to)
            if outcome.startswith("skipped"):
                what, outcome = "left", outcome.removeprefix("skipped: ")
            self._record(Move(node=move.node, to=to, at=workflow.now(), outcome=f"{what}: {outcome}"))
            if what == "left" or outcome == "moved":
                state.in_flight = None
                return True
        return False

    async def _v1_one(self, node: str, to: str) -> str:
        state = self._status.state
        try:
            result: MoveResult = await workflow.execute_activity(
                "pool_move_node",
                MoveRequest(settings=state.settings, node=node, to=to, workflow_id=workflow.info().workflow_id),
                result_type=MoveResult,
                start_to_close_timeout=timedelta(hours=2),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=self._RETRY,
                summary=f"move {node} to {to}",
            )
        except ActivityError as exc:
            return f"failed: {exc.cause or exc}"
        return "moved" if result.moved else f"skipped: {result.detail}"

    async def _v1_move(self, view: PoolView, count: int) -> None:
        state = self._status.state
        to = "inference" if count > 0 else "training"
        source = view.training if count > 0 else view.inference
        candidates = [node for node in source if node not in view.busy]
        for node in candidates[: abs(count)]:
            started = workflow.now()
            state.in_flight = Move(node=node, to=to, at=started)
            outcome = await self._v1_one(node, to)
            seconds = (workflow.now() - started).total_seconds()
            self._record(Move(node=node, to=to, at=started, outcome=outcome, seconds=seconds))
            if outcome.startswith("failed"):
                return
            state.in_flight = None
            if outcome == "moved":
                state.last_move = workflow.now()
        for node in source[: abs(count)]:
            if node in view.busy:
                outcome = f"skipped: {view.busy[node]}"
                last = next((m for m in reversed(state.moves) if m.node == node), None)
                if last is None or last.outcome != outcome:
                    self._record(Move(node=node, to=to, at=workflow.now(), outcome=outcome))
