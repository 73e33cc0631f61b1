"""The three patch formats of PATCH requests, applied as the API server applies them.

- JSON merge patch (RFC 7386, ``application/merge-patch+json``): objects merge, ``null``
  removes a field, a list replaces the list.
- Strategic merge patch (``application/strategic-merge-patch+json``, kubectl's default for
  built-in kinds): as a merge patch, except that lists the schema marks
  ``x-kubernetes-patch-strategy: merge`` merge by their ``x-kubernetes-patch-merge-key`` (a
  pod's containers by name, a node's conditions by type) or, for lists of scalars, as a set;
  other lists (a node's taints) are replaced whole. The directives kubectl writes are honoured:
  ``$patch: replace|delete|merge``, ``$setElementOrder/<list>``, ``$retainKeys`` and
  ``$deleteFromPrimitiveList/<list>``.
- JSON patch (RFC 6902, ``application/json-patch+json``): add, remove, replace, move, copy, test.

Each function returns a new object and leaves its arguments alone; a patch that cannot apply
raises ``PatchError`` with what was wrong.
"""

from __future__ import annotations

import copy
from typing import Any

from lab.openapi import Schema, field, resolve

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


class PatchError(ValueError):
    """A patch that cannot be applied (the API server answers 422 or 400)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _strategy(schema: Schema | None) -> tuple[bool, str | None]:
    """(merge or not, merge key) of a list field's schema."""
    if schema is None:
        return False, None
    strategies = str(schema.get("x-kubernetes-patch-strategy", "")).split(",")
    return "merge" in strategies, schema.get("x-kubernetes-patch-merge-key")


def _clean(value: Any) -> Any:
    """A patch value stored as it is: directives dropped, nulls in objects dropped."""
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items() if not key.startswith("$") and item is not None}
    if isinstance(value, list):
        return [_clean(item) for item in value if not (isinstance(item, dict) and item.get("$patch") == "delete")]
    return value


def strategic_merge_patch(original: Any, patch: Any, schema: Schema | None) -> Any:
    """Apply a strategic-merge patch to ``original``, whose schema is ``schema`` (None: an
    object of unknown type, merged as a JSON merge patch would, lists replaced)."""
    if not isinstance(patch, dict):
        return _clean(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return _clean(patch)
    if directive == "delete":
        return None
    if directive not in (None, "merge"):
        raise PatchError(f"unknown patch directive $patch: {directive!r}")
    result: dict[str, Any] = copy.deepcopy(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if not isinstance(value, list):
                raise PatchError(f"{key} must be a list")
            result[name] = [item for item in result.get(name) or [] if item not in value]
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
            continue
        sub = field(schema, key)
        if isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, sub, patch.get(f"$setElementOrder/{key}"))
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    for key, order in patch.items():
        name = key.split("/", 1)[1] if key.startswith("$setElementOrder/") else None
        if name is not None and name not in patch and isinstance(result.get(name), list):
            result[name] = _ordered(result[name], order, _strategy(field(schema, name))[1])
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {key: item for key, item in result.items() if key in retain}
    return result


def _merge_list(original: Any, patch: list[Any], schema: Schema | None, order: Any) -> list[Any]:
    merge, key = _strategy(schema)
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [_clean(item) for item in patch if not (isinstance(item, dict) and item.get("$patch") == "replace")]
    if not merge or not isinstance(original, list):
        return [_clean(item) for item in patch if not (isinstance(item, dict) and item.get("$patch") == "delete")]
    if key is None:  # a set of scalars (finalizers)
        merged = list(original)
        merged += [item for item in patch if item not in merged]
        return _ordered(merged, order, None)
    items = resolve(schema).get("items") if resolve(schema) else None  # type: ignore[union-attr]
    merged = copy.deepcopy(original)
    for change in patch:
        if not isinstance(change, dict) or key not in change:
            raise PatchError(f"an element of a list merged by {key!r} has no {key!r}: {change!r}")
        at = next((i for i, item in enumerate(merged) if isinstance(item, dict) and item.get(key) == change[key]), None)
        if change.get("$patch") == "delete":
            if at is not None:
                del merged[at]
        elif at is None:
            merged.append(_clean(change))
        else:
            merged[at] = strategic_merge_patch(merged[at], change, items)
    return _ordered(merged, order, key)


def _ordered(items: list[Any], order: Any, key: str | None) -> list[Any]:
    """``$setElementOrder``: the listed elements first, in that order, then the others."""
    if not isinstance(order, list):
        return items
    wanted = [entry.get(key) if key is not None and isinstance(entry, dict) else entry for entry in order]

    def rank(item: Any) -> int:
        ident = item.get(key) if key is not None and isinstance(item, dict) else item
        return wanted.index(ident) if ident in wanted else len(wanted)

    return sorted(items, key=rank)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"a JSON pointer starts with '/': {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], op: str) -> tuple[Any, str]:
    if not parts:
        raise PatchError(f"{op} of the whole object is not allowed")
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise PatchError(f"{op}: no path /{'/'.join(parts)} in the object")
    return node, parts[-1]


def _get(doc: Any, parts: list[str], op: str) -> Any:
    parent, last = _parent(doc, parts, op) if parts else (None, "")
    if not parts:
        return doc
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise PatchError(f"{op}: no path /{'/'.join(parts)} in the object")


def _remove(doc: Any, parts: list[str], op: str) -> Any:
    value = _get(doc, parts, op)
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict):
        del parent[last]
    else:
        del parent[int(last)]
    return value


def _add(doc: Any, parts: list[str], value: Any, op: str) -> None:
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list) and (last == "-" or (last.isdigit() and int(last) <= len(parent))):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        raise PatchError(f"{op}: cannot add at /{'/'.join(parts)}")


def json_patch(original: Any, operations: Any) -> Any:
    """RFC 6902."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations")
    doc = copy.deepcopy(original)
    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise PatchError(f"not a JSON patch operation (it needs op and path): {operation!r}")
        op, parts = operation["op"], _pointer(operation["path"])
        if op in ("add", "replace", "test") and "value" not in operation:
            raise PatchError(f"{op} {operation['path']}: no value")
        if op == "add":
            _add(doc, parts, copy.deepcopy(operation["value"]), op)
        elif op == "remove":
            _remove(doc, parts, op)
        elif op == "replace":
            _remove(doc, parts, op)
            _add(doc, parts, copy.deepcopy(operation["value"]), op)
        elif op in ("move", "copy"):
            source = _pointer(str(operation.get("from", "")))
            value = _remove(doc, source, op) if op == "move" else copy.deepcopy(_get(doc, source, op))
            _add(doc, parts, value, op)
        elif op == "test":
            if _get(doc, parts, op) != operation["value"]:
                raise PatchError(f"test {operation['path']}: the value differs")
        else:
            raise PatchError(f"unknown JSON patch operation {op!r}")
    return doc
