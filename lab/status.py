"""What ``gpufleet lab status`` shows: nodes on both sides, jobs, open incidents."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import WorkflowExecutionStatus

from clients.errors import ClientError
from clients.kube import KubernetesApi
from lab.fleet import FleetLab
from models.constants import POOL_LABEL, REMEDIATION_WORKFLOW
from starters.temporal import TemporalUnreachable, connect


def lab_status(lab: FleetLab) -> dict[str, Any]:
    """Nodes (Slurm state and reason, Kubernetes schedulable, pool, GPU fault), jobs and open incidents."""
    env = lab.env()
    result: dict[str, Any] = {
        "running": lab.running(),
        "slurm": lab.slurm_release(),
        "services": lab.state().get("services", {}),
        "nodes": [],
        "jobs": [],
        "incidents": [],
    }
    if not result["running"]:
        return result
    slurm = lab.slurm.client()
    kube_nodes: dict[str, Any] = {}
    try:
        kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
        kube_nodes = {node.name: node for node in kube.list_nodes()}
    except ClientError as exc:
        result["kubernetes_error"] = str(exc)
    faults = lab.faults.standing()
    for node in slurm.nodes():
        k = kube_nodes.get(node.name)
        result["nodes"].append(
            {
                "name": node.name,
                "slurm_state": "+".join([node.state, *node.flags]),
                "reason": node.reason,
                "partitions": node.partitions,
                "kubernetes": "absent" if k is None else ("cordoned" if k.unschedulable else "schedulable"),
                "pool": k.labels.get(POOL_LABEL, "") if k else "",
                # An injected GPU fault that still stands (lab/faults.py).
                "gpu_fault": faults[node.name].describe() if node.name in faults else "",
            }
        )
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
