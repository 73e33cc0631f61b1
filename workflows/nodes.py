"""Operator workflows on nodes: return a repaired node, list and release quarantined ones.

Each is a short workflow (so the CLI reaches Kubernetes and Slurm only through the worker of
the cluster) and tells the cluster's fleet guard what happened to the node.
"""

from __future__ import annotations

from temporalio import workflow

from workflows.retries import NODES_RETRY, NODES_STEP

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.spares import SpareActivities
    from models.constants import (
        GUARD_FORGIVE_SIGNAL,
        GUARD_RETURNED_SIGNAL,
        QUARANTINED_NODES_WORKFLOW,
        RELEASE_NODE_WORKFLOW,
        RETURN_NODE_WORKFLOW,
    )
    from models.guard import GuardCommand
    from models.requests import QuarantinedNode, ReleaseNodeRequest, ReturnNodeRequest


async def _tell_guard(signal: str, command: GuardCommand) -> None:
    await workflow.execute_activity_method(
        GuardActivities.tell,
        args=[signal, command],
        start_to_close_timeout=NODES_STEP,
        retry_policy=NODES_RETRY,
        summary=f"tell the fleet guard: {signal} {command.node}",
    )


@workflow.defn(name=RETURN_NODE_WORKFLOW)
class ReturnNodeWorkflow:
    @workflow.run
    async def run(self, request: ReturnNodeRequest) -> str:
        await workflow.execute_activity_method(
            SpareActivities.return_node,
            request,
            start_to_close_timeout=NODES_STEP,
            retry_policy=NODES_RETRY,
            summary=f"return {request.node} as {request.as_}",
        )
        # Its cooldown starts now: failing again soon makes it a lemon.
        await _tell_guard(GUARD_RETURNED_SIGNAL, GuardCommand(node=request.node))
        return f"{request.node} returned as {request.as_}"


@workflow.defn(name=QUARANTINED_NODES_WORKFLOW)
class QuarantinedNodesWorkflow:
    @workflow.run
    async def run(self) -> list[QuarantinedNode]:
        nodes: list[QuarantinedNode] = await workflow.execute_activity_method(
            SpareActivities.quarantined_nodes,
            start_to_close_timeout=NODES_STEP,
            retry_policy=NODES_RETRY,
            summary="list quarantined nodes",
        )
        return nodes


@workflow.defn(name=RELEASE_NODE_WORKFLOW)
class ReleaseNodeWorkflow:
    @workflow.run
    async def run(self, request: ReleaseNodeRequest) -> str:
        released: bool = await workflow.execute_activity_method(
            SpareActivities.release_quarantine,
            request.node,
            start_to_close_timeout=NODES_STEP,
            retry_policy=NODES_RETRY,
            summary=f"release {request.node} from quarantine",
        )
        if not released:
            return f"{request.node} is not quarantined; nothing to release"
        await _tell_guard(GUARD_FORGIVE_SIGNAL, GuardCommand(node=request.node, by=request.by, reason=request.reason))
        return f"{request.node} released from quarantine; `gpufleet nodes return {request.node}` brings it back"
