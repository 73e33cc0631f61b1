"""Names and values checked as a real API server checks them, worded as it words them.

A real kube-apiserver refuses an object whose name, labels, annotations or taints break its rules
with 422 Unprocessable Entity, reason ``Invalid``, and a Status whose ``details.causes`` name each
field. The rules and the words here are Kubernetes' own (v1.32): ``k8s.io/apimachinery``'s
``pkg/util/validation`` (qualified names, label values, DNS-1123 names and their messages),
``pkg/apis/meta/v1/validation`` (labels), ``pkg/api/validation`` (object metadata, annotations)
and ``pkg/apis/core/validation`` (node taints: under ``metadata.taints``, as the real server
writes it). A Job's name also becomes the ``job-name`` label of its pods, so a Job whose name is
longer than 63 characters is refused for its pod template's labels, as from Kubernetes 1.27.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_QNAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QNAME_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
)
_LABEL_VALUE_FMT = f"({_QNAME_FMT})?"
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
    "and must start and end with an alphanumeric character"
)
_DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character"
)
_DNS1123_SUBDOMAIN_FMT = _DNS1123_LABEL_FMT + "(\\." + _DNS1123_LABEL_FMT + ")*"
_DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character"
)
_DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
_DNS1035_LABEL_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
    "start with an alphabetic character, and end with an alphanumeric character"
)
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
TOTAL_ANNOTATION_SIZE = 256 * 1024
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _full(fmt: str) -> re.Pattern[str]:
    return re.compile(f"^{fmt}$")


_QNAME = _full(_QNAME_FMT)
_LABEL_VALUE = _full(_LABEL_VALUE_FMT)
_DNS1123_LABEL = _full(_DNS1123_LABEL_FMT)
_DNS1123_SUBDOMAIN = _full(_DNS1123_SUBDOMAIN_FMT)
_DNS1035_LABEL = _full(_DNS1035_LABEL_FMT)


def _max_len(length: int) -> str:
    return f"must be no more than {length} characters"


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    shown = " or ".join(f"'{example}', " for example in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def _length(value: str) -> int:
    """Go's len(): bytes of the UTF-8 text."""
    return len(value.encode())


def dns1123_subdomain(value: str) -> list[str]:
    """IsDNS1123Subdomain: what is wrong with ``value`` as a DNS-1123 subdomain (nothing: [])."""
    errors = []
    if _length(value) > DNS1123_SUBDOMAIN_MAX:
        errors.append(_max_len(DNS1123_SUBDOMAIN_MAX))
    if not _DNS1123_SUBDOMAIN.match(value):
        errors.append(_regex_error(_DNS1123_SUBDOMAIN_MSG, _DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errors


def dns1123_label(value: str) -> list[str]:
    """IsDNS1123Label."""
    errors = []
    if _length(value) > DNS1123_LABEL_MAX:
        errors.append(_max_len(DNS1123_LABEL_MAX))
    if not _DNS1123_LABEL.match(value):
        if _DNS1123_SUBDOMAIN.match(value):
            errors.append("must not contain dots")
        else:
            errors.append(_regex_error(_DNS1123_LABEL_MSG, _DNS1123_LABEL_FMT, "my-name", "123-abc"))
    return errors


def dns1035_label(value: str) -> list[str]:
    """IsDNS1035Label (a Service's name)."""
    errors = []
    if _length(value) > DNS1123_LABEL_MAX:
        errors.append(_max_len(DNS1123_LABEL_MAX))
    if not _DNS1035_LABEL.match(value):
        errors.append(_regex_error(_DNS1035_LABEL_MSG, _DNS1035_LABEL_FMT, "my-name", "abc-123"))
    return errors


def path_segment_name(value: str) -> list[str]:
    """IsValidPathSegmentName (the names of RBAC objects)."""
    if value in (".", ".."):
        return [f"may not be '{value}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in value]


def qualified_name(value: str) -> list[str]:
    """IsQualifiedName: a label key, an annotation key, a taint key."""
    errors = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors += ["prefix part " + message for message in dns1123_subdomain(prefix)]
    else:
        return [
            "a qualified name "
            + _regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name", "123-abc")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errors.append("name part must be non-empty")
    elif _length(name) > QUALIFIED_NAME_MAX:
        errors.append("name part " + _max_len(QUALIFIED_NAME_MAX))
    if not _QNAME.match(name):
        errors.append("name part " + _regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name", "123-abc"))
    return errors


def label_value(value: str) -> list[str]:
    """IsValidLabelValue: a label's value, a taint's value (may be empty)."""
    errors = []
    if _length(value) > LABEL_VALUE_MAX:
        errors.append(_max_len(LABEL_VALUE_MAX))
    if not _LABEL_VALUE.match(value):
        errors.append(_regex_error(_LABEL_VALUE_MSG, _LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errors


def _go_quote(value: str) -> str:
    """Go's %q of a string (what the server quotes a bad value with)."""
    out = []
    for char in value:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


@dataclass(frozen=True)
class FieldError:
    """One of field.ErrorList: its type (the StatusCause reason), field path, body (no path)."""

    reason: str
    field: str
    body: str

    @property
    def text(self) -> str:
        return f"{self.field}: {self.body}"


def invalid(path: str, value: Any, detail: str) -> FieldError:
    shown = _go_quote(value) if isinstance(value, str) else str(value)
    return FieldError("FieldValueInvalid", path, f"Invalid value: {shown}: {detail}")


def required(path: str, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", path, "Required value" + (f": {detail}" if detail else ""))


def _taint_repr(taint: dict[str, Any]) -> str:
    """How the server prints a core.Taint in a Duplicate value (Go's %#v of the struct)."""
    added = taint.get("timeAdded")
    when = f'"{added}"' if added else "(*v1.Time)(nil)"
    return (
        f"core.Taint{{Key:{_go_quote(str(taint.get('key') or ''))}, Value:{_go_quote(str(taint.get('value') or ''))}, "
        f"Effect:{_go_quote(str(taint.get('effect') or ''))}, TimeAdded:{when}}}"
    )


def label_map(values: Any, path: str) -> list[FieldError]:
    """ValidateLabels: each key a qualified name, each value a label value."""
    errors: list[FieldError] = []
    if not isinstance(values, dict):
        return errors
    for key, value in values.items():
        errors += [invalid(path, key, message) for message in qualified_name(str(key))]
        errors += [invalid(path, value, message) for message in label_value(str(value if value is not None else ""))]
    return errors


def annotation_map(values: Any, path: str) -> list[FieldError]:
    """ValidateAnnotations: each key a qualified name (in any case), 256 KiB in all."""
    errors: list[FieldError] = []
    if not isinstance(values, dict):
        return errors
    for key in values:
        errors += [invalid(path, key, message) for message in qualified_name(str(key).lower())]
    size = sum(_length(str(key)) + _length(str(value if value is not None else "")) for key, value in values.items())
    if size > TOTAL_ANNOTATION_SIZE:
        errors.append(
            FieldError("FieldValueTooLong", path, f"Too long: may not be more than {TOTAL_ANNOTATION_SIZE} bytes")
        )
    return errors


def taint_list(values: Any, path: str) -> list[FieldError]:
    """validateNodeTaints: key a qualified name, value a label value, a known effect, each
    (key, effect) once."""
    errors: list[FieldError] = []
    if not isinstance(values, list):
        return errors
    seen: set[tuple[str, str]] = set()
    for index, taint in enumerate(values):
        if not isinstance(taint, dict):
            continue
        where = f"{path}[{index}]"
        key, value, effect = (str(taint.get(name) or "") for name in ("key", "value", "effect"))
        errors += [invalid(f"{where}.key", key, message) for message in qualified_name(key)]
        wrong = label_value(value)
        if wrong:
            errors.append(invalid(f"{where}.value", value, ";".join(wrong)))
        if not effect:
            errors.append(required(f"{where}.effect"))
        elif effect not in TAINT_EFFECTS:
            supported = ", ".join(f'"{name}"' for name in TAINT_EFFECTS)
            errors.append(
                FieldError(
                    "FieldValueNotSupported",
                    f"{where}.effect",
                    f"Unsupported value: {_go_quote(effect)}: supported values: {supported}",
                )
            )
        if (key, effect) in seen:
            errors.append(
                FieldError(
                    "FieldValueDuplicate",
                    where,
                    f"Duplicate value: {_taint_repr(taint)}: taints must be unique by key and effect pair",
                )
            )
            continue
        seen.add((key, effect))
    return errors


NameCheck = Callable[[str], list[str]]

# The name rule of each kind the lab serves (ValidateObjectMeta's nameFn); the rest: a subdomain.
NAME_RULES: dict[str, NameCheck] = {
    "Namespace": dns1123_label,
    "Service": dns1035_label,
    "Role": path_segment_name,
    "RoleBinding": path_segment_name,
    "ClusterRole": path_segment_name,
    "ClusterRoleBinding": path_segment_name,
}
# Kinds whose spec.template is a pod template (its labels and annotations are checked too).
_TEMPLATED = ("Deployment", "ReplicaSet", "DaemonSet", "Job")


def _name_of(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def check(kind: str, obj: dict[str, Any], *, creating: bool) -> list[FieldError]:
    """What a real API server refuses in ``obj``, a ``kind``: on a create, its name and namespace
    too (they cannot change after)."""
    meta = obj.get("metadata") or {}
    errors: list[FieldError] = []
    if creating:
        name = _name_of(obj)
        rule = NAME_RULES.get(kind, dns1123_subdomain)
        if not name:
            errors.append(required("metadata.name", "name or generateName is required"))
        else:
            errors += [invalid("metadata.name", name, message) for message in rule(name)]
        namespace = meta.get("namespace")
        if namespace:
            errors += [invalid("metadata.namespace", namespace, message) for message in dns1123_label(str(namespace))]
    errors += label_map(meta.get("labels"), "metadata.labels")
    errors += annotation_map(meta.get("annotations"), "metadata.annotations")
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    assert isinstance(spec, dict)
    if kind == "Node" and spec.get("taints"):
        errors += taint_list(spec["taints"], "metadata.taints")
    if kind == "Pod" and spec.get("nodeName"):
        node = str(spec["nodeName"])
        errors += [invalid("spec.nodeName", node, message) for message in dns1123_subdomain(node)]
    if kind in _TEMPLATED and isinstance(spec.get("template"), dict):
        template = spec["template"].get("metadata") or {}
        template_labels = dict(template.get("labels") or {})
        if kind == "Job" and creating and _name_of(obj):
            # What the server adds to a Job's pod template before it checks it (since 1.27).
            template_labels |= {"batch.kubernetes.io/job-name": _name_of(obj), "job-name": _name_of(obj)}
        errors += label_map(template_labels, "spec.template.labels")
        errors += annotation_map(template.get("annotations"), "spec.template.annotations")
    return errors


def qualified_kind(kind: str, group: str) -> str:
    """schema.GroupKind's String(): ``Node``, ``Job.batch``, ``Lease.coordination.k8s.io``."""
    return f"{kind}.{group}" if group else kind


def status(kind: str, group: str, name: str, errors: list[FieldError]) -> dict[str, Any]:
    """The Status of a 422 Invalid, as errors.NewInvalid writes it: the causes in details, the
    message the aggregate of the errors (one alone, else in brackets, each text once)."""
    texts: list[str] = []
    for error in errors:
        if error.text not in texts:
            texts.append(error.text)
    aggregate = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "causes": [{"reason": error.reason, "message": error.body, "field": error.field} for error in errors],
    }
    if group:
        details["group"] = group
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'{qualified_kind(kind, group)} "{name}" is invalid: {aggregate}',
        "reason": "Invalid",
        "details": details,
        "code": 422,
    }
