"""Kubernetes through the official client: nodes, cordon, taints, pods, evictions, and Leases as mutexes."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from urllib3.exceptions import HTTPError as Urllib3Error

from clients.dryrun import refuse_writes
from clients.errors import (
    ClientError,
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    TooManyRequests,
    Unavailable,
    checked_node_name,
    error_for_status,
    redact,
)

log = logging.getLogger("gpufleet.kube")

Progress = Callable[[str], None]

# A Lease's name is a DNS-1123 subdomain; a namespace's a DNS-1123 label.
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LEASE_NAME_MAX = 253
_NAMESPACE_MAX = 63


class KubeNode(BaseModel):
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    unschedulable: bool = False
    ready: bool = False
    resource_version: str = ""
    taints: list[dict[str, str]] = Field(default_factory=list)
    boot_id: str = ""  # status.nodeInfo.bootID: a new one after every reboot


class PodRef(BaseModel):
    namespace: str
    name: str
    owner_kind: str = ""
    owner_name: str = ""  # the controller that owns it (a NodeSet's name for a Slinky worker pod)
    uid: str = ""  # this pod's, not a successor's under the same name
    node: str = ""  # spec.nodeName ("" while Pending)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    ready: bool = False  # its Ready condition is True
    phase: str = ""  # Pending, Running, Succeeded, Failed
    terminating: bool = False  # deleted (or evicted), and not gone yet
    tolerations: list[dict[str, str]] = Field(default_factory=list)  # key, operator, value, effect

    def tolerates(self, *, key: str, value: str, effect: str, by_name: bool = False) -> bool:
        """Whether the pod may stay on (or be placed on) a node with this taint, as the scheduler
        judges. ``by_name``: only a toleration that names the taint's key counts, not one that
        tolerates every taint (what system agents carry)."""
        for toleration in self.tolerations:
            if toleration.get("effect") not in (None, "", effect):
                continue
            if by_name and toleration.get("key") != key:
                continue
            if toleration.get("operator") == "Exists" and toleration.get("key") in (None, "", key):
                return True
            if toleration.get("key") == key and toleration.get("value", "") == value:
                return True
        return False

    @property
    def holds_node(self) -> bool:
        """Whether the pod still runs (or is about to) on its node: not finished."""
        return self.phase not in ("Succeeded", "Failed")

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
    def find_pod(self, namespace: str, name: str) -> PodRef | None: ...
    def get_nodeset(self, namespace: str, name: str) -> dict[str, Any]: ...
    def list_nodesets(self, namespace: str) -> list[dict[str, Any]]: ...
    def evict(
        self, pod: PodRef, *, timeout_seconds: float, progress: Progress | None = None, force: bool = True
    ) -> str: ...
    def delete_node(self, name: str) -> None: ...
    def create_job(self, namespace: str, body: dict[str, Any]) -> bool: ...
    def job_state(self, namespace: str, name: str) -> JobState: ...
    def job_annotations(self, namespace: str, name: str) -> dict[str, str]: ...
    def stop_job(self, namespace: str, name: str, *, annotations: dict[str, str]) -> None: ...
    def list_jobs(self, namespace: str, *, label_selector: str = "") -> list[JobSummary]: ...
    def job_exit(self, namespace: str, name: str) -> JobExit | None: ...
    def update_config_map(
        self, namespace: str, name: str, change: Callable[[dict[str, str]], dict[str, str]]
    ) -> dict[str, str]: ...
    def lease(self, name: str, *, namespace: str, holder: str) -> AbstractContextManager[object]: ...


def _translate(exc: Exception, what: str) -> ClientError:
    if isinstance(exc, ApiException):
        status = exc.status or 0
        detail = f"{what}: HTTP {status} {exc.reason}"
        if status in (400, 422):
            detail += _refusal(exc.body)
        if status in (401, 403):
            return Forbidden(f"{detail} (check gpufleet's RBAC: deploy/base/worker-rbac.yaml)")
        return error_for_status(status, detail)
    return Unavailable(f"{what}: {exc}")


def _refusal(body: Any) -> str:
    """What the API server says is wrong with a refused write (its Status message), as
    ``: Node "x" is invalid: metadata.labels: ...``; nothing when it said nothing readable."""
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        return ""
    return f": {redact(str(message), limit=600)}" if message else ""


def _node(raw: dict[str, Any]) -> KubeNode:
    """A Node as the API server's JSON has it (read without the client's models)."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    conditions = status.get("conditions") or []
    return KubeNode(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        unschedulable=bool(spec.get("unschedulable")),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        resource_version=meta.get("resourceVersion") or "",
        taints=[
            {"key": t.get("key", ""), "value": t.get("value") or "", "effect": t.get("effect", "")}
            for t in spec.get("taints") or []
        ],
        boot_id=(status.get("nodeInfo") or {}).get("bootID") or "",
    )


def _pod_ref(item: Any) -> PodRef:
    """A Pod as the client's model has it, as gpufleet reads it."""
    owners = item.metadata.owner_references or []
    owner = next((o for o in owners if o.controller), owners[0] if owners else None)
    status = item.status
    return PodRef(
        namespace=item.metadata.namespace,
        name=item.metadata.name,
        owner_kind=owner.kind if owner else "",
        owner_name=owner.name if owner else "",
        uid=item.metadata.uid or "",
        node=(item.spec.node_name if item.spec else None) or "",
        labels=dict(item.metadata.labels or {}),
        annotations=dict(item.metadata.annotations or {}),
        ready=any(c.type == "Ready" and c.status == "True" for c in ((status.conditions if status else None) or [])),
        phase=(status.phase if status else "") or "",
        terminating=item.metadata.deletion_timestamp is not None,
        tolerations=[
            {
                "key": t.key or "",
                "operator": t.operator or "Equal",
                "value": t.value or "",
                "effect": t.effect or "",
            }
            for t in ((item.spec.tolerations if item.spec else None) or [])
        ],
    )


T = TypeVar("T")


def retry_conflicts(write: Callable[[], T], *, attempts: int) -> T:
    """Run a read-modify-write guarded by a resourceVersion again (from a fresh read) while it
    loses races to other writers, ``attempts`` times in all."""
    for _ in range(attempts - 1):
        try:
            return write()
        except Conflict:
            continue
    return write()


def lease_name(text: str) -> str:
    """``text`` made a valid Lease name (a DNS-1123 subdomain): lowercased, other characters as ``-``.

    When that changes anything (or the name is too long), a short hash of ``text`` is appended,
    so that two different texts (``gpu_A`` and ``gpu-a``) never share a Lease.
    """
    cleaned = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    cleaned = re.sub(r"-{2,}", "-", cleaned)
    if cleaned == text and len(cleaned) <= _LEASE_NAME_MAX:
        return cleaned
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    head = cleaned[: _LEASE_NAME_MAX - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}" if head else digest


def checked_object_name(name: str, kind: str = "Lease") -> str:
    """``name`` when it is a valid name for an object of ``kind`` (a DNS-1123 subdomain: Leases,
    Pods, ServiceAccounts...), else InvalidInput."""
    if not isinstance(name, str) or len(name) > _LEASE_NAME_MAX or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise InvalidInput(f"invalid {kind} name {name!r}: a DNS-1123 subdomain (a-z, 0-9, '-', '.') is needed")
    return name


def checked_lease_name(name: str) -> str:
    """``name`` when it is a valid Lease name (a DNS-1123 subdomain), else InvalidInput."""
    return checked_object_name(name, "Lease")


def checked_namespace(namespace: str) -> str:
    """``namespace`` when it is a valid namespace name (a DNS-1123 label), else InvalidInput."""
    if not isinstance(namespace, str) or len(namespace) > _NAMESPACE_MAX or not _DNS1123_LABEL.fullmatch(namespace):
        raise InvalidInput(f"invalid namespace {namespace!r}: a DNS-1123 label (a-z, 0-9, '-') is needed")
    return namespace


@dataclass(frozen=True)
class JobState:
    finished: bool
    succeeded: bool
    message: str = ""
    age_seconds: float = 0.0  # since the Job was created (deadlines count from there, retries or not)


@dataclass(frozen=True)
class JobExit:
    """How a Job's container ended: its exit status and its termination message (what it wrote
    to /dev/termination-log, or its last output when it failed and the Job asked for that)."""

    exit_code: int
    message: str = ""


@dataclass(frozen=True)
class JobSummary:
    """A Job as a listing shows it: enough to tell whose it is and whether it still runs."""

    name: str
    namespace: str
    annotations: dict[str, str]
    node: str  # the node its pods are pinned to ("" when none)
    active: bool  # neither finished nor suspended


class _Blank:
    message: str | None = None
    reason: str | None = None


# The most Kubernetes calls one process makes at once: a worker's activity threads.
CONNECTIONS = 64
# How long one request may take by default (GPUFLEET_KUBE_TIMEOUT_SECONDS sets the worker's).
REQUEST_TIMEOUT_SECONDS = 15.0


def api_client(kubeconfig: Path | None = None) -> k8s.ApiClient:
    """The official client's ApiClient from ``kubeconfig``, else the in-cluster config, else the
    default kubeconfig; no urllib3 retries, and a connection per thread that may call at once."""
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
    # One connection per activity thread that may call at once: urllib3's default (5 per CPU)
    # made a burst open and discard a connection per request ("Connection pool is full").
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, CONNECTIONS)
    return k8s.ApiClient(configuration)


class KubernetesApi:
    """KubeClient over ``kubernetes.client.CoreV1Api``, from a kubeconfig or in-cluster config."""

    _request_timeout: float = REQUEST_TIMEOUT_SECONDS

    def __init__(
        self,
        *,
        kubeconfig: Path | None = None,
        poll_seconds: float = 0.5,
        request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
    ) -> None:
        if not request_timeout_seconds > 0:
            raise ValueError(f"a request timeout is a positive number of seconds, not {request_timeout_seconds!r}")
        client = api_client(kubeconfig)
        self._api = k8s.CoreV1Api(client)
        self._coordination = k8s.CoordinationV1Api(client)
        self._batch = k8s.BatchV1Api(client)
        self._custom = k8s.CustomObjectsApi(client)
        self._poll = poll_seconds
        self._request_timeout = request_timeout_seconds
        self.host: str = client.configuration.host

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not fn.__name__.startswith(("read_", "list_")):
            refuse_writes(what)
        kwargs.setdefault("_request_timeout", self._request_timeout)
        try:
            return fn(*args, **kwargs)
        except (ApiException, Urllib3Error, OSError) as exc:
            raise _translate(exc, what) from None

    def _call_json(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``_call``, the answer read as JSON rather than into the client's models: a claim lists
        every spare (a thousand Nodes in a large fleet), and sixty-four claims at once held that
        many models each."""
        response = self._call(what, fn, *args, _preload_content=False, **kwargs)
        try:
            data: dict[str, Any] = json.loads(response.data)
        except (Urllib3Error, OSError) as exc:  # the body cut off or timed out while read
            raise _translate(exc, what) from None
        except ValueError as exc:
            raise ClientError(f"{what}: the API server's answer is not JSON: {exc}") from None
        finally:
            response.release_conn()
        return data

    def get_node(self, name: str) -> KubeNode:
        name = checked_node_name(name)
        return _node(self._call_json(f"read node {name}", self._api.read_node, name))

    def list_nodes(self, *, label_selector: str = "") -> list[KubeNode]:
        listed = self._call_json("list nodes", self._api.list_node, label_selector=label_selector)
        return [_node(item) for item in listed.get("items") or []]

    def _patch(self, name: str, body: dict[str, Any]) -> KubeNode:
        return _node(self._call_json(f"patch node {name}", self._api.patch_node, name, body))

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
        return [_pod_ref(item) for item in result.items]

    def pods_in(self, namespace: str) -> list[PodRef]:
        """The pods of a namespace now."""
        namespace = checked_namespace(namespace)
        result = self._call(f"list pods in {namespace}", self._api.list_namespaced_pod, namespace)
        return [_pod_ref(item) for item in result.items]

    def find_pod(self, namespace: str, name: str) -> PodRef | None:
        """The pod of that name now (a successor under the same name has another ``uid``); None
        when there is none. Listed by name rather than read: the worker lists pods, never reads one."""
        namespace = checked_namespace(namespace)
        result = self._call(
            f"find pod {namespace}/{name}",
            self._api.list_namespaced_pod,
            namespace,
            field_selector=f"metadata.name={name}",
        )
        found = [_pod_ref(item) for item in result.items if item.metadata.name == name]
        return found[0] if found else None

    def get_nodeset(self, namespace: str, name: str) -> dict[str, Any]:
        """A Slinky NodeSet (``slinky.slurm.net/v1beta1``) as the API server has it; NotFound when none."""
        namespace = checked_namespace(namespace)
        found: dict[str, Any] = self._call(
            f"read NodeSet {namespace}/{name}",
            self._custom.get_namespaced_custom_object,
            "slinky.slurm.net",
            "v1beta1",
            namespace,
            "nodesets",
            name,
        )
        return found

    def list_nodesets(self, namespace: str) -> list[dict[str, Any]]:
        """The Slinky NodeSets of ``namespace``; none when the API server does not serve the
        NodeSet resource at all (slurm-operator's CRDs not installed)."""
        namespace = checked_namespace(namespace)
        try:
            found: dict[str, Any] = self._call(
                f"list NodeSets in {namespace}",
                self._custom.list_namespaced_custom_object,
                "slinky.slurm.net",
                "v1beta1",
                namespace,
                "nodesets",
            )
        except NotFound:
            return []
        return list(found.get("items") or [])

    def update_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        labels: dict[str, str | None] | None = None,
        annotations: dict[str, str | None] | None = None,
    ) -> None:
        """Labels and annotations on one pod (None: removed); NotFound when there is no such pod."""
        namespace = checked_namespace(namespace)
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = labels
        if annotations:
            metadata["annotations"] = annotations
        self._call(
            f"patch pod {namespace}/{name}", self._api.patch_namespaced_pod, name, namespace, {"metadata": metadata}
        )

    def patch_nodeset(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of a Slinky NodeSet (its replicas, an annotation), guarded by the
        resourceVersion the body names, if any (Conflict when it is stale)."""
        namespace = checked_namespace(namespace)
        found: dict[str, Any] = self._call(
            f"patch NodeSet {namespace}/{name}",
            self._custom.patch_namespaced_custom_object,
            "slinky.slurm.net",
            "v1beta1",
            namespace,
            "nodesets",
            name,
            body,
        )
        return found

    def evict(
        self, pod: PodRef, *, timeout_seconds: float, progress: Progress | None = None, force: bool = True
    ) -> str:
        """Evict through the eviction API; past the deadline, delete the pod (``force``), or
        raise TooManyRequests: the PodDisruptionBudget is kept.

        Returns:
            ``"evicted"``, ``"deleted"`` (forced after the deadline) or ``"gone"`` (no such pod, or,
            when ``pod.uid`` is known, only a successor of that name).
        """
        # With the pod's UID as a precondition: a successor under the same name (a NodeSet's pod
        # recreated while this retried) is never the one evicted; the API server answers 409.
        preconditions = k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=pod.uid)) if pod.uid else None
        body = k8s.V1Eviction(
            metadata=k8s.V1ObjectMeta(name=pod.name, namespace=pod.namespace), delete_options=preconditions
        )
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
            except Conflict:
                if not pod.uid:
                    raise
                return "gone"  # the UID differs: the pod meant is gone, another has its name
            except TooManyRequests:
                if time.monotonic() >= deadline:
                    if not force:
                        raise TooManyRequests(
                            f"evicting {pod.key} would break its PodDisruptionBudget, still after {timeout_seconds:g}s"
                        ) from None
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

    def create_job(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create a Job (False when one of that name exists already: a retry finds its own)."""
        namespace = checked_namespace(namespace)
        name = body["metadata"]["name"]
        try:
            self._call(f"create job {namespace}/{name}", self._batch.create_namespaced_job, namespace, body)
        except Conflict:
            return False
        return True

    def job_state(self, namespace: str, name: str) -> JobState:
        """Whether the Job has completed or failed yet, with the reason its conditions give."""
        job = self._call(
            f"read job {namespace}/{name}", self._batch.read_namespaced_job, name, checked_namespace(namespace)
        )
        status = job.status
        created = job.metadata.creation_timestamp if job.metadata else None
        age = (datetime.datetime.now(datetime.UTC) - created).total_seconds() if created else 0.0
        conditions = list(status.conditions or []) if status else []
        done = {c.type: c for c in conditions if c.status == "True"}
        if "Complete" in done or (status and (status.succeeded or 0) > 0):
            message = (done.get("Complete") or _Blank()).message or ""
            return JobState(finished=True, succeeded=True, message=message, age_seconds=age)
        if "Failed" in done or (status and (status.failed or 0) > 0):
            failed = done.get("Failed") or _Blank()
            message = failed.message or failed.reason or "failed"
            return JobState(finished=True, succeeded=False, message=message, age_seconds=age)
        return JobState(finished=False, succeeded=False, message="running", age_seconds=age)

    def job_annotations(self, namespace: str, name: str) -> dict[str, str]:
        job = self._call(
            f"read job {namespace}/{name}", self._batch.read_namespaced_job, name, checked_namespace(namespace)
        )
        return dict(job.metadata.annotations or {})

    def stop_job(self, namespace: str, name: str, *, annotations: dict[str, str]) -> None:
        """Suspend the Job (its running pods are stopped) and annotate it; the Job itself stays,
        as the record of its attempt."""
        body = {"metadata": {"annotations": annotations}, "spec": {"suspend": True}}
        self._call(
            f"stop job {namespace}/{name}",
            self._batch.patch_namespaced_job,
            name,
            checked_namespace(namespace),
            body,
        )

    def list_jobs(self, namespace: str, *, label_selector: str = "") -> list[JobSummary]:
        """The namespace's Jobs with the labels, each with its node and whether it still runs."""
        namespace = checked_namespace(namespace)
        listed = self._call_json(
            f"list jobs in {namespace}", self._batch.list_namespaced_job, namespace, label_selector=label_selector
        )
        jobs = []
        for item in listed.get("items") or []:
            metadata, spec, status = item.get("metadata") or {}, item.get("spec") or {}, item.get("status") or {}
            conditions = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
            ended = status.get("succeeded") or status.get("failed")
            finished = bool(conditions & {"Complete", "Failed"}) or bool(ended)
            jobs.append(
                JobSummary(
                    name=str(metadata.get("name", "")),
                    namespace=namespace,
                    annotations=dict(metadata.get("annotations") or {}),
                    node=str(((spec.get("template") or {}).get("spec") or {}).get("nodeName") or ""),
                    active=not finished and not spec.get("suspend"),
                )
            )
        return jobs

    def job_exit(self, namespace: str, name: str) -> JobExit | None:
        """How the container of the Job's last pod ended (None: no pod of it has ended)."""
        namespace = checked_namespace(namespace)
        listed = self._call_json(
            f"list pods of job {namespace}/{name}",
            self._api.list_namespaced_pod,
            namespace,
            label_selector=f"job-name={checked_object_name(name, 'Job')}",
        )
        ended: list[tuple[str, JobExit]] = []
        for pod in listed.get("items") or []:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                terminated = (container.get("state") or {}).get("terminated")
                if terminated is not None:
                    at = str(terminated.get("finishedAt") or "")
                    code = int(terminated.get("exitCode") or 0)
                    ended.append((at, JobExit(exit_code=code, message=str(terminated.get("message") or ""))))
        return max(ended, key=lambda pair: pair[0])[1] if ended else None

    def update_config_map(
        self, namespace: str, name: str, change: Callable[[dict[str, str]], dict[str, str]]
    ) -> dict[str, str]:
        """Make the ConfigMap's data ``change(data)`` (created when there is none), guarded by the
        resourceVersion read, read and changed again on a conflict: two writers never lose each
        other's change. Returns the data written."""
        ns = checked_namespace(namespace)
        name = checked_object_name(name, "ConfigMap")

        def write() -> dict[str, str]:
            try:
                found = self._call(f"read configmap {ns}/{name}", self._api.read_namespaced_config_map, name, ns)
            except NotFound:
                data = change({})
                body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}}
                try:
                    self._call(
                        f"create configmap {ns}/{name}",
                        self._api.create_namespaced_config_map,
                        ns,
                        {**body, "data": data},
                    )
                except Conflict:  # made meanwhile by another writer: read it and change that
                    raise Conflict(f"configmap {ns}/{name} was created meanwhile") from None
                return data
            before = dict(found.data or {})
            data = change(dict(before))
            if data == before:
                return data
            found.data = data
            self._call(f"update configmap {ns}/{name}", self._api.replace_namespaced_config_map, name, ns, found)
            return data

        return retry_conflicts(write, attempts=8)

    def _object_calls(
        self, obj: dict[str, Any]
    ) -> tuple[str, Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        """What the object is called, and how to create, delete and read it."""
        kind, meta = obj["kind"], obj["metadata"]
        name, namespace = meta["name"], meta.get("namespace", "")
        what = f"{kind} {namespace + '/' if namespace else ''}{name}"
        if kind == "Namespace":
            return (
                what,
                (lambda **kw: self._api.create_namespace(obj, **kw)),  # type: ignore[arg-type]
                (lambda **kw: self._api.delete_namespace(name, **kw)),
                (lambda **kw: self._api.read_namespace(name, **kw)),
            )
        core = {
            "Secret": "secret",
            "ConfigMap": "config_map",
            "PersistentVolumeClaim": "persistent_volume_claim",
        }
        if kind in core:
            create, delete, read = (
                getattr(self._api, f"{verb}_namespaced_{core[kind]}") for verb in ("create", "delete", "read")
            )
            ns = checked_namespace(namespace)
            return (
                what,
                (lambda **kw: create(ns, obj, **kw)),
                (lambda **kw: delete(name, ns, **kw)),
                (lambda **kw: read(name, ns, **kw)),
            )
        group, _, version = obj["apiVersion"].partition("/")
        if not version:
            raise InvalidInput(f"{what}: gpufleet does not create {obj['apiVersion']} objects")
        plural = kind.lower() + ("es" if kind.endswith("s") else "s")
        ns = checked_namespace(namespace)
        custom = self._custom
        return (
            what,
            lambda **kw: custom.create_namespaced_custom_object(group, version, ns, plural, obj, **kw),
            lambda **kw: custom.delete_namespaced_custom_object(group, version, ns, plural, name, **kw),
            lambda **kw: custom.get_namespaced_custom_object(group, version, ns, plural, name, **kw),
        )

    def create_object(self, obj: dict[str, Any]) -> bool:
        """Create a Namespace, Secret, ConfigMap, PersistentVolumeClaim or namespaced custom
        object; False when it exists already (a retry finds its own)."""
        what, create, _, _ = self._object_calls(obj)
        try:
            self._call(f"create {what}", create)
        except Conflict:
            return False
        return True

    def config_map_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """A ConfigMap's data; None when there is no such ConfigMap."""
        try:
            found = self._call(
                f"read configmap {namespace}/{name}",
                self._api.read_namespaced_config_map,
                name,
                checked_namespace(namespace),
            )
        except NotFound:
            return None
        return dict(found.data or {})

    def secret(self, namespace: str, name: str) -> tuple[dict[str, bytes], dict[str, str]] | None:
        """A Secret's data (decoded) and labels; None when there is no such Secret."""
        try:
            found = self._call(
                f"read secret {namespace}/{name}",
                self._api.read_namespaced_secret,
                name,
                checked_namespace(namespace),
            )
        except NotFound:
            return None
        data = {key: base64.b64decode(value) for key, value in (found.data or {}).items()}
        return data, dict(found.metadata.labels or {})

    def secret_data(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's data, decoded; None when there is no such Secret."""
        found = self.secret(namespace, name)
        return None if found is None else found[0]

    def replace_secret_data(self, namespace: str, name: str, data: dict[str, bytes]) -> bool:
        """Make ``data`` the Secret's whole data (keys not in it go), keeping its labels and
        annotations; guarded by the resourceVersion read, read again on a conflict. False when
        there is no such Secret (it is never created here)."""
        ns = checked_namespace(namespace)
        encoded = {key: base64.b64encode(value).decode() for key, value in data.items()}

        def write() -> bool:
            try:
                found = self._call(f"read secret {ns}/{name}", self._api.read_namespaced_secret, name, ns)
            except NotFound:
                return False
            if dict(found.data or {}) == encoded:
                return True  # already so: nothing to write
            found.data = encoded
            found.string_data = None
            try:
                self._call(f"update secret {ns}/{name}", self._api.replace_namespaced_secret, name, ns, found)
            except NotFound:
                return False
            return True

        return retry_conflicts(write, attempts=5)

    def service_address(self, namespace: str, name: str, *, external: bool = False) -> tuple[str, int] | None:
        """A Service's cluster IP and first port; None when there is no such Service, or it has
        neither yet. ``external``: a LoadBalancer's ingress IP or hostname first, when it has one."""
        try:
            found = self._call(
                f"read service {namespace}/{name}",
                self._api.read_namespaced_service,
                name,
                checked_namespace(namespace),
            )
        except NotFound:
            return None
        spec = found.spec
        if spec is None or not spec.ports:
            return None
        ingress = (found.status.load_balancer.ingress if found.status and found.status.load_balancer else None) or []
        if external and ingress and (ingress[0].ip or ingress[0].hostname):
            return str(ingress[0].ip or ingress[0].hostname), int(spec.ports[0].port)
        if not spec.cluster_ip or spec.cluster_ip == "None":
            return None
        return str(spec.cluster_ip), int(spec.ports[0].port)

    def object_exists(self, obj: dict[str, Any]) -> bool:
        return self.object_annotations(obj) is not None

    def object_annotations(self, obj: dict[str, Any]) -> dict[str, str] | None:
        """The object's annotations as stored; None when it does not exist."""
        what, _, _, read = self._object_calls(obj)
        try:
            found = self._call(f"read {what}", read)
        except NotFound:
            return None
        if isinstance(found, dict):  # a custom object
            return dict((found.get("metadata") or {}).get("annotations") or {})
        return dict(found.metadata.annotations or {}) if found.metadata else {}

    def delete_object(self, obj: dict[str, Any]) -> bool:
        """Delete it; False when it was gone already."""
        what, _, delete, _ = self._object_calls(obj)
        try:
            self._call(f"delete {what}", delete)
        except NotFound:
            return False
        return True

    def delete_node(self, name: str) -> None:
        name = checked_node_name(name)
        try:
            self._call(f"delete node {name}", self._api.delete_node, name)
        except NotFound:
            return

    def lease(
        self,
        name: str,
        *,
        namespace: str,
        holder: str,
        duration_seconds: int = 15,
        wait_seconds: float = 30.0,
        poll_seconds: float = 0.05,
    ) -> KubeLease:
        """A mutex over the Lease ``namespace/name``, held as ``holder``: ``with kube.lease(...): ...``."""
        return KubeLease(
            self,
            name=name,
            namespace=namespace,
            holder=holder,
            duration_seconds=duration_seconds,
            wait_seconds=wait_seconds,
            poll_seconds=poll_seconds,
        )


# One lock per Lease and holder identity in each process: the threads that share an identity
# take turns, so a Lease held under that identity is only ever held by one of them.
_local_locks: dict[tuple[str, str, str, str], threading.Lock] = {}
_local_locks_guard = threading.Lock()


def _local_lock(key: tuple[str, str, str, str]) -> threading.Lock:
    with _local_locks_guard:
        return _local_locks.setdefault(key, threading.Lock())


def _micro_time() -> str:
    """Now as a Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeLease:
    """A mutex across processes and machines over a ``coordination.k8s.io/v1`` Lease, by client-go's rules.

    Taking it: create the Lease with us as holder (409 AlreadyExists: it exists, read it), or
    replace it at the resourceVersion we read when it is free, ours, or expired (409: we lost
    the race, read again). A Lease held by someone else counts as expired only when its
    resourceVersion has not changed for its leaseDurationSeconds as observed by THIS process's
    monotonic clock: no clocks of two machines are ever compared. While held, a thread renews
    it every third of its duration, so a long critical section keeps it; a holder that dies
    or hangs stops renewing and loses it after the duration.

    ``acquire`` polls until ``wait_seconds`` have passed, then raises Unavailable naming the
    holder. ``release`` clears the holder; it never raises (a Lease it could not clear expires).
    Leaving the ``with`` block raises Conflict when the Lease was lost while held.
    """

    def __init__(
        self,
        kube: KubernetesApi,
        *,
        name: str,
        namespace: str,
        holder: str,
        duration_seconds: int = 15,
        wait_seconds: float = 30.0,
        poll_seconds: float = 0.05,
    ) -> None:
        self.name = checked_lease_name(name)
        self.namespace = checked_namespace(namespace)
        if not holder or not isinstance(holder, str):
            raise InvalidInput("a Lease needs a holder identity")
        if duration_seconds < 1:
            raise InvalidInput(f"a Lease lasts at least 1 s, not {duration_seconds}")
        self.holder = holder
        self.duration_seconds = int(duration_seconds)
        self._kube = kube
        self._api = kube._coordination
        self._wait = wait_seconds
        self._poll = poll_seconds
        self._local = _local_lock((kube.host, self.namespace, self.name, holder))
        self._io = threading.Lock()  # the renewing thread and the caller never write the Lease at once
        self._lease: Any = None  # the Lease as we last wrote it (held) or None
        self._lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        # What this process last saw of someone else's Lease, and when (time.monotonic()).
        self._observed_version = ""
        self._observed_at = 0.0
        self.last_holder = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def held(self) -> bool:
        return self._lease is not None and not self._lost

    # -- taking it ----------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the Lease, waiting up to ``wait_seconds``; Unavailable naming the holder after that."""
        if self._lease is not None:
            raise InvalidInput(f"lease {self.key} is already held by this object")
        deadline = time.monotonic() + self._wait
        if not self._local.acquire(timeout=self._wait):
            raise Unavailable(
                f"lease {self.key} is held by {self.holder} (another thread of this process); "
                f"gave up after {self._wait:g} s"
            )
        try:
            while not self._try_acquire():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(
                        f"lease {self.key} is held by {self.last_holder or 'someone else'}; "
                        f"gave up after {self._wait:g} s"
                    )
                time.sleep(min(self._poll, left))
        except BaseException:
            self._local.release()
            raise
        self._lost = False
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name=f"lease-{self.name}", daemon=True)
        self._renewer.start()

    def _read(self) -> Any:
        return self._kube._call(
            f"read lease {self.key}",
            self._api.read_namespaced_lease,
            self.name,
            self.namespace,
            _request_timeout=self._call_timeout,
        )

    def _try_acquire(self) -> bool:
        now = time.monotonic()
        try:
            current = self._read()
        except NotFound:
            return self._create()
        version = current.metadata.resource_version or ""
        if version != self._observed_version:
            self._observed_version, self._observed_at = version, now
        spec = current.spec or k8s.V1LeaseSpec()
        holder = spec.holder_identity or ""
        duration = spec.lease_duration_seconds or self.duration_seconds
        if holder and holder != self.holder and now < self._observed_at + duration:
            self.last_holder = holder
            return False
        if holder and holder != self.holder:
            log.warning("lease %s: %s let it expire (unchanged for %ss); taking it over", self.key, holder, duration)
        stamp = _micro_time()
        current.spec = spec
        if holder != self.holder:
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.holder
        spec.lease_duration_seconds = self.duration_seconds
        spec.acquire_time = stamp
        spec.renew_time = stamp
        try:
            # The read resourceVersion rides in the body: a write since our read answers 409.
            self._lease = self._replace(current)
        except (Conflict, NotFound):
            return False  # someone else wrote it (or deleted it) since our read: read again
        return True

    def _create(self) -> bool:
        stamp = _micro_time()
        body = k8s.V1Lease(
            metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=k8s.V1LeaseSpec(
                holder_identity=self.holder,
                lease_duration_seconds=self.duration_seconds,
                acquire_time=stamp,
                renew_time=stamp,
                lease_transitions=0,
            ),
        )
        try:
            self._lease = self._kube._call(
                f"create lease {self.key}", self._api.create_namespaced_lease, self.namespace, body
            )
        except Conflict:
            return False  # AlreadyExists: someone created it first; read it next time round
        return True

    def _replace(self, body: Any) -> Any:
        return self._kube._call(
            f"replace lease {self.key}",
            self._api.replace_namespaced_lease,
            self.name,
            self.namespace,
            body,
            _request_timeout=self._call_timeout,
        )

    @property
    def _call_timeout(self) -> float:
        # A renew slower than a third of the duration is a renew that did not happen.
        return max(1.0, self.duration_seconds / 3)

    # -- keeping it ---------------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(self.duration_seconds / 3):
            try:
                self._renew()
                renewed = time.monotonic()
            except Exception as exc:
                log.warning("lease %s: could not renew (%s); trying again", self.key, exc)
            if time.monotonic() - renewed > self.duration_seconds * 2 / 3:
                # Others may take it over soon: count it lost now, so the edit fails and is retried.
                self._lost = True
            if self._lost:
                return

    def _renew(self) -> None:
        with self._io:
            if self._lease is None or self._stop.is_set():
                return
            spec = self._lease.spec
            spec.acquire_time = _as_micro_time(spec.acquire_time) if spec.acquire_time else _micro_time()
            spec.renew_time = _micro_time()
            try:
                self._lease = self._replace(self._lease)
            except (Conflict, NotFound):
                self._lost = True
                log.error("lease %s: taken by someone else while %s held it", self.key, self.holder)

    # -- giving it back -----------------------------------------------------------------------------

    def release(self) -> None:
        """Clear the holder so that the next one need not wait; a Lease lost or gone is left alone."""
        if self._lease is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        try:
            with self._io:
                if not self._lost:
                    self._clear()
        finally:
            self._lease = None
            self._local.release()

    def _clear(self) -> None:
        lease = self._lease
        for _ in range(3):
            spec = lease.spec
            if (spec.holder_identity or "") != self.holder:
                return  # someone else's now
            spec.holder_identity = None
            spec.acquire_time = _as_micro_time(spec.acquire_time) if spec.acquire_time else None
            spec.renew_time = _micro_time()
            try:
                self._replace(lease)
                return
            except NotFound:
                return
            except Conflict:
                try:
                    lease = self._read()
                except ClientError:
                    return
            except ClientError as exc:
                log.warning("lease %s: could not release (%s); it expires on its own", self.key, exc)
                return

    def __enter__(self) -> KubeLease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lost = self._lost
        self.release()
        if lost and exc is None:
            raise Conflict(f"lease {self.key} was taken over while {self.holder} held it; retry")


def _as_micro_time(value: Any) -> str:
    """A MicroTime read back (a datetime) as the string the API server parses."""
    if isinstance(value, datetime.datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
        return aware.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return str(value)
