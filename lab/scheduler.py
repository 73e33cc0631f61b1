"""The lab's stand-in for the ReplicaSet controller and the scheduler, for ReplicaSets that carry
a pod template (the inference servers of a shared pool).

The emulated API has no controllers: a pod evicted from a node would simply be gone. Here, every
half second, each such ReplicaSet gets pods up to its ``replicas``, each placed as the scheduler
would place it: on a node that is Ready, not cordoned, matches the template's ``nodeSelector``
and has no ``NoSchedule``/``NoExecute`` taint the template does not tolerate, the node with the
fewest of the set's pods first. A pod with nowhere to go is created Pending (no node) and bound
once a node fits: when a rebalance moves a node to inference, the inference pods land on it.
Pods are Running and Ready as soon as they are placed (the lab runs no containers). A ReplicaSet
annotated ``lab.gpufleet.io/replicas-per-node=true`` wants one pod per node its template fits,
as an autoscaler would size the inference servers to the nodes that serve inference.

Run it as ``python -m lab.scheduler --api URL [--ready-file F]``; ``reconcile(api)`` is one pass.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from lab.kubeapi import PER_NODE_ANNOTATION

POLL_SECONDS = 0.5


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    """Whether a pod with ``tolerations`` may run on a node with ``taint``."""
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for toleration in tolerations:
        if toleration.get("effect") not in (None, "", taint.get("effect")):
            continue
        if toleration.get("operator") == "Exists" and toleration.get("key") in (None, "", taint.get("key")):
            return True
        if toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def fits(node: dict[str, Any], pod_spec: dict[str, Any]) -> bool:
    """Whether the scheduler may place a pod of ``pod_spec`` on ``node``."""
    meta, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not ready or spec.get("unschedulable"):
        return False
    labels = meta.get("labels") or {}
    if any(labels.get(key) != value for key, value in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    tolerations = pod_spec.get("tolerations") or []
    return all(tolerated(taint, tolerations) for taint in spec.get("taints") or [])


def _running(containers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True, "restartCount": 0}
            for c in containers
        ],
    }


def _place(nodes: list[dict[str, Any]], pod_spec: dict[str, Any], load: dict[str, int]) -> str | None:
    """The node for one more pod (fewest of the set's pods first, then by name), or None."""
    fitting = sorted((n["metadata"]["name"] for n in nodes if fits(n, pod_spec)), key=lambda n: (load.get(n, 0), n))
    return fitting[0] if fitting else None


def reconcile(http: httpx.Client) -> list[str]:
    """One pass over every ReplicaSet with a template; returns what it did, in words."""
    did: list[str] = []
    nodes = http.get("/api/v1/nodes").raise_for_status().json()["items"]
    for replicaset in http.get("/apis/apps/v1/replicasets").raise_for_status().json()["items"]:
        meta, spec = replicaset["metadata"], replicaset.get("spec") or {}
        template = spec.get("template")
        if not template:
            continue  # the lab's older fixed workloads: placed once, by hand
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid")
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        pods = [
            p
            for p in http.get(f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": _selector(labels)})
            .raise_for_status()
            .json()["items"]
            if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])
            and not p["metadata"].get("deletionTimestamp")
        ]
        pod_spec = template.get("spec") or {}
        wanted = int(spec.get("replicas") or 0)
        if (meta.get("annotations") or {}).get(PER_NODE_ANNOTATION) == "true":
            wanted = sum(1 for node in nodes if fits(node, pod_spec))  # one per node that serves
        pending = [p for p in pods if not (p.get("spec") or {}).get("nodeName")]
        for pod in pending[: max(0, len(pods) - wanted)]:  # fewer wanted: the waiting ones go first
            pod_name = pod["metadata"]["name"]
            http.delete(f"/api/v1/namespaces/{namespace}/pods/{pod_name}").raise_for_status()
            pods.remove(pod)
            did.append(f"deleted {namespace}/{pod_name} (Pending, no longer wanted)")
        load: dict[str, int] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node:
                load[node] = load.get(node, 0) + 1
        # Bind the pending ones first, then make up the count.
        for pod in pods:
            if (pod.get("spec") or {}).get("nodeName"):
                continue
            node = _place(nodes, pod_spec, load)
            if node is None:
                continue
            pod_name = pod["metadata"]["name"]
            http.patch(
                f"/api/v1/namespaces/{namespace}/pods/{pod_name}",
                json={"spec": {"nodeName": node}, "status": _running(pod_spec.get("containers") or [])},
                headers={"Content-Type": "application/merge-patch+json"},
            ).raise_for_status()
            load[node] = load.get(node, 0) + 1
            did.append(f"bound {namespace}/{pod_name} to {node}")
        for _ in range(wanted - len(pods)):
            node = _place(nodes, pod_spec, load)
            pod_name = f"{name}-{secrets.token_hex(3)}"
            body: dict[str, Any] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod_name,
                    "namespace": namespace,
                    "labels": {**(template.get("metadata") or {}).get("labels", {}), **labels},
                    "ownerReferences": [
                        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": uid, "controller": True}
                    ],
                },
                "spec": {**pod_spec, **({"nodeName": node} if node else {})},
                "status": _running(pod_spec.get("containers") or []) if node else {"phase": "Pending"},
            }
            http.post(f"/api/v1/namespaces/{namespace}/pods", json=body).raise_for_status()
            if node:
                load[node] = load.get(node, 0) + 1
            did.append(f"created {namespace}/{pod_name} " + (f"on {node}" if node else "(Pending: no node fits)"))
    return did


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.scheduler", description=__doc__.splitlines()[0])
    parser.add_argument("--api", required=True, help="the emulated Kubernetes API's URL")
    parser.add_argument("--ready-file", type=Path, help="written once it polls")
    args = parser.parse_args()
    if args.ready_file is not None:
        args.ready_file.write_text(args.api, encoding="utf-8")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with httpx.Client(base_url=args.api, timeout=10) as http:
        while not stop.is_set():
            try:
                for line in reconcile(http):
                    print(line, flush=True)
            except httpx.HTTPError as exc:  # the API restarting: try again at the next pass
                print(f"reconcile failed: {exc}", flush=True)
            stop.wait(POLL_SECONDS)


if __name__ == "__main__":
    main()
