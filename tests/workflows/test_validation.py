"""The validation ladder on the time-skipping server, with stand-in activities: after a repair in
place (a pass puts the node on probation, a failed rung replaces it and counts toward its
quarantine), before `gpufleet nodes return` (a failure keeps the node out and names the rung
and its figure; `--skip-validation` is recorded), and an event on a node on probation (replaced
and quarantined at once)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.constants import QUARANTINE_PROBATION, probation_workflow_id, task_queue
from models.guard import GuardStatus
from models.incident import Outcome, Step
from models.policy import Action, DrainAfterJobsSettings, RepairSettings
from models.requests import NodeFacts, ReturnNodeRequest
from models.validation import (
    ProbationInput,
    ProbationRequest,
    Rung,
    RungKind,
    RungOutcome,
    RungRequest,
    RungResult,
    ValidationResult,
    ValidationSettings,
)
from tests.workflows.test_guard import guard, guarded, running
from tests.workflows.test_remediation import Fleet, start
from workflows.guard import FleetGuardWorkflow
from workflows.nodes import ProbationWorkflow, ReturnNodeWorkflow

LADDER = ValidationSettings(
    enabled=True,
    rungs=[
        Rung(name="quick", kind=RungKind.QUICK, image="x", command=["check"]),
        Rung(name="dcgm", kind=RungKind.DCGM, image="x", command=["dcgmi", "diag", "-r", "{level}"]),
        Rung(name="nccl", kind=RungKind.NCCL, image="x", command=["all_reduce_perf", "-g", "{gpus}"]),
    ],
    nccl_floor_gbps=100,
)


class Ladder:
    """Stand-in rungs: each passes unless named in ``fails``; dcgm is skipped (no dcgmi); NCCL
    reports ``busbw``. Records rungs run and probation set or ended."""

    def __init__(self, fleet: Fleet, *, fails: set[str] | None = None, busbw: float = 180.0) -> None:
        self.fleet, self.fails, self.busbw = fleet, fails or set(), busbw
        self.ran: list[RungRequest] = []
        self.probation: list[ProbationRequest] = []
        self.skips: list[str] = []
        self.returned: list[ReturnNodeRequest] = []
        self.probation_until: datetime | None = None

    def activities(self) -> list[Any]:
        ladder = self

        @activity.defn(name="validation_rung")
        async def run_rung(request: RungRequest) -> RungResult:
            ladder.ran.append(request)
            rung = request.rung
            result = RungResult(name=rung.name, kind=rung.kind, outcome=RungOutcome.PASSED, job=f"job-{rung.name}")
            if rung.kind is RungKind.DCGM:
                return result.model_copy(update={"outcome": RungOutcome.SKIPPED, "detail": "its tool is not there"})
            if rung.kind is RungKind.NCCL:
                ok = ladder.busbw >= request.settings.nccl_floor_gbps
                return result.model_copy(
                    update={
                        "figure": ladder.busbw,
                        "threshold": request.settings.nccl_floor_gbps,
                        "outcome": RungOutcome.PASSED if ok else RungOutcome.FAILED,
                    }
                )
            if rung.name in ladder.fails:
                return result.model_copy(update={"outcome": RungOutcome.FAILED, "detail": "exit status 1"})
            return result

        @activity.defn(name="set_probation")
        async def set_probation(request: ProbationRequest) -> bool:
            ladder.probation.append(request)
            return True

        @activity.defn(name="record_skipped_validation")
        async def record_skipped(request: ProbationRequest) -> None:
            ladder.skips.append(request.why)

        @activity.defn(name="kube_node_facts")
        async def node_facts(node: str) -> NodeFacts:
            return NodeFacts(pool=ladder.fleet.pool or "", probation_until=ladder.probation_until)

        @activity.defn(name="return_node")
        async def return_node(request: ReturnNodeRequest) -> None:
            ladder.returned.append(request)

        mine = [run_rung, set_probation, record_skipped, node_facts, return_node]
        names = {activity._Definition.must_from_callable(fn).name for fn in mine}
        kept = [fn for fn in self.fleet.activities() if activity._Definition.must_from_callable(fn).name not in names]
        return [*kept, *mine]


@contextlib.asynccontextmanager
async def climbing(
    env: WorkflowEnvironment, ladder: Ladder, *workers: Worker, activities: list[Any] | None = None
) -> AsyncIterator[None]:
    """The fleet's workers with the ladder's stand-ins (and ``workers``); after them, the
    probation timers the test began are ended. One left behind on the module's server would, once
    its clock got there, hold a workflow task no worker polls any more, and the test server keeps
    its clock from skipping while one is outstanding: every later wait would take real time."""
    fleet = ladder.fleet
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running(env, fleet, activities=activities or ladder.activities()))
            for extra in workers:
                await stack.enter_async_context(extra)
            yield
    finally:
        for put in ladder.probation:
            if put.until is not None:
                timer = env.client.get_workflow_handle(probation_workflow_id(fleet.cluster, put.node, put.until))
                with contextlib.suppress(RPCError):
                    await timer.terminate("test over")


def ladder_fleet(**ladder: Any) -> tuple[Fleet, Ladder]:
    fleet = guarded()
    fleet.policy = fleet.policy.model_copy(
        update={"repair": RepairSettings(settle_seconds=1), "validation": LADDER.model_copy(update=ladder)}
    )
    return fleet, Ladder(fleet)


async def test_a_repair_that_holds_is_validated_and_the_node_goes_on_probation(env: WorkflowEnvironment) -> None:
    fleet, ladder = ladder_fleet()
    async with climbing(env, ladder):
        status = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.RESET_GPU
    assert [r.rung.name for r in ladder.ran] == ["quick", "dcgm", "nccl"]
    assert {r.request_id for r in ladder.ran} == {status.incident_id}
    [validated] = [e for e in status.timeline if e.step == Step.VALIDATE and e.event == "finished"]
    assert "gpu1 passed validation" in validated.detail and "dcgm: skipped" in validated.detail
    assert "nccl: passed 180 GB/s (threshold 100)" in validated.detail and "on probation until" in validated.detail
    [put] = ladder.probation
    assert put.node == "gpu1" and put.until is not None
    assert fleet.resumed_nodes == ["gpu1"]


async def test_a_repair_whose_validation_fails_replaces_the_node_and_counts(env: WorkflowEnvironment) -> None:
    fleet, ladder = ladder_fleet()
    ladder.busbw = 40.0  # under the floor
    async with climbing(env, ladder):
        status = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE and status.spare == "spare1"
    assert fleet.resumed_nodes == [] and ladder.probation == []
    [escalated] = [e.detail for e in status.timeline if e.event == "escalated"]
    assert "failed validation at rung nccl: failed 40 GB/s (threshold 100)" in escalated
    [counted] = [e.detail for e in state.state.log if e.event == "validation failed"]
    assert counted.startswith("gpu1: nccl: failed 40 GB/s")
    assert len(state.state.nodes["gpu1"].incidents) == 2  # the incident and its failed validation


async def test_an_event_on_a_node_on_probation_replaces_and_quarantines_it(env: WorkflowEnvironment) -> None:
    fleet, ladder = ladder_fleet()
    ladder.probation_until = datetime.now(UTC) + timedelta(days=365)
    async with climbing(env, ladder):
        status = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
    assert status.action == Action.REPLACE_NODE and status.spare == "spare1"
    assert fleet.repairs == [] and ladder.ran == []  # no reset tried
    assert fleet.quarantined == {"gpu1": QUARANTINE_PROBATION}
    assert "failed again while on probation" in status.quarantine


async def test_an_expired_probation_changes_nothing(env: WorkflowEnvironment) -> None:
    fleet, ladder = ladder_fleet()
    ladder.probation_until = datetime(2000, 1, 1, tzinfo=UTC)
    async with climbing(env, ladder):
        status = await (await start(env.client, fleet, node="gpu1", xid=48)).result()
    assert status.action == Action.RESET_GPU and fleet.quarantined == {}


async def return_node(env: WorkflowEnvironment, fleet: Fleet, ladder: Ladder, **request: Any) -> Any:
    nodes = Worker(
        env.client,
        task_queue=f"{task_queue(fleet.cluster)}.nodes",
        workflows=[ReturnNodeWorkflow, ProbationWorkflow],
        activities=ladder.activities(),
    )
    async with climbing(env, ladder, nodes):
        # The guard runs (as it does once the node has had an incident): it hears of the failure.
        await (await start(env.client, fleet, node="gpu2", xid=48)).result()
        handle = await env.client.start_workflow(
            ReturnNodeWorkflow.run,
            ReturnNodeRequest(node="gpu1", cluster=fleet.cluster, **request),
            id=f"return-{uuid.uuid4().hex[:8]}",
            task_queue=f"{task_queue(fleet.cluster)}.nodes",
        )
        try:
            return await handle.result(), await handle.query(ReturnNodeWorkflow.status), None
        except WorkflowFailureError as exc:
            state = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
            return exc, await handle.query(ReturnNodeWorkflow.status), state


async def test_nodes_return_validates_then_returns_on_probation(env: WorkflowEnvironment) -> None:
    fleet, ladder = ladder_fleet()
    said, progress, _ = await return_node(env, fleet, ladder)
    assert said.startswith("gpu1 returned as spare; gpu1 passed validation: quick: passed; dcgm: skipped")
    assert "on probation until" in said
    assert isinstance(progress, ValidationResult) and [r.name for r in progress.rungs] == ["quick", "dcgm", "nccl"]
    assert [r.node for r in ladder.returned] == ["gpu1"] and ladder.probation[-1].node == "gpu1"


@pytest.mark.parametrize(
    ("fails", "busbw", "says"),
    [({"quick"}, 180.0, "quick: failed: exit status 1"), (set(), 60.0, "nccl: failed 60 GB/s (threshold 100)")],
)
async def test_nodes_return_keeps_a_node_that_fails_a_rung_out(
    env: WorkflowEnvironment, fails: set[str], busbw: float, says: str
) -> None:
    fleet, ladder = ladder_fleet()
    ladder.fails, ladder.busbw = fails, busbw
    failure, progress, state = await return_node(env, fleet, ladder)
    assert isinstance(failure, WorkflowFailureError)
    assert f"gpu1 failed validation at rung {says}" in str(failure.cause)
    assert ladder.returned == [] and not [p for p in ladder.probation if p.node == "gpu1"]
    assert progress.failed is not None and progress.failed.line() == says
    assert any(e.event == "validation failed" and e.detail.startswith("gpu1:") for e in state.state.log)


async def test_nodes_return_skipping_validation_records_who_and_why(env: WorkflowEnvironment) -> None:
    fleet, ladder = ladder_fleet()
    said, _, _ = await return_node(env, fleet, ladder, skip_validation=True, by="alice", reason="vendor RMA, checked")
    assert "validation skipped by alice: vendor RMA, checked" in said
    assert [r.rung.name for r in ladder.ran if r.node == "gpu1"] == []
    [why] = ladder.skips
    assert why.startswith("alice at ") and why.endswith(": vendor RMA, checked")
    assert [r.node for r in ladder.returned] == ["gpu1"]


def drain_after_jobs_fleet(**ladder_settings: Any) -> tuple[Fleet, Ladder, list[Any]]:
    """A fleet whose Xid 92 drains the node after its jobs (``then: validate``), the ladder on."""
    from tests.workflows.test_drain_after_jobs import Jobs

    fleet, ladder = ladder_fleet(**ladder_settings)
    fleet.policy = fleet.policy.model_copy(update={"drain_after_jobs": DrainAfterJobsSettings()})
    acts = [a for a in ladder.activities() if activity._Definition.must_from_callable(a).name != "jobs_on_node"]
    return fleet, ladder, [*acts, Jobs(looks=2).activity()]


# A guard, not a measure: its waits (60, 90 and 135 s) take real time if the clock stops skipping.
@pytest.mark.timeout(60)
async def test_then_validate_after_the_jobs_climbs_the_ladder_and_puts_the_node_on_probation(
    env: WorkflowEnvironment,
) -> None:
    fleet, ladder, acts = drain_after_jobs_fleet()
    async with climbing(env, ladder, activities=acts):
        status = await (await start(env.client, fleet, node="gpu1", xid=92)).result()
    assert status.outcome == Outcome.RESOLVED and status.action == Action.DRAIN_AFTER_JOBS
    assert fleet.repairs == []  # the ladder, not the repair's lone check Job
    assert [r.rung.name for r in ladder.ran] == ["quick", "dcgm", "nccl"]
    [validated] = [e for e in status.timeline if e.step == Step.VALIDATE and e.event == "finished"]
    assert "gpu1 passed validation" in validated.detail and "on probation until" in validated.detail
    assert [p.node for p in ladder.probation if p.until is not None] == ["gpu1"]
    assert fleet.resumed_nodes == ["gpu1"]


# A guard, not a measure: its waits (60, 90 and 135 s) take real time if the clock stops skipping.
@pytest.mark.timeout(60)
async def test_then_validate_after_the_jobs_under_the_nccl_floor_replaces_the_node_and_counts(
    env: WorkflowEnvironment,
) -> None:
    fleet, ladder, acts = drain_after_jobs_fleet()
    ladder.busbw = 40.0
    async with climbing(env, ladder, activities=acts):
        status = await (await start(env.client, fleet, node="gpu1", xid=92)).result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert status.outcome == Outcome.RESOLVED and status.action == Action.REPLACE_NODE and status.spare == "spare1"
    assert fleet.resumed_nodes == [] and ladder.probation == [] and fleet.repairs == []
    [escalated] = [e.detail for e in status.timeline if e.event == "escalated"]
    assert "failed validation at rung nccl: failed 40 GB/s (threshold 100)" in escalated
    assert "REPLACE_NODE" in fleet.drain_reasons[-1]
    assert any(e.event == "validation failed" and e.detail.startswith("gpu1: nccl") for e in state.state.log)


async def test_the_probation_ends_even_after_the_kubernetes_api_was_away_for_a_while(temporal_test_server: str) -> None:
    """The timer's one step outlasts an API server away for longer than an operator step's retries:
    a node is never left on probation for good. A server of its own: no earlier test's workflow
    can hold its clock while the retries back off (see climbing)."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=temporal_test_server,
        test_server_startup_timeout=timedelta(seconds=60),
    )
    tries: list[ProbationRequest] = []

    @activity.defn(name="set_probation")
    async def set_probation(request: ProbationRequest) -> bool:
        tries.append(request)
        if len(tries) <= 15:
            raise ApplicationError("the Kubernetes API does not answer", type="Unavailable")
        return True

    until = (await env.get_current_time() + timedelta(hours=1)).replace(microsecond=0)
    queue = f"probation-{uuid.uuid4().hex[:8]}"
    try:
        async with Worker(env.client, task_queue=queue, workflows=[ProbationWorkflow], activities=[set_probation]):
            said = await env.client.execute_workflow(
                ProbationWorkflow.run, ProbationInput(node="gpu1", until=until), id=queue, task_queue=queue
            )
    finally:
        await env.shutdown()
    assert said == "gpu1: probation ended"
    assert len(tries) == 16 and {t.ending for t in tries} == {until} and {t.until for t in tries} == {None}
