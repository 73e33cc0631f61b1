"""The what-if's stand-in activities cover what the real workflows call: the topology reads
answer that a simulated node is in no failure domain."""

from __future__ import annotations

import inspect
from datetime import UTC, datetime

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.topology import TopologyActivities
from models.policy import Policy
from models.topology import Domain, DomainKind, DomainNodesRequest, DomainsRequest, NodeDomains
from sim.activities import SimFleet
from sim.world import FleetSpec, World


def names(functions: list[object]) -> dict[str, object]:
    return {activity._Definition.must_from_callable(fn).name: fn for fn in functions}


async def test_the_topology_stand_ins_answer_no_domains() -> None:
    fleet = SimFleet(
        cluster="c", world=World(FleetSpec(nodes=4)), policy=Policy(), start=datetime(1970, 1, 1, tzinfo=UTC)
    )
    acts = names(fleet.activities())
    real = names(
        [
            fn
            for _, fn in inspect.getmembers(TopologyActivities(None, None), inspect.ismethod)
            if hasattr(fn, "__temporal_activity_definition")
        ]
    )
    assert set(real) == {"node_domains", "domain_nodes"} <= set(acts)
    env = ActivityEnvironment()
    found = await env.run(acts["node_domains"], DomainsRequest(node="gpu0001"))
    assert found == NodeDomains(node="gpu0001") and found.domains == []
    domain = Domain(kind=DomainKind.RACK, name="r1")
    assert await env.run(acts["domain_nodes"], DomainNodesRequest(domain=domain)) == []
