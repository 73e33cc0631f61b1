"""Validation of names that reach command lines and API paths."""

from __future__ import annotations

import re

# Slurm node names and Kubernetes node names (RFC 1123 subdomain) share this safe subset.
_NODE_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_CLUSTER_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$")


class InvalidName(ValueError):
    """A name that would be unsafe or meaningless on a command line."""


def validate_node_name(name: str) -> str:
    """Return ``name`` when it is a safe node name, else raise InvalidName.

    Args:
        name: a Slurm/Kubernetes node name such as ``gpu1`` or ``node-a.rack3``.
    """
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name):
        raise InvalidName(
            f"invalid node name {name!r}: use letters, digits, '.', '_' or '-' "
            "(at most 63 characters, starting and ending with a letter or digit)"
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
