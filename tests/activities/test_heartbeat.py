"""A synchronous activity that blocks (a slow Slurm call) still heartbeats, through the thread
beside it: with a heartbeat timeout shorter than the call it completes, without it it times out.
That heartbeat is what lets a killed worker's activity be retried within seconds."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.heartbeat import heartbeating
from tests.conftest import start_dev_server

BLOCK_SECONDS = 4.0


@activity.defn(name="blocks_heartbeating")
@heartbeating
def blocks_heartbeating(seconds: float) -> str:
    time.sleep(seconds)  # one blocking call, no heartbeat of its own
    return "done"


@activity.defn(name="blocks_silently")
def blocks_silently(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


@workflow.defn(sandboxed=False)
class BlockingWorkflow:
    @workflow.run
    async def run(self, name: str) -> str:
        result: str = await workflow.execute_activity(
            name,
            BLOCK_SECONDS,
            start_to_close_timeout=timedelta(seconds=30),
            heartbeat_timeout=timedelta(seconds=2),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        return result


@pytest.fixture(scope="module")
async def env(temporal_cli: str) -> AsyncIterator[WorkflowEnvironment]:
    environment = await start_dev_server(temporal_cli)
    yield environment
    await environment.shutdown()


async def run(env: WorkflowEnvironment, name: str) -> str:
    queue = f"heartbeat-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(max_workers=4) as executor:
        async with Worker(
            env.client,
            task_queue=queue,
            workflows=[BlockingWorkflow],
            activities=[blocks_heartbeating, blocks_silently],
            activity_executor=executor,
        ):
            result: str = await env.client.execute_workflow(BlockingWorkflow.run, name, id=queue, task_queue=queue)
            return result


async def test_a_blocking_activity_keeps_heartbeating(env: WorkflowEnvironment) -> None:
    assert await run(env, "blocks_heartbeating") == "done"


async def test_without_the_heartbeat_thread_it_times_out(env: WorkflowEnvironment) -> None:
    with pytest.raises(WorkflowFailureError) as failure:
        await run(env, "blocks_silently")
    cause = failure.value.cause
    assert isinstance(cause, ActivityError)
    assert isinstance(cause.cause, TimeoutError) and cause.cause.type == TimeoutType.HEARTBEAT
