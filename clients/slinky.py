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


def create_all(kube: KubernetesApi, objects: list[dict[str, Any]]) -> str:
    made = [f"{o['kind']}/{o['metadata']['name']}" for o in objects if kube.create_object(with_keys(o))]
    return f"created {len(made)} object(s)" + (f": {', '.join(made)}" if made else " (all there already)")


def delete_all(kube: KubernetesApi, objects: list[dict[str, Any]]) -> str:
    gone = [f"{o['kind']}/{o['metadata']['name']}" for o in reversed(objects) if kube.delete_object(o)]
    return f"deleted {len(gone)} object(s)" + (f": {', '.join(gone)}" if gone else " (none were there)")


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
        controller = next(o for o in self._objects(spec) if o["kind"] == "Controller")
        return (
            f"Controller {spec.name} in {controller['metadata']['namespace']}"
            if self._kube.object_exists(controller)
            else ""
        )

    def render_conf(self, spec: ClusterSpec, placement: dict[str, list[str]]) -> str:
        # The operator writes slurm.conf itself; this is what gpufleet asks of it, for the record.
        return render_slurm_conf(spec, {p.name: placement.get(p.name, []) for p in spec.partitions})

    def create_objects(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str) -> str:
        return create_all(self._kube, self._objects(spec, placement))

    def delete_objects(self, spec: ClusterSpec) -> str:
        return delete_all(self._kube, self._objects(spec))

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
