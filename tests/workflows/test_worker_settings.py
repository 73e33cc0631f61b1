"""The cluster's workers (its task queue's and its fleet guard's) take their sticky-queue timeout
from GPUFLEET_STICKY_TIMEOUT_SECONDS: 3 s unless set (a killed worker's incidents move on within
seconds), longer for a worker that holds many incidents at once (README, the scale bench); a value
that is no timeout is refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from pydantic import ValidationError
from temporalio.testing import WorkflowEnvironment

from models.constants import guard_task_queue, task_queue
from models.settings import Settings
from workers.main import cluster_worker, guard_worker

BUILDERS = {"cluster": (cluster_worker, task_queue), "guard": (guard_worker, guard_task_queue)}


async def built(env: WorkflowEnvironment, settings: Settings, which: str) -> tuple[str, timedelta | None]:
    """The task queue and sticky timeout the worker was built with (run and shut down again)."""
    build, _ = BUILDERS[which]
    with ThreadPoolExecutor(max_workers=1) as executor:
        async with build(env.client, settings, [], executor) as worker:
            config = worker.config()
            return config["task_queue"], config.get("sticky_queue_schedule_to_start_timeout")


@pytest.mark.parametrize("which", sorted(BUILDERS))
async def test_the_sticky_timeout_is_three_seconds_unless_set(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    _, queue = BUILDERS[which]
    monkeypatch.delenv("GPUFLEET_STICKY_TIMEOUT_SECONDS", raising=False)
    default = Settings(cluster=f"sticky-default-{which}")
    assert await built(env, default, which) == (queue(default.cluster), timedelta(seconds=3))
    monkeypatch.setenv("GPUFLEET_STICKY_TIMEOUT_SECONDS", "45")
    # Another cluster's queue: the client keeps one worker per task queue.
    longer = Settings(cluster=f"sticky-set-{which}")
    assert await built(env, longer, which) == (queue(longer.cluster), timedelta(seconds=45))


@pytest.mark.parametrize("value", ["0", "-1", "forever", "601"])
def test_a_sticky_timeout_that_is_no_timeout_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GPUFLEET_STICKY_TIMEOUT_SECONDS", value)
    with pytest.raises(ValidationError, match="sticky_timeout_seconds"):
        Settings()


async def test_the_workflow_cache_is_the_sdks_unless_set(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPUFLEET_MAX_CACHED_WORKFLOWS: how many incidents the cluster's worker keeps in memory."""

    async def cache(settings: Settings) -> int:
        with ThreadPoolExecutor(max_workers=1) as executor:
            async with cluster_worker(env.client, settings, [], executor) as worker:
                return int(worker.config()["max_cached_workflows"])

    monkeypatch.delenv("GPUFLEET_MAX_CACHED_WORKFLOWS", raising=False)
    assert await cache(Settings(cluster="cache-default")) == 1000
    monkeypatch.setenv("GPUFLEET_MAX_CACHED_WORKFLOWS", "300")
    assert await cache(Settings(cluster="cache-set")) == 300
    monkeypatch.setenv("GPUFLEET_MAX_CACHED_WORKFLOWS", "-5")
    with pytest.raises(ValidationError, match="max_cached_workflows"):
        Settings()
