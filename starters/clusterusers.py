"""``gpufleet cluster users``: list, add and remove the users of a running cluster, or change
their SSH keys. Each change is checked here first (the user, its uid, its keys, the cluster), then
runs as one workflow (workflows/clusterusers.py) whose steps are printed as they happen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.markup import escape
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from models.cluster import ClusterSpec, SpecError, UserSpec, check_user_name, load_spec
from models.clusterops import CLUSTER_TASK_QUEUE, ClusterOutcome, ClusterStatus
from models.clusterusers import (
    CLUSTER_USERS_WORKFLOW,
    UsersAction,
    UsersChangeInput,
    UsersChangeStatus,
    UsersOutcome,
    users_workflow_id,
)
from models.names import InvalidName, validate_cluster_name
from starters.cli import _who, console, fail, run_async
from starters.clusterstate import SpecUnknown, creation, current_spec, current_state, deleted, follow_steps
from starters.temporal import connect
from workflows.clusterusers import ClusterUsersWorkflow

users_app = typer.Typer(
    help="The users of a running cluster: list them, add or remove one, change one's SSH keys. "
    "Each change runs as a workflow whose steps are undone if one fails.",
    no_args_is_help=True,
)

NameArg = Annotated[str, typer.Argument(help="The cluster (as `gpufleet cluster list` names it).")]
UserOpt = Annotated[str, typer.Option("--user", help="The Linux user name.")]
KeysOpt = Annotated[
    list[str] | None,
    typer.Option("--key", help="An SSH public key, one line of id_*.pub ('ssh-ed25519 AAAA... you@host'); repeat."),
]
KeyFileOpt = Annotated[
    Path | None,
    typer.Option("--key-file", help="A file of SSH public keys, one a line (an authorized_keys or id_*.pub)."),
]


def _name(name: str) -> None:
    try:
        validate_cluster_name(name)
    except InvalidName as exc:
        fail(str(exc), code=2)


def _keys(keys: list[str] | None, key_file: Path | None) -> list[str]:
    """The keys given by --key and --key-file together; exit 2 when there are none."""
    found = list(keys or [])
    if key_file is not None:
        try:
            text = key_file.read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"cannot read {key_file}: {exc.strerror or exc}", code=2)
        except UnicodeDecodeError:
            fail(f"{key_file}: not UTF-8 text: is it a public key file (id_*.pub)?", code=2)
        found += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not found:
        fail("no SSH key given: use --key 'ssh-ed25519 AAAA...' or --key-file ~/.ssh/id_ed25519.pub", code=2)
    return found


def _user(**fields: Any) -> UserSpec:
    """The user as the spec takes it; exit 2 naming every problem (a name, a uid, a key)."""
    try:
        return UserSpec.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {str(e['msg']).removeprefix('Value error, ')}" for e in exc.errors()
        )
        fail(f"user {fields.get('name')!r} refused, nothing was changed: {problems}", code=2)


async def _running(client: Client, name: str) -> tuple[ClusterStatus, ClusterSpec, str]:
    """The cluster's creation, its current spec and the run of the change that left it ('' for
    the creation); exit when there is none, or it is not ready."""
    made = await creation(client, name)
    if made is None or made.spec is None:
        fail(f"no cluster named {name} (gpufleet cluster list)", code=2)
    if made.outcome != ClusterOutcome.READY:
        fail(f"cluster {name} is not ready (it is {made.outcome}): its users change once it is")
    if await deleted(client, made):
        fail(f"cluster {name} is deleted")
    try:
        spec, based_on = await current_state(client, made)
    except SpecUnknown as exc:
        fail(str(exc))
    return made, spec, based_on


def _with_users(spec: ClusterSpec, users: list[UserSpec]) -> ClusterSpec:
    """The spec with these users, checked as a whole (uids unique, in the allowed range); exit 2."""
    raw = spec.model_dump(mode="json")
    raw["users"] = [u.model_dump(mode="json") for u in users]
    try:
        return load_spec(raw)
    except SpecError as exc:
        problems = "; ".join(f"{where}: {what}" for where, what in exc.problems)
        fail(f"refused, nothing was changed: {problems}", code=2)


async def _follow(handle: WorkflowHandle[Any, Any], *, quiet: bool) -> UsersChangeStatus:
    """Print each step as it happens, until the change is over."""
    status: UsersChangeStatus = await follow_steps(
        handle, ClusterUsersWorkflow.status, over=lambda s: s.outcome != UsersOutcome.CHANGING, quiet=quiet
    )
    return status


def _summary(status: UsersChangeStatus) -> dict[str, Any]:
    return {
        "name": status.name,
        "action": str(status.action),
        "outcome": str(status.outcome),
        "added": status.added,
        "removed": status.removed,
        "rekeyed": status.rekeyed,
        "failed_step": str(status.failed_step) if status.failed_step else None,
        "error": status.error or None,
        "users": [u.name for u in (status.current or status.new).users],
    }


async def _change(
    client: Client,
    made: ClusterStatus,
    old: ClusterSpec,
    new: ClusterSpec,
    action: UsersAction,
    *,
    based_on: str,
    as_json: bool,
) -> None:
    """Run the change as its workflow, print its steps, exit 1 unless it was done."""
    request = UsersChangeInput(
        name=made.name,
        backend=made.backend,
        creation=made.creation,
        old=old,
        new=new,
        requested_by=_who(),
        action=action,
        based_on=based_on,
    )
    try:
        handle = await client.start_workflow(
            CLUSTER_USERS_WORKFLOW,
            request,
            id=users_workflow_id(made.name),
            task_queue=CLUSTER_TASK_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        )
    except (WorkflowAlreadyStartedError, RPCError) as exc:
        if isinstance(exc, RPCError) and exc.status != RPCStatusCode.ALREADY_EXISTS:
            raise
        fail(
            f"a change of {made.name}'s users is under way (workflow {users_workflow_id(made.name)}): "
            "one change at a time; wait for it, then try again"
        )
    if not as_json:
        console.print(f"{action} on cluster {made.name} (workflow {handle.id})", highlight=False)
    status = await _follow(handle, quiet=as_json)
    if as_json:
        print(json.dumps(_summary(status)))
    elif status.outcome == UsersOutcome.DONE:
        console.print(f"cluster {made.name}: users now {', '.join(u.name for u in new.users) or 'none'}")
    elif status.outcome == UsersOutcome.UNDONE:
        console.print(
            f"cluster {made.name}: {action} failed at {status.failed_step}: {escape(status.error)}; "
            "what was done is undone, the users are as they were",
            highlight=False,
        )
    else:
        console.print(
            f"cluster {made.name}: {action} {status.outcome} at {status.failed_step}: {escape(status.error)}",
            highlight=False,
        )
    if status.outcome != UsersOutcome.DONE:
        raise typer.Exit(1)


@users_app.command("list")
def list_users(name: NameArg, as_json: Annotated[bool, typer.Option("--json", help="One JSON list.")] = False) -> None:
    """The cluster's users now (its spec after every change of its users), with their keys."""
    _name(name)

    async def go() -> ClusterSpec:
        client = await connect()
        made = await creation(client, name)
        if made is None or made.spec is None:
            fail(f"no cluster named {name} (gpufleet cluster list)", code=2)
        try:
            return await current_spec(client, made)
        except SpecUnknown as exc:
            fail(str(exc))

    spec: ClusterSpec = run_async(go())
    if as_json:
        print(json.dumps([u.model_dump(mode="json") for u in spec.users]))
        return
    if not spec.users:
        console.print(f"cluster {name} has no users (gpufleet cluster users add {name} --user ...)")
    for user in spec.users:
        kinds = ", ".join(" ".join(key.split()[:1] + key.split()[2:3]) for key in user.ssh_keys)
        admin = " admin" if user.admin else ""
        console.print(
            f"{user.name:<20} uid {user.uid:<6} account {user.account:<16}{admin} keys: {kinds}", highlight=False
        )


@users_app.command()
def add(
    name: NameArg,
    user: UserOpt,
    uid: Annotated[int, typer.Option(help="Its uid, unique in the cluster and in the allowed range.")],
    key: KeysOpt = None,
    key_file: KeyFileOpt = None,
    account: Annotated[
        str, typer.Option(help="Its Slurm account (made when it is the first user of it).")
    ] = "research",
    admin: Annotated[bool, typer.Option("--admin", help="A Slurm administrator (AdminLevel); never root.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object at the end.")] = False,
) -> None:
    """Add a user: its account into accounting, then its login (passwd entry and keys)."""
    _name(name)
    new_user = _user(name=user, uid=uid, ssh_keys=_keys(key, key_file), account=account, admin=admin)

    async def go() -> None:
        client = await connect()
        made, spec, based_on = await _running(client, name)
        if any(u.name == user for u in spec.users):
            fail(f"user {user} exists on {name} already (gpufleet cluster users set-keys to change its keys)", code=2)
        taken = next((u.name for u in spec.users if u.uid == uid), None)
        if taken is not None:
            fail(f"uid {uid} is taken on {name} by {taken}: choose another", code=2)
        new = _with_users(spec, [*spec.users, new_user])
        await _change(client, made, spec, new, UsersAction.ADD, based_on=based_on, as_json=as_json)

    run_async(go())


@users_app.command()
def remove(
    name: NameArg,
    user: UserOpt,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object at the end.")] = False,
) -> None:
    """Remove a user: its login first (it can no longer log in), then its accounting association
    (and its account's, when no other user of the cluster uses it)."""
    _name(name)
    try:
        check_user_name(user)
    except ValueError as exc:
        fail(f"--user {user!r}: {exc}", code=2)

    async def go() -> None:
        client = await connect()
        made, spec, based_on = await _running(client, name)
        if not any(u.name == user for u in spec.users):
            known = ", ".join(u.name for u in spec.users) or "none"
            fail(f"no user {user} on {name} (its users: {known})", code=2)
        new = _with_users(spec, [u for u in spec.users if u.name != user])
        await _change(client, made, spec, new, UsersAction.REMOVE, based_on=based_on, as_json=as_json)

    run_async(go())


@users_app.command("set-keys")
def set_keys(
    name: NameArg,
    user: UserOpt,
    key: KeysOpt = None,
    key_file: KeyFileOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object at the end.")] = False,
) -> None:
    """Replace a user's SSH keys with those given (--key, repeated, and/or --key-file): the keys
    not given stop working."""
    _name(name)
    keys = _keys(key, key_file)

    async def go() -> None:
        client = await connect()
        made, spec, based_on = await _running(client, name)
        was = next((u for u in spec.users if u.name == user), None)
        if was is None:
            known = ", ".join(u.name for u in spec.users) or "none"
            fail(f"no user {user} on {name} (its users: {known})", code=2)
        changed = _user(**{**was.model_dump(mode="json"), "ssh_keys": keys})
        if changed.ssh_keys == was.ssh_keys:
            fail(f"user {user} on {name} has these keys already: nothing to change", code=2)
        new = _with_users(spec, [changed if u.name == user else u for u in spec.users])
        await _change(client, made, spec, new, UsersAction.SET_KEYS, based_on=based_on, as_json=as_json)

    run_async(go())
