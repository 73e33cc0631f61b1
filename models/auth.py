"""Who is asking, as Kubernetes authenticated them, and the gpufleet.io resources RBAC decides on."""

from __future__ import annotations

from pydantic import BaseModel, Field

# The API group of gpufleet's resources in SubjectAccessReviews and ClusterRoles (deploy/).
API_GROUP = "gpufleet.io"
# The audience of the projected ServiceAccount token a detector presents to the intake.
INTAKE_AUDIENCE = "gpufleet"
# The extras a TokenReview answers for a pod-bound ServiceAccount token.
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"

# gpufleet.io resources (cluster-scoped) and the verbs each is authorised on; a
# SubjectAccessReview's ``name`` is the node or cluster concerned when there is one.
RESOURCES: dict[str, tuple[str, ...]] = {
    # create: remediate (a dry run too); approve: approve and reject; update: checkpoint-done,
    # spare-available.
    "incidents": ("get", "list", "create", "approve", "cancel", "update"),
    # pause: pause and resume.
    "breaker": ("get", "list", "reset", "pause"),
    "nodes": ("get", "list", "return", "release"),
    # update: cluster users add, remove, set-keys.
    "clusters": ("get", "list", "create", "delete", "update"),
    "pool": ("get", "list", "rebalance"),
    # A listing of workflows that names no gpufleet type.
    "workflows": ("list",),
}


class Identity(BaseModel):
    """An authenticated caller as a TokenReview (or a client certificate) names them."""

    name: str
    uid: str = ""
    groups: list[str] = Field(default_factory=list)
    extra: dict[str, list[str]] = Field(default_factory=dict)
    # The audiences the credential was found valid for (TokenReview status.audiences).
    audiences: list[str] = Field(default_factory=list)

    def _first(self, key: str) -> str | None:
        values = self.extra.get(key) or []
        return values[0] if values else None

    @property
    def node(self) -> str | None:
        """The node a pod-bound ServiceAccount token's pod runs on, as the API server recorded it."""
        return self._first(NODE_NAME_EXTRA)

    @property
    def pod_name(self) -> str | None:
        return self._first(POD_NAME_EXTRA)

    @property
    def pod_uid(self) -> str | None:
        return self._first(POD_UID_EXTRA)
