"""`gpufleet domains`: failures grouped by the rack, zone, NVLink domain or leaf switch they share
(workflows/guard_domains.py, workflows/domain.py): list them, show one, confirm or release it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode

from models.guard import DomainWatch, GuardCommand
from models.settings import CLUSTER_HELP
from models.topology import (
    DOMAIN_DECIDE_SIGNAL,
    GUARD_DOMAIN_SIGNAL,
    Domain,
    DomainDecision,
    DomainIncidentStatus,
    domain_workflow_id,
)
from starters.cli import _client, _cluster, _guard_status, _tell_guard, _who, console, fail, run_async
from workflows.domain import DomainIncidentWorkflow

domains_app = typer.Typer(
    help="Failures grouped by the rack, zone, NVLink domain or leaf switch they share.", no_args_is_help=True
)
DOMAIN_HELP = "The domain as KIND/NAME: rack/r12, zone/us-east-1a, nvlink/CLIQUE, switch/leaf3."
# How long confirm and release wait for the domain incident to pass the word to the fleet guard.
DECIDED_WITHIN_S = 30.0


def _domain(text: str) -> Domain:
    try:
        return Domain.parse(text)
    except ValidationError as exc:
        fail(f"{text!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}", code=2)
    except ValueError as exc:
        fail(str(exc), code=2)


def _line(watch: DomainWatch) -> str:
    nodes = ", ".join(sorted(f.node for f in watch.failures)) or "-"
    of = f" of {watch.size}" if watch.size else ""
    since = f" since {watch.opened_at:%Y-%m-%d %H:%M:%S} UTC" if watch.opened_at else ""
    return f"{watch.domain.key}: {watch.state}; {len(watch.failures)}{of} failed{since}: {nodes}"


@domains_app.command("list")
def domains_list(
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The fleet guard's domains as JSON.")] = False,
) -> None:
    """The domains with failures in them now: counting, open, confirmed or released.

    Open ones wait for a person: `gpufleet domains confirm` or `release`."""
    name = _cluster(cluster)

    async def go() -> dict[str, DomainWatch]:
        status = await _guard_status(await _client(), name)
        return status.state.domains if status is not None else {}

    domains = run_async(go())
    if as_json:
        typer.echo(json.dumps({key: watch.model_dump(mode="json") for key, watch in domains.items()}, indent=2))
        return
    if not domains:
        console.print(f"cluster {name}: no failures counted in any domain.")
        return
    for watch in domains.values():
        console.print(escape(_line(watch)), highlight=False)


async def _incident(client: Client, cluster: str, domain: Domain) -> tuple[DomainIncidentStatus | None, bool]:
    """The domain incident's status (None: it ended without one, failed or terminated) and
    whether it still runs; exit 2 when there is none."""
    handle = client.get_workflow_handle(domain_workflow_id(cluster, domain), result_type=DomainIncidentStatus)
    try:
        described = await handle.describe()
        running = described.status == WorkflowExecutionStatus.RUNNING
        if running:
            status: DomainIncidentStatus = await handle.query(DomainIncidentWorkflow.status)
            return status, True
        try:
            return await handle.result(), False
        except WorkflowFailureError:
            return None, False
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            fail(
                f"cluster {cluster} has no domain incident for {domain.key}; `gpufleet domains list --cluster "
                f"{cluster}` shows the domains with failures",
                code=2,
            )
        raise


async def _watch(client: Client, cluster: str, domain: Domain) -> DomainWatch | None:
    """What the fleet guard holds for the domain (None: nothing)."""
    status = await _guard_status(client, cluster)
    return status.state.domains.get(domain.key) if status is not None else None


def _print_incident(status: DomainIncidentStatus, running: bool) -> None:
    of = f" of its {status.size}" if status.size else ""
    opened = f"{status.opened_at:%Y-%m-%d %H:%M:%S} UTC" if status.opened_at else "?"
    console.print(
        escape(f"{status.domain.key} in cluster {status.cluster}: {status.state}; opened {opened}"), highlight=False
    )
    console.print(f"failed: {len(status.failures)}{of} nodes", highlight=False)
    for failure in status.failures:
        console.print(
            escape(f"  {failure.node}: {failure.event or 'event'} at {failure.at:%H:%M:%S}, {failure.incident_id}"),
            highlight=False,
        )
    if status.decision is not None:
        verb = "confirmed" if status.decision.confirm else "released"
        why = f": {status.decision.reason}" if status.decision.reason else ""
        console.print(escape(f"{verb} by {status.decision.by}{why}"), highlight=False)
    elif running:
        key, cluster = status.domain.key, status.cluster
        console.print(
            f"waiting for a person: `gpufleet domains confirm {key} --cluster {cluster}` (fix node by node) or "
            f"`gpufleet domains release {key} --cluster {cluster}` (the domain is fixed)",
            highlight=False,
        )


@domains_app.command("show")
def domains_show(
    domain: Annotated[str, typer.Argument(help=DOMAIN_HELP)],
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The domain incident's status as JSON.")] = False,
) -> None:
    """One domain incident: its failed nodes and their events, since when, and its decision."""
    name, which = _cluster(cluster), _domain(domain)

    async def go() -> tuple[DomainIncidentStatus | None, bool, DomainWatch | None]:
        client = await _client()
        status, running = await _incident(client, name, which)
        return status, running, await _watch(client, name, which) if status is None else None

    status, running, watch = run_async(go())
    if status is None:
        # Its workflow failed or was terminated before a decision reached the guard.
        if as_json:
            typer.echo(
                json.dumps({"ended_without_status": True, "guard": watch.model_dump(mode="json") if watch else None})
            )
            return
        console.print(escape(f"the domain incident {which.key} in cluster {name} ended without a decision"))
        if watch is not None:
            console.print(escape(f"the fleet guard holds: {_line(watch)}"), highlight=False)
            console.print(f"`gpufleet domains confirm|release {which.key} --cluster {name}` still decide it")
        return
    if as_json:
        typer.echo(status.model_dump_json(indent=2))
        return
    _print_incident(status, running)


def _decide(domain: str, cluster: str | None, reason: str, *, confirm: bool) -> None:
    name, which = _cluster(cluster), _domain(domain)
    decision = DomainDecision(confirm=confirm, by=_who(), reason=reason)

    async def go() -> DomainIncidentStatus | None:
        client = await _client()
        status, running = await _incident(client, name, which)
        if not running and status is not None and status.decision is not None:
            verb = "confirmed" if status.decision.confirm else "released"
            fail(
                f"the domain incident {which.key} in cluster {name} was {verb} already by {status.decision.by}", code=2
            )
        if not running:
            # Its workflow ended without passing a decision on (failed, or terminated): the word
            # goes to the fleet guard itself, which holds the nodes.
            watch = await _watch(client, name, which)
            if watch is None or watch.state not in ("open", "confirmed"):
                fail(f"cluster {name}'s fleet guard holds nothing for {which.key}: nothing to decide", code=2)
            command = GuardCommand(domain=which.key, confirm=confirm, by=decision.by, reason=decision.reason)
            await _tell_guard(name, GUARD_DOMAIN_SIGNAL, command, start=False)
            return None
        handle = client.get_workflow_handle(domain_workflow_id(name, which), result_type=DomainIncidentStatus)
        await handle.signal(DOMAIN_DECIDE_SIGNAL, decision)
        deadline = time.monotonic() + DECIDED_WITHIN_S
        with console.status("waiting for the domain incident to tell the fleet guard", spinner="dots"):
            while True:
                described = await handle.describe()
                if described.status != WorkflowExecutionStatus.RUNNING:
                    break
                if time.monotonic() > deadline:
                    fail(
                        f"the domain incident {which.key} has not passed the decision on within "
                        f"{DECIDED_WITHIN_S:g} s (is a worker of cluster {name} running?); it is queued: check "
                        f"`gpufleet domains show {which.key} --cluster {name}`"
                    )
                await asyncio.sleep(0.2)
        done: DomainIncidentStatus = await handle.result()
        return done

    status = run_async(go())
    if status is None:
        console.print(escape(f"{which.key}: {'confirmed' if confirm else 'released'}, told to the fleet guard."))
        return
    # (Through `gpufleet api`, who decided is the authenticated user, not this login.)
    if status.decision is None or status.decision.confirm != confirm or status.decision.reason != decision.reason:
        _print_incident(status, False)
        fail("another decision came first; the domain incident took that one")
    count = len(status.failures)
    if confirm:
        console.print(
            escape(f"{which.key}: confirmed; its {count} failed node(s) are fixed one at a time."), highlight=False
        )
    else:
        console.print(
            escape(f"{which.key}: released; its {count} failed node(s) are validated and returned to service."),
            highlight=False,
        )


REASON_HELP = "Why, for the domain incident's record and the operators' message."


@domains_app.command("confirm")
def domains_confirm(
    domain: Annotated[str, typer.Argument(help=DOMAIN_HELP)],
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    reason: Annotated[str, typer.Option(help=REASON_HELP)] = "",
) -> None:
    """The nodes' own faults: fix the domain's failed nodes one by one.

    Each gets its own repair or replacement, one at a time, within the fleet guard's limits."""
    _decide(domain, cluster, reason, confirm=True)


@domains_app.command("release")
def domains_release(
    domain: Annotated[str, typer.Argument(help=DOMAIN_HELP)],
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    reason: Annotated[str, typer.Option(help=REASON_HELP)] = "",
) -> None:
    """The domain's shared cause is fixed: validate its failed nodes and return them.

    No spare is claimed; a node that fails validation is replaced after all."""
    _decide(domain, cluster, reason, confirm=False)
