"""Kubernetes through the official client: nodes, cordon, taints, pods, evictions."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from urllib3.exceptions import HTTPError as Urllib3Error

from clients.errors import (
    ClientError,
    Conflict,
    InvalidInput,
    NotFound,
    TooManyRequests,
    Unavailable,
    checked_node_name,
)

Progress = Callable[[str], None]


class KubeNode(BaseModel):
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    unschedulable: bool = False
    ready: bool = False
    resource_version: str = ""
    taints: list[dict[str, str]] = Field(default_factory=list)


class PodRef(BaseModel):
    namespace: str
    name: str
    owner_kind: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class KubeClient(Protocol):
    """What gpufleet needs from a Kubernetes API server."""

    def get_node(self, name: str) -> KubeNode: ...
    def list_nodes(self, *, label_selector: str = "") -> list[KubeNode]: ...
    def set_unschedulable(self, name: str, unschedulable: bool) -> KubeNode: ...
    def add_taint(self, name: str, *, key: str, value: str, effect: str = "NoSchedule") -> KubeNode: ...
    def remove_taint(self, name: str, *, key: str, effect: str | None = None) -> KubeNode: ...
    def update_metadata(
        self,
        name: str,
        *,
        labels: dict[str, str | None] | None = None,
        annotations: dict[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> KubeNode: ...
    def pods_on_node(self, name: str) -> list[PodRef]: ...
    def evict(self, pod: PodRef, *, timeout_seconds: float, progress: Progress | None = None) -> str: ...
    def delete_node(self, name: str) -> None: ...


def _translate(exc: Exception, what: str) -> ClientError:
    if isinstance(exc, ApiException):
        status = exc.status or 0
        detail = f"{what}: HTTP {status} {exc.reason}"
        if status == 404:
            return NotFound(detail)
        if status == 409:
            return Conflict(detail)
        if status == 429:
            return TooManyRequests(detail)
        if status in (400, 422):
            return InvalidInput(detail)
        if status >= 500 or status == 0:
            return Unavailable(detail)
        return ClientError(detail)
    return Unavailable(f"{what}: {exc}")


def _node(raw: Any) -> KubeNode:
    meta = raw.metadata
    spec = raw.spec
    conditions = (raw.status.conditions if raw.status else None) or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    taints = [
        {"key": t.key, "value": t.value or "", "effect": t.effect} for t in ((spec.taints if spec else None) or [])
    ]
    return KubeNode(
        name=meta.name,
        labels=dict(meta.labels or {}),
        annotations=dict(meta.annotations or {}),
        unschedulable=bool(spec.unschedulable) if spec else False,
        ready=ready,
        resource_version=meta.resource_version or "",
        taints=taints,
    )


class KubernetesApi:
    """KubeClient over ``kubernetes.client.CoreV1Api``, from a kubeconfig or in-cluster config."""

    def __init__(self, *, kubeconfig: Path | None = None, poll_seconds: float = 0.5) -> None:
        configuration = k8s.Configuration()
        if kubeconfig is not None:
            k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            try:
                k8s_config.load_incluster_config(client_configuration=configuration)
            except k8s_config.ConfigException:
                k8s_config.load_kube_config(client_configuration=configuration)
        # Fail fast to the activity's retry policy instead of urllib3's own long retries.
        configuration.retries = 0
        self._api = k8s.CoreV1Api(k8s.ApiClient(configuration))
        self._poll = poll_seconds
        self.host = configuration.host

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", 15)
        try:
            return fn(*args, **kwargs)
        except (ApiException, Urllib3Error, OSError) as exc:
            raise _translate(exc, what) from None

    def get_node(self, name: str) -> KubeNode:
        name = checked_node_name(name)
        return _node(self._call(f"read node {name}", self._api.read_node, name))

    def list_nodes(self, *, label_selector: str = "") -> list[KubeNode]:
        result = self._call("list nodes", self._api.list_node, label_selector=label_selector)
        return [_node(item) for item in result.items]

    def _patch(self, name: str, body: dict[str, Any]) -> KubeNode:
        return _node(self._call(f"patch node {name}", self._api.patch_node, name, body))

    def set_unschedulable(self, name: str, unschedulable: bool) -> KubeNode:
        current = self.get_node(name)
        if current.unschedulable == unschedulable:
            return current
        return self._patch(name, {"spec": {"unschedulable": unschedulable}})

    def add_taint(self, name: str, *, key: str, value: str, effect: str = "NoSchedule") -> KubeNode:
        current = self.get_node(name)
        if any(t["key"] == key and t["effect"] == effect for t in current.taints):
            return current
        taints = [*current.taints, {"key": key, "value": value, "effect": effect}]
        # The taint list is replaced whole, so guard it with the version we read it at.
        body = {"metadata": {"resourceVersion": current.resource_version}, "spec": {"taints": taints}}
        return self._patch(name, body)

    def remove_taint(self, name: str, *, key: str, effect: str | None = None) -> KubeNode:
        """Remove the taints with ``key`` (only those with ``effect`` when given); none there: a no-op."""
        current = self.get_node(name)
        kept = [t for t in current.taints if not (t["key"] == key and effect in (None, t["effect"]))]
        if len(kept) == len(current.taints):
            return current
        # The taint list is replaced whole, so guard it with the version we read it at.
        body = {"metadata": {"resourceVersion": current.resource_version}, "spec": {"taints": kept}}
        return self._patch(name, body)

    def update_metadata(
        self,
        name: str,
        *,
        labels: dict[str, str | None] | None = None,
        annotations: dict[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> KubeNode:
        name = checked_node_name(name)
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = labels
        if annotations:
            metadata["annotations"] = annotations
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        return self._patch(name, {"metadata": metadata})

    def pods_on_node(self, name: str) -> list[PodRef]:
        name = checked_node_name(name)
        result = self._call(
            f"list pods on {name}",
            self._api.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={name}",
        )
        pods = []
        for item in result.items:
            owners = item.metadata.owner_references or []
            pods.append(
                PodRef(
                    namespace=item.metadata.namespace,
                    name=item.metadata.name,
                    owner_kind=owners[0].kind if owners else "",
                )
            )
        return pods

    def evict(self, pod: PodRef, *, timeout_seconds: float, progress: Progress | None = None) -> str:
        """Evict through the eviction API; past the deadline, delete the pod.

        Returns:
            ``"evicted"``, ``"deleted"`` (forced after the deadline) or ``"gone"``.
        """
        body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=pod.name, namespace=pod.namespace))
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                self._call(
                    f"evict {pod.key}",
                    self._api.create_namespaced_pod_eviction,
                    pod.name,
                    pod.namespace,
                    body,
                )
                return "evicted"
            except NotFound:
                return "gone"
            except TooManyRequests:
                if time.monotonic() >= deadline:
                    break
                if progress:
                    progress(f"eviction of {pod.key} refused by a PodDisruptionBudget; retrying")
                time.sleep(self._poll)
        try:
            self._call(
                f"delete {pod.key}",
                self._api.delete_namespaced_pod,
                pod.name,
                pod.namespace,
                grace_period_seconds=0,
            )
        except NotFound:
            return "gone"
        return "deleted"

    def delete_node(self, name: str) -> None:
        name = checked_node_name(name)
        try:
            self._call(f"delete node {name}", self._api.delete_node, name)
        except NotFound:
            return
