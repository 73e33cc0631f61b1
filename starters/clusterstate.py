"""Where a cluster stands, read from Temporal: its creation, its deletion, and its current spec
(the creation's, or the one the last change of its users left)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rich.markup import escape
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from models.cluster import ClusterSpec
from models.clusterops import ClusterStatus, DeletionStatus, cluster_workflow_id, deletion_workflow_id
from models.clusterusers import UsersChangeStatus, UsersOutcome, users_workflow_id
from starters.cli import console
from starters.temporal import refused
from workflows.cluster import ClusterCreationWorkflow, ClusterDeletionWorkflow

MARKS = {"done": "[green]✓[/]", "failed": "[red]✗[/]", "undone": "[yellow]↺[/]", "undo_failed": "[red]↺✗[/]"}


class StepLine(Protocol):
    """One event of a cluster workflow's timeline (a creation's, a change of its users')."""

    @property
    def step(self) -> Any: ...
    @property
    def event(self) -> str: ...
    @property
    def detail(self) -> str: ...


class Stepped(Protocol):
    @property
    def timeline(self) -> Any: ...


S = TypeVar("S", bound=Stepped)


def say_step(event: StepLine) -> None:
    """One line for a step's event, as the cluster commands print them."""
    if event.event == "started":
        console.print(f"  … {event.step}")
        return
    detail = f": {escape(event.detail)}" if event.detail else ""
    console.print(f"  {MARKS.get(event.event, '•')} {event.step} {event.event}{detail}", highlight=False)


async def follow_steps(handle: WorkflowHandle[Any, Any], query: Any, *, over: Callable[[S], bool], quiet: bool) -> S:
    """Print each step of the workflow as it happens (``query`` its status), until ``over``."""
    shown = 0
    while True:
        try:
            status: S | None = await handle.query(query)
        except RPCError as exc:
            if refused(exc):
                raise
            status = None  # not started by a worker yet
        if status is not None:
            if not quiet:
                for event in status.timeline[shown:]:
                    say_step(event)
            shown = len(status.timeline)
            if over(status):
                return status
        await asyncio.sleep(0.5)


class SpecUnknown(Exception):
    """The cluster's current users cannot be told (a change under way, or one whose result
    cannot be read): the message says which, and what to do."""


async def creation(client: Client, name: str) -> ClusterStatus | None:
    """The status of the cluster's last creation; None when there is none."""
    try:
        result: ClusterStatus | None = await client.get_workflow_handle(cluster_workflow_id(name)).query(
            ClusterCreationWorkflow.status
        )
    except RPCError as exc:
        if refused(exc):
            raise
        return None
    return result


async def deletion(client: Client, name: str) -> DeletionStatus | None:
    try:
        result: DeletionStatus | None = await client.get_workflow_handle(deletion_workflow_id(name)).query(
            ClusterDeletionWorkflow.status
        )
    except RPCError as exc:
        if refused(exc):
            raise
        return None
    return result


async def deleted(client: Client, made: ClusterStatus) -> bool:
    """Whether a deletion finished after this creation."""
    gone = await deletion(client, made.name)
    return (
        gone is not None
        and gone.outcome == "deleted"
        and gone.started_at is not None
        and made.started_at is not None
        and gone.started_at > made.started_at
    )


async def current_spec(client: Client, made: ClusterStatus) -> ClusterSpec:
    """The spec the cluster ``made`` has now (``current_state``)."""
    spec, _ = await current_state(client, made)
    return spec


async def current_state(client: Client, made: ClusterStatus) -> tuple[ClusterSpec, str]:
    """The spec the cluster ``made`` has now, and the run of the change that left it ('' for the
    creation): the creation's spec, or, when a change of its users for the same creation ended
    since, that change's ``new`` (``old`` when it was undone). A refused change did nothing: the
    change it was based on counts. SpecUnknown when a change is under way or its result cannot
    be read: never a guess."""
    if made.spec is None:
        raise SpecUnknown(f"the creation of {made.name} holds no spec")
    workflow_id = users_workflow_id(made.name)
    try:
        described = await client.get_workflow_handle(workflow_id).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return made.spec, ""  # its users were never changed
        raise
    if made.started_at is not None and described.start_time < made.started_at:
        return made.spec, ""  # a change of an earlier cluster of the same name
    if described.status == WorkflowExecutionStatus.RUNNING:
        raise SpecUnknown(
            f"a change of {made.name}'s users is under way (workflow {workflow_id}): wait for it "
            f"(gpufleet cluster users list {made.name})"
        )
    runs: list[tuple[str, WorkflowExecutionStatus | None]] = [(described.run_id, described.status)]
    seen: set[str] = set()
    while runs:
        run_id, state = runs.pop(0)
        if run_id in seen:
            continue
        seen.add(run_id)
        change = await _change(client, made.name, run_id, state)
        if change.creation != made.creation:
            return made.spec, ""  # a change of an earlier cluster of the same name
        if change.outcome != UsersOutcome.REFUSED:
            if change.current is None:
                raise SpecUnknown(
                    f"the last change of {made.name}'s users ({change.action}) failed at {change.failed_step} and "
                    f"its undo failed too ({change.error}): which users the cluster has is unknown; look at its "
                    f"timeline (workflow {workflow_id}) and set the users right by hand"
                )
            return change.current, run_id
        if not runs:
            runs = await _runs_before(client, workflow_id, change)
    return made.spec, ""


async def _runs_before(
    client: Client, workflow_id: str, refused: UsersChangeStatus
) -> list[tuple[str, WorkflowExecutionStatus | None]]:
    """The changes that ran before a refused one, newest first (Temporal's visibility); where the
    server lists none (the test server), the one it was read from (a refusal for a stale read
    points behind the change that made it stale: the list is the truth)."""
    try:
        listed = [
            (found.start_time, found.run_id, found.status)
            async for found in client.list_workflows(f'WorkflowId = "{workflow_id}"')
            if refused.started_at is None or found.start_time < refused.started_at
        ]
    except RPCError as exc:
        if exc.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        if not refused.based_on:
            return []
        state = (await client.get_workflow_handle(workflow_id, run_id=refused.based_on).describe()).status
        return [(refused.based_on, state)]
    return [(run_id, state) for _, run_id, state in sorted(listed, key=lambda run: run[0], reverse=True)]


async def _change(client: Client, name: str, run_id: str, state: WorkflowExecutionStatus | None) -> UsersChangeStatus:
    """The result of one change of the cluster's users; SpecUnknown when it cannot be read."""
    workflow_id = users_workflow_id(name)
    if state != WorkflowExecutionStatus.COMPLETED:
        said = state.name.lower() if state is not None else "unknown"
        raise SpecUnknown(
            f"a change of {name}'s users (workflow {workflow_id}, run {run_id}) ended {said}: its result cannot "
            "be read, so which users the cluster has is unknown; look at it in the Temporal UI and set the "
            "users right by hand"
        )
    handle = client.get_workflow_handle(workflow_id, run_id=run_id, result_type=UsersChangeStatus)
    try:
        change: UsersChangeStatus = await handle.result()
    except Exception as exc:  # a result that cannot be read or decoded: refuse, never guess
        raise SpecUnknown(
            f"the result of a change of {name}'s users (workflow {workflow_id}) cannot be read: {exc}"
        ) from None
    return change
