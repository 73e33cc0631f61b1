"""The time-skipping test server, one per test module."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment


@pytest.fixture(scope="module")
async def env(temporal_test_server: str) -> AsyncIterator[WorkflowEnvironment]:
    environment = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=temporal_test_server,
        # The SDK waits 5 s by default for the server to start: too little on a loaded machine.
        test_server_startup_timeout=timedelta(seconds=60),
    )
    yield environment
    await environment.shutdown()
