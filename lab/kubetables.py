"""Server-side printing for the emulated API: ``kubectl get`` asks for a ``meta.k8s.io/v1``
Table and prints its columns, as a real API server renders them for each kind."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

Row = list[Any]
# Per kind: (column name, priority (1: only with -o wide), cell of an object).
Column = tuple[str, int, Callable[[dict[str, Any]], Any]]


def age(obj: dict[str, Any]) -> str:
    """How kubectl shows an age: 45s, 12m, 5h, 3d."""
    stamp = obj.get("metadata", {}).get("creationTimestamp")
    if not stamp:
        return "<unknown>"
    created = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = max(0, int((datetime.datetime.now(datetime.UTC) - created).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= size):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _node_status(node: dict[str, Any]) -> str:
    conditions = node.get("status", {}).get("conditions") or []
    ready = next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)
    status = "Ready" if ready == "True" else "NotReady" if ready == "False" else "Unknown"
    return status + (",SchedulingDisabled" if node.get("spec", {}).get("unschedulable") else "")


def _node_roles(node: dict[str, Any]) -> str:
    prefix = "node-role.kubernetes.io/"
    roles = [key[len(prefix) :] for key in node.get("metadata", {}).get("labels") or {} if key.startswith(prefix)]
    return ",".join(sorted(roles)) or "<none>"


def _node_address(kind: str) -> Callable[[dict[str, Any]], str]:
    def cell(node: dict[str, Any]) -> str:
        addresses = node.get("status", {}).get("addresses") or []
        return next((a.get("address", "") for a in addresses if a.get("type") == kind), "<none>")

    return cell


def _pod_ready(pod: dict[str, Any]) -> str:
    containers = pod.get("spec", {}).get("containers") or []
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return f"{sum(1 for s in statuses if s.get('ready'))}/{len(containers)}"


def _pod_status(pod: dict[str, Any]) -> str:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "Terminating"
    return str(pod.get("status", {}).get("phase") or "Pending")


def _pod_restarts(pod: dict[str, Any]) -> int:
    return sum(int(s.get("restartCount", 0)) for s in pod.get("status", {}).get("containerStatuses") or [])


def _pdb_field(name: str) -> Callable[[dict[str, Any]], str]:
    return lambda pdb: str(pdb.get("spec", {}).get(name, "N/A"))


def _name(obj: dict[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _status_of(obj: dict[str, Any], name: str) -> int:
    return int((obj.get("status") or {}).get(name) or 0)


def _containers(name: str) -> Callable[[dict[str, Any]], str]:
    def cell(obj: dict[str, Any]) -> str:
        containers = obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
        return ",".join(str(container.get(name, "")) for container in containers)

    return cell


COLUMNS: dict[str, list[Column]] = {
    "Node": [
        ("Name", 0, _name),
        ("Status", 0, _node_status),
        ("Roles", 0, _node_roles),
        ("Age", 0, age),
        ("Version", 0, lambda n: n.get("status", {}).get("nodeInfo", {}).get("kubeletVersion", "")),
        ("Internal-IP", 1, _node_address("InternalIP")),
        ("External-IP", 1, _node_address("ExternalIP")),
    ],
    "Pod": [
        ("Name", 0, _name),
        ("Ready", 0, _pod_ready),
        ("Status", 0, _pod_status),
        ("Restarts", 0, _pod_restarts),
        ("Age", 0, age),
        ("IP", 1, lambda p: p.get("status", {}).get("podIP") or "<none>"),
        ("Node", 1, lambda p: p.get("spec", {}).get("nodeName") or "<none>"),
    ],
    "PodDisruptionBudget": [
        ("Name", 0, _name),
        ("Min Available", 0, _pdb_field("minAvailable")),
        ("Max Unavailable", 0, _pdb_field("maxUnavailable")),
        ("Allowed Disruptions", 0, lambda p: p.get("status", {}).get("disruptionsAllowed", 0)),
        ("Age", 0, age),
    ],
    "Deployment": [
        ("Name", 0, _name),
        ("Ready", 0, lambda d: f"{_status_of(d, 'readyReplicas')}/{d.get('spec', {}).get('replicas', 1)}"),
        ("Up-to-date", 0, lambda d: _status_of(d, "updatedReplicas")),
        ("Available", 0, lambda d: _status_of(d, "availableReplicas")),
        ("Age", 0, age),
        ("Containers", 1, _containers("name")),
        ("Images", 1, _containers("image")),
    ],
    "ReplicaSet": [
        ("Name", 0, _name),
        ("Desired", 0, lambda r: r.get("spec", {}).get("replicas", 1)),
        ("Current", 0, lambda r: _status_of(r, "replicas")),
        ("Ready", 0, lambda r: _status_of(r, "readyReplicas")),
        ("Age", 0, age),
    ],
    "DaemonSet": [
        ("Name", 0, _name),
        ("Desired", 0, lambda d: _status_of(d, "desiredNumberScheduled")),
        ("Current", 0, lambda d: _status_of(d, "currentNumberScheduled")),
        ("Ready", 0, lambda d: _status_of(d, "numberReady")),
        ("Up-to-date", 0, lambda d: _status_of(d, "updatedNumberScheduled")),
        ("Available", 0, lambda d: _status_of(d, "numberAvailable")),
        ("Age", 0, age),
    ],
    "CustomResourceDefinition": [
        ("Name", 0, _name),
        ("Created At", 0, lambda crd: crd.get("metadata", {}).get("creationTimestamp") or ""),
    ],
    "Lease": [
        ("Name", 0, _name),
        ("Holder", 0, lambda lease: lease.get("spec", {}).get("holderIdentity") or ""),
        ("Age", 0, age),
    ],
}


_NUMBERS = {"Restarts", "Up-to-date", "Available", "Desired", "Current"}


def table(kind: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The Table a real API server returns for a list of ``kind`` (each row carries its object)."""
    columns = COLUMNS.get(kind, [("Name", 0, _name), ("Age", 0, age)])
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {},
        "columnDefinitions": [
            {
                "name": name,
                "type": "integer" if name in _NUMBERS else "string",
                "format": "name" if name == "Name" else "",
                "description": "",
                "priority": priority,
            }
            for name, priority, _ in columns
        ],
        "rows": [{"cells": [cell(item) for _, _, cell in columns], "object": item} for item in items],
    }
