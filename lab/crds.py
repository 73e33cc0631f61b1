"""Slinky's CustomResourceDefinitions (slurm-operator, pinned release), and what a real API server
does with a custom resource because of them.

The CRDs are vendored unchanged in ``lab/crds/slinky-v1.2.1`` (see the README there). From each
one's ``openAPIV3Schema`` (a structural schema), as kube-apiserver's apiextensions handler does:

- unknown fields are found and pruned (``x-kubernetes-preserve-unknown-fields`` keeps them; an
  object with neither properties nor additionalProperties keeps none); ``metadata`` is pruned to
  ObjectMeta's fields;
- nulls in fields that are not ``nullable`` are dropped (or given the field's default), then
  ``default`` values are set where a field is missing inside an object that is present;
- the object is validated as kube-openapi validates it (type, format date-time, required, enum,
  minimum/maximum, minLength/maxLength, pattern, minItems/maxItems, int-or-string), each error
  worded as the server words it (``lab.kubevalidate.FieldError``);
- the ``x-kubernetes-validations`` (CEL) rules are evaluated by a small interpreter of the part of
  CEL they use (``self``, field selection, ``has()``, ``!``, ``&&``, ``||``, ``? :``, ``==``,
  ``!=``, string and boolean literals, with CEL's error semantics); a rule outside it is listed by
  ``validation_rules`` as not enforced and skipped.
"""

from __future__ import annotations

import copy
import datetime
import functools
import importlib.resources
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from lab import openapi
from lab.kubetables import age
from lab.kubevalidate import FieldError, invalid

RELEASE = "v1.2.1"
FOLDER = f"slinky-{RELEASE}"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# What the server answers when schema errors keep the CEL rules from being evaluated.
RULES_NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)

Schema = dict[str, Any]


@dataclass(frozen=True)
class CustomResource:
    """One served version of a CRD, as discovery and the handlers need it."""

    crd: dict[str, Any]
    group: str
    version: str
    plural: str
    singular: str
    kind: str
    short_names: tuple[str, ...]
    namespaced: bool
    schema: Schema
    subresources: dict[str, Any] = field(default_factory=dict)
    printer_columns: tuple[dict[str, Any], ...] = ()

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def scale(self) -> dict[str, Any] | None:
        found = self.subresources.get("scale")
        return found if isinstance(found, dict) else None


@functools.cache
def definitions() -> tuple[dict[str, Any], ...]:
    """The vendored CRDs, as parsed from their YAML, ordered by name."""
    root = importlib.resources.files("lab") / "crds" / FOLDER
    found = []
    for entry in root.iterdir():
        if entry.name.endswith(".yaml"):
            found += [doc for doc in yaml.safe_load_all(entry.read_text(encoding="utf-8")) if doc]
    return tuple(sorted(found, key=lambda crd: str(crd["metadata"]["name"])))


@functools.cache
def served() -> tuple[CustomResource, ...]:
    """Every served version of every CRD."""
    resources = []
    for crd in definitions():
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            resources.append(
                CustomResource(
                    crd=crd,
                    group=spec["group"],
                    version=version["name"],
                    plural=names["plural"],
                    singular=names.get("singular") or names["kind"].lower(),
                    kind=names["kind"],
                    short_names=tuple(names.get("shortNames") or ()),
                    namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    schema=version["schema"]["openAPIV3Schema"],
                    subresources=dict(version.get("subresources") or {}),
                    printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                )
            )
    return tuple(resources)


def stored_definition(crd: dict[str, Any]) -> dict[str, Any]:
    """A CRD as the API server stores it once it is established: its names accepted."""
    stored = copy.deepcopy(crd)
    stored.setdefault("metadata", {})
    spec = stored["spec"]
    conditions = [
        {
            "type": "NamesAccepted",
            "status": "True",
            "reason": "NoConflicts",
            "message": "no conflicts found",
            "lastTransitionTime": "1970-01-01T00:00:00Z",
        },
        {
            "type": "Established",
            "status": "True",
            "reason": "InitialNamesAccepted",
            "message": "the initial names have been accepted",
            "lastTransitionTime": "1970-01-01T00:00:00Z",
        },
    ]
    stored["status"] = {
        "acceptedNames": copy.deepcopy(spec["names"]),
        "conditions": conditions,
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
    }
    return stored


# ---- pruning, nulls and defaults -------------------------------------------------------------


def _preserves(schema: Schema) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def _object_meta() -> Schema:
    return {"$ref": "#/components/schemas/" + OBJECT_META}


def unknown_fields(schema: Schema, value: Any, path: str = "") -> list[str]:
    """The paths of the fields a structural schema prunes from ``value`` (as the server names
    them in a strict decoding error: ``spec.foo``, ``spec.list[0].bar``)."""
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if not path and key == "metadata":
                found += openapi.unknown_fields(_object_meta(), item, "metadata")
            elif key in properties:
                found += unknown_fields(properties[key], item, where)
            elif isinstance(extra, dict):
                found += unknown_fields(extra, item, where)
            elif not _preserves(schema) and extra is not True:
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{index}]")
    return found


def prune(schema: Schema, value: Any, *, root: bool = True) -> None:
    """Drop, in place, what ``unknown_fields`` names."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key in list(value):
            if root and key == "metadata":
                openapi.prune(_object_meta(), value[key])
            elif key in properties:
                prune(properties[key], value[key], root=False)
            elif isinstance(extra, dict):
                prune(extra, value[key], root=False)
            elif not _preserves(schema) and extra is not True:
                del value[key]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            prune(schema["items"], item, root=False)


def default(schema: Schema, value: Any) -> None:
    """Defaults set in place, as the server sets them: a field that is missing (or null and not
    nullable) inside an object that is there gets its schema's ``default``; a null that is not
    nullable and has no default is dropped."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for key, prop in properties.items():
            if value.get(key, 0) is None and not prop.get("nullable") and "default" not in prop:
                del value[key]
            elif "default" in prop and (key not in value or (value[key] is None and not prop.get("nullable"))):
                value[key] = copy.deepcopy(prop["default"])
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                default(properties[key], item)
            elif isinstance(extra, dict):
                default(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            default(schema["items"], item)


# ---- schema validation (kube-openapi's, worded as apiextensions words it) ---------------------


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _types(schema: Schema) -> list[str]:
    if schema.get("x-kubernetes-int-or-string"):
        return ["integer", "string"]
    kind = schema.get("type")
    return [kind] if isinstance(kind, str) and kind else []


def _go_regex(pattern: str) -> re.Pattern[str]:
    """A schema's pattern (RE2 as Go reads it) for Python: ``$`` matches only at the very end."""
    out, escaped, in_class = [], False, False
    for char in pattern:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif char == "[" and not in_class:
            in_class = True
            out.append(char)
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        elif char == "$" and not in_class:
            out.append(r"\Z")
        else:
            out.append(char)
    return re.compile("".join(out))


_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$",
)


def _date_time(value: str) -> bool:
    if not _RFC3339.match(value):
        return False
    try:
        datetime.datetime.fromisoformat(value.replace("z", "Z").replace("t", "T").replace(" ", "T"))
    except ValueError:
        return False
    return True


def _number(value: float) -> str:
    """How Go's %v prints a schema bound (an integral one as an integer)."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def _bad_type(path: str, wanted: str, actual: str) -> FieldError:
    body = f"{path} in body must be of type {wanted}: {_quote(actual)}"
    return FieldError("FieldValueTypeInvalid", path, f"Invalid value: {_quote(actual)}: {body}")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _shown(value: Any) -> Any:
    return value if not isinstance(value, (dict, list)) else "object" if isinstance(value, dict) else "array"


def _type_ok(schema: Schema, value: Any) -> tuple[bool, str, str]:
    """(valid, wanted, actual) for the type check."""
    wanted = _types(schema)
    actual = _json_type(value)
    if value is None:
        return (not wanted or bool(schema.get("nullable"))), ",".join(wanted), "null"
    if not wanted:
        return True, "", actual
    if actual == "number" and "integer" in wanted and float(value).is_integer():
        return True, "", actual
    if actual == "integer" and "number" in wanted:
        return True, "", actual
    fmt = schema.get("format")
    if fmt in ("int32", "int64") and actual == "number" and "integer" in wanted:
        return False, str(fmt), "double"
    return actual in wanted, ",".join(wanted), actual


def validate(schema: Schema, value: Any, path: str = "") -> list[FieldError]:
    """What kube-openapi finds wrong with ``value`` under ``schema`` (root: the whole object)."""
    errors: list[FieldError] = []
    ok, wanted, actual = _type_ok(schema, value)
    if not ok:
        errors.append(_bad_type(path, wanted, actual))
    if value is None:
        return errors
    enum = schema.get("enum")
    if enum is not None and value not in enum:
        supported = ", ".join(_quote(v) if isinstance(v, str) else str(v).lower() for v in enum)
        shown = _quote(value) if isinstance(value, str) else str(_shown(value))
        errors.append(
            FieldError("FieldValueNotSupported", path, f"Unsupported value: {shown}: supported values: {supported}")
        )
    if isinstance(value, str):
        errors += _validate_string(schema, value, path)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        errors += _validate_number(schema, value, path)
    elif isinstance(value, list):
        errors += _validate_array(schema, value, path)
    elif isinstance(value, dict) and ok:
        errors += _validate_object(schema, value, path)
    return errors


def _validate_string(schema: Schema, value: str, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if schema.get("format") == "date-time" and not _date_time(value):
        body = f"{path} in body must be of type date-time: {_quote(value)}"
        errors.append(FieldError("FieldValueTypeInvalid", path, f"Invalid value: {_quote(value)}: {body}"))
    if "maxLength" in schema and len(value) > int(schema["maxLength"]):
        limit = int(schema["maxLength"])
        unit = "byte" if limit == 1 else "bytes"
        errors.append(FieldError("FieldValueTooLong", path, f"Too long: may not be more than {limit} {unit}"))
    if "minLength" in schema and len(value) < int(schema["minLength"]):
        errors.append(invalid(path, value, f"{path} in body should be at least {schema['minLength']} chars long"))
    pattern = schema.get("pattern")
    if pattern and not _go_regex(pattern).search(value):
        errors.append(invalid(path, value, f"{path} in body should match '{pattern}'"))
    return errors


def _validate_number(schema: Schema, value: float, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if "minimum" in schema:
        low = schema["minimum"]
        exclusive = bool(schema.get("exclusiveMinimum"))
        if value < low or (exclusive and value == low):
            words = "greater than" if exclusive else "greater than or equal to"
            errors.append(invalid(path, value, f"{path} in body should be {words} {_number(low)}"))
    if "maximum" in schema:
        high = schema["maximum"]
        exclusive = bool(schema.get("exclusiveMaximum"))
        if value > high or (exclusive and value == high):
            words = "less than" if exclusive else "less than or equal to"
            errors.append(invalid(path, value, f"{path} in body should be {words} {_number(high)}"))
    return errors


def _validate_array(schema: Schema, value: list[Any], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    items = schema.get("items")
    if isinstance(items, dict):
        for index, item in enumerate(value):
            errors += validate(items, item, f"{path}[{index}]")
    if "minItems" in schema and len(value) < int(schema["minItems"]):
        errors.append(invalid(path, len(value), f"{path} in body should have at least {schema['minItems']} items"))
    if "maxItems" in schema and len(value) > int(schema["maxItems"]):
        limit = int(schema["maxItems"])
        unit = "item" if limit == 1 else "items"
        errors.append(
            FieldError("FieldValueTooMany", path, f"Too many: {len(value)}: must have at most {limit} {unit}")
        )
    return errors


def _validate_object(schema: Schema, value: dict[str, Any], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for name in schema.get("required") or ():
        if name not in value:
            errors.append(FieldError("FieldValueRequired", f"{path}.{name}" if path else name, "Required value"))
    properties = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if not path and key == "metadata":
            if not isinstance(item, dict):
                errors.append(_bad_type("metadata", "object", _json_type(item)))
            continue
        if key in properties:
            errors += validate(properties[key], item, where)
        elif isinstance(extra, dict):
            errors += validate(extra, item, where)
    return errors


# ---- x-kubernetes-validations (CEL) ---------------------------------------------------------


class CelError(Exception):
    """A CEL evaluation error (``no such key: x``, ``no such overload``)."""


_TOKEN = re.compile(
    r"\s*(?:(\|\||&&|==|!=|[!?:().])|('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")|([A-Za-z_][A-Za-z0-9_]*))"
)

Node = tuple[Any, ...]


def _tokens(text: str) -> list[str]:
    tokens, at = [], 0
    text = text.strip()
    while at < len(text):
        found = _TOKEN.match(text, at)
        if found is None or found.end() == at:
            raise ValueError(f"not in the CEL subset served: {text[at:]!r}")
        tokens.append(found.group(0).strip())
        at = found.end()
        while at < len(text) and text[at].isspace():
            at += 1
    return tokens


class _Parser:
    """expr := or ('?' expr ':' expr)?; or := and ('||' and)*; and := eq ('&&' eq)*;
    eq := unary (('=='|'!=') unary)?; unary := '!' unary | primary;
    primary := 'has' '(' select ')' | select | literal | '(' expr ')'; select := 'self' ('.' name)*"""

    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.at = 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, wanted: str | None = None) -> str:
        token = self.peek()
        if token is None or (wanted is not None and token != wanted):
            raise ValueError(f"expected {wanted or 'more'} at {token!r}")
        self.at += 1
        return token

    def parse(self) -> Node:
        node = self.expr()
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.peek()!r}")
        return node

    def expr(self) -> Node:
        cond = self.binary("||", self.conj)
        if self.peek() == "?":
            self.take("?")
            then = self.expr()
            self.take(":")
            return ("?", cond, then, self.expr())
        return cond

    def conj(self) -> Node:
        return self.binary("&&", self.equality)

    def binary(self, op: str, operand: Callable[[], Node]) -> Node:
        node = operand()
        while self.peek() == op:
            self.take(op)
            node = (op, node, operand())
        return node

    def equality(self) -> Node:
        node = self.unary()
        if self.peek() in ("==", "!="):
            op = self.take()
            return (op, node, self.unary())
        return node

    def unary(self) -> Node:
        if self.peek() == "!":
            self.take("!")
            return ("!", self.unary())
        return self.primary()

    def primary(self) -> Node:
        word = self.take()
        if word == "(":
            node = self.expr()
            self.take(")")
            return node
        if word in ("true", "false"):
            return ("lit", word == "true")
        if word[0] in "'\"":
            return ("lit", word[1:-1].encode().decode("unicode_escape"))
        if word == "has":
            self.take("(")
            selected = self.select(self.take())
            self.take(")")
            if selected[0] != "sel":
                raise ValueError("has() takes a field selection")
            return ("has", selected[1], selected[2])
        return self.select(word)

    def select(self, word: str) -> Node:
        if word != "self":
            raise ValueError(f"unknown name {word!r}")
        node: Node = ("self",)
        while self.peek() == ".":
            self.take(".")
            node = ("sel", node, self.take())
        return node


def compile_rule(rule: str) -> Node | None:
    """The rule's syntax tree, or None when it is outside the subset this interpreter serves."""
    try:
        return _Parser(rule).parse()
    except ValueError:
        return None


def _select(value: Any, name: str) -> Any:
    if not isinstance(value, dict):
        raise CelError(f"no such overload: {_json_type(value)}.{name}")
    if name not in value:
        raise CelError(f"no such key: {name}")
    return value[name]


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"no such overload: {_json_type(value)}")
    return value


def evaluate(node: Node, self_value: Any) -> Any:
    """CEL's value of ``node`` with ``self`` bound; CelError for an error value. ``||`` and
    ``&&`` are commutative over errors, as in CEL: ``true || error`` is true either way round."""
    op = node[0]
    if op == "lit":
        return node[1]
    if op == "self":
        return self_value
    if op == "sel":
        return _select(evaluate(node[1], self_value), node[2])
    if op == "has":
        holder = evaluate(node[1], self_value)
        if not isinstance(holder, dict):
            raise CelError(f"no such overload: has({_json_type(holder)})")
        return node[2] in holder
    if op == "!":
        return not _bool(evaluate(node[1], self_value))
    if op in ("==", "!="):
        left, right = evaluate(node[1], self_value), evaluate(node[2], self_value)
        if _json_type(left) != _json_type(right):
            raise CelError(f"no such overload: {_json_type(left)} {op} {_json_type(right)}")
        return (left == right) == (op == "==")
    if op == "?":
        return evaluate(node[2] if _bool(evaluate(node[1], self_value)) else node[3], self_value)
    decisive = op == "||"  # the value that decides the whole: true for ||, false for &&
    failure: CelError | None = None
    for operand in node[1:]:
        try:
            if _bool(evaluate(operand, self_value)) == decisive:
                return decisive
        except CelError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return not decisive


@dataclass(frozen=True)
class Rule:
    """One x-kubernetes-validations rule of a CRD: where it sits, and whether it is enforced."""

    kind: str
    path: str
    rule: str
    message: str
    enforced: bool


def _rules_at(schema: Schema, path: str) -> Iterator[tuple[str, Schema]]:
    if schema.get("x-kubernetes-validations"):
        yield path, schema
    for name, prop in (schema.get("properties") or {}).items():
        yield from _rules_at(prop, f"{path}.{name}" if path else name)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _rules_at(schema["additionalProperties"], f"{path}[*]")
    if isinstance(schema.get("items"), dict):
        yield from _rules_at(schema["items"], f"{path}[*]")


def validation_rules() -> list[Rule]:
    """Every CEL rule of the served CRDs (for the README's account of what is enforced)."""
    found = []
    for resource in served():
        for path, schema in _rules_at(resource.schema, ""):
            for rule in schema["x-kubernetes-validations"]:
                text = " ".join(str(rule["rule"]).split())
                enforced = compile_rule(text) is not None and not rule.get("messageExpression")
                found.append(Rule(resource.kind, path, text, str(rule.get("message") or ""), enforced))
    return found


def _rule_message(rule: dict[str, Any]) -> str:
    message = str(rule.get("message") or "").strip()
    return message or f"failed rule: {' '.join(str(rule['rule']).split())}"


def _rule_error_string(rule: dict[str, Any]) -> str:
    return str(rule.get("message") or "").strip() or " ".join(str(rule["rule"]).split())


def check_rules(schema: Schema, value: Any, path: str = "") -> list[FieldError]:
    """The x-kubernetes-validations rules broken in ``value`` (each evaluated where its node is
    present; a rule outside the interpreter's subset is skipped)."""
    errors: list[FieldError] = []
    if value is None:
        return errors
    type_name = _json_type(value)
    for rule in schema.get("x-kubernetes-validations") or ():
        node = compile_rule(" ".join(str(rule["rule"]).split()))
        if node is None or rule.get("messageExpression"):
            continue
        try:
            result = evaluate(node, value)
        except CelError as exc:
            text = str(exc)
            if text.startswith("no such overload"):
                detail = (
                    f"'{text}': call arguments did not match a supported operator, function or macro "
                    f"signature for rule: {_rule_error_string(rule)}"
                )
            else:
                detail = f"{text} evaluating rule: {_rule_error_string(rule)}"
            errors.append(invalid(path or "<nil>", type_name, detail))
            continue
        if result is not True:
            errors.append(invalid(path or "<nil>", type_name, _rule_message(rule)))
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key in properties:
                errors += check_rules(properties[key], item, where)
            elif isinstance(extra, dict):
                errors += check_rules(extra, item, where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors += check_rules(schema["items"], item, f"{path}[{index}]")
    return errors


def check(resource: CustomResource, obj: dict[str, Any]) -> list[FieldError]:
    """The schema's errors in ``obj`` (already pruned and defaulted), then its CEL rules' unless
    a type or an unsupported value keeps them from being evaluated, as the server does."""
    errors = validate(resource.schema, obj)
    if any(error.reason in ("FieldValueTypeInvalid", "FieldValueNotSupported") for error in errors):
        return [*errors, FieldError("FieldValueInvalid", "<nil>", f'Invalid value: "null": {RULES_NOT_CHECKED}')]
    return errors + check_rules(resource.schema, obj)


def openapi_schema(resource: CustomResource) -> dict[str, Schema]:
    """The kind's schema as a real server publishes it in its OpenAPI v3 document (for
    ``kubectl explain``): named by the reversed group, ``metadata`` as ObjectMeta."""
    schema = copy.deepcopy(resource.schema)
    schema.setdefault("properties", {})["metadata"] = {
        "allOf": [_object_meta()],
        "description": "Standard object's metadata.",
    }
    schema["x-kubernetes-group-version-kind"] = [
        {"group": resource.group, "version": resource.version, "kind": resource.kind}
    ]
    name = ".".join(reversed(resource.group.split(".")))
    return {f"{name}.{resource.version}.{resource.kind}": schema}


# ---- printing ---------------------------------------------------------------------------------


def _at(obj: Any, json_path: str) -> Any:
    for part in json_path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def columns(resource: CustomResource) -> list[tuple[str, int, Callable[[dict[str, Any]], Any]]]:
    """``kubectl get``'s columns for the kind: NAME, then the CRD's additionalPrinterColumns
    (a date as an age)."""
    found: list[tuple[str, int, Callable[[dict[str, Any]], Any]]] = [
        ("Name", 0, lambda obj: obj.get("metadata", {}).get("name", ""))
    ]
    for column in resource.printer_columns:
        path = str(column["jsonPath"])
        if column.get("type") == "date":

            def cell(obj: dict[str, Any], path: str = path) -> Any:
                stamp = _at(obj, path)
                return age({"metadata": {"creationTimestamp": stamp}}) if stamp else "<unknown>"

        else:

            def cell(obj: dict[str, Any], path: str = path) -> Any:
                return _at(obj, path)

        found.append((str(column["name"]), int(column.get("priority") or 0), cell))
    return found
