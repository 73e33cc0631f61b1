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


def _directive(item: Any, name: str) -> bool:
    return isinstance(item, dict) and item.get("$patch") == name


def _clean(value: Any) -> Any:
    """A patch value stored as it is: directives and their markers dropped, nulls in objects dropped."""
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items() if not key.startswith("$") and item is not None}
    if isinstance(value, list):
        return [_clean(item) for item in value if not (_directive(item, "delete") or _directive(item, "replace"))]
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
            if isinstance(result.get(name), list):
                result[name] = [item for item in result[name] if item not in value]
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
            result[name] = _merge_list(result[name], [], field(schema, name), order)
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {key: item for key, item in result.items() if key in retain}
    return result


def _merge_list(original: Any, patch: list[Any], schema: Schema | None, order: Any) -> list[Any]:
    """A list merged as the API server merges it: by key (or as a set of scalars) when the schema
    says so, deletions first; the patch's order (or its ``$setElementOrder``) wins, and elements
    only the server has keep their places relative to the others."""
    merge, key = _strategy(schema)
    if any(_directive(item, "replace") for item in patch):
        return [_clean(item) for item in patch if not _directive(item, "replace")]
    if not merge or not isinstance(original, list):
        return [_clean(item) for item in patch if not _directive(item, "delete")]

    def ident(item: Any) -> Any:
        if key is None:
            return item
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"an element of a list merged by {key!r} has no {key!r}: {item!r}")
        return item[key]

    merged = copy.deepcopy(original)
    for change in patch:  # deletions first
        if key is not None and _directive(change, "delete"):
            merged = [item for item in merged if ident(item) != ident(change)]
    items = (resolve(schema) or {}).get("items")
    for change in patch:
        if _directive(change, "delete"):
            continue
        at = next((i for i, item in enumerate(merged) if ident(item) == ident(change)), None)
        if at is None:
            merged.append(_clean(change))
        elif key is not None:
            merged[at] = strategic_merge_patch(merged[at], change, items)
    return _ordered(merged, [ident(item) for item in original], order if isinstance(order, list) else patch, ident)


def _ordered(merged: list[Any], server: list[Any], order: list[Any], ident: Any) -> list[Any]:
    """The order apimachinery gives a merged list: the elements the patch (or its order list)
    names, in that order, interleaved with the elements only the server had, in server order."""
    wanted = [ident(entry) for entry in order if not _directive(entry, "delete")]
    named = sorted((item for item in merged if ident(item) in wanted), key=lambda item: wanted.index(ident(item)))
    others = [item for item in merged if ident(item) not in wanted]
    result: list[Any] = []
    while named or others:
        if not others:
            result.append(named.pop(0))
        elif not named:
            result.append(others.pop(0))
        else:
            left, right = ident(named[0]), ident(others[0])
            both = left in server and right in server
            result.append(named.pop(0) if both and server.index(left) < server.index(right) else others.pop(0))
    return result


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str):
        raise PatchError(f"a JSON pointer is a string: {path!r}")
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"a JSON pointer starts with '/': {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _index(part: str) -> int | None:
    return int(part) if part.isascii() and part.isdecimal() else None


def _parent(doc: Any, parts: list[str], op: str) -> tuple[Any, str]:
    if not parts:
        raise PatchError(f"{op} of the whole object is not allowed")
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and _index(part) is not None and _index(part) < len(node):  # type: ignore[operator]
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
    index = _index(last)
    if isinstance(parent, list) and index is not None and index < len(parent):
        return parent[index]
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
    elif isinstance(parent, list) and (last == "-" or (_index(last) is not None and int(last) <= len(parent))):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        raise PatchError(f"{op}: cannot add at /{'/'.join(parts)}")


def _same(left: Any, right: Any) -> bool:
    """JSON equality: true is not 1."""
    if type(left) is not type(right) and not (isinstance(left, (int, float)) and isinstance(right, (int, float))):
        return False
    if isinstance(left, bool) != isinstance(right, bool):
        return False
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_same(left[k], right[k]) for k in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right, strict=True))
    return bool(left == right)


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
            if "from" not in operation:
                raise PatchError(f"{op} {operation['path']}: no from")
            source = _pointer(operation["from"])
            if op == "move" and parts[: len(source)] == source and len(parts) > len(source):
                raise PatchError(f"move {operation['path']}: cannot move a value into itself")
            value = _remove(doc, source, op) if op == "move" else copy.deepcopy(_get(doc, source, op))
            _add(doc, parts, value, op)
        elif op == "test":
            if not _same(_get(doc, parts, op), operation["value"]):
                raise PatchError(f"test {operation['path']}: the value differs")
        else:
            raise PatchError(f"unknown JSON patch operation {op!r}")
    return doc
