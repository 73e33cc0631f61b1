"""The spare an incident brings in (patch spare-claims-checked), on the time-skipping test server.

- A claimed spare that someone else drained before it came in (an Xid on the spare: its own
  incident) is not resumed by the claim (tests/clients/test_spares.py, on real Slurm); the claim
  fails with SpareLost, and the incident says so in its timeline and claims the next spare.
- An inference node's replacement serves inference: the claim asks for the inference pool, or
  (policy ``spares.inference: none``) nothing is claimed; it never joins training.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from models.incident import IncidentStatus, Outcome, Step
from models.policy import InferenceSpare, Policy, SpareSettings
from models.requests import ClaimRequest
from tests.workflows.test_remediation import Fleet, start, worker

THEIRS = "gpufleet: xid 79 REPLACE_NODE incident lab-spare1-20261205T050000Z"


def claim_spare(fleet: Fleet, answers: list[str | Exception | None]) -> object:
    """A claim_spare stand-in answering from ``answers`` in turn (an Exception is raised), then None."""

    @activity.defn(name="claim_spare")
    async def claim(request: ClaimRequest) -> str | None:
        fleet.writes.append(request)
        fleet.claim_started.set()
        fleet.calls.append("claim_spare")
        answer = answers.pop(0) if answers else None
        if isinstance(answer, Exception):
            raise answer
        return answer

    return claim


def with_claim(fleet: Fleet, claim: object) -> list[object]:
    return [claim if getattr(a, "__name__", "") == "claim" else a for a in fleet.activities()]


def claims(fleet: Fleet) -> list[ClaimRequest]:
    return [w for w in fleet.writes if isinstance(w, ClaimRequest)]


async def test_a_spare_drained_by_someone_else_is_lost_said_and_the_next_one_claimed(
    env: WorkflowEnvironment,
) -> None:
    fleet = Fleet()
    lost = ApplicationError(
        f"spare1: spare1 was taken out of service after it was claimed (drained, {THEIRS!r}); not resuming it; "
        "its claim is released",
        type="SpareLost",
        non_retryable=True,
    )
    async with worker(env, fleet, activities=with_claim(fleet, claim_spare(fleet, [lost, "spare2"]))):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.outcome == Outcome.RESOLVED
    assert status.spare == "spare2"
    said = [e.detail for e in status.timeline if e.step == Step.CLAIM_SPARE and e.event == "spare lost"]
    assert len(said) == 1 and "spare1 was taken out of service after it was claimed" in said[0] and THEIRS in said[0]
    assert [c.report_lost for c in claims(fleet)] == [True, True]
    notified = next(n for n in fleet.notifications if n.kind == "resolved")
    assert "replaced by spare2" in notified.text


async def test_an_inference_nodes_spare_is_claimed_for_inference(env: WorkflowEnvironment) -> None:
    fleet = Fleet(pool="inference")
    async with worker(env, fleet):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.outcome == Outcome.RESOLVED and status.spare == "spare1" and status.pool == "inference"
    assert [c.pool for c in claims(fleet)] == ["inference"]
    done = [e.detail for e in status.timeline if e.step == Step.CLAIM_SPARE and e.event == "finished"]
    assert done == ["spare1 joined the inference pool"]


async def test_an_inference_node_does_not_wait_for_a_spare(env: WorkflowEnvironment) -> None:
    fleet = Fleet(pool="inference", spare_free=False)
    async with worker(env, fleet):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.outcome == Outcome.RESOLVED and status.spare is None
    assert not status.waiting_for_spare and "notify:no_spare" not in fleet.calls
    assert [c.pool for c in claims(fleet)] == ["inference"]
    notified = next(n for n in fleet.notifications if n.kind == "resolved")
    assert "retired, not replaced by a spare" in notified.text


async def test_policy_none_claims_no_spare_for_an_inference_node(env: WorkflowEnvironment) -> None:
    fleet = Fleet(pool="inference", policy=Policy(spares=SpareSettings(inference=InferenceSpare.NONE)))
    fleet.claim_started.set()  # the stand-in retirement waits for a claim to begin: there is none
    async with worker(env, fleet):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.outcome == Outcome.RESOLVED and status.spare is None
    assert "claim_spare" not in fleet.calls
    assert "retire_node" in fleet.calls  # the failed node is still retired
    done = [e.detail for e in status.timeline if e.step == Step.CLAIM_SPARE and e.event == "finished"]
    assert done == ["none claimed: an inference node is not replaced by a spare (policy spares.inference: none)"]


async def test_a_training_node_still_claims_into_training(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    async with worker(env, fleet):
        status: IncidentStatus = await (await start(env.client, fleet)).result()
    assert status.spare == "spare1" and [c.pool for c in claims(fleet)] == ["training"]
