"""Failure domains on the time-skipping test server: the fleet guard with the incidents it guards
and the domain incident it opens (workflows/guard_domains.py, workflows/domain.py).

Three Xids in one rack open one domain incident: the operators are told once, the rack's nodes
are drained and their jobs requeued, but no node is replaced and no spare claimed, while an Xid
in the other rack at the same time is remediated as usual and the fleet-wide breaker does not
trip. Confirming replaces the rack's nodes one at a time; releasing returns them to service with
no spare; a later failure in the rack joins its incident.
"""

from __future__ import annotations

from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from models.constants import GUARD_REQUEST_SIGNAL
from models.guard import GuardEvent, GuardStatus
from models.incident import IncidentStatus, Outcome
from models.policy import GuardSettings, Policy
from models.topology import (
    DOMAIN_DECIDE_SIGNAL,
    Domain,
    DomainDecision,
    DomainIncidentStatus,
    DomainKind,
    DomainSettings,
    domain_workflow_id,
)
from tests.workflows.test_guard import guard, running, until
from tests.workflows.test_remediation import Fleet, start
from tests.workflows.test_validation import LADDER, Ladder, climbing
from workflows.domain import DomainIncidentWorkflow
from workflows.guard import FleetGuardWorkflow
from workflows.remediation import NodeRemediationWorkflow

RACK_A = Domain(kind=DomainKind.RACK, name="a")
RACK_B = Domain(kind=DomainKind.RACK, name="b")
SWITCH_A = Domain(kind=DomainKind.SWITCH, name="leaf-a")
A_NODES = ["gpu1", "gpu2", "gpu3", "gpu4"]
B_NODES = ["gpu5", "gpu6", "gpu7", "gpu8"]


def racked(**domains: Any) -> Fleet:
    """Eight nodes in two racks of four (each rack also a leaf switch, a domain as wide), the
    guard's default limits but for two slots, domains at their defaults (3 nodes, half a rack)."""
    fleet = Fleet(
        nodes={*A_NODES, *B_NODES},
        partition_size=8,
        policy=Policy(guard=GuardSettings(max_in_flight=2, max_share=0.5), domains=DomainSettings(**domains)),
    )
    fleet.domains = {node: [RACK_A, SWITCH_A] for node in A_NODES} | {node: [RACK_B] for node in B_NODES}
    return fleet


def domain(client: Client, fleet: Fleet, which: Domain = RACK_A) -> WorkflowHandle[Any, Any]:
    return client.get_workflow_handle(domain_workflow_id(fleet.cluster, which), result_type=DomainIncidentStatus)


def held(status: IncidentStatus) -> bool:
    return "held by the domain incident rack/a" in (status.waiting_for_approval or "")


async def storm(env: WorkflowEnvironment, fleet: Fleet) -> tuple[list[Any], Any]:
    """Xids on three of rack a's nodes and one of rack b's: the three wait, held by rack a."""
    rack = [await start(env.client, fleet, node=node) for node in A_NODES[:3]]
    other = await start(env.client, fleet, node="gpu5")
    for handle in rack:
        await until(handle, NodeRemediationWorkflow.status, held, "held by its rack's domain incident")
    return rack, other


def claims(fleet: Fleet, nodes: list[str]) -> list[str]:
    return [w.node for w in fleet.writes if type(w).__name__ == "ClaimRequest" and w.node in nodes]


def guard_log(status: GuardStatus, *events: str) -> list[GuardEvent]:
    return [e for e in status.state.log if e.event in events]


async def test_a_rack_storm_opens_one_domain_incident_and_claims_no_spare(env: WorkflowEnvironment) -> None:
    fleet = racked()
    async with running(env, fleet):
        rack, other = await storm(env, fleet)
        # The other rack's single Xid is remediated as usual, meanwhile.
        assert (await other.result()).outcome == Outcome.RESOLVED
        incident: DomainIncidentStatus = await until(
            domain(env.client, fleet), DomainIncidentWorkflow.status, lambda s: s.notified, "told the operators"
        )
        statuses = [await handle.query(NodeRemediationWorkflow.status) for handle in rack]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        # A fourth node of rack a fails later: it joins the incident and waits with the rest.
        late = await start(env.client, fleet, node="gpu4")
        await until(late, NodeRemediationWorkflow.status, held, "the late node held too")
        joined = await domain(env.client, fleet).query(DomainIncidentWorkflow.status)
        for handle in [*rack, late]:
            await handle.terminate("test over")
    # One domain incident, the narrowest (the rack, not its switch, as wide), told once with the summary.
    assert incident.domain == RACK_A and incident.size == 4 and incident.state == "open"
    assert sorted(f.node for f in incident.failures) == A_NODES[:3]
    told = [n for n in fleet.notifications if n.kind == "domain_incident"]
    assert len(told) == 1
    assert all(node in told[0].text for node in A_NODES[:3]) and "Xid 79" in told[0].text
    assert "gpufleet domains confirm rack/a" in told[0].text
    assert not [k for k in state.state.domains if k == SWITCH_A.key and state.state.domains[k].state == "open"]
    # Drained and requeued as usual, but no spare claimed for them, and the breaker never tripped.
    assert sorted(fleet.drained) == sorted([*A_NODES, "gpu5"])
    assert all(s.requeued == [7] for s in statuses)
    assert claims(fleet, A_NODES) == [] and claims(fleet, ["gpu5"]) == ["gpu5"]
    assert not state.state.tripped and not [n for n in fleet.notifications if n.kind == "breaker_tripped"]
    assert sorted(r.node for r in state.state.domain_held) == A_NODES[:3]
    assert sorted(f.node for f in joined.failures) == A_NODES


async def test_confirming_replaces_the_racks_nodes_one_at_a_time(env: WorkflowEnvironment) -> None:
    fleet = racked()
    async with running(env, fleet):
        rack, other = await storm(env, fleet)
        await other.result()
        await until(domain(env.client, fleet), DomainIncidentWorkflow.status, lambda s: s.notified, "told")
        await domain(env.client, fleet).signal(DOMAIN_DECIDE_SIGNAL, DomainDecision(confirm=True, by="ops"))
        decided: DomainIncidentStatus = await domain(env.client, fleet).result()
        results = [await handle.result() for handle in rack]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert decided.state == "confirmed" and decided.decision is not None and decided.decision.by == "ops"
    assert all(r.outcome == Outcome.RESOLVED and r.spare for r in results)
    assert sorted(claims(fleet, A_NODES)) == A_NODES[:3]
    # One at a time: each rack node's slot for its replacement is granted only once the one
    # before gave its slot back.
    rack_ids = {r.incident_id for r in results}
    log = state.state.log
    confirmed = next(i for i, e in enumerate(log) if e.event == "domain confirmed")
    fixing: set[str] = set()
    granted = []
    for event in log[confirmed:]:
        if event.incident_id not in rack_ids:
            continue
        if event.event == "granted":
            assert not fixing, f"{event.node} granted while {fixing} was being replaced"
            fixing.add(event.incident_id)
            granted.append(event.node)
        elif event.event == "released":
            fixing.discard(event.incident_id)
    assert sorted(granted) == A_NODES[:3]
    assert len(guard_log(state, "domain next")) == 3


async def test_releasing_returns_the_racks_nodes_without_a_spare(env: WorkflowEnvironment) -> None:
    fleet = racked()
    async with running(env, fleet):
        rack, other = await storm(env, fleet)
        await other.result()
        await until(domain(env.client, fleet), DomainIncidentWorkflow.status, lambda s: s.notified, "told")
        await domain(env.client, fleet).signal(
            DOMAIN_DECIDE_SIGNAL, DomainDecision(confirm=False, by="ops", reason="PDU replaced")
        )
        decided: DomainIncidentStatus = await domain(env.client, fleet).result()
        results = [await handle.result() for handle in rack]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert decided.state == "released"
    assert all(r.outcome == Outcome.RESOLVED and not r.spare for r in results)
    assert claims(fleet, A_NODES) == []
    assert sorted(fleet.resumed_nodes) == A_NODES[:3]
    resolved = [n.text for n in fleet.notifications if n.kind == "resolved" and "rack/a" in n.text]
    assert len(resolved) == 3 and all("released" in text for text in resolved)
    assert any("PDU replaced" in n.text for n in fleet.notifications if n.kind == "domain_released")
    # Released: the rack counts afresh.
    assert RACK_A.key not in state.state.domains or state.state.domains[RACK_A.key].state == "released"
    assert not state.state.domain_held


async def test_two_failures_in_a_rack_are_remediated_as_usual(env: WorkflowEnvironment) -> None:
    fleet = racked()
    async with running(env, fleet):
        handles = [await start(env.client, fleet, node=node) for node in A_NODES[:2]]
        results = [await handle.result() for handle in handles]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert all(r.outcome == Outcome.RESOLVED and r.spare for r in results)
    assert state.state.domains[RACK_A.key].state == "counting"
    assert len(state.state.domains[RACK_A.key].failures) == 2
    assert not [n for n in fleet.notifications if n.kind == "domain_incident"]


async def test_domains_switched_off_count_nothing(env: WorkflowEnvironment) -> None:
    fleet = racked(enabled=False)
    async with running(env, fleet):
        handles = [await start(env.client, fleet, node=node) for node in A_NODES[:3]]
        results = [await handle.result() for handle in handles]
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert all(r.outcome == Outcome.RESOLVED and r.spare for r in results)
    assert not state.state.domains and "guard:node_domains" not in fleet.calls


async def released(env: WorkflowEnvironment, fleet: Fleet) -> list[IncidentStatus]:
    """A storm on rack a, then rack a released by ops: the rack's incidents' results."""
    rack, other = await storm(env, fleet)
    await other.result()
    await until(domain(env.client, fleet), DomainIncidentWorkflow.status, lambda s: s.notified, "told")
    await domain(env.client, fleet).signal(DOMAIN_DECIDE_SIGNAL, DomainDecision(confirm=False, by="ops", reason="PDU"))
    await domain(env.client, fleet).result()
    return [await handle.result() for handle in rack]


async def test_a_released_storm_still_counts_as_one_node_for_the_breaker(env: WorkflowEnvironment) -> None:
    """Rack a's drains stay in the breaker's window after its release, still as one node: an
    Xid in rack b within the window is remediated as usual, the breaker closed."""
    fleet = racked()
    async with running(env, fleet):
        await released(env, fleet)
        late = await start(env.client, fleet, node="gpu6")
        status: IncidentStatus = await late.result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
    assert status.outcome == Outcome.RESOLVED and status.spare
    assert not state.state.tripped, state.state.tripped_why
    assert RACK_A.key in state.nodes_in_window and not set(A_NODES) & set(state.nodes_in_window)


async def test_a_held_incident_asking_again_after_the_release_is_told_released(env: WorkflowEnvironment) -> None:
    """An ask crossed by the release (sent before the incident heard it, or its answer lost) is
    answered `released` again, never granted: no node of the rack is replaced."""
    fleet = racked()
    async with running(env, fleet):
        rack, other = await storm(env, fleet)
        await other.result()
        state: GuardStatus = await guard(env.client, fleet).query(FleetGuardWorkflow.status)
        request = next(r for r in state.state.domain_held if r.node == "gpu1")
        await domain(env.client, fleet).signal(
            DOMAIN_DECIDE_SIGNAL, DomainDecision(confirm=False, by="ops", reason="PDU")
        )
        await domain(env.client, fleet).result()
        handle = guard(env.client, fleet)
        seen = state.state.handled
        await handle.signal(GUARD_REQUEST_SIGNAL, request.model_copy(update={"held_by": ""}))
        state = await until(handle, FleetGuardWorkflow.status, lambda s: s.state.handled >= seen + 2, "handled")
        results = [await h.result() for h in rack]
    assert not [r for r in state.state.in_flight if r.node == "gpu1"], "granted a fix after its domain's release"
    assert claims(fleet, A_NODES) == [] and all(r.outcome == Outcome.RESOLVED for r in results)


async def test_a_released_node_that_fails_validation_is_replaced(env: WorkflowEnvironment) -> None:
    """The release returns each node through the validation ladder; one that fails it has a
    fault of its own and is replaced after all, with a slot of its own."""
    fleet = racked()
    fleet.policy = fleet.policy.model_copy(update={"validation": LADDER})
    ladder = Ladder(fleet)
    ladder.busbw = 40.0  # under the ladder's NCCL floor: every node fails
    async with climbing(env, ladder):
        results = await released(env, fleet)
    assert all(r.outcome == Outcome.RESOLVED and r.spare for r in results)
    assert sorted(claims(fleet, A_NODES)) == A_NODES[:3]
