"""``gpufleet cluster``: create Slurm clusters from a spec, follow them, list and show them."""

from __future__ import annotations

import asyncio
import json
import math
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.markup import escape
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from models.cluster import ClusterSpec, SpecError, load_spec, render_slurm_conf
from models.clusterops import (
    BUILTIN_BACKENDS,
    CLUSTER_CREATION_WORKFLOW,
    CLUSTER_DELETION_WORKFLOW,
    CLUSTER_TASK_QUEUE,
    RESUME_SIGNAL,
    ROLL_BACK_SIGNAL,
    ClusterCreateInput,
    ClusterDeleteInput,
    ClusterOutcome,
    ClusterStatus,
    DeletionStatus,
    cluster_workflow_id,
    deletion_workflow_id,
)
from models.names import InvalidName, validate_cluster_name
from models.plugins import CLUSTER_BACKENDS, cli_default, declared, present
from models.settings import cluster_backend_names
from models.slinky import SLURM_VERSION, slinky_objects
from models.trust import deletion_problem
from starters.cli import _who, console, fail, run_async, say_error, unknown
from starters.clusterstate import SpecUnknown, creation, current_spec, follow_steps, say_step
from starters.clusterstate import deleted as _deleted
from starters.clusterstate import deletion as _deletion
from starters.clusterusers import users_app
from starters.temporal import connect, refused
from workflows.cluster import ClusterCreationWorkflow

cluster_app = typer.Typer(help="Slurm clusters made from a spec (one command each).", no_args_is_help=True)
cluster_app.add_typer(users_app, name="users")


class Output(StrEnum):
    YAML = "yaml"
    JSON = "json"


def _spec(path: Path) -> ClusterSpec:
    """The spec from its file, or exit 2 listing every problem in it by field."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}", code=2)
    except UnicodeDecodeError as exc:
        fail(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8", code=2)
    except yaml.YAMLError as exc:
        fail(f"{path} is not valid YAML: {exc}", code=2)
    except RecursionError:
        fail(f"{path} is not a cluster spec: nested too deep", code=2)
    try:
        return load_spec(raw)
    except SpecError as exc:
        problems = "; ".join(f"{where}: {what}" for where, what in exc.problems)
        fail(f"{path}: {len(exc.problems)} problem(s), nothing was created: {problems}", code=2)


SLINKY = "slinky"
BACKEND_HELP = (
    "Where the cluster runs: slinky, or a backend an installed package adds (the lab's: lab). "
    "Default: the one an installed package gives (lab, where the lab is installed)."
)


def _backend(backend: str | None) -> str:
    """--backend, else the default an installed package gives (the lab's, in a checkout); exit 2
    for a name nothing declares, or one whose package is not installed here (the lab, in the image)."""
    try:
        chosen = backend or cli_default("cluster_backend")
    except ValueError as exc:
        fail(str(exc), code=2)
    known = cluster_backend_names()
    if not chosen:
        fail(f"no cluster backend named: give --backend ({', '.join(known)})", code=2)
    if chosen not in known:
        fail(f"unknown backend {chosen!r}: use {', '.join(known)}", code=2)
    entry = declared(CLUSTER_BACKENDS).get(chosen)
    if chosen not in BUILTIN_BACKENDS and entry is not None and not present(entry):
        fail(
            f"the cluster backend {chosen!r} is not installed here: its module {entry.module} is missing "
            "(the lab's backend exists only where the lab is installed, a checkout of gpufleet); "
            f"use --backend {SLINKY}",
            code=2,
        )
    return chosen


def planned_objects(spec: ClusterSpec, backend: str) -> list[dict[str, Any]]:
    """What a creation would make, with the nodes still unknown (the reservation picks them)."""
    placement = {p.name: [f"<{p.name} node {i + 1}>" for i in range(p.nodes)] for p in spec.partitions}
    objects = slinky_objects(spec, placement)
    if backend == SLINKY:
        return objects
    conf = render_slurm_conf(spec, placement, gres=False)
    slurm = {"kind": "slurm.conf", "note": f"the {backend} backend adds its hosts, ports and paths", "text": conf}
    return [o for o in objects if o["apiVersion"] == "v1"] + [slurm]


def ssh_commands(login: str, users: list[str]) -> dict[str, str]:
    """The ``ssh`` command each user logs in with, for a login node at ``host:port``."""
    if not login:
        return {}
    host, _, port = login.rpartition(":")
    if not host or not port.isdigit():
        return {}
    where = f"-p {port} " if port != "22" else ""
    return {user: f"ssh {where}{user}@{host}" for user in users}


def summary(status: ClusterStatus) -> dict[str, Any]:
    live = status.outcome in (ClusterOutcome.READY, ClusterOutcome.FAILED_KEPT)
    return {
        "name": status.name,
        "backend": status.backend,
        "partitions": [{"name": name, "nodes": nodes} for name, nodes in status.partitions.items()],
        "users": status.users,
        "login": status.login if live else None,
        "ssh": ssh_commands(status.login, status.users) if live else {},
        "outcome": str(status.outcome),
        "seconds": status.seconds,
        "failed_step": str(status.failed_step) if status.failed_step else None,
        "error": status.error or None,
        "placement": status.placement,
    }


def _say_logins(login: str, users: list[str]) -> None:
    commands = ssh_commands(login, users)
    if not login:
        console.print("no login node (the step bring_up says why)")
    elif not commands:
        console.print(f"login node on {login}; no users to log in")
    else:
        console.print(f"log in on {login}:")
        for command in commands.values():
            console.print(f"  {command}", highlight=False)


async def _follow(handle: WorkflowHandle[Any, Any], *, quiet: bool) -> ClusterStatus:
    """Print each step as it happens, until the creation is over or waits to be resumed."""
    status: ClusterStatus = await follow_steps(
        handle, ClusterCreationWorkflow.status, over=lambda s: s.outcome != ClusterOutcome.CREATING, quiet=quiet
    )
    return status


def _report(status: ClusterStatus, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary(status)))
    elif status.outcome == ClusterOutcome.READY:
        console.print(f"cluster {status.name} is ready ({status.seconds:.1f}s)")
        _say_logins(status.login, status.users)
    elif status.outcome == ClusterOutcome.FAILED_KEPT:
        console.print(
            f"cluster {status.name} failed at {status.failed_step}: {escape(status.error)}\n"
            f"everything made is kept; fix the cause, then `gpufleet cluster create --resume {status.name}`"
        )
    else:
        console.print(
            f"cluster {status.name}: {status.outcome} after failing at {status.failed_step}: {escape(status.error)}"
        )
    if status.outcome not in (ClusterOutcome.READY, ClusterOutcome.CREATING):
        raise typer.Exit(1)


@cluster_app.command()
def create(
    spec_file: Annotated[Path | None, typer.Argument(metavar="[SPEC.yaml]", help="The cluster spec.")] = None,
    backend: Annotated[str | None, typer.Option(help=BACKEND_HELP)] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Follow the steps until it is over.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object at the end.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be made; change nothing.")] = False,
    output: Annotated[Output, typer.Option(help="With --dry-run: yaml (one document each) or json.")] = Output.YAML,
    keep_on_failure: Annotated[
        bool, typer.Option("--keep-on-failure", help="On a failure keep what was made, to resume after a fix.")
    ] = False,
    resume: Annotated[
        str | None, typer.Option(metavar="NAME", help="Resume a creation kept on failure, from its failed step.")
    ] = None,
    roll_back: Annotated[
        str | None, typer.Option(metavar="NAME", help="Undo what a creation kept on failure made.")
    ] = None,
) -> None:
    """Create a Slurm cluster from SPEC: validate, reserve nodes, render slurm.conf, make its
    Kubernetes objects, bring up Slurm, add users, run a smoke job per partition, make it
    remediable, notify. A failure undoes what was done, unless --keep-on-failure."""
    if resume is not None or roll_back is not None:
        if spec_file is not None or (resume is not None and roll_back is not None):
            fail("give one of SPEC, --resume NAME or --roll-back NAME", code=2)
        _answer(
            resume or roll_back or "", signal=RESUME_SIGNAL if resume else ROLL_BACK_SIGNAL, wait=wait, as_json=as_json
        )
        return
    if spec_file is None:
        fail("a SPEC file is needed (or --resume NAME); see examples/cluster.yaml", code=2)
    spec = _spec(spec_file)
    chosen = _backend(backend)
    if dry_run:
        objects = planned_objects(spec, chosen)
        if output == Output.JSON:
            print(json.dumps(objects, indent=2))
        else:
            header = f"# gpufleet cluster create --dry-run: {spec.name} on {chosen}"
            if chosen == SLINKY:
                header += f" (slurm-operator v1beta1 objects, Slurm {SLURM_VERSION})"
            print(header)
            print(yaml.safe_dump_all(objects, sort_keys=False), end="")
        return

    async def go() -> None:
        client = await connect()
        handle = await _start(client, spec, chosen, keep_on_failure=keep_on_failure)
        if not as_json:
            console.print(f"creating cluster {spec.name} on {chosen} (workflow {handle.id})")
        if not wait:
            return
        _report(await _follow(handle, quiet=as_json), as_json=as_json)

    run_async(go())


async def _start(client: Client, spec: ClusterSpec, backend: str, *, keep_on_failure: bool) -> WorkflowHandle[Any, Any]:
    # A name is taken while its last creation stands (ready, or kept on failure); one that was
    # rolled back leaves it free. The workflow checks again (the nodes, the backend).
    last = await creation(client, spec.name)
    if last is not None and last.outcome == ClusterOutcome.READY and not await _deleted(client, last):
        fail(f"cluster {spec.name} exists already (gpufleet cluster show {spec.name}): choose another name")
    try:
        return await client.start_workflow(
            CLUSTER_CREATION_WORKFLOW,
            ClusterCreateInput(spec=spec, backend=backend, keep_on_failure=keep_on_failure, requested_by=_who()),
            id=cluster_workflow_id(spec.name),
            task_queue=CLUSTER_TASK_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.ALREADY_EXISTS:
            fail(f"a creation of {spec.name} is under way: gpufleet cluster show {spec.name}")
        raise


def _answer(name: str, *, signal: str, wait: bool, as_json: bool) -> None:
    """Resume (the failed step again) or roll back a creation that waits, kept on failure."""
    try:
        validate_cluster_name(name)
    except InvalidName as exc:
        fail(str(exc), code=2)

    async def go() -> None:
        client = await connect()
        handle = client.get_workflow_handle(cluster_workflow_id(name))
        try:
            status: ClusterStatus | None = await handle.query(ClusterCreationWorkflow.status)
        except RPCError as exc:
            if refused(exc):
                raise
            fail(f"no creation of {name} is open (gpufleet cluster list)", code=unknown(exc))
        if status is None or status.outcome != ClusterOutcome.FAILED_KEPT:
            fail(f"{name} is not waiting to be resumed (it is {status.outcome if status else 'starting'})")
        await handle.signal(signal)
        if not as_json:
            doing = f"resuming {name} from" if signal == RESUME_SIGNAL else f"rolling {name} back after"
            console.print(f"{doing} {status.failed_step}")
        if wait:
            seen = len(status.timeline)
            handle_status = await _follow_from(handle, seen, quiet=as_json)
            _report(handle_status, as_json=as_json)

    run_async(go())


async def _follow_from(handle: WorkflowHandle[Any, Any], seen: int, *, quiet: bool) -> ClusterStatus:
    """Follow, once the resume is taken (the status leaves failed_kept)."""
    while True:
        status: ClusterStatus | None = await handle.query(ClusterCreationWorkflow.status)
        if status is not None and len(status.timeline) > seen:
            break
        await asyncio.sleep(0.2)
    return await _follow(handle, quiet=quiet)


@cluster_app.command("list")
def list_clusters(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every cluster creation, newest first, with its outcome."""

    async def go() -> list[dict[str, Any]]:
        client = await connect()
        rows = []
        async for execution in client.list_workflows(f"WorkflowType='{CLUSTER_CREATION_WORKFLOW}'"):
            try:
                status = await client.get_workflow_handle(execution.id, run_id=execution.run_id).query(
                    ClusterCreationWorkflow.status
                )
            except RPCError as exc:
                if refused(exc):
                    raise
                continue
            if status is not None:
                row = summary(status)
                if await _deleted(client, status):
                    row["outcome"] = "deleted"
                rows.append(row)
        return rows

    rows: list[dict[str, Any]] = run_async(go())
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        console.print("no clusters created yet (gpufleet cluster create SPEC)")
    for row in rows:
        parts = ", ".join(f"{p['name']} x{p['nodes']}" for p in row["partitions"])
        console.print(f"{row['name']:<20} {row['backend']:<7} {row['outcome']:<20} {parts}", highlight=False)


@cluster_app.command()
def show(name: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One creation: its steps, what each did, where it stands."""
    try:
        validate_cluster_name(name)
    except InvalidName as exc:
        fail(str(exc), code=2)

    async def go() -> tuple[ClusterStatus | None, DeletionStatus | None, str]:
        client = await connect()
        result = await creation(client, name)
        if result is None:
            return None, None, ""
        gone = await _deletion(client, name) if result is not None and await _deleted(client, result) else None
        unknown_users = ""
        if result is not None and gone is None and result.outcome == ClusterOutcome.READY:
            # Its users now: those the last change of them left, not the creation's.
            try:
                result.users = [u.name for u in (await current_spec(client, result)).users]
            except SpecUnknown as exc:
                unknown_users = str(exc)
        return result, gone, unknown_users

    status, gone, unknown_users = run_async(go())
    if status is None:
        fail(f"no cluster named {name} (gpufleet cluster list)", code=2)
    outcome = "deleted" if gone is not None else str(status.outcome)
    if as_json:
        if unknown_users:
            fail(unknown_users)
        timeline = [e.model_dump(mode="json") for e in status.timeline]
        gone_fields: dict[str, Any] = {"login": None, "ssh": {}} if gone is not None else {}
        print(json.dumps({**summary(status), "outcome": outcome, "timeline": timeline, **gone_fields}))
        return
    console.print(f"cluster {status.name} on {status.backend}: {outcome}", highlight=False)
    for event in status.timeline:
        say_step(event)
    if gone is None and status.outcome in (ClusterOutcome.READY, ClusterOutcome.FAILED_KEPT):
        _say_logins(status.login, status.users)
    if status.error:
        say_error(f"failed at {status.failed_step}: {status.error}")
    if unknown_users:
        fail(f"its users: {unknown_users}")
    if gone is None and status.outcome == ClusterOutcome.READY:
        console.print(f"users: {', '.join(status.users) or 'none'}", highlight=False)


@cluster_app.command()
def delete(
    name: str,
    force: Annotated[
        bool, typer.Option("--force", help="Cancel running jobs (not requeued: the cluster goes) instead of waiting.")
    ] = False,
    reason: Annotated[str, typer.Option(help="Why, for the deletion's record; required with --force.")] = "",
    deadline: Annotated[float, typer.Option(help="Seconds to wait for running jobs before giving up.")] = 3600.0,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Follow the steps until it is over.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object at the end.")] = False,
) -> None:
    """Delete a cluster: drain it, wait for its running jobs (or --force: cancel them), stop its
    remediation, tear Slurm down, give every node back to the free pool, delete its objects."""
    try:
        validate_cluster_name(name)
    except InvalidName as exc:
        fail(str(exc), code=2)
    if not math.isfinite(deadline) or deadline < 0:
        fail(f"--deadline {deadline:g}: give a number of seconds, 0 or more", code=2)
    problem = deletion_problem(force=force, requested_by=_who(), reason=reason)
    if problem:
        fail(f"not deleted: {problem}", code=2)

    async def go() -> None:
        client = await connect()
        made = await creation(client, name)
        if made is None or made.spec is None:
            fail(f"no cluster named {name} (gpufleet cluster list)", code=2)
        if made.outcome == ClusterOutcome.CREATING:
            fail(f"{name} is still being created: wait for it (gpufleet cluster show {name})")
        if made.outcome == ClusterOutcome.ROLLED_BACK:
            fail(f"{name} was rolled back when its creation failed: nothing to delete")
        if made.outcome == ClusterOutcome.FAILED_KEPT:
            fail(
                f"{name}'s creation failed and waits, kept: `gpufleet cluster create --resume {name}` after a fix, "
                f"or `gpufleet cluster create --roll-back {name}` to undo what it made"
            )
        if await _deleted(client, made):
            fail(f"{name} is deleted already")
        try:
            # The accounts to remove are those of its users now, not only the creation's.
            spec = await current_spec(client, made)
        except SpecUnknown as exc:
            fail(f"{name} not deleted: {exc}")
        request = ClusterDeleteInput(
            spec=spec,
            backend=made.backend,
            creation=made.creation,
            force=force,
            deadline_seconds=deadline,
            requested_by=_who(),
            reason=reason,
        )
        try:
            handle = await client.start_workflow(
                CLUSTER_DELETION_WORKFLOW,
                request,
                id=deletion_workflow_id(name),
                task_queue=CLUSTER_TASK_QUEUE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            )
        except RPCError as exc:
            if exc.status == RPCStatusCode.ALREADY_EXISTS:
                fail(f"a deletion of {name} is under way: gpufleet cluster show {name}")
            raise
        if not as_json:
            console.print(f"deleting cluster {name} (workflow {handle.id})")
        if not wait:
            return
        shown = 0
        while True:
            status: DeletionStatus | None = await _deletion(client, name)
            if status is not None:
                if not as_json:
                    for event in status.timeline[shown:]:
                        detail = f": {escape(event.detail)}" if event.detail else ""
                        console.print(f"  {event.step} {event.event}{detail}", highlight=False)
                    shown = len(status.timeline)
                if status.outcome != "deleting":
                    break
            await asyncio.sleep(0.5)
        if as_json:
            print(
                json.dumps(
                    {
                        "name": name,
                        "outcome": status.outcome,
                        "seconds": status.seconds,
                        "cancelled_jobs": status.cancelled_jobs,
                        "error": status.error or None,
                    }
                )
            )
        elif status.outcome == "deleted":
            console.print(f"cluster {name} is deleted ({status.seconds:.1f}s); its nodes are back in the free pool")
        else:
            say_error(f"cluster {name} not deleted: {status.error}")
        if status.outcome != "deleted":
            raise typer.Exit(1)

    run_async(go())
