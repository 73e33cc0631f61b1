"""ReturnNodeWorkflow: a repaired node comes back, as a spare or for training, with its history."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities.errors import NON_RETRYABLE
    from activities.spares import SpareActivities
    from models.constants import RETURN_NODE_WORKFLOW
    from models.requests import ReturnNodeRequest


@workflow.defn(name=RETURN_NODE_WORKFLOW)
class ReturnNodeWorkflow:
    @workflow.run
    async def run(self, request: ReturnNodeRequest) -> str:
        await workflow.execute_activity_method(
            SpareActivities.return_node,
            request,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(
                maximum_interval=timedelta(seconds=10),
                maximum_attempts=10,
                non_retryable_error_types=list(NON_RETRYABLE),
            ),
            summary=f"return {request.node} as {request.as_}",
        )
        return f"{request.node} returned as {request.as_}"
