"""Changing the users of a running cluster as Temporal sees it: what the workflow is asked, its
steps, its status, and what a change may be (only users, of a cluster that stays the same)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from models.cluster import ClusterSpec, SpecError, load_spec

CLUSTER_USERS_WORKFLOW = "ClusterUsers"


def users_workflow_id(name: str) -> str:
    # One change at a time per cluster: a second start while one runs is refused by its ID.
    return f"users-cluster-{name}"


class UsersAction(StrEnum):
    ADD = "add"
    REMOVE = "remove"
    SET_KEYS = "set-keys"


class UsersStep(StrEnum):
    VALIDATE = "validate"
    ADD_ACCOUNTS = "add_accounts"
    SET_LOGINS = "set_logins"
    REMOVE_ACCOUNTS = "remove_accounts"


USERS_STEPS: tuple[UsersStep, ...] = (UsersStep.ADD_ACCOUNTS, UsersStep.SET_LOGINS, UsersStep.REMOVE_ACCOUNTS)


class UsersOutcome(StrEnum):
    CHANGING = "changing"
    DONE = "done"  # the cluster's users are the new spec's
    REFUSED = "refused"  # the change was invalid: nothing was done
    UNDONE = "undone"  # a step failed; what was done was undone: the users are the old spec's
    UNDO_INCOMPLETE = "undo_incomplete"  # a step failed and an undo too: neither spec holds (said which)


class UsersChangeInput(BaseModel):
    name: str
    backend: str
    creation: str  # the run ID of the creation that made the cluster
    old: ClusterSpec  # the cluster's users now
    new: ClusterSpec  # what they become
    requested_by: str = ""
    action: UsersAction
    # The run of the change whose result ``old`` was read from ('' for the creation's spec): a
    # refused change points back to it, so the users now are never a refused change's reading.
    based_on: str = ""


class UsersEvent(BaseModel):
    step: UsersStep
    event: str  # started | done | failed | undone | undo_failed
    at: datetime
    detail: str = ""


class UsersChangeStatus(BaseModel):
    name: str
    backend: str
    creation: str
    action: UsersAction
    old: ClusterSpec
    new: ClusterSpec
    based_on: str = ""  # as in UsersChangeInput
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    rekeyed: list[str] = Field(default_factory=list)
    outcome: UsersOutcome = UsersOutcome.CHANGING
    step: UsersStep | None = None
    done: list[UsersStep] = Field(default_factory=list)
    failed_step: UsersStep | None = None
    error: str = ""
    timeline: list[UsersEvent] = Field(default_factory=list)
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def current(self) -> ClusterSpec | None:
        """The spec whose users the cluster has once this change is over (None: unknown, while it
        runs or when an undo failed)."""
        if self.outcome == UsersOutcome.DONE:
            return self.new
        if self.outcome in (UsersOutcome.UNDONE, UsersOutcome.REFUSED):
            return self.old
        return None


class UsersChange(BaseModel):
    """What a change does, by user name."""

    added: list[str]
    removed: list[str]
    rekeyed: list[str]


def users_change_problems(request: UsersChangeInput) -> tuple[list[str], UsersChange]:
    """Everything wrong with a change (none: it may run), and what it does. Pure: the workflow
    checks again what the command checked."""
    problems: list[str] = []
    old, new = request.old, request.new
    if not request.creation:
        problems.append("no creation named: the change must say which creation made the cluster")
    if old.name != request.name or new.name != request.name:
        problems.append(f"the specs are of {old.name} and {new.name}, not of {request.name}")
    if old.model_copy(update={"users": []}) != new.model_copy(update={"users": []}):
        problems.append("only the users of a running cluster may change, nothing else of its spec")
    for spec, which in ((old, "old"), (new, "new")):
        try:
            load_spec(spec.model_dump(mode="json"))
        except SpecError as exc:
            problems += [f"{which} spec: {where}: {what}" for where, what in exc.problems]
    before = {u.name: u for u in old.users}
    after = {u.name: u for u in new.users}
    for name in sorted(before.keys() & after.keys()):
        was, now = before[name], after[name]
        for field in ("uid", "account", "admin"):
            if getattr(was, field) != getattr(now, field):
                problems.append(
                    f"user {name}: its {field} cannot change on a running cluster "
                    f"({getattr(was, field)!r} -> {getattr(now, field)!r}); remove the user, then add it again"
                )
    change = UsersChange(
        added=[u.name for u in new.users if u.name not in before],
        removed=[u.name for u in old.users if u.name not in after],
        rekeyed=[n for n in sorted(before.keys() & after.keys()) if before[n].ssh_keys != after[n].ssh_keys],
    )
    if not (change.added or change.removed or change.rekeyed):
        problems.append("the change changes nothing: the new users are the old ones")
    return problems, change
