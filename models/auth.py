"""Who is asking: an identity the Kubernetes API server vouched for, and gpufleet's RBAC names."""

from __future__ import annotations

from pydantic import BaseModel, Field

API_GROUP = "gpufleet.io"
INTAKE_AUDIENCE = "gpufleet"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"

RESOURCES: dict[str, tuple[str, ...]] = {
    "incidents": ("get", "list", "create", "approve", "cancel", "update"),
    "breaker": ("get", "list", "reset", "pause"),
    "nodes": ("get", "list", "return", "release"),
    "clusters": ("get", "list", "create", "delete", "update"),
    "pool": ("get", "list", "rebalance"),
    "workflows": ("list",),
}


class Identity(BaseModel):
    """An authenticated user (a TokenReview's status.user and status.audiences)."""

    name: str
    uid: str = ""
    groups: list[str] = Field(default_factory=list)
    extra: dict[str, list[str]] = Field(default_factory=dict)
    audiences: list[str] = Field(default_factory=list)

    def _first(self, key: str) -> str | None:
        values = self.extra.get(key) or []
        return values[0] if values else None

    @property
    def node(self) -> str | None:
        return self._first(NODE_NAME_EXTRA)

    @property
    def pod_name(self) -> str | None:
        return self._first(POD_NAME_EXTRA)

    @property
    def pod_uid(self) -> str | None:
        return self._first(POD_UID_EXTRA)
