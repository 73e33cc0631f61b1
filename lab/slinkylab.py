"""The lab's Slinky flavor (``gpufleet lab up --flavor slinky``): one Slinky cluster's objects in
the emulated Kubernetes API, its NodeSet's pods run by the operator stand-in (lab/operator.py) as
dynamic Slurm 26.05 nodes named after the pods, and a real slurmrestd the worker reaches Slurm
through.

The objects are the ones gpufleet renders for a Slinky cluster (models/slinky.py): the Namespace
``slurm-<cluster>``, the JWT key Secret ``<cluster>-jwt-key`` (holding the key slurmctld and
slurmrestd use), the ``Controller``, one StatefulSet-mode ``NodeSet`` ``<cluster>-<partition>``
(its partition in Slurm is named after it) and the ``RestApi``. The training Kubernetes nodes
carry the labels the NodeSet's ``nodeSelector`` asks for; the spares do not, so they are
Kubernetes nodes with no Slurm node until a pod lands there.

Beside them, the database password Secret ``gpufleet/lab-db`` (key ``password``), labelled
``gpufleet.io/copy-to-clusters=true``, which a cluster spec with accounting names in its
``accounting_storage`` (``SlinkyBackend.unsupported`` asks for one). The lab runs each cluster's
database itself (lab/slinkyclusters.py), so the password is copied but not used.
"""

from __future__ import annotations

import base64
import secrets
from pathlib import Path
from typing import Any

import httpx

from lab.kubeapi import node_object, training_node
from models.cluster import ClusterSpec
from models.slinky import API, CLUSTER_LABEL, COPY_LABEL, PARTITION_LABEL, cluster_namespace, slinky_objects

FLAVORS = ("default", "slinky")
# Dynamic nodes (slurmd -Z per pod, NodeSet partitions) need Slurm 26.05 here (lab/dynamic.py).
SLINKY_RELEASE = "26.05"
JWT_KEY = "jwt_hs256.key"
# The database password Secret a spec with accounting names: namespace, name, key.
DB_SECRET = ("gpufleet", "lab-db", "password")
# The objects of a Slinky cluster the lab creates (models/slinky.py renders more: the Slurm key,
# users, sssd, remediation ConfigMap and LoginSet play no part in the lab).
_KINDS = ("Namespace", "Controller", "NodeSet", "RestApi")
_PLURALS = {"Controller": "controllers", "NodeSet": "nodesets", "RestApi": "restapis"}


def nodeset_name(cluster: str, partition: str) -> str:
    """The NodeSet (and so the Slurm partition) of the cluster's partition, as models/slinky.py names it."""
    return f"{cluster}-{partition}"


def eligible_labels(cluster: str, partition: str) -> dict[str, str]:
    """The labels the NodeSet's nodeSelector asks of a Kubernetes node."""
    return {CLUSTER_LABEL: cluster, PARTITION_LABEL: partition}


def slinky_nodes(cluster: str, partition: str, training: list[str], spares: list[str]) -> list[dict[str, Any]]:
    """The GPU Kubernetes nodes: training ones eligible for the NodeSet, spares not."""
    nodes = []
    for name in training:
        node = training_node(name)
        node["metadata"]["labels"].update(eligible_labels(cluster, partition))
        nodes.append(node)
    return nodes + [node_object(name, pool="spare") for name in spares]


def cluster_objects(cluster: str, partition: str, replicas: int, jwt_key: bytes) -> list[dict[str, Any]]:
    """The Namespace, the JWT key Secret, the Controller, the NodeSet and the RestApi, in creation order."""
    spec = ClusterSpec.model_validate({"name": cluster, "partitions": [{"name": partition, "nodes": replicas}]})
    objects = []
    for obj in slinky_objects(spec, {partition: [f"n{i}" for i in range(replicas)]}):
        if obj["kind"] == "Secret" and obj["metadata"]["name"] == f"{cluster}-jwt-key":
            obj = {k: v for k, v in obj.items() if k != "stringData"}
            obj["data"] = {JWT_KEY: base64.b64encode(jwt_key).decode()}
        elif obj["kind"] not in _KINDS:
            continue
        objects.append(obj)
    return objects


def db_secret_objects() -> list[dict[str, Any]]:
    """The Namespace and the labelled database password Secret ``DB_SECRET`` (a new password;
    one already there is kept by ``create_objects``)."""
    namespace, name, key = DB_SECRET
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {COPY_LABEL: "true"}},
        "type": "Opaque",
        "data": {key: base64.b64encode(secrets.token_hex(16).encode()).decode()},
    }
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}, secret]


def create_objects(api: str, objects: list[dict[str, Any]]) -> None:
    """Create the objects through the API (an object already there is kept)."""
    with httpx.Client(base_url=api, timeout=10) as http:
        for obj in objects:
            kind, meta = obj["kind"], obj["metadata"]
            if kind == "Namespace":
                path = "/api/v1/namespaces"
            elif kind == "Secret":
                path = f"/api/v1/namespaces/{meta['namespace']}/secrets"
            else:
                path = f"/apis/{API}/namespaces/{meta['namespace']}/{_PLURALS[kind]}"
            response = http.post(path, json=obj)
            if response.status_code != 409 and response.is_error:
                raise RuntimeError(f"creating {kind} {meta['name']}: {response.status_code} {response.text[:500]}")


def jwt_secret(api: str, cluster: str) -> bytes:
    """The key in the cluster's JWT key Secret."""
    with httpx.Client(base_url=api, timeout=10) as http:
        path = f"/api/v1/namespaces/{cluster_namespace(cluster)}/secrets/{cluster}-jwt-key"
        secret = http.get(path).raise_for_status().json()
    return base64.b64decode(secret["data"][JWT_KEY])


def write_jwt_key(path: Path) -> bytes:
    """A new JWT key at ``path`` (mode 600, as slurmctld wants it); returns it."""
    key = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(key)
    path.chmod(0o600)
    return key


def nodeset_pods(api: str, cluster: str, nodeset: str) -> dict[str, dict[str, Any]]:
    """The NodeSet's pods by name."""
    with httpx.Client(base_url=api, timeout=10) as http:
        items = http.get(f"/api/v1/namespaces/{cluster_namespace(cluster)}/pods").raise_for_status().json()["items"]
    return {
        pod["metadata"]["name"]: pod
        for pod in items
        if any(
            o.get("kind") == "NodeSet" and o.get("name") == nodeset
            for o in pod["metadata"].get("ownerReferences") or []
        )
    }
