"""What ``gpufleet lab status`` shows: nodes on both sides, jobs, open incidents."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from temporalio.client import WorkflowExecutionStatus

from clients.errors import ClientError
from clients.kube import KubernetesApi
from lab.fleet import FleetLab
from lab.slinkylab import nodeset_pods
from models.constants import POOL_LABEL, REMEDIATION_WORKFLOW
from starters.temporal import TemporalUnreachable, connect


def lab_status(lab: FleetLab) -> dict[str, Any]:
    """Nodes (Slurm state and reason, Kubernetes schedulable, pool, GPU fault), jobs and open incidents."""
    env = lab.env()
    result: dict[str, Any] = {
        "running": lab.running(),
        "flavor": lab.config.flavor,
        "slurm": lab.slurm_release(),
        "services": lab.state().get("services", {}),
        "nodes": [],
        "jobs": [],
        "incidents": [],
    }
    if not result["running"]:
        return result
    api = result["services"].get("api")
    if api is not None:  # where the lab's `gpufleet` commands go, and whom a user may act as
        result["api"] = {"address": api["address"], "ca": api["ca"], "users": api.get("users", {})}
    slurm = lab.slurm.client()
    kube_nodes: dict[str, Any] = {}
    # The Kubernetes node under each Slurm node: its own name on the default flavor; on the slinky
    # flavor a Slurm node is a NodeSet pod, on the node the pod is bound to.
    pods: dict[str, str] = {}
    try:
        kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
        kube_nodes = {node.name: node for node in kube.list_nodes()}
        if lab.slinky:
            api = result["services"]["kubeapi"]["url"]
            bound = nodeset_pods(api, lab.config.cluster, lab.partition)
            pods = {name: (pod.get("spec") or {}).get("nodeName") or "" for name, pod in bound.items()}
    except (ClientError, httpx.HTTPError) as exc:
        result["kubernetes_error"] = str(exc)
    faults = lab.faults.standing()
    under: set[str] = set()
    for node in slurm.nodes():
        kube_node = pods.get(node.name, "") if lab.slinky else (node.name if node.name in kube_nodes else "")
        under.add(kube_node)
        k = kube_nodes.get(kube_node)
        result["nodes"].append(
            {
                "name": node.name,
                "pod": node.name if node.name in pods else "",
                "kubernetes_node": kube_node,
                "slurm_state": "+".join([node.state, *node.flags]),
                "reason": node.reason,
                "partitions": node.partitions,
                "kubernetes": "absent" if k is None else ("cordoned" if k.unschedulable else "schedulable"),
                "pool": k.labels.get(POOL_LABEL, "") if k else "",
                # An injected GPU fault that still stands (lab/faults.py).
                "gpu_fault": faults[node.name].describe() if node.name in faults else "",
            }
        )
    # GPU nodes (training and spare) that no Slurm node stands on.
    gpu = {name for name, k in kube_nodes.items() if k.labels.get(POOL_LABEL) in {"training", "spare"}}
    result["kubernetes_only"] = sorted(gpu - under)
    result["jobs"] = [
        {"job_id": j.job_id, "name": j.name, "state": j.state, "nodes": j.nodes, "restarts": j.restarts}
        for j in slurm.jobs()
        if j.state in {"RUNNING", "PENDING", "COMPLETING"}
    ]
    try:
        result["incidents"] = asyncio.run(_open_incidents(env["TEMPORAL_ADDRESS"]))
    except TemporalUnreachable as exc:
        result["temporal_error"] = str(exc)
    return result


async def _open_incidents(address: str) -> list[dict[str, Any]]:
    client = await connect(address=address)
    rows = []
    query = f"WorkflowType='{REMEDIATION_WORKFLOW}' AND ExecutionStatus='Running'"
    async for execution in client.list_workflows(query):
        if execution.status == WorkflowExecutionStatus.RUNNING:
            rows.append({"id": execution.id, "started": execution.start_time.isoformat()})
    return rows
