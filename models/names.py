"""Validation of names that reach command lines and API paths."""

from __future__ import annotations

import hashlib
import re

# Slurm node names and Kubernetes node names (RFC 1123 subdomain) share this safe subset: a name
# of letters, digits, '.', '_' and '-' that starts and ends with a letter or digit, as a cloud
# or a bare-metal fleet names its nodes: a 63-character label, or a fully qualified name of such
# labels (ip-10-0-12-34.us-west-2.compute.internal) up to 253 characters.
_NODE_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
NODE_NAME_MAX = 253
NODE_NAME_PART_MAX = 63
_CLUSTER_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$")


class InvalidName(ValueError):
    """A name that would be unsafe or meaningless on a command line."""


def validate_node_name(name: str) -> str:
    """Return ``name`` when it is a safe node name, else raise InvalidName.

    Args:
        name: a Slurm/Kubernetes node name such as ``gpu1`` or ``node-a.rack3``.
    """
    if (
        not isinstance(name, str)
        or len(name) > NODE_NAME_MAX
        or not _NODE_NAME.fullmatch(name)
        or any(len(part) > NODE_NAME_PART_MAX for part in name.split("."))
    ):
        raise InvalidName(
            f"invalid node name {name!r}: use letters, digits, '.', '_' or '-', starting and ending with a "
            f"letter or digit (at most {NODE_NAME_MAX} characters, at most {NODE_NAME_PART_MAX} between dots)"
        )
    return name


def validate_cluster_name(name: str) -> str:
    """Return ``name`` when it is a valid cluster name (lowercase DNS label), else raise InvalidName."""
    if not isinstance(name, str) or not _CLUSTER_NAME.fullmatch(name):
        raise InvalidName(
            f"invalid cluster name {name!r}: use lowercase letters, digits and '-' (at most 40 characters)"
        )
    return name


_NOT_IN_A_MARK = re.compile(r"[^A-Za-z0-9._:-]+")


def safe_mark_part(text: str) -> str:
    """``text`` with every character a Slurm job mark may not carry (``gpufleet:<kind>:<this>``)
    made ``-``: a workflow ID may hold any character, a mark only ``[A-Za-z0-9._:-]``."""
    return _NOT_IN_A_MARK.sub("-", text)


# What Kubernetes takes as a label value (and a taint's value): at most 63 characters of
# [A-Za-z0-9._-], starting and ending with a letter or digit (or empty).
LABEL_VALUE_MAX = 63
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)?$")
_NOT_IN_A_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")
# A DNS-1123 subdomain (the names of Jobs, Leases, ConfigMaps): lowercase letters, digits, '-' and '.'.
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*$")
_NOT_IN_A_DNS_NAME = re.compile(r"[^a-z0-9-]+")
_DIGEST_LENGTH = 10


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_LENGTH]


def label_value(text: str, limit: int = LABEL_VALUE_MAX) -> str:
    """``text`` as a Kubernetes label value (or a taint's value): ``text`` itself when it is one
    already (so that what was written before still matches), else a readable prefix of it and a
    hash of the whole (``prod-gpu-node-0001.rack12.row03.dc1.example.com-2026-0d0f0081db``), at
    most ``limit`` characters, the same for the same text, different for different texts.

    Where a value is compared with what was written (a claim, a holder), compare with this form
    of the value, or keep the whole value in an annotation beside it.
    """
    if len(text) <= limit and _LABEL_VALUE.fullmatch(text):
        return text
    return _shortened(_NOT_IN_A_LABEL_VALUE.sub("-", text), _digest(text), limit)


def dns_name(text: str, limit: int = LABEL_VALUE_MAX) -> str:
    """``text`` as an object name that is a DNS-1123 subdomain and fits a label value (a Job's
    name becomes its pods' ``job-name`` label, so at most 63 characters): ``text`` itself when
    it is one, else a lowercase readable prefix and a hash of the whole, as ``label_value``."""
    if len(text) <= limit and _DNS1123_SUBDOMAIN.fullmatch(text):
        return text
    return _shortened(_NOT_IN_A_DNS_NAME.sub("-", text.lower()), _digest(text), limit)


def _shortened(cleaned: str, digest: str, limit: int) -> str:
    head = cleaned[: max(limit - len(digest) - 1, 0)]
    head = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", head)
    return f"{head}-{digest}" if head else digest
