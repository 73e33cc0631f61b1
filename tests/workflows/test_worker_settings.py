"""The cluster's workers (its task queue's and its fleet guard's) take their sticky-queue timeout
from GPUFLEET_STICKY_TIMEOUT_SECONDS: 3 s unless set (a killed worker's incidents move on within
seconds), longer for a worker that holds many incidents at once (docs/performance.md); a value
that is no timeout is refused. Their workflow cache and sandbox come from the settings too."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio import workflow
from temporalio.api.common.v1 import Payloads
from temporalio.api.failure.v1 import Failure
from temporalio.converter import DataConverter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import WorkflowInstanceDetails
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from temporalio.worker.workflow_sandbox._runner import _fake_info

from models.constants import guard_task_queue, task_queue
from models.settings import Settings
from workers.main import (
    CLUSTER_WORKFLOWS,
    CREATION_WORKFLOWS,
    GUARD_WORKFLOWS,
    WORKFLOW_PACKAGE,
    cluster_worker,
    creation_worker,
    guard_worker,
    workflow_runner,
)
from workflows.remediation import NodeRemediationWorkflow

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


def sandboxed_class(runner: SandboxedWorkflowRunner) -> type:
    """The incident workflow's class as one run in the runner's sandbox sees it (the SDK makes a
    run's instance this way when it first validates a workflow, with stand-in run details)."""
    defn = workflow._Definition.must_from_class(NodeRemediationWorkflow)
    instance = runner.create_instance(
        WorkflowInstanceDetails(
            payload_converter_factory=DataConverter.default._new_payload_converter,
            failure_converter_class=DataConverter.default.failure_converter_class,
            interceptor_classes=[],
            defn=defn,
            info=_fake_info,
            randomness_seed=-1,
            extern_functions={},
            disable_eager_activity_execution=False,
            worker_level_failure_exception_types=[],
            patch_activation_callback=None,
            last_completion_result=Payloads(),
            last_failure=Failure(),
        )
    )
    return instance.globals_and_locals["__temporal_workflow_class"]  # type: ignore[attr-defined, no-any-return]


async def test_runs_share_the_workflow_code_unless_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUFLEET_WORKFLOW_SANDBOX: "shared" (the default) runs every incident on the workflow code
    the worker imported once; "isolated" gives each run its own import of it; anything else is
    refused."""
    monkeypatch.delenv("GPUFLEET_WORKFLOW_SANDBOX", raising=False)
    shared = workflow_runner(Settings())
    assert sandboxed_class(shared) is NodeRemediationWorkflow
    monkeypatch.setenv("GPUFLEET_WORKFLOW_SANDBOX", "isolated")
    isolated = workflow_runner(Settings())
    first, second = sandboxed_class(isolated), sandboxed_class(isolated)
    assert first is not NodeRemediationWorkflow and first is not second
    assert first.__qualname__ == NodeRemediationWorkflow.__qualname__
    monkeypatch.setenv("GPUFLEET_WORKFLOW_SANDBOX", "none")
    with pytest.raises(ValidationError, match="workflow_sandbox"):
        Settings()


async def test_each_worker_runs_its_workflows_in_the_sandbox_the_setting_names(
    env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's, the guard's and the cluster-creation worker all take the runner above."""

    async def shares(build: Any, settings: Settings) -> bool:
        with ThreadPoolExecutor(max_workers=1) as executor:
            async with build(env.client, settings, [], executor) as worker:
                runner = worker.config()["workflow_runner"]
                assert isinstance(runner, SandboxedWorkflowRunner)
                return WORKFLOW_PACKAGE in runner.restrictions.passthrough_modules

    monkeypatch.delenv("GPUFLEET_WORKFLOW_SANDBOX", raising=False)
    for build in (cluster_worker, guard_worker, creation_worker):
        assert await shares(build, Settings(cluster="sandbox-shared")), build.__name__
    monkeypatch.setenv("GPUFLEET_WORKFLOW_SANDBOX", "isolated")
    for build in (cluster_worker, guard_worker):  # another cluster's queues
        assert not await shares(build, Settings(cluster="sandbox-isolated")), build.__name__


@pytest.mark.parametrize(
    "cls", sorted({*CLUSTER_WORKFLOWS, *GUARD_WORKFLOWS, *CREATION_WORKFLOWS}, key=lambda c: c.__name__)
)
async def test_every_workflow_a_worker_runs_loads_in_the_isolated_sandbox(cls: type) -> None:
    """What a worker built with the isolated sandbox checks at its start, for every workflow the
    workers register, whatever the default: its module imports and its class is made inside the
    sandbox without touching anything the sandbox forbids."""
    SandboxedWorkflowRunner().prepare_workflow(workflow._Definition.must_from_class(cls))
