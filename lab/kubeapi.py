"""An emulated Kubernetes API server, built on kmock's KubernetesEmulator.

kmock keeps objects in memory and serves list/get/create/patch/delete. We add what
gpufleet relies on and a real API server does:

- ``resourceVersion`` on every write, and 409 Conflict when a write names a stale one;
- 409 AlreadyExists when a create names an object that exists;
- replace (PUT) of a whole object, which kmock does not serve (Leases are taken and renewed so);
- label selectors and field selectors on lists;
- the eviction subresource: 429 while a PodDisruptionBudget forbids it, else the pod goes.

For bad days on purpose (chaos runs and tests): ``PUT /_faults`` with
``{"status": 500, "count": N, "retry_after": S}`` makes the next N API requests answer that
status (429 with a Retry-After when given); ``{"count": 0}`` clears it.

Run it as ``python -m lab.kubeapi --port N --seed FILE --kubeconfig FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import datetime
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, rendering
from kmock._internal.k8s import KubernetesObjectNotFoundError

from lab import kubetables as tables
from lab.selectors import SelectorError, field_selector, label_selector

PODS = kmock.resource("", "v1", "pods")
NODES = kmock.resource("", "v1", "nodes")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
# resource: (kind, short names, namespaced, subresources)
RESOURCE_INFO: dict[kmock.resource, tuple[str, list[str], bool, list[str]]] = {
    PODS: ("Pod", ["po"], True, ["eviction"]),
    NODES: ("Node", ["no"], False, []),
    PDBS: ("PodDisruptionBudget", ["pdb"], True, []),
    LEASES: ("Lease", [], True, []),
    # Stored as given, so that `kubectl apply -f deploy/` and `kubectl get` work on the lab.
    kmock.resource("", "v1", "namespaces"): ("Namespace", ["ns"], False, []),
    kmock.resource("", "v1", "configmaps"): ("ConfigMap", ["cm"], True, []),
    kmock.resource("", "v1", "serviceaccounts"): ("ServiceAccount", ["sa"], True, []),
    kmock.resource("", "v1", "services"): ("Service", ["svc"], True, []),
    kmock.resource("apps", "v1", "deployments"): ("Deployment", ["deploy"], True, []),
    kmock.resource("apps", "v1", "replicasets"): ("ReplicaSet", ["rs"], True, []),
    kmock.resource("apps", "v1", "daemonsets"): ("DaemonSet", ["ds"], True, []),
    kmock.resource("batch", "v1", "jobs"): ("Job", [], True, []),
    kmock.resource("rbac.authorization.k8s.io", "v1", "roles"): ("Role", [], True, []),
    kmock.resource("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", [], True, []),
    kmock.resource("rbac.authorization.k8s.io", "v1", "clusterroles"): ("ClusterRole", [], False, []),
    kmock.resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings"): ("ClusterRoleBinding", [], False, []),
}


def _selector(pdb: dict[str, Any]) -> dict[str, str]:
    return (pdb.get("spec", {}).get("selector") or {}).get("matchLabels") or {}


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


_REQUEST: contextvars.ContextVar[rendering.Request] = contextvars.ContextVar("request")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Success" if code < 300 else "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=code)


@attrs.define(kw_only=True)
class KubeApiEmulator(kmock.KubernetesEmulator):
    """KubernetesEmulator with resourceVersions, selectors and evictions."""

    _version: int = attrs.field(default=0, init=False)
    _fault_status: int = attrs.field(default=0, init=False)
    _fault_count: int = attrs.field(default=0, init=False)
    _fault_retry_after: int | None = attrs.field(default=None, init=False)
    faults_served: int = attrs.field(default=0, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Declared with what discovery says of them, so that kubectl finds each resource type
        # (by name, kind and short name) and knows what it may do with it.
        for res, (kind, short, namespaced, subresources) in RESOURCE_INFO.items():
            self.resources[res] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=VERBS,
                shortnames=short,
                subresources=subresources,
            )

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        """An APIResourceList as a real API server writes it (the core group is plain "v1";
        a subresource such as pods/eviction names its own kind and verbs)."""
        payload = await super()._serve_version(request)
        assert isinstance(payload, dict)
        if payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]
        for entry in payload.get("resources", []):
            if entry["name"] == "pods/eviction":
                entry.update(kind="Eviction", group="policy", version="v1", verbs=["create"], singularName="")
        return payload

    def next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def seed(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        """Add an object directly (lab set-up), stamped like an API write."""
        meta = obj.setdefault("metadata", {})
        self._stamp_new(meta)
        self.objects[resource, meta.get("namespace"), meta["name"]] = obj

    def _stamp_new(self, meta: dict[str, Any]) -> None:
        meta["resourceVersion"] = self.next_version()
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def _live(self, resource: kmock.resource, namespace: str | None = None) -> list[dict[str, Any]]:
        found = []
        for (res, ns, _name), obj in self.objects.items():
            if res == resource and not obj.deleted and (namespace is None or ns == namespace):
                found.append(dict(obj.raw))
        return found

    def _find(self, resource: kmock.resource, namespace: str | None, name: str) -> Any | None:
        for (res, ns, obj_name), obj in self.objects.items():
            if res == resource and ns == namespace and obj_name == name and not obj.deleted:
                return obj
        return None

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        _REQUEST.set(request)
        if request.url.path == "/_faults":
            return self._set_faults(request)
        if self._fault_count > 0:
            self._fault_count -= 1
            self.faults_served += 1
            response = _status(self._fault_status, "InjectedFault", "a fault injected on purpose (PUT /_faults)")
            if self._fault_retry_after is not None:
                response.headers["Retry-After"] = str(self._fault_retry_after)
            return response
        if request.resource == PODS and request.subresource == "eviction" and request.method == enums.method.POST:
            async with self._write_lock:
                return await self._evict(request)
        if (
            request.resource is not None
            and request.method == enums.method.PUT
            and request.name is not None
            and request.subresource is None
        ):
            async with self._write_lock:
                return await self._replace(request)
        if request.resource is None or request.action not in (enums.action.CREATE, enums.action.UPDATE):
            return await super()._handle(request)
        async with self._write_lock:
            if isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                if request.action == enums.action.CREATE:
                    name = meta.get("name") or request.name
                    if name and self._find(request.resource, request.namespace or meta.get("namespace"), name):
                        return _status(409, "AlreadyExists", f'{request.resource.plural} "{name}" already exists')
                if request.action == enums.action.UPDATE and request.name is not None:
                    current = self._find(request.resource, request.namespace, request.name)
                    wanted = meta.get("resourceVersion")
                    have = current.raw.get("metadata", {}).get("resourceVersion") if current else None
                    if current is not None and wanted and wanted != have:
                        return _status(
                            409,
                            "Conflict",
                            f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": '
                            "the object has been modified; please apply your changes to the latest version "
                            "and try again",
                        )
                    meta["resourceVersion"] = self.next_version()
                else:
                    self._stamp_new(meta)
            return await super()._handle(request)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        """A missing object's 404 worded as a real API server words it (reason NotFound: older
        kubectl and other clients look for exactly that)."""
        if isinstance(exc, KubernetesObjectNotFoundError):
            request = _REQUEST.get(None)
            what = request.resource.plural if request is not None and request.resource is not None else "object"
            name = request.name if request is not None else ""
            return _status(404, "NotFound", f'{what} "{name}" not found')
        return await super()._render_error(exc)

    async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """PUT: the whole object replaced, guarded by its resourceVersion when the body names one."""
        assert request.resource is not None and request.name is not None
        plural = request.resource.plural
        current = self._find(request.resource, request.namespace, request.name)
        if current is None:
            return _status(404, "NotFound", f'{plural} "{request.name}" not found')
        if not isinstance(request.data, dict):
            return _status(400, "BadRequest", "the body of a replace must be a JSON object")
        obj = request.data
        meta = obj.setdefault("metadata", {})
        if meta.get("name", request.name) != request.name:
            return _status(400, "BadRequest", f"the name in the body ({meta.get('name')!r}) is not the URL's")
        have = current.raw.get("metadata", {})
        wanted = meta.get("resourceVersion")
        if wanted and wanted != have.get("resourceVersion"):
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {plural} "{request.name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
            )
        meta["name"] = request.name
        if request.namespace is not None:
            meta["namespace"] = request.namespace
        for kept in ("uid", "creationTimestamp"):
            if kept in have:
                meta[kept] = have[kept]
        meta["resourceVersion"] = self.next_version()
        self.objects[request.resource, request.namespace, request.name] = obj
        await self._buses[request.resource].put({"type": "MODIFIED", "object": obj})
        return aiohttp.web.json_response(obj)

    def _set_faults(self, request: rendering.Request) -> aiohttp.web.Response:
        if request.method == enums.method.GET:
            return aiohttp.web.json_response({"pending": self._fault_count, "served": self.faults_served})
        data = request.data if isinstance(request.data, dict) else {}
        self._fault_status = int(data.get("status", 500))
        self._fault_count = int(data.get("count", 0))
        retry_after = data.get("retry_after")
        self._fault_retry_after = int(retry_after) if retry_after is not None else None
        return aiohttp.web.json_response({"pending": self._fault_count, "served": self.faults_served})

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_list(request)
        assert isinstance(payload, dict)
        try:
            labels = label_selector(request.params.get("labelSelector", ""))
            fields = field_selector(request.params.get("fieldSelector", ""))
        except SelectorError as exc:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=str(exc)) from None
        payload["items"] = [
            item for item in payload["items"] if labels(item.get("metadata", {}).get("labels") or {}) and fields(item)
        ]
        payload["metadata"] = {"resourceVersion": str(self._version)}
        if request.resource == PDBS:
            payload["items"] = [self._with_pdb_status(pdb) for pdb in payload["items"]]
        if request.resource is not None and request.resource in RESOURCE_INFO:
            kind = RESOURCE_INFO[request.resource][0]
            group, version = request.resource.group, request.resource.version
            payload["kind"] = f"{kind}List"
            payload["apiVersion"] = f"{group}/{version}" if group else version
            if "as=Table" in request.headers.get("Accept", ""):
                return tables.table(kind, payload["items"])
        return payload

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_fetch(request)
        if request.resource == PDBS and isinstance(payload, dict):
            payload = self._with_pdb_status(payload)
        if request.resource in RESOURCE_INFO and "as=Table" in request.headers.get("Accept", ""):
            assert request.resource is not None and isinstance(payload, dict)
            return tables.table(RESOURCE_INFO[request.resource][0], [payload])
        return payload

    def _with_pdb_status(self, pdb: dict[str, Any]) -> dict[str, Any]:
        """The budget's status as the disruption controller keeps it, from the pods there are now."""
        expected, healthy, allowed = self._budget(pdb)
        allowed = max(allowed, 0) if _selector(pdb) else 0
        return {
            **pdb,
            "status": {
                **(pdb.get("status") or {}),
                "currentHealthy": healthy,
                "desiredHealthy": healthy - allowed,
                "disruptionsAllowed": allowed,
                "expectedPods": expected,
                "observedGeneration": pdb.get("metadata", {}).get("generation", 1),
            },
        }

    async def _evict(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.name is not None
        pod = self._find(PODS, request.namespace, request.name)
        if pod is None:
            return _status(404, "NotFound", f'pods "{request.name}" not found')
        for pdb in self._live(PDBS, request.namespace):
            selector = _selector(pdb)
            if not selector or not _matches(pod.raw, selector):
                continue
            if self._budget(pdb)[2] <= 0:
                return _status(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                )
        await self._remove(PODS, request.namespace, request.name)
        return _status(201, "", "")

    def _budget(self, pdb: dict[str, Any]) -> tuple[int, int, int]:
        """(pods expected, pods healthy, disruptions allowed) under a budget, from the pods there are now."""
        selector = _selector(pdb)
        namespace = pdb.get("metadata", {}).get("namespace")
        matching = [pod for pod in self._live(PODS, namespace) if selector and _matches(pod, selector)]
        healthy = sum(1 for pod in matching if (pod.get("status") or {}).get("phase", "Running") == "Running")
        spec = pdb.get("spec", {})
        if "minAvailable" in spec:
            return len(matching), healthy, healthy - int(spec["minAvailable"])
        if "maxUnavailable" in spec:
            return len(matching), healthy, int(spec["maxUnavailable"]) - (len(matching) - healthy)
        return len(matching), healthy, 1

    async def _remove(self, resource: kmock.resource, namespace: str | None, name: str) -> None:
        obj = self._find(resource, namespace, name)
        if obj is None:
            return
        raw = dict(obj.raw)
        obj.delete()
        await self._buses[resource].put({"type": "DELETED", "object": raw})


def node_object(name: str, *, pool: str, ready: bool = True) -> dict[str, Any]:
    """A Node as the lab seeds it: Ready, labelled with its gpufleet pool."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "gpufleet.io/pool": pool}},
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _owned(kind: str, name: str, uid: str) -> list[dict[str, Any]]:
    api = "apps/v1"
    return [{"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": True, "blockOwnerDeletion": True}]


def lab_workloads(serving: list[str], every: list[str]) -> dict[str, list[dict[str, Any]]]:
    """What runs on the lab's nodes, owned as a real cluster owns it: an inference Deployment
    (its ReplicaSet's pods on the ``serving`` nodes, a PodDisruptionBudget allowing one down) and
    a node-exporter DaemonSet with a pod on ``every`` node."""
    labels = {"app": "inference"}
    deployment_uid, replicaset_uid, daemonset_uid = (str(uuid.uuid4()) for _ in range(3))
    replicaset = "inference-5c9f7d6b8"
    container = [{"name": "server", "image": "vllm/vllm-openai"}]
    running = {"phase": "Running"}
    return {
        "namespaces": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in ("serving", "monitoring")
        ],
        "deployments": [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "inference", "namespace": "serving", "uid": deployment_uid, "labels": labels},
                "spec": {
                    "replicas": len(serving),
                    "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels}, "spec": {"containers": container}},
                },
            }
        ],
        "replicasets": [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {
                    "name": replicaset,
                    "namespace": "serving",
                    "uid": replicaset_uid,
                    "labels": labels,
                    "ownerReferences": _owned("Deployment", "inference", deployment_uid),
                },
                "spec": {"replicas": len(serving), "selector": {"matchLabels": labels}},
            }
        ],
        "daemonsets": [
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "node-exporter", "namespace": "monitoring", "uid": daemonset_uid},
                "spec": {"selector": {"matchLabels": {"app": "node-exporter"}}},
            }
        ],
        "pods": [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{replicaset}-{node}",
                    "namespace": "serving",
                    "labels": labels,
                    "ownerReferences": _owned("ReplicaSet", replicaset, replicaset_uid),
                },
                "spec": {"nodeName": node, "containers": container},
                "status": running,
            }
            for node in serving
        ]
        + [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"node-exporter-{node}",
                    "namespace": "monitoring",
                    "labels": {"app": "node-exporter"},
                    "ownerReferences": _owned("DaemonSet", "node-exporter", daemonset_uid),
                },
                "spec": {"nodeName": node, "containers": [{"name": "exporter", "image": "prom/node-exporter"}]},
                "status": running,
            }
            for node in every
        ],
        "pdbs": [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "inference", "namespace": "serving"},
                "spec": {"minAvailable": max(len(serving) - 1, 0), "selector": {"matchLabels": labels}},
            }
        ],
    }


def write_kubeconfig(path: Path, *, server: str) -> Path:
    """A kubeconfig that points the official client at the emulator."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "gpufleet-lab", "cluster": {"server": server}}],
        "users": [{"name": "gpufleet-lab", "user": {"token": "lab"}}],
        "contexts": [{"name": "gpufleet-lab", "context": {"cluster": "gpufleet-lab", "user": "gpufleet-lab"}}],
        "current-context": "gpufleet-lab",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


async def serve(*, port: int, seed: Path | None, kubeconfig: Path | None, ready_file: Path | None) -> None:
    emulator = KubeApiEmulator()
    if seed is not None:
        data = json.loads(seed.read_text(encoding="utf-8"))
        plurals = {str(res.plural): res for res in RESOURCE_INFO} | {"pdbs": PDBS}
        for key, objects in data.items():
            if key not in plurals:
                raise SystemExit(f"{seed}: unknown kind of object {key!r}; known: {', '.join(sorted(plurals))}")
            for obj in objects:
                emulator.seed(plurals[key], obj)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with emulator, kmock.Server(emulator, port=port, host="127.0.0.1") as server:
        url = f"http://127.0.0.1:{server.port}"
        if kubeconfig is not None:
            write_kubeconfig(kubeconfig, server=url)
        if ready_file is not None:
            ready_file.write_text(url, encoding="utf-8")
        print(f"emulated Kubernetes API on {url}", flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.kubeapi", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--seed", type=Path, help="JSON file of objects to start with, by plural: nodes, pods, pdbs, deployments..."
    )
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for the server here")
    parser.add_argument("--ready-file", type=Path, help="write the server URL here once it listens")
    args = parser.parse_args()
    asyncio.run(serve(port=args.port, seed=args.seed, kubeconfig=args.kubeconfig, ready_file=args.ready_file))


if __name__ == "__main__":
    main()
