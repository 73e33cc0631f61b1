"""Changing a running cluster's users on the time-skipping server, its steps stood in for under
the activities' real names: add, remove and new keys each run their steps in order; a failed step
undoes what was done, in reverse, and the users are as they were; a change that is not valid is
refused before any step; a second change while one runs is refused by its workflow ID."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from models.cluster import ClusterSpec, UserSpec, load_spec
from models.clusterops import ClusterRequest, StepResult
from models.clusterusers import (
    UsersAction,
    UsersChangeInput,
    UsersChangeStatus,
    UsersOutcome,
    UsersStep,
    users_workflow_id,
)
from tests.models.test_cluster_spec import EXAMPLE
from workflows.clusterusers import CHECK, DO, UNDO, ClusterUsersWorkflow

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH carol@laptop"
OTHER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH alice@desk"


@dataclass
class Call:
    activity: str
    users: list[str]  # the spec's users it was given
    only: list[str] | None


@dataclass
class Backend:
    """Records each activity called, with the spec's users and ``only``; fails where told; an
    activity in ``hold`` waits until released."""

    fail: dict[str, int] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    hold: asyncio.Event | None = None
    fail_type: str = "StepFailed"
    task_queue: str = field(default_factory=lambda: f"users-{uuid.uuid4().hex[:8]}")

    def activities(self) -> list[Callable[..., Any]]:
        made = []
        for name in sorted({CHECK, *DO.values(), *UNDO.values()}):

            def make(name: str) -> Callable[..., Any]:
                @activity.defn(name=name)
                async def run(request: ClusterRequest) -> StepResult:
                    if name != CHECK:
                        self.calls.append(Call(name, [u.name for u in request.spec.users], request.only))
                    if self.hold is not None:
                        await self.hold.wait()
                    if self.fail.get(name, 0) > 0:
                        self.fail[name] -= 1
                        raise ApplicationError(f"{name} broke on purpose", type=self.fail_type, non_retryable=True)
                    return StepResult(detail=f"{name} ok")

                return run

            made.append(make(name))
        return made


def cluster() -> ClusterSpec:
    return load_spec(yaml.safe_load(EXAMPLE.read_text()))  # users alice and bob


def with_users(spec: ClusterSpec, users: list[UserSpec]) -> ClusterSpec:
    raw = spec.model_dump(mode="json")
    raw["users"] = [u.model_dump(mode="json") for u in users]
    return ClusterSpec.model_validate(raw)


def added() -> tuple[ClusterSpec, ClusterSpec]:
    old = cluster()
    carol = UserSpec(name="carol", uid=2100, ssh_keys=[KEY], account="vision")
    return old, with_users(old, [*old.users, carol])


def removed() -> tuple[ClusterSpec, ClusterSpec]:
    old = cluster()
    return old, with_users(old, [u for u in old.users if u.name != "bob"])


def rekeyed() -> tuple[ClusterSpec, ClusterSpec]:
    old = cluster()
    return old, with_users(
        old, [u.model_copy(update={"ssh_keys": [OTHER_KEY]}) if u.name == "alice" else u for u in old.users]
    )


async def change(
    env: WorkflowEnvironment, backend: Backend, old: ClusterSpec, new: ClusterSpec, action: UsersAction, **extra: Any
) -> WorkflowHandle[Any, UsersChangeStatus]:
    request = UsersChangeInput(
        name=old.name, backend="lab", creation="run-1", old=old, new=new, action=action, requested_by="ops"
    ).model_copy(update=extra)
    return await env.client.start_workflow(
        ClusterUsersWorkflow.run,
        request,
        id=f"{users_workflow_id(old.name)}-{uuid.uuid4().hex[:6]}",
        task_queue=backend.task_queue,
    )


def worker(env: WorkflowEnvironment, backend: Backend) -> Worker:
    return Worker(
        env.client, task_queue=backend.task_queue, workflows=[ClusterUsersWorkflow], activities=backend.activities()
    )


def steps(status: UsersChangeStatus, event: str) -> list[UsersStep]:
    return [e.step for e in status.timeline if e.event == event]


async def test_a_user_added_gets_its_account_then_its_login(env: WorkflowEnvironment) -> None:
    backend = Backend()
    old, new = added()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.ADD)).result()
    assert status.outcome == UsersOutcome.DONE and status.added == ["carol"] and status.removed == []
    assert backend.calls == [
        Call("cluster_add_users", ["alice", "bob", "carol"], None),
        Call("cluster_set_logins", ["alice", "bob", "carol"], None),
    ]
    assert steps(status, "done") == [UsersStep.VALIDATE, *DO]
    assert status.current == new


async def test_a_user_removed_loses_its_login_then_its_account(env: WorkflowEnvironment) -> None:
    backend = Backend()
    old, new = removed()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.REMOVE)).result()
    assert status.outcome == UsersOutcome.DONE and status.removed == ["bob"]
    # The accounts removed are those of the old spec, only bob's.
    assert backend.calls == [
        Call("cluster_set_logins", ["alice"], None),
        Call("cluster_remove_users", ["alice", "bob"], ["bob"]),
    ]
    assert status.current == new


async def test_new_keys_change_only_the_logins(env: WorkflowEnvironment) -> None:
    backend = Backend()
    old, new = rekeyed()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.SET_KEYS)).result()
    assert status.outcome == UsersOutcome.DONE and status.rekeyed == ["alice"]
    assert backend.calls == [Call("cluster_set_logins", ["alice", "bob"], None)]
    details = {e.step: e.detail for e in status.timeline if e.event == "done"}
    assert (
        details[UsersStep.ADD_ACCOUNTS] == "no user added" and details[UsersStep.REMOVE_ACCOUNTS] == "no user removed"
    )


async def test_logins_that_fail_undo_the_accounts_added(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={"cluster_set_logins": 1})
    old, new = added()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.ADD)).result()
    assert status.outcome == UsersOutcome.UNDONE and status.current == old
    assert status.failed_step == UsersStep.SET_LOGINS and status.error == "cluster_set_logins broke on purpose"
    assert backend.calls == [
        Call("cluster_add_users", ["alice", "bob", "carol"], None),
        Call("cluster_set_logins", ["alice", "bob", "carol"], None),  # failed
        Call("cluster_set_logins", ["alice", "bob"], None),  # the old logins again (it may have written part)
        Call("cluster_remove_users", ["alice", "bob", "carol"], ["carol"]),  # carol's account only
    ]
    assert steps(status, "undone") == [UsersStep.SET_LOGINS, UsersStep.ADD_ACCOUNTS]


async def test_accounts_that_cannot_be_removed_undo_the_logins(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={"cluster_remove_users": 1})
    old, new = removed()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.REMOVE)).result()
    assert status.outcome == UsersOutcome.UNDONE and status.current == old
    assert status.failed_step == UsersStep.REMOVE_ACCOUNTS
    assert backend.calls == [
        Call("cluster_set_logins", ["alice"], None),
        Call("cluster_remove_users", ["alice", "bob"], ["bob"]),  # failed, perhaps halfway
        Call("cluster_add_users", ["alice", "bob"], None),  # what it removed put back
        Call("cluster_set_logins", ["alice", "bob"], None),  # bob may log in again
    ]
    assert steps(status, "undone") == [UsersStep.REMOVE_ACCOUNTS, UsersStep.SET_LOGINS]


async def test_a_step_the_backend_cannot_do_is_not_undone(env: WorkflowEnvironment) -> None:
    """A backend with no set_logins: the step did nothing, so only the accounts added are
    undone, and the users are known to be the old ones."""
    backend = Backend(fail={"cluster_set_logins": 1}, fail_type="Unsupported")
    old, new = added()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.ADD)).result()
    assert status.outcome == UsersOutcome.UNDONE and status.current == old
    assert [call.activity for call in backend.calls] == [
        "cluster_add_users",
        "cluster_set_logins",  # unsupported
        "cluster_remove_users",  # carol's account undone
    ]


async def test_an_undo_that_fails_is_said_and_the_users_are_unknown(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={"cluster_set_logins": 2})
    old, new = added()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.ADD)).result()
    assert status.outcome == UsersOutcome.UNDO_INCOMPLETE and status.current is None
    assert steps(status, "undo_failed") == [UsersStep.SET_LOGINS]
    assert steps(status, "undone") == [UsersStep.ADD_ACCOUNTS]  # the others still run


@pytest.mark.parametrize(
    ("what", "make", "says"),
    [
        (
            "a uid taken twice",
            lambda old: with_users(old, [*old.users, UserSpec(name="carol", uid=old.users[0].uid, ssh_keys=[KEY])]),
            "uid",
        ),
        (
            "a uid outside the range",
            lambda old: with_users(old, [UserSpec(name="carol", uid=7, ssh_keys=[KEY])]),
            "range",
        ),
        ("more than users", lambda old: old.model_copy(update={"spares": old.spares + 1}), "only the users"),
        (
            "an account moved",
            lambda old: with_users(old, [old.users[0].model_copy(update={"account": "other"}), *old.users[1:]]),
            "account cannot change",
        ),
        ("nothing", lambda old: old, "changes nothing"),
    ],
)
async def test_an_invalid_change_is_refused_and_changes_nothing(
    env: WorkflowEnvironment, what: str, make: Callable[[ClusterSpec], ClusterSpec], says: str
) -> None:
    backend = Backend()
    old = cluster()
    async with worker(env, backend):
        status = await (await change(env, backend, old, make(old), UsersAction.ADD)).result()
    assert status.outcome == UsersOutcome.REFUSED and status.failed_step == UsersStep.VALIDATE, what
    assert says in status.error, status.error
    assert backend.calls == [] and status.current == old


async def test_a_change_of_another_cluster_or_no_creation_is_refused(env: WorkflowEnvironment) -> None:
    backend = Backend()
    old, new = added()
    async with worker(env, backend):
        other = await (await change(env, backend, old, new, UsersAction.ADD, name="elsewhere")).result()
        nameless = await (await change(env, backend, old, new, UsersAction.ADD, creation="")).result()
    assert other.outcome == UsersOutcome.REFUSED and "not of elsewhere" in other.error
    assert nameless.outcome == UsersOutcome.REFUSED and "no creation" in nameless.error
    assert backend.calls == []


async def test_a_change_the_cluster_check_refuses_is_refused_and_changes_nothing(env: WorkflowEnvironment) -> None:
    backend = Backend(fail={CHECK: 1})
    old, new = added()
    async with worker(env, backend):
        status = await (await change(env, backend, old, new, UsersAction.ADD)).result()
    assert status.outcome == UsersOutcome.REFUSED and status.failed_step == UsersStep.VALIDATE
    assert status.error == f"{CHECK} broke on purpose" and backend.calls == []


async def test_a_second_change_while_one_runs_is_refused(env: WorkflowEnvironment) -> None:
    backend = Backend(hold=asyncio.Event())
    old, new = added()
    workflow_id = f"users-cluster-research-{uuid.uuid4().hex[:6]}"
    request = UsersChangeInput(name=old.name, backend="lab", creation="run-1", old=old, new=new, action=UsersAction.ADD)
    async with worker(env, backend):
        first = await env.client.start_workflow(
            ClusterUsersWorkflow.run,
            request,
            id=workflow_id,
            task_queue=backend.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
        with pytest.raises(WorkflowAlreadyStartedError):
            await env.client.start_workflow(
                ClusterUsersWorkflow.run,
                request,
                id=workflow_id,
                task_queue=backend.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            )
        assert backend.hold is not None
        backend.hold.set()
        status = await first.result()
    assert status.outcome == UsersOutcome.DONE
    assert [c.activity for c in backend.calls] == ["cluster_add_users", "cluster_set_logins"]  # once each
