"""The emulated API's OpenAPI v3 documents, from the Kubernetes schema definitions.

A real API server publishes its types at ``/openapi/v3``: an index naming one document per
group-version, each with the paths it serves and the schemas of its kinds. kubectl reads them
for ``kubectl explain``, to learn whether the server validates fields itself (the
``fieldValidation`` parameter on PATCH), and for the merge keys of strategic-merge patches.

The schemas are Kubernetes' own, as the ``kubernetes-validate`` package ships them (JSON
Schema, converted back to OpenAPI here); the emulator also uses them to find unknown fields
(``fieldValidation=Strict``) and the merge keys of the patches it applies (``lab.patches``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import re
from collections.abc import Iterable
from typing import Any

# The Kubernetes release whose schemas the emulator serves (and whose version it reports):
# the minor of the kubectl the machine image ships. The newest present is used when absent.
SCHEMA_RELEASE = "v1.32.0"
_REF = "#/components/schemas/"

Schema = dict[str, Any]


def _release_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name.split("-")[0]))


@functools.cache
def release() -> str:
    """The release whose definitions are served, e.g. ``v1.32.0``."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    local = [entry.name.removesuffix("-local") for entry in root.iterdir() if entry.name.endswith("-local")]
    present = sorted(local, key=_release_key)
    if not present:
        raise RuntimeError("kubernetes-validate has no schema definitions: reinstall it with pip")
    return SCHEMA_RELEASE if SCHEMA_RELEASE in present else present[-1]


def _openapi(node: Any) -> Any:
    """JSON Schema as kubernetes-validate writes it, back to OpenAPI v3 as an API server serves it:
    ``$defs`` references become component references and ``["string", "null"]`` types plain."""
    if isinstance(node, list):
        return [_openapi(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted: Schema = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            converted[key] = _REF + value.rsplit("/", 1)[-1]
        elif key == "type" and isinstance(value, list):
            kinds = [kind for kind in value if kind != "null"]
            converted[key] = kinds[0] if len(kinds) == 1 else kinds
        elif key == "properties" and isinstance(value, dict):
            converted[key] = {name: _openapi(prop) for name, prop in value.items()}
            for name in ("apiVersion", "kind"):  # kubernetes-validate's own addition
                if isinstance(converted[key].get(name), dict):
                    converted[key][name].pop("enum", None)
        else:
            converted[key] = _openapi(value)
    return converted


@functools.cache
def definitions() -> dict[str, Schema]:
    """Every schema of the release, by its Kubernetes name (``io.k8s.api.core.v1.Node``)."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    raw = json.loads((root / f"{release()}-local" / "_definitions.json").read_text(encoding="utf-8"))
    return {name: _openapi(schema) for name, schema in raw["$defs"].items()}


@functools.cache
def _by_kind() -> dict[tuple[str, str, str], str]:
    found: dict[tuple[str, str, str], str] = {}
    for name, schema in definitions().items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            found.setdefault((gvk["group"], gvk["version"], gvk["kind"]), name)
    return found


def schema_name(group: str, version: str, kind: str) -> str | None:
    """The name of a kind's schema, or None for a kind Kubernetes does not define."""
    return _by_kind().get((group, version, kind))


def resolve(schema: Schema | None) -> Schema | None:
    """A schema with its reference (plain or in a one-element ``allOf``) followed."""
    while schema is not None:
        ref = schema.get("$ref") or next((part.get("$ref") for part in schema.get("allOf", [])), None)
        if not ref:
            return schema
        schema = definitions().get(ref[len(_REF) :])
    return None


def field(schema: Schema | None, name: str) -> Schema | None:
    """The schema of one property of an object schema (None when unknown or untyped)."""
    resolved = resolve(schema)
    if resolved is None:
        return None
    properties = resolved.get("properties")
    if properties is not None and name in properties:
        found: Schema = properties[name]
        return found
    extra = resolved.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _open(schema: Schema) -> bool:
    """Whether an object schema takes any field (no declared properties: RawExtension, JSON)."""
    return "properties" not in schema or bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def unknown_fields(schema: Schema | None, value: Any, path: str = "") -> list[str]:
    """The paths of the fields in ``value`` that its schema does not declare, written as the
    API server writes them in a strict decoding error (``spec.template.spec.containers[0].imagee``).
    Keys starting with ``$`` are strategic-merge directives, not fields."""
    resolved = resolve(schema)
    if resolved is None:
        return []
    found: list[str] = []
    if isinstance(value, dict):
        extra = resolved.get("additionalProperties")
        for key, item in value.items():
            if key.startswith("$"):
                continue
            where = f"{path}.{key}" if path else key
            if isinstance(extra, dict):
                found += unknown_fields(extra, item, where)
            elif key in resolved.get("properties", {}):
                found += unknown_fields(resolved["properties"][key], item, where)
            elif not _open(resolved):
                found.append(where)
    elif isinstance(value, list) and isinstance(resolved.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(resolved["items"], item, f"{path}[{index}]")
    return found


def prune(schema: Schema | None, value: Any) -> None:
    """Drop, in place, the fields ``unknown_fields`` names (a real server keeps only what its
    types declare)."""
    resolved = resolve(schema)
    if resolved is None:
        return
    if isinstance(value, dict):
        extra = resolved.get("additionalProperties")
        properties = resolved.get("properties", {})
        for key in list(value):
            if key.startswith("$"):
                continue
            if isinstance(extra, dict):
                prune(extra, value[key])
            elif key in properties:
                prune(properties[key], value[key])
            elif not _open(resolved):
                del value[key]
    elif isinstance(value, list) and isinstance(resolved.get("items"), dict):
        for item in value:
            prune(resolved["items"], item)


def _closure(names: Iterable[str]) -> dict[str, Schema]:
    """The named schemas and every schema they reference."""
    wanted = list(names)
    found: dict[str, Schema] = {}
    while wanted:
        name = wanted.pop()
        if name in found or name not in definitions():
            continue
        found[name] = definitions()[name]
        wanted += [ref[len(_REF) :] for ref in re.findall(r'"\$ref": "([^"]+)"', json.dumps(found[name]))]
    return found


def _references(schemas: dict[str, Schema]) -> list[str]:
    """The names of Kubernetes' schemas that ``schemas`` reference."""
    return [ref[len(_REF) :] for ref in re.findall(r'"\$ref": "([^"]+)"', json.dumps(schemas))]


_FIELD_VALIDATION = {
    "name": "fieldValidation",
    "in": "query",
    "description": "Ignore, Warn (the default) or Strict: what the server does with unknown fields.",
    "schema": {"type": "string", "uniqueItems": True},
}


def _operations(group: str, version: str, kind: str, namespaced: bool, plural: str) -> dict[str, Any]:
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    where = f"{prefix}/namespaces/{{namespace}}/{plural}" if namespaced else f"{prefix}/{plural}"
    gvk = {"group": group, "version": version, "kind": kind}

    def operation(action: str, *, validated: bool = False) -> dict[str, Any]:
        return {
            "operationId": f"{action}{kind}",
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": gvk,
            "parameters": [_FIELD_VALIDATION] if validated else [],
            "responses": {"200": {"description": "OK"}},
        }

    return {
        where: {"get": operation("list"), "post": operation("post", validated=True)},
        f"{where}/{{name}}": {
            "get": operation("get"),
            "put": operation("put", validated=True),
            "patch": operation("patch", validated=True),
            "delete": operation("delete"),
        },
    }


def group_version_path(group: str, version: str) -> str:
    """The key of a group-version in the index: ``api/v1`` or ``apis/apps/v1``."""
    return f"apis/{group}/{version}" if group else f"api/{version}"


def document(
    group: str, version: str, kinds: Iterable[tuple[str, str, bool]], schemas: dict[str, Schema] | None = None
) -> dict[str, Any]:
    """One group-version's document; ``kinds`` are (kind, plural, namespaced) of what it serves;
    ``schemas`` those of kinds Kubernetes does not define (a CRD's, by name), which may
    reference Kubernetes' own."""
    paths: dict[str, Any] = {}
    names = []
    for kind, plural, namespaced in kinds:
        paths.update(_operations(group, version, kind, namespaced, plural))
        name = schema_name(group, version, kind)
        if name is not None:
            names.append(name)
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (gpufleet lab)", "version": release()},
        "paths": paths,
        "components": {
            "schemas": dict(sorted((_closure(names + _references(schemas or {})) | (schemas or {})).items()))
        },
    }


def index(documents: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``/openapi/v3``: each group-version's document by path, with a hash of its content."""
    return {
        "paths": {
            path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={_digest(doc)}"}
            for path, doc in sorted(documents.items())
        }
    }


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:64].upper()
