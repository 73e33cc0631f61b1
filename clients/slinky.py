"""Cluster objects in Kubernetes: the ones every backend makes (Namespace, Secrets, storage, the
remediation ConfigMap), and the Slinky backend, which adds slurm-operator's custom resources.

Keys are generated when their Secret is first created, never before: a retry finds the Secret
and keeps its key. Objects are created in order and deleted in reverse; each call is
idempotent (already there / already gone is fine).
"""

from __future__ import annotations

import base64
import os
from typing import Any

from clients.clusters import StepFailed
from clients.kube import KubernetesApi
from models.cluster import ClusterSpec, render_slurm_conf
from models.slinky import API, GENERATED, slinky_objects

CREATION_ANNOTATION = "gpufleet.io/creation"


def with_keys(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with each generated key filled in (1024 random bytes, base64)."""
    data = obj.get("stringData") or {}
    if GENERATED not in data.values():
        return obj
    filled = {k: (base64.b64encode(os.urandom(1024)).decode() if v == GENERATED else v) for k, v in data.items()}
    return {**obj, "stringData": filled}


def core_objects(spec: ClusterSpec, placement: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The objects every backend makes: all but slurm-operator's own kinds."""
    return [o for o in slinky_objects(spec, placement) if o["apiVersion"] == "v1"]


def _owned(obj: dict[str, Any], creation: str) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        **obj,
        "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), CREATION_ANNOTATION: creation}},
    }


def create_all(kube: KubernetesApi, objects: list[dict[str, Any]], creation: str) -> str:
    """Create each object marked with the creation that made it. One that exists already is
    this creation's (a retry) or refused: gpufleet never adopts what it did not make."""
    made = []
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if kube.create_object(with_keys(_owned(obj, creation))):
            made.append(name)
            continue
        annotations = kube.object_annotations(obj) or {}
        if annotations.get(CREATION_ANNOTATION) != creation:
            raise StepFailed(f"{name} exists and was not made by this creation: remove it, or choose another name")
    return f"created {len(made)} object(s)" + (f": {', '.join(made)}" if made else " (all there already)")


def delete_all(kube: KubernetesApi, objects: list[dict[str, Any]], creation: str) -> str:
    """Delete, in reverse, the objects this creation made; others of the same names stay."""
    gone, kept = [], []
    for obj in reversed(objects):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        annotations = kube.object_annotations(obj)
        if annotations is None:
            continue
        if annotations.get(CREATION_ANNOTATION) != creation:
            kept.append(name)
        elif kube.delete_object(obj):
            gone.append(name)
    said = f"deleted {len(gone)} object(s)" + (f": {', '.join(gone)}" if gone else " (none were there)")
    return said + (f"; left alone, not made by this creation: {', '.join(kept)}" if kept else "")


class SlinkyBackend:
    """Slurm run by Slinky's slurm-operator in the cluster the kubeconfig names.

    Creating and deleting its objects is done here; bringing the cluster up is the operator's
    work, which this backend waits for. The smoke test needs a shell in the login pod
    (``kubectl exec``), which gpufleet does not do yet: a creation on Slinky stops there, with
    the objects kept or undone as asked.
    """

    name = "slinky"

    def __init__(self, kube: KubernetesApi) -> None:
        self._kube = kube

    def _objects(self, spec: ClusterSpec, placement: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
        return slinky_objects(spec, placement or {p.name: [""] * p.nodes for p in spec.partitions})

    def unsupported(self, spec: ClusterSpec) -> str:
        return ""

    def exists(self, spec: ClusterSpec) -> str:
        for kind in ("Namespace", "Controller"):
            obj = next(o for o in self._objects(spec) if o["kind"] == kind)
            if self._kube.object_exists(obj):
                where = obj["metadata"].get("namespace")
                return f"{kind} {obj['metadata']['name']}" + (f" in {where}" if where else "")
        return ""

    def render_conf(self, spec: ClusterSpec, placement: dict[str, list[str]]) -> str:
        # The operator writes slurm.conf itself; this is what gpufleet asks of it, for the record.
        return render_slurm_conf(spec, {p.name: placement.get(p.name, []) for p in spec.partitions})

    def create_objects(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str, creation: str) -> str:
        return create_all(self._kube, self._objects(spec, placement), creation)

    def delete_objects(self, spec: ClusterSpec, creation: str) -> str:
        return delete_all(self._kube, self._objects(spec), creation)

    def bring_up(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str) -> str:
        return f"the operator brings up {spec.name} from its {API} objects"

    def tear_down(self, spec: ClusterSpec) -> str:
        return "the operator tears down what its objects' deletion removes"

    def add_users(self, spec: ClusterSpec) -> str:
        return f"{len(spec.users)} user(s) in the sssd user database Secret"

    def remove_users(self, spec: ClusterSpec) -> str:
        return "users leave with the user database Secret"

    def smoke_test(self, spec: ClusterSpec) -> str:
        raise StepFailed(
            "the smoke test on Slinky needs a shell in the login pod, which gpufleet does not run yet; "
            f"check by hand: kubectl -n slurm-{spec.name} exec deploy/{spec.name}-login -- sbatch --wrap hostname"
        )

    def drain(self, spec: ClusterSpec) -> str:
        return "left to the operator, which drains a NodeSet's nodes before deleting its pods"

    def running_jobs(self, spec: ClusterSpec) -> int:
        raise StepFailed(
            "gpufleet cannot see a Slinky cluster's jobs yet (no slurmrestd client): delete with --force, "
            "which leaves draining and the jobs to the operator"
        )

    def cancel_jobs(self, spec: ClusterSpec) -> int:
        return 0  # the operator's: it drains before deleting pods

    def make_remediable(self, spec: ClusterSpec) -> str:
        return f"remediation defaults in ConfigMap gpufleet-remediation; run a worker with GPUFLEET_CLUSTER={spec.name}"

    def unmake_remediable(self, spec: ClusterSpec) -> str:
        return "the ConfigMap goes with the objects"
