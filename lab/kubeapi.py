"""An emulated Kubernetes API server, built on kmock's KubernetesEmulator.

kmock keeps objects in memory and serves list/get/create/patch/delete. We add what
gpufleet relies on and a real API server does:

- ``resourceVersion`` on every write, and 409 Conflict when a write names a stale one;
- 409 AlreadyExists when a create names an object that exists;
- replace (PUT) of a whole object, which kmock does not serve (Leases are taken and renewed so);
- label selectors and field selectors on lists;
- the eviction subresource: 429 while a PodDisruptionBudget forbids it, else the pod goes;
- JSON merge, strategic-merge and JSON patches applied as the API server applies them
  (``lab.patches``), with the merge keys of Kubernetes' own schemas;
- ``fieldValidation`` (Strict, Warn, Ignore) of unknown fields on create, replace and patch;
- the OpenAPI v3 documents kubectl reads (``lab.openapi``) and watches in kubectl's format;
- Slinky's CustomResourceDefinitions (``lab.crds``, slurm-operator's pinned release): served
  read-only, their kinds discovered from them, and each custom resource pruned, defaulted and
  validated against its CRD's schema and CEL rules (422 Invalid naming each field).

For bad days on purpose (chaos runs and tests): ``PUT /_faults`` with
``{"status": 500, "count": N, "retry_after": S}`` makes the next N API requests answer that
status (429 with a Retry-After when given); ``{"count": 0}`` clears it.

Authentication and authorization as gpufleet's services ask a cluster for them (the rules in
``lab.kubeauth``): TokenRequest (``POST .../serviceaccounts/NAME/token``: HMAC-signed JWTs with a
real server's claims, bound to a Pod on request; any expiry of a second or more, where a real
server's minimum is 10 minutes), TokenReview (ServiceAccount tokens, and the static tokens of
``--token-file FILE`` in kube-apiserver's ``--token-auth-file`` format) and SubjectAccessReview
(from the RBAC objects stored here; ``aggregationRule`` gathered at each review). Requests to
this API itself stay unauthenticated. ``--signing-key FILE`` keeps the signing key across restarts.

For RBAC (tests/test_rbac.py): ``--audit-log FILE`` (off by default) appends one JSON line per
request for a resource, with the verb as Kubernetes RBAC names it (``rbac_verb``), the API group,
resource, subresource, namespace and name, so that what a client really asks for can be compared
with what a Role grants.

Run it as ``python -m lab.kubeapi --port N --seed FILE --kubeconfig FILE [--audit-log FILE]
[--token-file FILE] [--signing-key FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextvars
import copy
import datetime
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, parsing, rendering
from kmock._internal.k8s import KubernetesObjectNotFoundError

from lab import crds, kubeauth, kubevalidate, openapi
from lab import kubetables as tables
from lab.patches import APPLY, JSON_PATCH, MERGE, STRATEGIC, PatchError, json_patch, merge_patch, strategic_merge_patch
from lab.selectors import SelectorError, field_selector, label_selector

PODS = kmock.resource("", "v1", "pods")
NODES = kmock.resource("", "v1", "nodes")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
REPLICASETS = kmock.resource("apps", "v1", "replicasets")
DAEMONSETS = kmock.resource("apps", "v1", "daemonsets")
SECRETS = kmock.resource("", "v1", "secrets")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
SERVICEACCOUNTS = kmock.resource("", "v1", "serviceaccounts")
CLUSTERROLES = kmock.resource("rbac.authorization.k8s.io", "v1", "clusterroles")
CLUSTERROLEBINDINGS = kmock.resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings")
ROLES = kmock.resource("rbac.authorization.k8s.io", "v1", "roles")
ROLEBINDINGS = kmock.resource("rbac.authorization.k8s.io", "v1", "rolebindings")
TOKENREVIEWS = kmock.resource("authentication.k8s.io", "v1", "tokenreviews")
SUBJECTACCESSREVIEWS = kmock.resource("authorization.k8s.io", "v1", "subjectaccessreviews")
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
# resource: (kind, short names, namespaced, subresources)
RESOURCE_INFO: dict[kmock.resource, tuple[str, list[str], bool, list[str]]] = {
    PODS: ("Pod", ["po"], True, ["eviction"]),
    NODES: ("Node", ["no"], False, []),
    PDBS: ("PodDisruptionBudget", ["pdb"], True, []),
    LEASES: ("Lease", [], True, []),
    # Stored as given, so that `kubectl apply -k deploy/base` and `kubectl get` work on the lab.
    kmock.resource("", "v1", "namespaces"): ("Namespace", ["ns"], False, []),
    kmock.resource("", "v1", "configmaps"): ("ConfigMap", ["cm"], True, []),
    SERVICEACCOUNTS: ("ServiceAccount", ["sa"], True, ["token"]),
    kmock.resource("", "v1", "services"): ("Service", ["svc"], True, []),
    DEPLOYMENTS: ("Deployment", ["deploy"], True, []),
    REPLICASETS: ("ReplicaSet", ["rs"], True, []),
    DAEMONSETS: ("DaemonSet", ["ds"], True, []),
    SECRETS: ("Secret", [], True, []),
    kmock.resource("", "v1", "persistentvolumeclaims"): ("PersistentVolumeClaim", ["pvc"], True, []),
    kmock.resource("batch", "v1", "jobs"): ("Job", [], True, []),
    ROLES: ("Role", [], True, []),
    ROLEBINDINGS: ("RoleBinding", [], True, []),
    CLUSTERROLES: ("ClusterRole", [], False, []),
    CLUSTERROLEBINDINGS: ("ClusterRoleBinding", [], False, []),
    # Served read-only: the CRDs of slurm-operator's pinned release (lab.crds).
    CRDS: ("CustomResourceDefinition", ["crd", "crds"], False, []),
}
# Slinky's slurm-operator kinds (gpufleet cluster create --backend slinky), served from their CRDs:
# discovery from the CRD's names and subresources, each write pruned, defaulted and validated
# against its openAPIV3Schema and its CEL rules as a real API server does (lab.crds). No operator
# acts on them.
CUSTOM: dict[kmock.resource, crds.CustomResource] = {
    kmock.resource(cr.group, cr.version, cr.plural): cr for cr in crds.served()
}
RESOURCE_INFO.update(
    {res: (cr.kind, list(cr.short_names), cr.namespaced, sorted(cr.subresources)) for res, cr in CUSTOM.items()}
)
for _custom in CUSTOM.values():
    tables.COLUMNS[_custom.kind] = crds.columns(_custom)
SUBRESOURCE_VERBS = ["get", "patch", "update"]


def _string_data(secret: dict[str, Any]) -> None:
    """A Secret's ``stringData`` as the API server stores it: base64 in ``data``, write-only."""
    plain = secret.pop("stringData", None) or {}
    if plain:
        data = secret.setdefault("data", {})
        for key, value in plain.items():
            data[key] = base64.b64encode(str(value).encode()).decode()


def _selector(pdb: dict[str, Any]) -> dict[str, str]:
    return (pdb.get("spec", {}).get("selector") or {}).get("matchLabels") or {}


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


def _dry_run(request: rendering.Request) -> bool:
    """``?dryRun=All`` (or ``dryRun`` in the DeleteOptions a delete or an eviction carries): the
    write is checked and answered, and nothing is stored."""
    if request.params.get("dryRun"):
        return True
    body = request.data if isinstance(request.data, dict) else {}
    options = body.get("deleteOptions") if body.get("kind") == "Eviction" else body
    return isinstance(options, dict) and bool(options.get("dryRun"))


def _json_body(request: rendering.Request) -> bool:
    content_type = request.headers.get("Content-Type", "application/json").split(";")[0].strip()
    return content_type == "application/json" or content_type.endswith("+json")


def _apply(request: rendering.Request) -> bool:
    return request.headers.get("Content-Type", "").split(";")[0].strip() == APPLY


def _warn(response: aiohttp.web.StreamResponse, warnings: list[str]) -> None:
    """Warning headers as the API server sends them (kubectl prints each as ``Warning: ...``)."""
    for text in warnings:
        quoted = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
        response.headers.add("Warning", f'299 - "{quoted}"')


_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock reads ``/api/v1/namespaces/NAME`` as a namespace prefix (and fails on
    ``/api/v1/namespaces``): here they are the Namespace objects themselves, as on a real server."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or (len(parts) == 5 and parts[4] == "status")):
        name = parts[3] if len(parts) > 3 else None
        subresource = parts[4] if len(parts) > 4 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, subresource)
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path

_REQUEST: contextvars.ContextVar[rendering.Request] = contextvars.ContextVar("request")


def rbac_verb(request: rendering.Request) -> str:
    """The request's verb as Kubernetes authorizes it: GET (or HEAD) of one object is ``get``, of
    a collection ``list``, either with ``?watch=true`` ``watch``; POST ``create``, PUT ``update``,
    PATCH ``patch``, DELETE of one object ``delete``, of a collection ``deletecollection``."""
    method = request.method
    if method in (enums.method.GET, enums.method.HEAD):
        if request.action == enums.action.WATCH or request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name is not None else "list"
    if method == enums.method.DELETE:
        return "delete" if request.name is not None else "deletecollection"
    verbs = {enums.method.POST: "create", enums.method.PUT: "update", enums.method.PATCH: "patch"}
    return verbs.get(method, str(method.value if method is not None else "").lower())


def audit_record(request: rendering.Request) -> dict[str, str | None]:
    """What RBAC decides a resource request on: verb, API group, resource, subresource, namespace, name."""
    assert request.resource is not None
    return {
        "verb": rbac_verb(request),
        "apiGroup": str(request.resource.group or ""),
        "resource": str(request.resource.plural),
        "subresource": request.subresource,
        "namespace": request.namespace,
        "name": request.name,
    }


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> aiohttp.web.Response:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Success" if code < 300 else "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    if details is not None:
        body["details"] = details
    return aiohttp.web.json_response(body, status=code)


def _review_answer(kind: str, api_version: str, spec: dict[str, Any], status: dict[str, Any]) -> aiohttp.web.Response:
    """A review's answer as the API server gives it: the spec asked, the status decided, 201."""
    answer = {"kind": kind, "apiVersion": api_version, "metadata": {"creationTimestamp": None}, "spec": spec}
    return aiohttp.web.json_response({**answer, "status": status}, status=201)


@attrs.define(kw_only=True)
class KubeApiEmulator(kmock.KubernetesEmulator):
    """KubernetesEmulator with resourceVersions, selectors and evictions."""

    _version: int = attrs.field(default=0, init=False)
    _fault_status: int = attrs.field(default=0, init=False)
    _fault_count: int = attrs.field(default=0, init=False)
    _fault_retry_after: int | None = attrs.field(default=None, init=False)
    faults_served: int = attrs.field(default=0, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _documents: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    # Where each resource request is recorded (audit_record, one JSON line each); None: nowhere.
    audit_log: Path | None = attrs.field(default=None)
    # The key ServiceAccount tokens are signed with (kubeauth.signing_key), and the static tokens
    # (--token-file) by value.
    signing_key: bytes = attrs.field(factory=lambda: kubeauth.signing_key(None))
    static_tokens: dict[str, kubeauth.StaticUser] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Declared with what discovery says of them, so that kubectl finds each resource type
        # (by name, kind and short name) and knows what it may do with it.
        for res, (kind, short, namespaced, subresources) in RESOURCE_INFO.items():
            self.resources[res] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=["get", "list", "watch"] if res == CRDS else VERBS,
                shortnames=short,
                subresources=subresources,
            )
        for crd in crds.definitions():
            self.seed(CRDS, crds.stored_definition(crd))

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
            elif entry["name"] == "serviceaccounts/token":
                entry.update(kind="TokenRequest", group="authentication.k8s.io", version="v1", verbs=["create"])
                entry.update(singularName="", shortNames=[], categories=[])
            elif entry["name"].endswith("/status"):
                entry.update(verbs=SUBRESOURCE_VERBS, singularName="", shortNames=[], categories=[])
            elif entry["name"].endswith("/scale"):
                entry.update(kind="Scale", group="autoscaling", version="v1", verbs=SUBRESOURCE_VERBS)
                entry.update(singularName="", shortNames=[], categories=[])
        payload["resources"] = sorted(payload.get("resources", []), key=lambda entry: entry["name"])
        return payload

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        """The release whose schemas are served (so that kubectl's version skew warning is true)."""
        release = openapi.release()
        major, minor, _patch = release[1:].split(".")
        return {
            "major": major,
            "minor": minor,
            "gitVersion": f"{release}-gpufleet-lab",
            "gitTreeState": "clean",
            "platform": "linux/amd64",
        }

    def _openapi_documents(self) -> dict[str, dict[str, Any]]:
        if not self._documents:
            served: dict[tuple[str, str], list[tuple[str, str, bool]]] = {}
            for res, (kind, _short, namespaced, _sub) in RESOURCE_INFO.items():
                served.setdefault((str(res.group), str(res.version)), []).append((kind, str(res.plural), namespaced))
            schemas: dict[tuple[str, str], dict[str, openapi.Schema]] = {}
            for custom in CUSTOM.values():
                schemas.setdefault((custom.group, custom.version), {}).update(crds.openapi_schema(custom))
            self._documents = {
                openapi.group_version_path(group, version): openapi.document(
                    group, version, kinds, schemas.get((group, version))
                )
                for (group, version), kinds in served.items()
            }
        return self._documents

    def _serve_openapi(self, path: str) -> aiohttp.web.Response:
        """``/openapi/v3`` and each group-version's document; no OpenAPI v2 (kubectl reads v3)."""
        documents = self._openapi_documents()
        if path.rstrip("/") == "/openapi/v3":
            return aiohttp.web.json_response(openapi.index(documents))
        wanted = path.removeprefix("/openapi/v3/")
        if path.startswith("/openapi/v3/") and wanted in documents:
            return aiohttp.web.json_response(documents[wanted])
        return _status(404, "NotFound", f"no OpenAPI document at {path} (the emulated API serves /openapi/v3 only)")

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
        meta["uid"] = meta.get("uid") or str(uuid.uuid4())
        meta["generation"] = meta.get("generation") or 1
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["creationTimestamp"] = meta.get("creationTimestamp") or now

    def _live(self, resource: kmock.resource, namespace: str | None = None) -> list[dict[str, Any]]:
        found = []
        for (res, ns, _name), obj in self.objects.items():
            if res == resource and not obj.deleted and (namespace is None or ns == namespace):
                found.append(dict(obj.raw))
        return found

    def _stored(self, resource: kmock.resource | None, namespace: str | None, name: str | None) -> Any | None:
        """The object at that address, deleted or not, found by its key. kmock's own lookups scan
        every object per request, which made a fleet of ten thousand nodes (make bench-scale) the
        emulator's bound rather than gpufleet's."""
        objects: dict[Any, Any] = self.objects._objects  # kmock's array is a dict by (resource, ns, name)
        return objects.get((resource, namespace, name))

    def _find(self, resource: kmock.resource, namespace: str | None, name: str) -> Any | None:
        found = self._stored(resource, namespace, name)
        return None if found is None or found.deleted else found

    # kmock answers these from a scan of every object; by key, the answers are the same.

    async def _serve_fetch_stored(self, request: rendering.Request) -> rendering.Payload:
        if request.name is None:
            return await super()._serve_fetch(request)
        async with self._lock:
            obj = self._stored(request.resource, request.namespace, request.name)
        if obj is None or obj.deleted:
            raise KubernetesObjectNotFoundError()
        raw: dict[str, Any] = obj.raw
        return raw

    async def _serve_last_stored(self, request: rendering.Request) -> rendering.Payload:
        """The object as kmock's _handle just left it (updated, or deleted: its last state)."""
        async with self._lock:
            obj = self._stored(request.resource, request.namespace, request.name)
        assert obj is not None
        last: dict[str, Any] = obj.last.raw
        return last

    _serve_update = _serve_last_stored
    _serve_delete = _serve_last_stored

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        meta = request.data.get("metadata", {}) if isinstance(request.data, dict) else {}
        namespace = request.namespace or meta.get("namespace")
        async with self._lock:
            obj = self._stored(request.resource, namespace, request.name or meta.get("name"))
        assert obj is not None  # created by kmock's _handle just before
        raw: dict[str, Any] = obj.raw
        return raw

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        _REQUEST.set(request)
        # kmock keeps every request for a test's assertions, and matches each new one to its
        # reactions by scanning that whole record: each request cost more than the one before, and
        # a long lab run or a burst (make bench-scale) slowed down quadratically. Nothing here asks
        # kmock for past requests: keep only the one being served.
        del self._requests[:-1]
        for payload in self._payloads:
            payload._requests.clear()
        if request.url.path == "/_faults":
            return self._set_faults(request)
        if request.url.path.startswith("/openapi/"):
            return self._serve_openapi(request.url.path)
        if self.audit_log is not None and request.resource is not None:
            with self.audit_log.open("a", encoding="utf-8") as audit:
                audit.write(json.dumps(audit_record(request)) + "\n")
        if self._fault_count > 0:
            self._fault_count -= 1
            self.faults_served += 1
            response = _status(self._fault_status, "InjectedFault", "a fault injected on purpose (PUT /_faults)")
            if self._fault_retry_after is not None:
                response.headers["Retry-After"] = str(self._fault_retry_after)
            return response
        if request.resource is None:
            return await super()._handle(request)
        writes = (enums.method.POST, enums.method.PUT, enums.method.PATCH)
        if request.method in writes and request.body and not _json_body(request) and not _apply(request):
            return _status(
                415,
                "UnsupportedMediaType",
                f"the emulated API reads JSON bodies only, not {request.headers.get('Content-Type', '?')!r}",
            )
        if request.resource in (TOKENREVIEWS, SUBJECTACCESSREVIEWS) or (
            request.resource == SERVICEACCOUNTS and request.subresource == "token"
        ):
            return self._review(request)
        if request.resource == PODS and request.subresource == "eviction" and request.method == enums.method.POST:
            async with self._write_lock:
                return await self._evict(request)
        if request.resource == CRDS and request.method not in (enums.method.GET, enums.method.HEAD):
            return _status(
                405,
                "MethodNotAllowed",
                f"the emulated API serves the CustomResourceDefinitions of slurm-operator {crds.RELEASE} "
                "as vendored (lab/crds); they cannot be changed here",
            )
        custom = CUSTOM.get(request.resource)
        if custom is not None and request.subresource is not None and request.subresource not in custom.subresources:
            return _status(404, "NotFound", "the server could not find the requested resource")
        if custom is not None and request.subresource == "scale" and request.name is not None:
            async with self._write_lock:
                return await self._scale(request, custom)
        if request.subresource not in (None, "status") and request.method != enums.method.GET:
            # A real server serves more (scale, ephemeralcontainers...); this one does not.
            return _status(404, "NotFound", "the server could not find the requested resource")
        if request.method == enums.method.PUT and request.name is not None:
            async with self._write_lock:
                return await self._replace(request)
        if request.method == enums.method.PATCH and request.name is not None:
            async with self._write_lock:
                return await self._patch(request)
        if request.method == enums.method.DELETE and request.name is not None and _dry_run(request):
            found = self._find(request.resource, request.namespace, request.name)
            if found is None:
                return _status(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            return aiohttp.web.json_response(dict(found.raw))
        if request.action == enums.action.WATCH:
            return await self._watch(request)
        if request.action != enums.action.CREATE:
            return await super()._handle(request)
        async with self._write_lock:
            return await self._create(request)

    async def _create(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """POST: refused when it exists; the namespace from the URL; fields checked (and unknown
        ones dropped, as a real server does); stamped; nothing stored on a dry run."""
        assert request.resource is not None
        if not isinstance(request.data, dict):
            return _status(400, "BadRequest", "the body of a create must be a JSON object")
        meta = request.data.setdefault("metadata", {})
        namespaced = RESOURCE_INFO.get(request.resource, ("", [], True))[2]
        if namespaced and request.namespace is not None:
            meta["namespace"] = request.namespace
        name = meta.get("name") or request.name
        if not name:
            refused = self._invalid(request.resource, request.data, creating=True)
            return refused or _status(422, "Invalid", f"{request.resource.plural}: metadata.name is required")
        if self._find(request.resource, meta.get("namespace") if namespaced else None, name):
            return _status(409, "AlreadyExists", f'{request.resource.plural} "{name}" already exists')
        refused, warnings = self._validate_fields(request, request.data)
        if refused is not None:
            return refused
        self._prepare_custom(request, request.data, None)
        invalid = self._invalid(request.resource, request.data, creating=True)
        if invalid is not None:
            return invalid
        if request.resource == SECRETS:
            _string_data(request.data)
        self._stamp_new(meta)
        if _dry_run(request):
            created: aiohttp.web.StreamResponse = aiohttp.web.json_response(request.data, status=201)
        else:
            created = await super()._handle(request)
            if created.status == 200:
                created.set_status(201)  # Created, as a real server answers (some clients read only that)
        _warn(created, warnings)
        return created

    async def _watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """A watch as the API server streams it: one JSON event per line (the object as a Table of
        one row when kubectl asks for tables), the changes after the resourceVersion asked (every
        object as ADDED when none is), until the client leaves or ``timeoutSeconds`` pass."""
        assert request.resource is not None
        resource, namespace = request.resource, request.namespace
        try:
            labels = label_selector(request.params.get("labelSelector", ""))
            fields = field_selector(request.params.get("fieldSelector", ""))
        except SelectorError as exc:
            return _status(400, "BadRequest", str(exc))
        kind = RESOURCE_INFO[resource][0] if resource in RESOURCE_INFO else str(resource.plural)
        as_table = "as=Table" in request.headers.get("Accept", "")
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None

        def wanted(obj: dict[str, Any]) -> bool:
            meta = obj.get("metadata", {})
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            return labels(meta.get("labels") or {}) and fields(obj)

        def changed_since(obj: dict[str, Any]) -> bool:
            version = str(obj.get("metadata", {}).get("resourceVersion", "0"))
            return not since.isdigit() or int(since) == 0 or (version.isdigit() and int(version) > int(since))

        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None
        await response.prepare(request._raw_request)
        bus = self._buses[resource]
        marker = await bus.mark()
        backlog = [
            {"type": "ADDED" if since in ("", "0") else "MODIFIED", "object": obj}
            for obj in self._live(resource)
            if changed_since(obj)
        ]

        async def events() -> Any:
            for event in backlog:
                yield event
            async for event in bus.stream(since=marker):
                yield event

        try:
            async with asyncio.timeout(timeout):
                async for event in events():
                    obj = self._with_status(resource, event["object"])
                    if wanted(obj):
                        shown = tables.table(kind, [obj]) if as_table and resource in RESOURCE_INFO else obj
                        line = json.dumps({"type": event["type"], "object": shown}) + "\n"
                        await response.write(line.encode())
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            await bus.unmark(marker)
        return response

    def _schema(self, resource: kmock.resource) -> openapi.Schema | None:
        kind = RESOURCE_INFO.get(resource, ("",))[0]
        name = openapi.schema_name(str(resource.group), str(resource.version), kind)
        return openapi.definitions().get(name) if name else None

    def _validate_fields(
        self, request: rendering.Request, obj: Any, before: Any = None
    ) -> tuple[aiohttp.web.Response | None, list[str]]:
        """Unknown fields in what a write would store (beyond those already stored), under the
        request's ``fieldValidation``: Strict refuses the write (400), Warn (the default) answers
        with a Warning header per field, Ignore says nothing; either way they are not stored."""
        assert request.resource is not None
        mode = request.params.get("fieldValidation", "Warn")
        if mode not in ("Strict", "Warn", "Ignore"):
            return _status(400, "BadRequest", f"fieldValidation must be Strict, Warn or Ignore, not {mode!r}"), []
        custom = CUSTOM.get(request.resource)
        if custom is not None:
            known = set(crds.unknown_fields(custom.schema, before)) if before is not None else set()
            unknown = [path for path in crds.unknown_fields(custom.schema, obj) if path not in known]
            crds.prune(custom.schema, obj)  # a structural schema keeps only what it declares
        else:
            schema = self._schema(request.resource)
            if schema is None:
                return None, []
            known = set(openapi.unknown_fields(schema, before)) if before is not None else set()
            unknown = [path for path in openapi.unknown_fields(schema, obj) if path not in known]
            openapi.prune(schema, obj)  # what a real server does with fields it does not know
        if mode == "Ignore":
            return None, []
        if unknown and mode == "Strict":
            kind = RESOURCE_INFO[request.resource][0]
            fields = ", ".join(f'unknown field "{path}"' for path in unknown)
            version = request.resource.version
            message = f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: {fields}'
            return _status(400, "BadRequest", message), []
        return None, [f'unknown field "{path}"' for path in unknown]

    def _invalid(self, resource: kmock.resource, obj: dict[str, Any], *, creating: bool) -> aiohttp.web.Response | None:
        """422 Invalid, worded as a real API server words it, when a name, label, annotation or
        taint of what a write would store breaks Kubernetes' rules (lab.kubevalidate)."""
        kind = RESOURCE_INFO.get(resource, ("",))[0]
        if not kind:
            return None
        errors = kubevalidate.check(kind, obj, creating=creating)
        custom = CUSTOM.get(resource)
        if custom is not None:
            errors += crds.check(custom, obj)
        if not errors:
            return None
        name = str((obj.get("metadata") or {}).get("name") or "")
        body = kubevalidate.status(kind, str(resource.group or ""), name, errors)
        return aiohttp.web.json_response(body, status=422)

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
        current = self._find(request.resource, request.namespace, request.name)
        if current is None:
            return _status(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        if not isinstance(request.data, dict):
            return _status(400, "BadRequest", "the body of a replace must be a JSON object")
        meta = request.data.setdefault("metadata", {})
        if meta.get("name", request.name) != request.name:
            return _status(400, "BadRequest", f"the name in the body ({meta.get('name')!r}) is not the URL's")
        return await self._store(request, current, request.data)

    async def _patch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """PATCH, in the format its Content-Type names (lab.patches), guarded by the
        resourceVersion the patch names, if any. The status subresource patches the object."""
        assert request.resource is not None and request.name is not None
        current = self._find(request.resource, request.namespace, request.name)
        if current is None:
            return _status(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        original = copy.deepcopy(dict(current.raw))
        try:
            if content_type == JSON_PATCH:
                patched = json_patch(original, request.data)
            elif content_type == MERGE:
                patched = merge_patch(original, request.data)
            elif content_type == STRATEGIC and request.resource in CUSTOM:
                return _status(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types include: "
                    f"{JSON_PATCH}, {MERGE}, {APPLY}",
                )
            elif content_type == STRATEGIC:
                patched = strategic_merge_patch(original, request.data, self._schema(request.resource))
            else:
                served = ""
                if content_type == APPLY:
                    served = "server-side apply is not served (use kubectl apply without --server-side); "
                return _status(
                    415,
                    "UnsupportedMediaType",
                    f"the patch content type {content_type!r} is not supported: {served}"
                    f"send {MERGE}, {STRATEGIC} or {JSON_PATCH}",
                )
        except PatchError as exc:
            kind = RESOURCE_INFO.get(request.resource, ("",))[0]
            # With the cause in details, as clients before 1.27 print only those of an Invalid status.
            cause = {"reason": "FieldValueInvalid", "message": f"the patch cannot be applied: {exc}"}
            details = {"name": request.name, "kind": kind, "causes": [cause]}
            return _status(422, "Invalid", f'{kind} "{request.name}" is invalid: {cause["message"]}', details)
        if not isinstance(patched, dict):
            return _status(422, "Invalid", "the patch leaves no object")
        return await self._store(request, current, patched, before=original)

    async def _store(
        self, request: rendering.Request, current: Any, obj: dict[str, Any], before: Any = None
    ) -> aiohttp.web.StreamResponse:
        """Store a replaced or patched object: fields checked, the resourceVersion it names (if
        any) checked against the stored one, identity kept, a new resourceVersion, a watch event."""
        assert request.resource is not None and request.name is not None
        plural = request.resource.plural
        refused, warnings = self._validate_fields(request, obj, before)
        if refused is not None:
            return refused
        meta = obj.setdefault("metadata", {})
        have = current.raw.get("metadata", {})
        wanted = meta.get("resourceVersion")
        if wanted and wanted != have.get("resourceVersion"):
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {plural} "{request.name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
            )
        self._prepare_custom(request, obj, dict(current.raw))
        meta = obj["metadata"]
        invalid = self._invalid(request.resource, obj, creating=False)
        if invalid is not None:
            return invalid
        meta["name"] = request.name
        if request.namespace is not None:
            meta["namespace"] = request.namespace
        for kept in ("uid", "creationTimestamp"):
            if kept in have:
                meta[kept] = have[kept]
        generation = int(have.get("generation") or 1)
        if request.resource in CUSTOM:
            # A custom resource's generation counts changes to anything but its metadata and status.
            changed = {k: v for k, v in obj.items() if k not in ("metadata", "status")} != {
                k: v for k, v in current.raw.items() if k not in ("metadata", "status")
            }
        else:
            changed = obj.get("spec") != current.raw.get("spec")
        meta["generation"] = generation + 1 if changed else generation
        meta["resourceVersion"] = self.next_version()
        if not _dry_run(request):
            self.objects[request.resource, request.namespace, request.name] = obj
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                await self._remove(request.resource, request.namespace, request.name)  # its last finalizer went
            else:
                await self._buses[request.resource].put({"type": "MODIFIED", "object": obj})
        response = aiohttp.web.json_response(obj)
        _warn(response, warnings)
        return response

    def _prepare_custom(self, request: rendering.Request, obj: dict[str, Any], current: dict[str, Any] | None) -> None:
        """What the server does to a custom resource before validating a write, in place: with a
        status subresource, a create drops ``status``, an update of the object keeps the stored
        status and an update of ``/status`` changes nothing else; then the schema's defaults."""
        custom = CUSTOM.get(request.resource) if request.resource is not None else None
        if custom is None:
            return
        if custom.has_status:
            if current is None:
                obj.pop("status", None)
            elif request.subresource == "status":
                status = obj.get("status")
                wanted = (obj.get("metadata") or {}).get("resourceVersion")
                obj.clear()
                obj.update(copy.deepcopy(current))
                obj.pop("status", None)
                if status is not None:
                    obj["status"] = status
                if wanted:
                    obj["metadata"]["resourceVersion"] = wanted
            elif "status" in current:
                obj["status"] = copy.deepcopy(current["status"])
            else:
                obj.pop("status", None)
        crds.default(custom.schema, obj)

    async def _scale(self, request: rendering.Request, custom: crds.CustomResource) -> aiohttp.web.StreamResponse:
        """The scale subresource (autoscaling/v1 Scale) of a custom resource that declares it:
        read from, and written to, the paths its CRD names."""
        assert request.resource is not None and request.name is not None and custom.scale is not None
        found = self._find(request.resource, request.namespace, request.name)
        if found is None:
            return _status(404, "NotFound", f'{request.resource.plural}.{custom.group} "{request.name}" not found')
        spec_path = str(custom.scale["specReplicasPath"]).strip(".").split(".")
        status_path = str(custom.scale["statusReplicasPath"]).strip(".").split(".")
        selector_path = str(custom.scale.get("labelSelectorPath") or "").strip(".").split(".")

        def at(obj: Any, path: list[str]) -> Any:
            for part in path:
                obj = obj.get(part) if isinstance(obj, dict) else None
            return obj

        def scale(obj: dict[str, Any]) -> dict[str, Any]:
            meta = obj["metadata"]
            status: dict[str, Any] = {"replicas": at(obj, status_path) or 0}
            if at(obj, selector_path):
                status["selector"] = at(obj, selector_path)
            return {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
                "spec": {"replicas": at(obj, spec_path) or 0},
                "status": status,
            }

        current = dict(found.raw)
        if request.method in (enums.method.GET, enums.method.HEAD):
            return aiohttp.web.json_response(scale(current))
        if request.method == enums.method.PUT:
            wanted = request.data
        elif request.method == enums.method.PATCH:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            try:
                if content_type == JSON_PATCH:
                    wanted = json_patch(scale(current), request.data)
                elif content_type == MERGE:
                    wanted = merge_patch(scale(current), request.data)
                else:
                    return _status(415, "UnsupportedMediaType", f"send {MERGE} or {JSON_PATCH} to a scale subresource")
            except PatchError as exc:
                return _status(422, "Invalid", f"the patch cannot be applied: {exc}")
        else:
            return _status(405, "MethodNotAllowed", f"{request.method} is not served on a scale subresource")
        replicas = (wanted.get("spec") or {}).get("replicas") if isinstance(wanted, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            error = kubevalidate.invalid("spec.replicas", replicas, "must be greater than or equal to 0")
            return aiohttp.web.json_response(
                kubevalidate.status("Scale", "autoscaling", request.name, [error]), status=422
            )
        obj = copy.deepcopy(current)
        holder = obj
        for part in spec_path[:-1]:
            holder = holder.setdefault(part, {})
        holder[spec_path[-1]] = replicas
        wanted_version = ((wanted.get("metadata") or {}) if isinstance(wanted, dict) else {}).get("resourceVersion")
        obj["metadata"]["resourceVersion"] = wanted_version or current["metadata"].get("resourceVersion")
        stored = await self._store(request, found, obj)
        if stored.status != 200:
            return stored
        after = self._find(request.resource, request.namespace, request.name)
        return aiohttp.web.json_response(scale(dict(after.raw) if after is not None else obj))

    def _set_faults(self, request: rendering.Request) -> aiohttp.web.Response:
        if request.method == enums.method.GET:
            return aiohttp.web.json_response({"pending": self._fault_count, "served": self.faults_served})
        data = request.data if isinstance(request.data, dict) else {}
        self._fault_status = int(data.get("status", 500))
        self._fault_count = int(data.get("count", 0))
        retry_after = data.get("retry_after")
        self._fault_retry_after = int(retry_after) if retry_after is not None else None
        return aiohttp.web.json_response({"pending": self._fault_count, "served": self.faults_served})

    # -- authentication and authorization (lab.kubeauth holds the rules) -----------------------------

    def _review(self, request: rendering.Request) -> aiohttp.web.Response:
        """TokenRequest, TokenReview and SubjectAccessReview: each a create that stores nothing."""
        assert request.resource is not None
        if request.method != enums.method.POST:
            return _status(405, "MethodNotAllowed", f"{request.resource.plural}: only create (POST) is served")
        body = request.data if isinstance(request.data, dict) else None
        if body is None:
            return _status(400, "BadRequest", "the body must be a JSON object")
        spec = body.get("spec")
        if not isinstance(spec, dict):
            return _status(422, "Invalid", "spec: Required value")
        if request.resource == TOKENREVIEWS:
            return self._token_review(spec)
        if request.resource == SUBJECTACCESSREVIEWS:
            return self._access_review(spec)
        return self._token_request(request, spec)

    def _token_request(self, request: rendering.Request, spec: dict[str, Any]) -> aiohttp.web.Response:
        """POST serviceaccounts/NAME/token: a token of that ServiceAccount for the audiences asked
        (the API's own when none), bound to a Pod when ``spec.boundObjectRef`` names one. Any
        positive ``expirationSeconds`` is taken (a real server refuses under 600: tests want less)."""
        namespace, name = request.namespace or "", request.name or ""
        account = self._find(SERVICEACCOUNTS, namespace, name)
        if account is None:
            return _status(404, "NotFound", f'serviceaccounts "{name}" not found')
        audiences = spec.get("audiences") or list(kubeauth.API_AUDIENCES)
        if not isinstance(audiences, list) or not all(isinstance(a, str) and a for a in audiences):
            return _status(422, "Invalid", "spec.audiences: must be a list of non-empty strings")
        seconds = spec.get("expirationSeconds", kubeauth.DEFAULT_EXPIRATION)
        if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 1:
            return _status(422, "Invalid", f"spec.expirationSeconds: Invalid value: {seconds!r}: must be positive")
        now = int(datetime.datetime.now(datetime.UTC).timestamp())
        jti = str(uuid.uuid4())
        private: dict[str, Any] = {
            "namespace": namespace,
            "serviceaccount": {"name": name, "uid": account.raw["metadata"]["uid"]},
        }
        bound = spec.get("boundObjectRef")
        if bound:
            if not isinstance(bound, dict) or bound.get("kind") != "Pod" or not bound.get("name"):
                return _status(
                    422,
                    "Invalid",
                    "spec.boundObjectRef: the emulated API binds tokens to a Pod only: "
                    '{"kind": "Pod", "apiVersion": "v1", "name": ..., "uid": ...}',
                )
            pod = self._find(PODS, namespace, str(bound["name"]))
            if pod is None:
                return _status(404, "NotFound", f'pods "{bound["name"]}" not found')
            meta, pod_spec = pod.raw["metadata"], pod.raw.get("spec") or {}
            if bound.get("uid") and bound["uid"] != meta["uid"]:
                return _status(
                    409,
                    "Conflict",
                    f"the UID in the bound object reference ({bound['uid']}) does not match the UID in record. "
                    "The object might have been deleted and then recreated",
                )
            private["pod"] = {"name": meta["name"], "uid": meta["uid"]}
            node_name = pod_spec.get("nodeName")
            if node_name:
                node = self._find(NODES, None, node_name)
                private["node"] = {"name": node_name, "uid": node.raw["metadata"]["uid"] if node is not None else ""}
            bound = {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}
        claims = {
            "aud": audiences,
            "exp": now + seconds,
            "iat": now,
            "iss": kubeauth.ISSUER,
            "jti": jti,
            "kubernetes.io": private,
            "nbf": now,
            "sub": f"{kubeauth.SERVICE_ACCOUNT_PREFIX}{namespace}:{name}",
        }
        expires = datetime.datetime.fromtimestamp(now + seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        answer = {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None},
            "spec": {"audiences": audiences, "expirationSeconds": seconds, "boundObjectRef": bound or None},
            "status": {"token": kubeauth.sign(claims, self.signing_key), "expirationTimestamp": expires},
        }
        return aiohttp.web.json_response(answer, status=201)

    def _token_review(self, spec: dict[str, Any]) -> aiohttp.web.Response:
        """POST tokenreviews: who the token is, for the audiences asked (the API's own when none)."""
        wanted = spec.get("audiences") or list(kubeauth.API_AUDIENCES)
        if not isinstance(wanted, list) or not all(isinstance(a, str) for a in wanted):
            return _status(422, "Invalid", "spec.audiences: must be a list of strings")
        try:
            status = self._authenticate(str(spec.get("token") or ""), wanted)
        except kubeauth.TokenInvalid as exc:
            status = {"authenticated": False, "user": {}, "error": f"[invalid bearer token, {exc}]"}
        return _review_answer("TokenReview", "authentication.k8s.io/v1", spec, status)

    def _authenticate(self, token: str, wanted: list[str]) -> dict[str, Any]:
        """A TokenReview's status for an authenticated token; TokenInvalid saying why not."""
        if not token:
            raise kubeauth.TokenInvalid("token lookup failed")
        user = self.static_tokens.get(token)
        if user is not None:
            # Audience-agnostic, as kube-apiserver wraps its token file: valid for the API's audiences.
            audiences = [a for a in wanted if a in kubeauth.API_AUDIENCES]
            if not audiences:
                raise kubeauth.TokenInvalid(
                    f"token audiences {list(kubeauth.API_AUDIENCES)} is invalid for the target audiences {wanted}"
                )
            groups = [*user.groups, kubeauth.AUTHENTICATED]
            return {
                "authenticated": True,
                "user": {"username": user.name, "uid": user.uid, "groups": list(dict.fromkeys(groups))},
                "audiences": audiences,
            }
        claims = kubeauth.verify(token, self.signing_key, now=datetime.datetime.now(datetime.UTC).timestamp())
        have = kubeauth.token_audiences(claims)
        audiences = [a for a in wanted if a in have]
        if not audiences:
            raise kubeauth.TokenInvalid(f"token audiences {have} is invalid for the target audiences {wanted}")
        private = claims.get("kubernetes.io") or {}
        namespace = str(private.get("namespace") or "")
        account = private.get("serviceaccount") or {}
        if claims.get("sub") != f"{kubeauth.SERVICE_ACCOUNT_PREFIX}{namespace}:{account.get('name')}":
            raise kubeauth.TokenInvalid("token lookup failed")
        stored = self._find(SERVICEACCOUNTS, namespace, str(account.get("name")))
        if stored is None:
            raise kubeauth.TokenInvalid(f'serviceaccounts "{account.get("name")}" not found')
        if stored.raw["metadata"]["uid"] != account.get("uid"):
            uid = stored.raw["metadata"]["uid"]
            raise kubeauth.TokenInvalid(f"service account UID ({uid}) does not match claim ({account.get('uid')})")
        extra: dict[str, list[str]] = {kubeauth.CREDENTIAL_ID: [f"JTI={claims.get('jti')}"]}
        pod_claim = private.get("pod")
        if pod_claim:
            pod = self._find(PODS, namespace, str(pod_claim.get("name")))
            if pod is None:
                raise kubeauth.TokenInvalid(f'pods "{pod_claim.get("name")}" not found')
            if pod.raw["metadata"]["uid"] != pod_claim.get("uid"):
                uid = pod.raw["metadata"]["uid"]
                raise kubeauth.TokenInvalid(f"pod UID ({uid}) does not match claim ({pod_claim.get('uid')})")
            extra[kubeauth.POD_NAME] = [str(pod_claim["name"])]
            extra[kubeauth.POD_UID] = [str(pod_claim["uid"])]
            node_claim = private.get("node")
            if node_claim:
                extra[kubeauth.NODE_NAME] = [str(node_claim.get("name"))]
                if node_claim.get("uid"):
                    extra[kubeauth.NODE_UID] = [str(node_claim["uid"])]
        return {
            "authenticated": True,
            "user": {
                "username": claims["sub"],
                "uid": str(account.get("uid")),
                "groups": [
                    kubeauth.SERVICE_ACCOUNTS,
                    f"{kubeauth.SERVICE_ACCOUNTS}:{namespace}",
                    kubeauth.AUTHENTICATED,
                ],
                "extra": extra,
            },
            "audiences": audiences,
        }

    def _access_review(self, spec: dict[str, Any]) -> aiohttp.web.Response:
        """POST subjectaccessreviews: whether the RBAC objects stored here allow the request
        (kubeauth.authorize); the group ``system:masters`` may do anything, as on a real server."""
        resource = spec.get("resourceAttributes")
        non_resource = spec.get("nonResourceAttributes")
        if bool(resource) == bool(non_resource):
            return _status(
                422,
                "Invalid",
                "spec: Invalid value: exactly one of nonResourceAttributes or resourceAttributes must be specified",
            )
        user, groups = str(spec.get("user") or ""), [str(g) for g in spec.get("groups") or []]
        if not user and not groups:
            return _status(422, "Invalid", "spec.user: Invalid value: at least one of user or group must be specified")
        attributes = resource or non_resource
        assert isinstance(attributes, dict)
        request_attrs = kubeauth.Attributes(
            user=user,
            groups=tuple(groups),
            verb=str(attributes.get("verb") or ""),
            resource_request=bool(resource),
            group=str(attributes.get("group") or ""),
            resource=str(attributes.get("resource") or ""),
            subresource=str(attributes.get("subresource") or ""),
            name=str(attributes.get("name") or ""),
            namespace=str(attributes.get("namespace") or ""),
            path=str(attributes.get("path") or ""),
        )
        if "system:masters" in groups:
            decision = kubeauth.Decision(True, "")
        else:
            decision = kubeauth.authorize(
                request_attrs,
                cluster_roles=self._live(CLUSTERROLES),
                cluster_role_bindings=self._live(CLUSTERROLEBINDINGS),
                roles=lambda ns: self._live(ROLES, ns),
                role_bindings=lambda ns: self._live(ROLEBINDINGS, ns),
            )
        status: dict[str, Any] = {"allowed": decision.allowed}
        if decision.reason:
            status["reason"] = decision.reason
        if decision.errors:
            status["evaluationError"] = "; ".join(decision.errors)
        return _review_answer("SubjectAccessReview", "authorization.k8s.io/v1", spec, status)

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource in RESOURCE_INFO:
            objects: dict[Any, Any] = self.objects._objects
            async with self._lock:
                items = [
                    obj.raw
                    for (resource, namespace, _), obj in objects.items()
                    if resource == request.resource
                    and (request.namespace is None or namespace == request.namespace)
                    and not obj.deleted
                ]
            payload: dict[str, Any] = {"items": items}
        else:
            answered = await super()._serve_list(request)  # kmock's answer (404) for what it does not know
            assert isinstance(answered, dict)
            payload = answered
        try:
            labels = label_selector(request.params.get("labelSelector", ""))
            fields = field_selector(request.params.get("fieldSelector", ""))
        except SelectorError as exc:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=str(exc)) from None
        payload["items"] = [
            item for item in payload["items"] if labels(item.get("metadata", {}).get("labels") or {}) and fields(item)
        ]
        listed = {"resourceVersion": str(self._version)}
        payload["metadata"] = listed
        if request.resource is not None:
            payload["items"] = [self._with_status(request.resource, item) for item in payload["items"]]
        if request.resource is not None and request.resource in RESOURCE_INFO:
            kind = RESOURCE_INFO[request.resource][0]
            group, version = request.resource.group, request.resource.version
            payload["kind"] = f"{kind}List"
            payload["apiVersion"] = f"{group}/{version}" if group else version
            if "as=Table" in request.headers.get("Accept", ""):
                # The list's resourceVersion, so that `kubectl get -w` watches from there.
                return {**tables.table(kind, payload["items"]), "metadata": listed}
        return payload

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        payload = await self._serve_fetch_stored(request)
        if request.resource is not None and isinstance(payload, dict):
            payload = self._with_status(request.resource, payload)
        if request.resource in RESOURCE_INFO and "as=Table" in request.headers.get("Accept", ""):
            assert request.resource is not None and isinstance(payload, dict)
            return tables.table(RESOURCE_INFO[request.resource][0], [payload])
        return payload

    def _with_status(self, resource: kmock.resource, obj: dict[str, Any]) -> dict[str, Any]:
        """The status a controller keeps, computed from the objects there are now: a budget's
        disruptions, a Deployment's or ReplicaSet's replicas, a DaemonSet's scheduled pods."""
        if resource == PDBS:
            return self._with_pdb_status(obj)
        if resource not in (DEPLOYMENTS, REPLICASETS, DAEMONSETS):
            return obj
        namespace = obj.get("metadata", {}).get("namespace")
        selector = _selector(obj)
        pods = [pod for pod in self._live(PODS, namespace) if selector and _matches(pod, selector)]
        ready = sum(1 for pod in pods if _ready(pod))
        generation = obj.get("metadata", {}).get("generation", 1)
        if resource == DAEMONSETS:
            status = {
                "desiredNumberScheduled": self._daemon_nodes(obj),
                "currentNumberScheduled": len(pods),
                "updatedNumberScheduled": len(pods),
                "numberReady": ready,
                "numberAvailable": ready,
                "numberMisscheduled": 0,
            }
        else:
            status = {"replicas": len(pods), "updatedReplicas": len(pods), "readyReplicas": ready}
            status["availableReplicas"] = ready
        return {**obj, "status": {**(obj.get("status") or {}), **status, "observedGeneration": generation}}

    def _daemon_nodes(self, daemonset: dict[str, Any]) -> int:
        """The nodes a DaemonSet should run on: those its template's ``nodeSelector`` matches."""
        template = (daemonset.get("spec") or {}).get("template") or {}
        wanted = (template.get("spec") or {}).get("nodeSelector") or {}
        return sum(1 for node in self._live(NODES) if _matches(node, wanted))

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
        if _dry_run(request):
            return _status(201, "", "")
        if (pod.raw.get("metadata") or {}).get("finalizers"):
            # Graceful deletion: the pod stays, terminating, until its finalizers are gone (the
            # lab's stand-in for a kubelet that has not yet stopped its containers).
            if not pod.raw["metadata"].get("deletionTimestamp"):
                obj = dict(pod.raw)
                obj["metadata"] = {
                    **obj["metadata"],
                    "deletionTimestamp": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "resourceVersion": self.next_version(),
                }
                self.objects[PODS, request.namespace, request.name] = obj
                await self._buses[PODS].put({"type": "MODIFIED", "object": obj})
        else:
            await self._remove(PODS, request.namespace, request.name)
        return _status(201, "", "")

    def _budget(self, pdb: dict[str, Any]) -> tuple[int, int, int]:
        """(pods expected, pods healthy, disruptions allowed) under a budget, from the pods there are now."""
        selector = _selector(pdb)
        namespace = pdb.get("metadata", {}).get("namespace")
        matching = [pod for pod in self._live(PODS, namespace) if selector and _matches(pod, selector)]
        healthy = sum(
            1
            for pod in matching
            if _ready(pod) and not pod["metadata"].get("deletionTimestamp")  # terminating: no longer serving
        )
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
    """A Node as the lab seeds it: Ready, labelled with its gpufleet pool, with the system
    facts a kubelet reports (its boot ID changes when the node reboots)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "gpufleet.io/pool": pool}},
        "spec": {},
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "nodeInfo": node_info(name, boot_id=str(uuid.uuid4())),
        },
    }


def node_info(name: str, *, boot_id: str) -> dict[str, str]:
    """``status.nodeInfo`` as a kubelet of the lab's Kubernetes version reports it."""
    machine = uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.gpufleet.lab")
    return {
        "architecture": "amd64",
        "bootID": boot_id,
        "containerRuntimeVersion": "containerd://1.7.24",
        "kernelVersion": "6.1.0-lab",
        "kubeProxyVersion": "",
        "kubeletVersion": "v1.32.0",
        "machineID": machine.hex,
        "operatingSystem": "linux",
        "osImage": "gpufleet lab",
        "systemUUID": str(machine),
    }


def _owned(kind: str, name: str, uid: str) -> list[dict[str, Any]]:
    api = "apps/v1"
    return [{"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": True, "blockOwnerDeletion": True}]


def _ready(pod: dict[str, Any]) -> bool:
    """Running and Ready, as the disruption and workload controllers count a pod (a Pending pod,
    or one whose readiness probe fails, serves nothing)."""
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _running(containers: list[dict[str, Any]]) -> dict[str, Any]:
    """A pod's status once the kubelet runs it: Running, Ready, each container ready."""
    return {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0, "started": True}
            for c in containers
        ],
    }


TRAINING_TAINT = {"key": "gpufleet.io/pool", "value": "training", "effect": "NoSchedule"}


def training_node(name: str) -> dict[str, Any]:
    """A training node of the shared pool: tainted so that inference pods stay off it."""
    node = node_object(name, pool="training")
    node["spec"]["taints"] = [dict(TRAINING_TAINT)]
    return node


def merge_seeds(*seeds: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Seeds put together (a Namespace named twice is made once)."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for seed in seeds:
        for key, objects in seed.items():
            have = merged.setdefault(key, [])
            names = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in have}
            have += [o for o in objects if (o["metadata"].get("namespace"), o["metadata"]["name"]) not in names]
    return merged


def inference_workloads(replicas: int) -> dict[str, list[dict[str, Any]]]:
    """The shared pool's inference servers: a vLLM Deployment whose ReplicaSet carries a pod
    template (placed by the lab's scheduler on nodes labelled ``gpufleet.io/pool=inference``, one
    per such node, as an autoscaler would size it) and a PodDisruptionBudget that keeps the
    replicas it starts with serving: nodes beyond them may go back to training, those may not."""
    labels = {"app": "vllm"}
    deployment_uid, replicaset_uid = str(uuid.uuid4()), str(uuid.uuid4())
    template = {
        "metadata": {"labels": labels},
        "spec": {
            "nodeSelector": {"gpufleet.io/pool": "inference"},
            "containers": [{"name": "server", "image": "vllm/vllm-openai", "ports": [{"containerPort": 8000}]}],
        },
    }
    return {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "serving"}}],
        "deployments": [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "vllm", "namespace": "serving", "uid": deployment_uid, "labels": labels},
                "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template},
            }
        ],
        "replicasets": [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {
                    "name": "vllm-6f8d9c7b5",
                    "namespace": "serving",
                    "uid": replicaset_uid,
                    "labels": labels,
                    "annotations": {PER_NODE_ANNOTATION: "true"},
                    "ownerReferences": _owned("Deployment", "vllm", deployment_uid),
                },
                "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template},
            }
        ],
        "pdbs": [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "vllm", "namespace": "serving"},
                "spec": {"minAvailable": replicas, "selector": {"matchLabels": labels}},
            }
        ],
    }


# On a lab ReplicaSet: one replica per node its template fits (the lab's stand-in for an
# autoscaler sizing the inference servers to the nodes that serve inference).
PER_NODE_ANNOTATION = "lab.gpufleet.io/replicas-per-node"


def lab_workloads(
    serving: list[str],
    every: list[str],
    *,
    name: str = "inference",
    namespace: str = "serving",
    image: str = "vllm/vllm-openai",
) -> dict[str, list[dict[str, Any]]]:
    """What runs on the lab's nodes, owned as a real cluster owns it: a Deployment ``name``
    (its ReplicaSet's pods on the ``serving`` nodes, a PodDisruptionBudget allowing one down) and
    a node-exporter DaemonSet with a pod on ``every`` node."""
    labels = {"app": name}
    deployment_uid, replicaset_uid, daemonset_uid = (str(uuid.uuid4()) for _ in range(3))
    replicaset = f"{name}-5c9f7d6b8"
    container = [{"name": "server", "image": image}]
    exporter = [{"name": "exporter", "image": "prom/node-exporter"}]
    return {
        "namespaces": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in (namespace, "monitoring")
        ],
        "deployments": [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "namespace": namespace, "uid": deployment_uid, "labels": labels},
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
                    "namespace": namespace,
                    "uid": replicaset_uid,
                    "labels": labels,
                    "ownerReferences": _owned("Deployment", name, deployment_uid),
                },
                "spec": {"replicas": len(serving), "selector": {"matchLabels": labels}},
            }
        ],
        "daemonsets": [
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "node-exporter", "namespace": "monitoring", "uid": daemonset_uid},
                "spec": {
                    "selector": {"matchLabels": {"app": "node-exporter"}},
                    "template": {
                        "metadata": {"labels": {"app": "node-exporter"}},
                        "spec": {"containers": exporter, "tolerations": [{"operator": "Exists"}]},
                    },
                },
            }
        ],
        "pods": [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{replicaset}-{node}",
                    "namespace": namespace,
                    "labels": labels,
                    "ownerReferences": _owned("ReplicaSet", replicaset, replicaset_uid),
                },
                # Placed by hand on the training nodes, whose taint they tolerate.
                "spec": {
                    "nodeName": node,
                    "containers": container,
                    "tolerations": [{"key": "gpufleet.io/pool", "operator": "Exists"}],
                },
                "status": _running(container),
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
                "spec": {"nodeName": node, "containers": exporter},
                "status": _running(exporter),
            }
            for node in every
        ],
        "pdbs": [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": name, "namespace": namespace},
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


async def serve(
    *,
    port: int,
    seed: Path | None,
    kubeconfig: Path | None,
    ready_file: Path | None,
    audit_log: Path | None = None,
    token_file: Path | None = None,
    signing_key: Path | None = None,
) -> None:
    try:
        static = kubeauth.read_token_file(token_file) if token_file is not None else {}
        key = kubeauth.signing_key(signing_key)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"python -m lab.kubeapi: {exc}") from None
    emulator = KubeApiEmulator(audit_log=audit_log, signing_key=key, static_tokens=static)
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
    parser.add_argument(
        "--audit-log",
        type=Path,
        help="append one JSON line per resource request here (verb as RBAC names it, apiGroup, resource, "
        "subresource, namespace, name)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help='static bearer tokens, as kube-apiserver\'s --token-auth-file: CSV lines token,user,uid,"group1,group2"',
    )
    parser.add_argument(
        "--signing-key",
        type=Path,
        help="the key ServiceAccount tokens are signed with (made here when absent), so that they outlive a "
        "restart; default: a fresh key per start",
    )
    args = parser.parse_args()
    asyncio.run(
        serve(
            port=args.port,
            seed=args.seed,
            kubeconfig=args.kubeconfig,
            ready_file=args.ready_file,
            audit_log=args.audit_log,
            token_file=args.token_file,
            signing_key=args.signing_key,
        )
    )


if __name__ == "__main__":
    main()
