"""What a chaos run reads and does around its scenarios: the fleet's facts and the totals computed
from them, the job's fate, `gpufleet` commands, returning retired nodes, labs of its own.

On the slinky flavor the Slurm nodes are NodeSet pods named after themselves, wherever they run,
and claims, pools and incidents are on Kubernetes nodes: the partition, for the claims, is the
Kubernetes nodes its pods run on (``fleet_facts``), and a Slurm node's drain is followed under its
pod's name."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from temporalio.service import RPCError

from clients.kube import KubernetesApi
from clients.nodesets import NodeSets
from lab.chaos.outages import Say, slurm_update
from lab.drill import pod_hosts
from lab.fleet import REPO_ROOT, FleetLab, LabConfig
from lab.histories import record_histories_async
from lab.procs import free_port, wait_for
from lab.slinkylab import SLINKY_RELEASE
from models.constants import CLAIMED_BY_ANNOTATION, POOL_LABEL, POOL_RETIRED, owned_reason
from models.incident import IncidentStatus, JobInfo, Step
from workflows.remediation import NodeRemediationWorkflow


def fleet_facts(lab: FleetLab) -> dict[str, Any]:
    """What the totals are computed from: claims on nodes, pools, Slurm reasons, the jobs.

    ``partition`` holds Kubernetes node names as the claims do: on the slinky flavor the nodes the
    partition's pods run on (``slurm_partition`` their Slurm nodes, ``hosts`` where each runs)."""
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    slurm = lab.slurm.client()
    nodes = {node.name: node for node in kube.list_nodes()}
    members = slurm.partition_nodes(lab.partition)
    hosts = pod_hosts(lab)
    partition = sorted({hosts[m] for m in members if hosts.get(m)}) if lab.slinky else members
    return {
        "claims": {n: k.annotations.get(CLAIMED_BY_ANNOTATION) for n, k in nodes.items()},
        "pools": {n: k.labels.get(POOL_LABEL, "") for n, k in nodes.items()},
        "slurm": {node.name: (node.drained, node.reason) for node in slurm.nodes()},
        "partition": partition,
        "slurm_partition": members,
        "hosts": hosts,
    }


def pods_placed(lab: FleetLab) -> bool:
    """Whether every pod of the lab's NodeSet (one per training node) runs on a node."""
    hosts = pod_hosts(lab)
    return len(hosts) >= len(lab.config.training) and all(hosts.values())


def on_node(lab: FleetLab, node: str, slurm_nodes: list[str]) -> list[str]:
    """Those of ``slurm_nodes`` that run on ``node``: on the slinky flavor the pods it hosts, else
    ``node`` itself if it is one of them."""
    hosts = pod_hosts(lab)
    return [name for name in slurm_nodes if hosts.get(name, name) == node]


def host_of(lab: FleetLab, slurm_node: str) -> str:
    """The node an Xid for ``slurm_node`` is injected on: on the slinky flavor the Kubernetes node
    its pod runs on, else the node itself."""
    return pod_hosts(lab).get(slurm_node, slurm_node)


def double_claims(facts: dict[str, Any]) -> int:
    incidents = [claim for claim in facts["claims"].values() if claim]
    return len(incidents) - len(set(incidents))


def leaked_claims(facts: dict[str, Any]) -> int:
    """A claim on a node that did not join the partition: claimed and never used."""
    return sum(1 for node, claim in facts["claims"].items() if claim and node not in facts["partition"])


def undrained_not_ours(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Nodes someone else had drained that are no longer drained with their reason."""
    lost = 0
    for node, (drained, reason) in before["slurm"].items():
        if drained and reason and not owned_reason(reason):
            still = after["slurm"].get(node)
            if still is None or not still[0] or still[1] != reason:
                lost += 1
    return lost


async def gpufleet(lab: FleetLab, *args: str) -> str:
    """Run a `gpufleet` command as an operator would, against the lab; its output (raises when it fails)."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "workers.entry", *args],
        env=lab.env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"gpufleet {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


async def return_retired(
    lab: FleetLab, say: Say, *, all_healthy: bool = True, only: set[str] | None = None
) -> list[str]:
    """Every retired node (of ``only``, when given) comes back as a spare, as after a repair (its
    GPU fault cleared); an operator's drain is lifted first.
    Then waits until every node (or, without ``all_healthy``, every returned one) is healthy in Slurm."""
    facts = fleet_facts(lab)
    returned = []
    for node, pool in facts["pools"].items():
        if pool != POOL_RETIRED or (only is not None and node not in only):
            continue
        # On the slinky flavor a retired node hosts no Slurm node: its pods left with their names.
        drained, reason = facts["slurm"].get(node, (False, ""))
        if drained and not owned_reason(reason):
            slurm_update(lab, node, "State=RESUME")  # the operator finishes their work
        lab.faults.clear(node)  # repaired: its GPU works again
        await gpufleet(lab, "nodes", "return", node, "--as", "spare")
        returned.append(node)
        say(f"returned {node} as a spare")
    # A returned node is briefly "not responding" after its resume: wait until Slurm shows it idle
    # (on the slinky flavor, and every NodeSet pod runs on a node).
    slurm = lab.slurm.client()
    await asyncio.to_thread(
        wait_for,
        lambda: (
            all(
                not n.flags and n.state in {"idle", "allocated", "mixed"}
                for n in slurm.nodes()
                if all_healthy or n.name in returned
            )
            and (not lab.slinky or pods_placed(lab))
        ),
        timeout=60,
        what="every node to be healthy in Slurm" if all_healthy else f"{', '.join(returned)} to be healthy in Slurm",
    )
    return returned


async def return_failed(lab: FleetLab, node: str, say: Say) -> None:
    """On the slinky flavor, a node an incident left cordoned when it failed (its pods not evicted)
    is brought back as its failure's message says a person would: each NodeSet pod still on it
    evicted once its Slurm node is idle (never forced), and the node returned for training."""
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    for pod in await asyncio.to_thread(NodeSets(kube).nodeset_pods_on, node):
        said = await asyncio.to_thread(kube.evict, pod, timeout_seconds=60, force=False)
        say(f"{pod.key}: {said} once its Slurm node was idle")
    lab.faults.clear(node)
    await gpufleet(lab, "nodes", "return", node, "--as", "training")
    say(f"returned {node} for training")


def chaos_lab(
    home: Path,
    training: list[str],
    *,
    say: Say,
    spares: list[str] | None = None,
    flavor: str = "default",
    racks: dict[str, list[str]] | None = None,
    domain_incidents: bool = False,
) -> FleetLab:
    """A lab of the chaos run's own: these training nodes, two spares (unless said), the lab's
    racks (unless said), a 60 s grace, free ports; on the slinky flavor a NodeSet of one pod per
    training node, on Slurm 26.05."""
    config = LabConfig(
        training=training,
        spares=["spare1", "spare2"] if spares is None else spares,
        temporal_port=free_port(),
        ui_port=free_port(),
        grace_seconds=60,
        flavor=flavor,
    )
    if flavor == "slinky":
        config.slurm = SLINKY_RELEASE
    if racks is not None:
        config.racks = racks
    config.domain_incidents = domain_incidents
    lab = FleetLab(home, config)
    lab.up(say=say)
    return lab


async def record_and_stop(lab: FleetLab) -> None:
    """Stop the lab, its workflows' histories first written where $GPUFLEET_RECORD_HISTORIES says."""
    try:
        await record_histories_async(lab.env()["TEMPORAL_ADDRESS"])
    finally:
        lab.down()


def step_end(status: IncidentStatus, step: Step) -> datetime:
    return [e.at for e in status.timeline if e.step == step and e.event == "finished"][-1]


async def closed(handle: Any, *, since: datetime, timeout: float = 300) -> IncidentStatus:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            description = await handle.describe()
        except RPCError:  # not started yet
            description = None
        if description is not None and description.start_time >= since and description.close_time is not None:
            status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
            return status
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{handle.id} did not close within {timeout:.0f}s")


def job_lost(restarts_before: int, after: JobInfo | None) -> int:
    """1 for a job the failure ended (or left hanging) that did not run again: it does not run
    now on a later restart than it did before the Xid. 0 once it runs again."""
    return 0 if after is not None and after.state == "RUNNING" and after.restarts > restarts_before else 1


def met_gpu_fault(lab: FleetLab, job_id: int, nodes: list[str], effect: str, *, since: float) -> list[str]:
    """The nodes among ``nodes`` where a rank of the job did not meet its GPU fault (``effect``)
    since ``since``: empty when the fault fired everywhere it should have."""
    hits = {(hit["node"], hit["effect"]) for hit in lab.faults.hits(job_id) if hit["at"] >= since}
    return [node for node in nodes if (node, effect) not in hits]
