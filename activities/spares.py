"""Node provider steps: claim a spare, retire the failed node."""

from __future__ import annotations

from temporalio import activity

from activities.errors import client_errors
from clients.spares import NodeProvider
from models.requests import ClaimRequest


class SpareActivities:
    def __init__(self, provider: NodeProvider) -> None:
        self._provider = provider

    @activity.defn(name="claim_spare")
    def claim_spare(self, request: ClaimRequest) -> str | None:
        """The spare claimed for this incident (the same one on every retry), or None if none is free."""
        with client_errors():
            return self._provider.claim(request.incident_id)

    @activity.defn(name="retire_node")
    def retire_node(self, node: str) -> None:
        with client_errors():
            self._provider.retire(node)
