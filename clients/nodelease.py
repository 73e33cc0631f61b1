"""The per-node lease: the annotation ``gpufleet.io/lease=<holder>`` on a Kubernetes Node, written
with a resourceVersion precondition, held by whoever changes the node in several steps: an
incident (its workflow ID) or a pool move (the pool's). A move takes a free node only and checks
between its steps that it still holds it; an incident takes the node whoever holds it (a GPU
failure wins over a rebalance), and the move that loses it stops where it is.
"""

from __future__ import annotations

import logging

from clients.errors import Conflict, NotFound, NotOwned
from clients.kube import KubeClient
from models.constants import NODE_LEASE_ANNOTATION

log = logging.getLogger("gpufleet.nodelease")


def holder_of(kube: KubeClient, node: str) -> str:
    """Who holds the node ('' when nobody)."""
    return kube.get_node(node).annotations.get(NODE_LEASE_ANNOTATION) or ""


def take(kube: KubeClient, node: str, holder: str) -> None:
    """Hold the node (again, if ours already); NotOwned when someone else holds it."""
    while True:
        current = kube.get_node(node)
        held = current.annotations.get(NODE_LEASE_ANNOTATION)
        if held == holder:
            return
        if held:
            raise NotOwned(f"{node} is held by {held}")
        try:
            kube.update_metadata(
                node, annotations={NODE_LEASE_ANNOTATION: holder}, resource_version=current.resource_version
            )
            return
        except Conflict:
            continue  # changed since we read it: look again


def take_over(kube: KubeClient, node: str, holder: str) -> str:
    """Hold the node whoever held it; returns who did ('' when nobody, or ``holder`` itself).
    A node Kubernetes does not know has no lease to take: ''."""
    while True:
        try:
            current = kube.get_node(node)
        except NotFound:
            return ""
        held = current.annotations.get(NODE_LEASE_ANNOTATION) or ""
        if held == holder:
            return held
        try:
            kube.update_metadata(
                node, annotations={NODE_LEASE_ANNOTATION: holder}, resource_version=current.resource_version
            )
        except Conflict:
            continue
        except NotFound:
            return ""
        if held:
            log.warning("%s: %s takes the node from %s", node, holder, held)
        return held


def still_held(kube: KubeClient, node: str, holder: str) -> None:
    """NotOwned when the node is no longer ``holder``'s: someone (an incident) took it over."""
    held = holder_of(kube, node)
    if held != holder:
        raise NotOwned(f"{node} was taken over by {held or 'nobody'}: {holder} stops here and leaves it to them")


def update_if_held(
    kube: KubeClient,
    node: str,
    holder: str,
    *,
    labels: dict[str, str | None] | None = None,
    annotations: dict[str, str | None] | None = None,
) -> None:
    """Write labels and annotations only while ``holder`` holds the node: at the resourceVersion
    of the Node read with the lease still its own. NotOwned once someone else holds it."""
    while True:
        current = kube.get_node(node)
        held = current.annotations.get(NODE_LEASE_ANNOTATION)
        if held != holder:
            raise NotOwned(f"{node} was taken over by {held or 'nobody'}: {holder} stops here and leaves it to them")
        try:
            kube.update_metadata(
                node, labels=labels, annotations=annotations, resource_version=current.resource_version
            )
            return
        except Conflict:
            continue  # the Node changed since we read it: look again


def give_back(kube: KubeClient, node: str, holder: str) -> bool:
    """Let go of the node if ``holder`` holds it; False when it did not (or the Node is gone)."""
    while True:
        try:
            current = kube.get_node(node)
        except NotFound:
            return False
        if current.annotations.get(NODE_LEASE_ANNOTATION) != holder:
            return False
        try:
            kube.update_metadata(
                node, annotations={NODE_LEASE_ANNOTATION: None}, resource_version=current.resource_version
            )
            return True
        except Conflict:
            continue
        except NotFound:
            return False
