"""The cluster's worker takes its sticky-queue timeout from GPUFLEET_STICKY_TIMEOUT_SECONDS: 3 s
unless set (a killed worker's incidents move on within seconds), longer for a worker that holds
many incidents at once (README, the scale bench); a value that is no timeout is refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from pydantic import ValidationError
from temporalio.testing import WorkflowEnvironment

from models.settings import Settings
from workers.main import cluster_worker


async def sticky_timeout(env: WorkflowEnvironment, settings: Settings) -> timedelta | None:
    """The timeout the cluster's worker was built with (the worker run and shut down again)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        async with cluster_worker(env.client, settings, [], executor) as worker:
            return worker.config().get("sticky_queue_schedule_to_start_timeout")


async def test_the_sticky_timeout_is_three_seconds_unless_set(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUFLEET_STICKY_TIMEOUT_SECONDS", raising=False)
    assert await sticky_timeout(env, Settings(cluster="sticky-default")) == timedelta(seconds=3)
    monkeypatch.setenv("GPUFLEET_STICKY_TIMEOUT_SECONDS", "45")
    # Another cluster's queue: the client keeps one worker per task queue.
    assert await sticky_timeout(env, Settings(cluster="sticky-set")) == timedelta(seconds=45)


@pytest.mark.parametrize("value", ["0", "-1", "forever", "601"])
def test_a_sticky_timeout_that_is_no_timeout_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GPUFLEET_STICKY_TIMEOUT_SECONDS", value)
    with pytest.raises(ValidationError, match="sticky_timeout_seconds"):
        Settings()
