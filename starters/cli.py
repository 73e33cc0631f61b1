"""The ``gpufleet`` command for people (tables, progress) and scripts (``--json``)."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import math
import os
import re
import time
from contextlib import nullcontext
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowQueryFailedError
from temporalio.exceptions import ActivityError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from models.constants import (
    GUARD_PAUSE_SIGNAL,
    GUARD_RESET_SIGNAL,
    GUARD_RESUME_SIGNAL,
    GUARD_WORKFLOW,
    INCIDENT_STAMP,
    QUARANTINED_NODES_WORKFLOW,
    RELEASE_NODE_WORKFLOW,
    REMEDIATION_WORKFLOW,
    RETURN_NODE_WORKFLOW,
    guard_task_queue,
    guard_workflow_id,
    release_workflow_id,
    remediation_workflow_id,
    return_workflow_id,
    task_queue,
)
from models.goodput import IncidentLedger, Phase
from models.guard import GuardCommand, GuardInput, GuardStatus
from models.incident import Approval, CancelRequest, IncidentStatus, Outcome, Step, seen
from models.names import InvalidName, validate_cluster_name, validate_node_name
from models.requests import QuarantinedNode, ReleaseNodeRequest, ReturnNodeRequest
from models.settings import CLUSTER_HELP, ClusterNotSet, Settings
from models.topology import NODE_DOMAINS_WORKFLOW, NodeDomains, NodeDomainsInput, node_domains_workflow_id
from models.trust import answer_problem
from models.validation import ValidationResult
from models.xid import XidEvent
from starters.chart import write_chart
from starters.server import dev_server_argv
from starters.temporal import TemporalConfigInvalid, TemporalUnreachable, connect, refusal, refused, report_xid
from workflows.guard import FleetGuardWorkflow
from workflows.nodes import ReturnNodeWorkflow
from workflows.remediation import NodeRemediationWorkflow

app = typer.Typer(
    help="gpufleet: turn GPU failures into automatic, audited recoveries (Temporal + Slurm + Kubernetes).",
    no_args_is_help=True,
    add_completion=False,
)
incidents_app = typer.Typer(help="List and inspect incidents.", no_args_is_help=True)
app.add_typer(incidents_app, name="incidents")
nodes_app = typer.Typer(help="Nodes gpufleet took out of service.", no_args_is_help=True)
app.add_typer(nodes_app, name="nodes")
breaker_app = typer.Typer(
    help="The fleet guard's breaker: how much of a cluster gpufleet may take down on its own.", no_args_is_help=True
)
app.add_typer(breaker_app, name="breaker")

XID_MAX = 65535

console = Console()
err = Console(stderr=True)


def failure_text(exc: WorkflowFailureError) -> str:
    """What went wrong, in the words of the error that started it: an activity's failure wraps
    the message that says what to fix in an "Activity task failed" of its own."""
    cause: BaseException | None = exc.cause
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return str(getattr(cause, "message", cause))


def one_line(text: str) -> str:
    """``text`` on one line: a message quoting a file (a YAML error's context) or a server's
    answer keeps every word, its line breaks and runs of blanks become one space."""
    return " ".join(text.split())


def say_error(message: str) -> None:
    """``error: MESSAGE`` in one line on stderr, printed as it is: never wrapped, never read as markup."""
    err.print(f"[bold red]error:[/] {escape(one_line(message))}", soft_wrap=True, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Say what was wrong in one line on stderr and exit with ``code``: 2 for bad input (nothing
    was contacted or changed), 1 for a failure (a server that does not answer, an operation that
    failed)."""
    say_error(message)
    raise typer.Exit(code)


def unknown(exc: RPCError) -> int:
    """The exit code for a name Temporal did not find: 2, bad input (nothing was changed);
    1 for any other error of the server."""
    return 2 if exc.status == RPCStatusCode.NOT_FOUND else 1


def run_async(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except TemporalUnreachable as exc:
        fail(str(exc))
    except (InvalidName, TemporalConfigInvalid) as exc:
        fail(str(exc), code=2)
    except RPCError as exc:
        if refused(exc):  # the gpufleet API's refusal: who may not do what, and which role to ask for
            fail(refusal(exc))
        raise


async def _client() -> Client:
    return await connect()


def _cluster(cluster: str | None, settings: Settings | None = None) -> str:
    """The cluster a command acts on (Settings.command_cluster), or exit 2 saying what to set."""
    try:
        return (settings or Settings()).command_cluster(cluster)
    except ClusterNotSet as exc:
        fail(f"{exc}: give --cluster NAME or set GPUFLEET_CLUSTER", code=2)
    except ValueError as exc:  # a bad name, or installed packages that disagree on the default
        fail(str(exc), code=2)


def _configured_cluster(cluster: str | None) -> list[str]:
    """The cluster given or configured, if any (an empty list where nothing names one)."""
    try:
        return [Settings().command_cluster(cluster)]
    except ClusterNotSet:
        return []
    except ValueError as exc:
        fail(str(exc), code=2)


# -- server --------------------------------------------------------------------------------------


@app.command()
def server(
    port: Annotated[int, typer.Option(help="Temporal frontend (gRPC) port.")] = 7233,
    ui_port: Annotated[int, typer.Option(help="Temporal UI port.")] = 8233,
    db: Annotated[Path | None, typer.Option(help="SQLite file (default: $GPUFLEET_HOME/temporal.db).")] = None,
) -> None:
    """Run the local Temporal dev server (UI on --ui-port), with gpufleet's search attributes."""
    settings = Settings()
    db_file = db or settings.home / "temporal.db"
    db_file.parent.mkdir(parents=True, exist_ok=True)
    argv = dev_server_argv(db_file=db_file, port=port, ui_port=ui_port)
    console.print(f"Temporal dev server on localhost:{port}, UI on http://localhost:{ui_port} (db {db_file})")
    os.execv(argv[0], argv)  # noqa: S606 - replace this process with the server; argv is ours


# -- remediate -----------------------------------------------------------------------------------


def print_incident(status: IncidentStatus, *, as_json: bool) -> None:
    if as_json:
        print(status.model_dump_json())
        return
    console.print(
        f"[bold]{status.incident_id}[/]  node {status.node}  {seen(status)}  "
        f"action {status.action or '-'}  outcome [bold]{status.outcome}[/]"
    )
    if status.dry_run:
        console.print(
            "[bold yellow]DRY RUN[/]: every step below is what gpufleet would have done; nothing was changed."
        )
    if status.spare:
        console.print(f"replacement: {escape(status.spare)}")
    if status.requeued or status.unrequeued:
        ended = f" ({len(status.ended)} the failure had ended, requeued at once)" if status.ended else ""
        console.print(
            f"jobs: {len(status.requeued)} requeued{ended}, {len(status.ran_again)} running again, "
            f"{len(status.unrequeued)} lost"
        )
    if status.unrequeued:
        console.print(f"[yellow]lost, to resubmit:[/] {escape(str(status.unrequeued))}")
    if status.waiting_for_jobs:
        console.print(f"[yellow]drained after its jobs:[/] {escape(status.waiting_for_jobs)}")
    if status.waiting_for_approval:
        console.print(
            f"[yellow]awaiting approval:[/] {escape(status.waiting_for_approval)}\n"
            f"  gpufleet approve {status.incident_id}   |   gpufleet reject {status.incident_id}"
        )
    if status.skipped:
        console.print(f"left alone: {escape(str(status.skipped))}")
    if status.error:
        console.print(f"[red]error:[/] {escape(status.error)}")
    if status.settings:
        knobs = status.settings
        console.print(
            f"settings: grace {knobs.grace_seconds:g}s, spare re-check {knobs.spare_recheck_seconds:g}s, "
            f"resume timeout {knobs.resume_timeout_seconds:g}s, eviction timeout {knobs.eviction_timeout_seconds:g}s, "
            f"owner-drained nodes: {knobs.owner_drained}"
        )
    if status.notifications:
        sent = ", ".join(f"{n.kind} {n.outcome}" + (f" ({n.error})" if n.error else "") for n in status.notifications)
        console.print(f"notifications: {escape(sent)}")
    table = Table("time (UTC)", "+s", "step", "event", "detail")
    start = status.timeline[0].at if status.timeline else None
    for entry in status.timeline:
        offset = f"{(entry.at - start).total_seconds():.1f}" if start else ""
        table.add_row(
            entry.at.strftime("%H:%M:%S.%f")[:-3],
            offset,
            *(escape(str(v)) for v in (entry.step, entry.event, entry.detail)),
        )
    console.print(table)
    if status.ledger is not None:
        print_ledger(status.ledger)


def print_ledger(ledger: IncidentLedger) -> None:
    """What the failure cost (docs/goodput.md): each phase's seconds and GPU-hours, the lost work
    where the jobs reported checkpoints, and which jobs reported none."""
    console.print(
        f"cost of {escape(ledger.cause or 'the failure')}: recovered in {ledger.recovery_seconds:.1f}s "
        f"({ledger.failed_at:%H:%M:%S} to {ledger.recovered_at:%H:%M:%S} UTC), {ledger.gpus} GPU(s) stopped, "
        f"{ledger.gpu_seconds_lost / 3600:.2f} GPU-hours lost"
        + (" and lost work unknown" if ledger.lost_work_unknown else "")
    )
    table = Table("phase", "seconds", "GPU-hours")
    for phase in Phase:
        cost = ledger.cost(phase)
        hours = "unknown" if cost.gpu_seconds is None else f"{cost.gpu_seconds / 3600:.2f}"
        table.add_row(phase.value.replace("_", " "), f"{cost.seconds:.1f}", hours)
    console.print(table)
    if ledger.lost_work_unknown:
        jobs = ", ".join(map(str, ledger.lost_work_unknown))
        console.print(
            f"[yellow]lost work unknown[/] for job(s) {jobs}: no checkpoint reported "
            "(`gpufleet checkpoint-done` inside the job after each save; docs/goodput.md)"
        )


async def _wait_for(
    handle: Any, *, until_closed: bool, show_progress: bool, timeout: float
) -> tuple[IncidentStatus | None, str | None]:
    """Poll the incident until it closes (or leaves classification); returns (status, failure)."""
    deadline = time.monotonic() + timeout
    status: IncidentStatus | None = None
    with console.status("waiting for the incident", spinner="dots") if show_progress else nullcontext() as spinner:
        while time.monotonic() < deadline:
            description = await handle.describe()
            if description.status != WorkflowExecutionStatus.RUNNING:
                try:
                    status = await handle.result()
                    return status, None
                except WorkflowFailureError as exc:
                    return status, failure_text(exc)
            try:
                status = await handle.query(NodeRemediationWorkflow.status)
            except RPCError as exc:
                if refused(exc):
                    raise
                status = None
            if status is not None:
                if spinner is not None:
                    spinner.update(f"{status.node}: {status.step} ({status.outcome})")
                if not until_closed and status.step != Step.CLASSIFY:
                    return status, None
            await asyncio.sleep(0.3)
    return status, f"still running after {timeout:.0f}s"


@app.command()
def remediate(
    node: Annotated[str, typer.Argument(help="The failed node (Slurm and Kubernetes name).")],
    xid: Annotated[int, typer.Option(help="The Xid seen on the node, e.g. 79 (fallen off the bus).")],
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the incident closes.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up waiting after this many seconds.")] = 3600,
    as_json: Annotated[bool, typer.Option("--json", help="Print the incident as JSON.")] = False,
    dry_run: Annotated[
        bool | None,
        typer.Option(
            "--dry-run/--no-dry-run",
            help="Run every step and record what it would do, changing nothing and notifying nobody "
            "(workflow ID dryrun-CLUSTER-NODE). Default: $GPUFLEET_DRY_RUN.",
        ),
    ] = None,
) -> None:
    """Open (or join) the incident for NODE with an Xid, as the detector would."""
    settings = Settings()
    dry = settings.dry_run if dry_run is None else dry_run
    try:
        validate_node_name(node)
    except InvalidName as exc:
        fail(str(exc), code=2)
    cluster = _cluster(cluster, settings)
    if not 0 <= xid <= XID_MAX:
        fail(f"--xid {xid} is not an Xid: NVIDIA Xids are 0..{XID_MAX} (e.g. 79, fallen off the bus)", code=2)
    if not math.isfinite(timeout) or timeout <= 0:
        fail(f"--timeout {timeout:g}: give a number of seconds above 0", code=2)

    async def go() -> int:
        client = await _client()
        event = XidEvent(node=node, xid=xid, source="cli", message="reported with gpufleet remediate")
        handle = await report_xid(client, event, cluster=cluster, dry_run=dry)
        if not as_json:
            what = "dry run" if dry else "incident workflow"
            console.print(f"{what} [bold]{handle.id}[/] (Xid {xid} on {node})")
        status, failure = await _wait_for(
            handle, until_closed=wait, show_progress=not as_json, timeout=timeout if wait else 60
        )
        if failure:
            say_error(failure)
            if as_json and status is not None:
                print(status.model_dump_json())
            return 1
        if status is not None:
            if wait or as_json:
                print_incident(status, as_json=as_json)
            else:
                console.print(f"running: step {status.step}; follow with `gpufleet incidents show {handle.id}`")
        if status is not None and status.outcome == Outcome.JOBS_LOST:
            return 3  # the node was dealt with, but a job did not run again: its owner must resubmit
        return 0 if status is None or status.outcome != Outcome.FAILED else 1

    raise typer.Exit(run_async(go()))


# -- signals -------------------------------------------------------------------------------------


def signal_incident(node: str, cluster: str | None, signal: Any, *args: Any) -> None:
    """Send ``signal`` to the node's open incident; a clear error when there is none."""
    try:
        validate_node_name(node)
    except InvalidName as exc:
        fail(str(exc), code=2)
    workflow_id = remediation_workflow_id(_cluster(cluster), node)

    async def go() -> None:
        client = await _client()
        try:
            await client.get_workflow_handle(workflow_id).signal(signal, *args)
        except RPCError as exc:
            if refused(exc):
                raise
            fail(f"no open incident for {node} ({workflow_id}): {exc.message}", code=unknown(exc))

    run_async(go())


# `gpufleet checkpoint-done` writes the job's Comment through Slurm as well: the composition root
# registers it (workers/entry.py), with signal_incident above and checked_job_id below.


def checked_job_id(job_id: int) -> int:
    """``job_id`` when Slurm could have it (1..2**31-1), else exit 2 naming it."""
    if not 0 < job_id < 2**31:
        fail(f"job id {job_id} is not a Slurm job id (1..{2**31 - 1})", code=2)
    return job_id


@app.command("spare-available")
def spare_available(
    node: Annotated[str, typer.Argument(help="The failed node whose incident waits for a spare.")],
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
) -> None:
    """Tell an incident waiting for a spare to look again now."""
    signal_incident(node, cluster, NodeRemediationWorkflow.spare_available)


# -- incidents -----------------------------------------------------------------------------------


@incidents_app.command("list")
def incidents_list(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array for scripts.")] = False,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 50,
) -> None:
    """List incidents, newest first."""

    async def go() -> list[dict[str, Any]]:
        client = await _client()
        rows = []
        async for execution in client.list_workflows(f"WorkflowType='{REMEDIATION_WORKFLOW}'", limit=limit):
            rows.append(
                {
                    "id": execution.id,
                    "run_id": execution.run_id,
                    "status": execution.status.name if execution.status else "",
                    "start_time": execution.start_time.isoformat(),
                    "close_time": execution.close_time.isoformat() if execution.close_time else None,
                }
            )
        return rows

    rows = run_async(go())
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("incident workflow", "status", "started", "closed")
    for row in rows:
        table.add_row(row["id"], row["status"], _short(row["start_time"]), _short(row["close_time"]))
    console.print(table)


def _short(stamp: str | None) -> str:
    return datetime.fromisoformat(stamp).strftime("%Y-%m-%d %H:%M:%S") if stamp else "-"


@incidents_app.command("show")
def incidents_show(
    incident: Annotated[str, typer.Argument(help=INCIDENT_HELP)],
    cluster: Annotated[str | None, typer.Option(help="Cluster, when INCIDENT is a node name.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The incident as JSON.")] = False,
    chart: Annotated[
        Path | None, typer.Option(help="Also draw the timeline as a Gantt chart: FILE.html, FILE.svg or FILE.png.")
    ] = None,
) -> None:
    """Show an incident: outcome, jobs, spare, notifications and its timeline (optionally as a chart)."""
    workflow_id = _incident_workflow_id(incident, cluster)

    async def go() -> IncidentStatus:
        _, status = await _incident(workflow_id)
        return status

    status = run_async(go())
    print_incident(status, as_json=as_json)
    if chart is not None:
        try:
            write_chart(status, chart)
        except ValueError as exc:
            fail(str(exc), code=2)
        if not as_json:
            console.print(f"chart written to {chart}")


# -- approvals and nodes -------------------------------------------------------------------------

INCIDENT_HELP = (
    "Incident ID (CLUSTER-NODE-TIMESTAMP), workflow ID (remediate-CLUSTER-NODE, dryrun-CLUSTER-NODE) or a node name."
)
_STAMP = re.compile(rf"-{INCIDENT_STAMP}$")


def _incident_workflow_id(incident: str, cluster: str | None) -> str:
    """The workflow behind an incident ID, a workflow ID or a node name (bad names: exit 2)."""
    try:
        if cluster is not None:
            validate_cluster_name(cluster)
        if incident.startswith(("remediate-", "dryrun-")) and not _STAMP.search(incident):
            return incident
        if incident.startswith("dryrun-"):  # a dry run's incident ID: dryrun-CLUSTER-NODE-STAMP
            return _STAMP.sub("", incident)
        this_cluster = _cluster(cluster)
        node = incident
        if _STAMP.search(incident):
            prefix = f"{this_cluster}-"
            if not incident.startswith(prefix):
                fail(f"incident {incident!r} is not of cluster {this_cluster!r} (use --cluster)", code=2)
            node = _STAMP.sub("", incident)[len(prefix) :]
        return remediation_workflow_id(this_cluster, validate_node_name(node))
    except InvalidName as exc:
        fail(str(exc), code=2)


async def _incident(workflow_id: str) -> tuple[Any, IncidentStatus]:
    """The incident's handle and status; a clear error when there is none."""
    client = await _client()
    handle = client.get_workflow_handle(workflow_id)
    try:
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
    except RPCError as exc:
        if refused(exc):
            raise
        fail(f"no incident {workflow_id}: {exc.message}", code=unknown(exc))
    return handle, status


def _answer_checked(by: str, reason: str, *, what: str) -> None:
    """Exit 2 on text the incident would ignore (models/trust.py): refused here, before it is sent,
    rather than reported sent and dropped by the workflow."""
    problem = answer_problem(by=by, reason=reason)
    if problem:
        fail(f"not {what}: {problem}", code=2)


def _decide(incident: str, cluster: str | None, *, approved: bool, reason: str) -> None:
    workflow_id = _incident_workflow_id(incident, cluster)
    _answer_checked(_who(), reason, what="approved" if approved else "rejected")

    async def go() -> IncidentStatus:
        handle, status = await _incident(workflow_id)
        if _STAMP.search(incident) and status.incident_id != incident:
            fail(f"incident {incident} is over; the node's latest incident is {status.incident_id}")
        if status.waiting_for_approval is None:
            fail(f"incident {status.incident_id} is not waiting for approval (step {status.step}, {status.outcome})")
        answer = Approval(
            approved=approved, by=_who(), reason=reason, wait=status.approval_wait, incident_id=status.incident_id
        )
        await handle.signal(NodeRemediationWorkflow.decide, answer)
        return status

    status = run_async(go())
    verdict = "approved" if approved else "rejected"
    console.print(f"{status.incident_id}: {verdict}; follow with `gpufleet incidents show {status.incident_id}`")


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


@app.command()
def approve(
    incident: Annotated[str, typer.Argument(help=INCIDENT_HELP)],
    reason: Annotated[str, typer.Option(help="Why, for the incident's record.")] = "",
    cluster: Annotated[str | None, typer.Option(help="Cluster, when INCIDENT is a node name.")] = None,
) -> None:
    """Let an incident that waits at awaiting_approval go on (e.g. on a node someone else drained)."""
    _decide(incident, cluster, approved=True, reason=reason)


@app.command()
def reject(
    incident: Annotated[str, typer.Argument(help=INCIDENT_HELP)],
    reason: Annotated[str, typer.Option(help="Why, for the incident's record.")] = "",
    cluster: Annotated[str | None, typer.Option(help="Cluster, when INCIDENT is a node name.")] = None,
) -> None:
    """Close an incident that waits at awaiting_approval: before its drain nothing on the node
    changes; at an approval gate (after the drain) the node stays drained, its jobs requeued."""
    _decide(incident, cluster, approved=False, reason=reason)


@incidents_app.command("cancel")
def incidents_cancel(
    incident: Annotated[str, typer.Argument(help=INCIDENT_HELP)],
    reason: Annotated[str, typer.Option(help="Why, for the incident's record and the owner's message.")] = "",
    cluster: Annotated[str | None, typer.Option(help="Cluster, when INCIDENT is a node name.")] = None,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the incident to give back what it holds (0: do not wait).")
    ] = 120.0,
) -> None:
    """Stop an open incident cleanly: the jobs it signalled are requeued, its repair Job is stopped,
    its spare claim, guard slot and node lease are given back. The node stays drained: the command
    says so, and `gpufleet nodes return NODE` puts it back once checked."""
    workflow_id = _incident_workflow_id(incident, cluster)
    if not 0 <= wait <= 3600:
        fail(f"--wait must be between 0 and 3600 seconds, not {wait:g}", code=2)
    _answer_checked(_who(), reason, what="cancelled")

    async def go() -> tuple[IncidentStatus, IncidentStatus | None]:
        handle, status = await _incident(workflow_id)
        if _STAMP.search(incident) and status.incident_id != incident:
            fail(f"incident {incident} is over; the node's latest incident is {status.incident_id}")
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            fail(f"incident {status.incident_id} is not open ({status.outcome}); nothing to cancel")
        # This run only: if it closes meanwhile and the node's next incident starts, that one
        # is not cancelled by mistake (the cancel of a closed run fails, and says so).
        handle = (await _client()).get_workflow_handle(workflow_id, run_id=description.run_id)
        request = CancelRequest(by=_who(), reason=reason, incident_id=status.incident_id)
        try:
            await handle.signal(NodeRemediationWorkflow.cancel_requested, request)
            await handle.cancel(reason=f"gpufleet incidents cancel by {request.by}: {reason}".rstrip(": "))
        except RPCError as exc:
            if refused(exc):
                raise
            fail(f"incident {status.incident_id} could not be cancelled: {exc.message} (did it just close?)")
        if wait <= 0:
            return status, None
        deadline = time.monotonic() + wait
        with console.status(f"cancelling {status.incident_id}", spinner="dots"):
            while time.monotonic() < deadline:
                if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                    try:
                        closed: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
                    except RPCError:
                        closed = status
                    return status, closed
                await asyncio.sleep(0.3)
        fail(f"{status.incident_id}: cancel requested; still giving back what it holds after {wait:g}s")

    status, closed = run_async(go())
    if closed is None:
        follow = f"gpufleet incidents show {status.incident_id}"
        console.print(f"{status.incident_id}: cancel requested; follow with `{follow}`")
        return
    console.print(f"{closed.incident_id}: {closed.outcome} at {_cancelled_at(closed)}")
    for line in closed.left or ["nothing left for a person"]:
        console.print(f"  left: {line}")


def _cancelled_at(status: IncidentStatus) -> str:
    """The step the incident was at when it was cancelled."""
    return next((e.step for e in status.timeline if e.event == "cancelled"), status.step)


def _cluster_of(cluster: str | None, node: str) -> str:
    """The cluster (given or configured) once both it and the node name are safe (else exit 2)."""
    try:
        validate_node_name(node)
    except InvalidName as exc:
        fail(str(exc), code=2)
    return _cluster(cluster)


@nodes_app.command("return")
def nodes_return(
    node: Annotated[str, typer.Argument(help="A repaired node that gpufleet retired or left drained.")],
    as_: Annotated[str, typer.Option("--as", help="spare (the warm pool) or training (the partition).")] = "spare",
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    skip_validation: Annotated[
        bool,
        typer.Option(
            "--skip-validation",
            help="Return it without the policy's validation ladder (needs --reason; recorded on the node).",
        ),
    ] = False,
    reason: Annotated[str, typer.Option(help="Why the validation is skipped, for the record.")] = "",
) -> None:
    """Bring a repaired node back: the policy's validation ladder first (docs/validation.md), then
    uncordon, untaint, relabel; resume it in Slurm only if gpufleet drained it. A node that fails
    a rung stays out, and the command says which rung failed with what figure."""
    if as_ not in {"spare", "training"}:
        fail(f"--as {as_!r}: expected 'spare' or 'training'", code=2)
    by = _who()
    if skip_validation:
        problem = answer_problem(by=by, reason=reason) or ("" if reason.strip() else "--reason is empty")
        if problem:
            fail(f"--skip-validation needs --reason (why the node goes back unchecked): {problem}", code=2)
    this_cluster = _cluster_of(cluster, node)

    async def go() -> str:
        client = await _client()
        incident = client.get_workflow_handle(remediation_workflow_id(this_cluster, node))
        with contextlib.suppress(RPCError):
            if (await incident.describe()).status == WorkflowExecutionStatus.RUNNING:
                # Closed and only delivering its last messages (a webhook may be down): done with the node.
                status: IncidentStatus | None = None
                with contextlib.suppress(RPCError, WorkflowQueryFailedError):
                    status = await incident.query(NodeRemediationWorkflow.status)
                if status is None or status.step != Step.CLOSED:
                    fail(f"{node} has an open incident ({incident.id}); let it close first")
        request = ReturnNodeRequest(
            node=node,
            as_=as_,
            cluster=this_cluster,
            skip_validation=skip_validation,
            by=by if skip_validation else "",
            reason=reason if skip_validation else "",
        )
        return_id = return_workflow_id(this_cluster, node)
        try:
            handle = await client.start_workflow(
                RETURN_NODE_WORKFLOW,
                request,
                id=return_id,
                task_queue=task_queue(this_cluster),
                result_type=str,
            )
        except WorkflowAlreadyStartedError:
            # An earlier `nodes return` whose terminal went away: its ladder climbs on regardless.
            fail(
                f"{node}'s return is already under way (workflow {return_id}, its validation may take a "
                f"while); it goes on without this command: follow it with `temporal workflow show "
                f"--workflow-id {return_id} --follow`, and run this again once it has ended if it failed"
            )
        waiting = asyncio.ensure_future(handle.result())
        shown, running = 0, ""
        while not waiting.done():
            with contextlib.suppress(RPCError, WorkflowQueryFailedError):
                progress: ValidationResult | None = await handle.query(ReturnNodeWorkflow.status)
                rungs = progress.rungs if progress is not None else []
                for rung in rungs[shown:]:
                    console.print(f"  {escape(rung.line())}")
                shown = max(shown, len(rungs))
                now = progress.running if progress is not None else ""
                if now and now != running:
                    console.print(f"validating {node}: {escape(now)} ...")
                running = now
            await asyncio.wait({waiting}, timeout=1.0)
        try:
            result: str = waiting.result()
        except WorkflowFailureError as exc:
            fail(failure_text(exc))
        return result

    console.print(run_async(go()))


@nodes_app.command("quarantined")
def nodes_quarantined(
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array for scripts.")] = False,
) -> None:
    """List the quarantined nodes ("lemons": never spares, not returned until released), and why."""
    this_cluster = _cluster(cluster)

    async def go() -> list[QuarantinedNode]:
        client = await _client()
        nodes: list[QuarantinedNode] = await client.execute_workflow(
            QUARANTINED_NODES_WORKFLOW,
            id=f"quarantined-{this_cluster}-{int(time.time() * 1000)}",
            task_queue=task_queue(this_cluster),
            result_type=list[QuarantinedNode],
            execution_timeout=timedelta(minutes=2),
        )
        return nodes

    nodes = run_async(go())
    if as_json:
        print(json.dumps([node.model_dump() for node in nodes]))
        return
    if not nodes:
        console.print(f"cluster {this_cluster}: no quarantined nodes")
        return
    table = Table("node", "quarantine", "why")
    for node in nodes:
        table.add_row(node.node, node.code, node.reason)
    console.print(table)


@nodes_app.command("show")
def nodes_show(
    node: Annotated[str, typer.Argument(help="A node of the cluster (Kubernetes or Slurm).")],
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object for scripts.")] = False,
) -> None:
    """Show a node's failure domains (rack, zone, NVLink domain, Slurm leaf switch), where each
    was read, and what could not be read."""
    this_cluster = _cluster_of(cluster, node)

    async def go() -> NodeDomains:
        client = await _client()
        try:
            found: NodeDomains = await client.execute_workflow(
                NODE_DOMAINS_WORKFLOW,
                NodeDomainsInput(node=node, cluster=this_cluster),
                id=node_domains_workflow_id(this_cluster, int(time.time() * 1000)),
                task_queue=task_queue(this_cluster),
                result_type=NodeDomains,
                execution_timeout=timedelta(minutes=2),
            )
        except WorkflowFailureError as exc:
            fail(f"cluster {this_cluster}, node {node}: {failure_text(exc)}")
        return found

    found = run_async(go())
    if as_json:
        print(json.dumps({"cluster": this_cluster, **found.model_dump(mode="json")}))
        return
    if found.domains:
        table = Table("kind", "domain", "read from", title=f"{found.node} (cluster {this_cluster})")
        for domain in found.domains:
            table.add_row(str(domain.kind), domain.name, found.sources.get(domain.key, ""))
        console.print(table)
    else:
        console.print(f"{found.node} (cluster {this_cluster}): in no failure domain")
    for note in found.notes:
        console.print(f"note: {escape(note)}")


@nodes_app.command("release")
def nodes_release(
    node: Annotated[str, typer.Argument(help="A quarantined node, once it is really repaired.")],
    reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
) -> None:
    """Take a node out of quarantine (its incident record starts again); then `gpufleet nodes return` it."""
    this_cluster = _cluster_of(cluster, node)

    async def go() -> str:
        client = await _client()
        try:
            result: str = await client.execute_workflow(
                RELEASE_NODE_WORKFLOW,
                ReleaseNodeRequest(node=node, by=_who(), reason=reason),
                id=release_workflow_id(this_cluster, node),
                task_queue=task_queue(this_cluster),
                result_type=str,
                execution_timeout=timedelta(minutes=2),
            )
        except WorkflowFailureError as exc:
            fail(failure_text(exc))
        return result

    console.print(run_async(go()))


# -- the fleet guard ----------------------------------------------------------------------------


async def _guard_status(client: Client, cluster: str) -> GuardStatus | None:
    """The guard's state, or None when no incident (or pause) has started it yet."""
    try:
        status: GuardStatus = await client.get_workflow_handle(guard_workflow_id(cluster)).query(
            FleetGuardWorkflow.status
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    except WorkflowQueryFailedError as exc:
        fail(f"the fleet guard of cluster {cluster} did not answer: {exc}")
    return status


def _print_guard(cluster: str, status: GuardStatus | None, *, as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "cluster": cluster,
                    "running": status is not None,
                    **(status.model_dump(mode="json") if status else {}),
                }
            )
        )
        return
    if status is None:
        console.print(f"cluster {cluster}: no incident has asked the fleet guard yet; the breaker is closed.")
        return
    state, limits = status.state, status.limits
    mode = "[bold yellow]PAUSED[/]" if state.paused else "[bold red]TRIPPED[/]" if state.tripped else "[green]closed[/]"
    console.print(f"cluster {cluster}: breaker {mode}")
    if state.tripped:
        console.print(
            f"  tripped at {state.tripped_at:%Y-%m-%d %H:%M:%S} UTC: {escape(state.tripped_why)}"
            if state.tripped_at
            else ""
        )
    if state.paused:
        console.print(
            f"  paused by {escape(state.paused_by or '?')}"
            + (f": {escape(state.paused_reason)}" if state.paused_reason else "")
        )
    share = (
        f"{len(status.nodes_in_window)} of {status.nodes} nodes"
        if status.nodes
        else f"{len(status.nodes_in_window)} nodes"
    )
    console.print(
        f"  in flight {len(state.in_flight)} of {limits.max_in_flight}; window {limits.window_seconds / 60:g} min: "
        f"{share} ({', '.join(status.nodes_in_window) or '-'}), limit {limits.max_share:.0%}; pages sent {state.pages}"
    )
    table = Table("", "node", "incident", "since (UTC)")
    held = [("in flight", r) for r in state.in_flight] + [("waiting", r) for r in state.waiting]
    held += [(f"held by {r.held_by.removeprefix('domain:')}", r) for r in state.domain_held]
    for label, request in held:
        since = request.asked_at.strftime("%H:%M:%S") if request.asked_at else ""
        table.add_row(escape(label), request.node, request.incident_id, since)
    if held:
        console.print(table)
    if state.domain_held:
        console.print("  held for their domain incident: `gpufleet domains list` shows the domains (docs/domains.md)")
    if state.waiting:
        console.print(f"  `gpufleet breaker reset --cluster {cluster}` lets the waiting go on, one slot at a time;")
        console.print("  `gpufleet approve INCIDENT` lets one past, `gpufleet reject INCIDENT` closes it.")
    recent = Table("time (UTC)", "event", "node", "detail")
    for event in state.log[-10:]:
        recent.add_row(
            event.at.strftime("%H:%M:%S"), *(escape(str(v)) for v in (event.event, event.node, event.detail))
        )
    console.print(recent)


@breaker_app.command("status")
def breaker_status(
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The guard's state as JSON.")] = False,
) -> None:
    """Show the breaker: tripped or not, paused or not, slots in flight, the window, and who waits."""
    name = _cluster(cluster)

    async def go() -> GuardStatus | None:
        return await _guard_status(await _client(), name)

    _print_guard(name, run_async(go()), as_json=as_json)


async def _tell_guard(cluster: str, signal: str, command: GuardCommand, *, start: bool) -> GuardStatus | None:
    """Signal the guard (starting it first when ``start``); its state afterwards, or None if none runs."""
    client = await _client()
    before = await _guard_status(client, cluster)
    seen = before.state.handled if before is not None else 0
    if start:
        await client.start_workflow(
            GUARD_WORKFLOW,
            GuardInput(cluster=cluster),
            id=guard_workflow_id(cluster),
            task_queue=guard_task_queue(cluster),
            start_signal=signal,
            start_signal_args=[command],
            static_summary=f"fleet guard of cluster {cluster}",
        )
    elif before is None:
        return None
    else:
        await client.get_workflow_handle(guard_workflow_id(cluster)).signal(signal, command)
    # The guard handles messages in order; wait (briefly) until it has handled ours.
    deadline = time.monotonic() + 15
    with console.status("waiting for the fleet guard", spinner="dots"):
        while True:
            status = await _guard_status(client, cluster)
            if status is not None and status.state.handled > seen:
                return status
            if time.monotonic() > deadline:
                fail(
                    f"the fleet guard of cluster {cluster} has not confirmed within 15 s (is a worker of the "
                    f"cluster running?); the signal is queued: check `gpufleet breaker status --cluster {cluster}`"
                )
            await asyncio.sleep(0.2)


@breaker_app.command("reset")
def breaker_reset(
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    reason: Annotated[str, typer.Option(help="Why, for the guard's record.")] = "",
) -> None:
    """Close a tripped breaker: waiting incidents go on as slots free up, one at a time."""
    name = _cluster(cluster)

    async def go() -> GuardStatus | None:
        return await _tell_guard(name, GUARD_RESET_SIGNAL, GuardCommand(by=_who(), reason=reason), start=False)

    status = run_async(go())
    if status is None:
        console.print(f"cluster {name}: no fleet guard runs yet; nothing to reset.")
        return
    waiting = len(status.state.waiting)
    console.print(f"cluster {name}: breaker closed; {waiting} incident(s) waiting go on as slots free up.")


async def _guarded_clusters(client: Client) -> list[str]:
    """The clusters whose fleet guard runs now (every cluster that has had an incident or a pause)."""
    prefix = guard_workflow_id("")
    found = []
    async for execution in client.list_workflows(f"WorkflowType='{GUARD_WORKFLOW}' AND ExecutionStatus='Running'"):
        found.append(execution.id.removeprefix(prefix))
    return sorted(set(found))


def _pause_or_resume(cluster: str | None, all_clusters: bool, *, signal: str, reason: str) -> dict[str, Any]:
    """Tell one cluster's guard, or every running one and the configured cluster's; their states."""

    async def go() -> dict[str, Any]:
        client = await _client()
        if not all_clusters:
            names = [_cluster(cluster)]
        else:  # the whole fleet: the configured cluster too, when one is
            names = sorted({*_configured_cluster(cluster), *await _guarded_clusters(client)})
            if not names:
                fail("no cluster has a fleet guard and none is configured: give --cluster NAME", code=2)
        command = GuardCommand(by=_who(), reason=reason)
        return {name: await _tell_guard(name, signal, command, start=signal == GUARD_PAUSE_SIGNAL) for name in names}

    result: dict[str, Any] = run_async(go())
    return result


ALL_HELP = "Every cluster with a fleet guard (and the configured one), not one."


@app.command()
def pause(
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    all_clusters: Annotated[bool, typer.Option("--all", help=ALL_HELP)] = False,
    reason: Annotated[str, typer.Option(help="Why, for the guard's record and `breaker status`.")] = "",
) -> None:
    """Stop new destructive steps in the cluster (or, with --all, the whole fleet): new incidents
    are recorded and wait, changing nothing; incidents in flight go on."""
    if cluster is not None and all_clusters:
        fail("give --cluster or --all, not both", code=2)
    for name in _pause_or_resume(cluster, all_clusters, signal=GUARD_PAUSE_SIGNAL, reason=reason):
        console.print(f"cluster {name}: paused. Incidents in flight go on; new ones wait. `gpufleet resume` to go on.")


@app.command()
def resume(
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    all_clusters: Annotated[bool, typer.Option("--all", help=ALL_HELP)] = False,
    reason: Annotated[str, typer.Option(help="Why, for the guard's record.")] = "",
) -> None:
    """Undo `gpufleet pause`: waiting incidents go on as slots free up."""
    if cluster is not None and all_clusters:
        fail("give --cluster or --all, not both", code=2)
    for name, status in _pause_or_resume(cluster, all_clusters, signal=GUARD_RESUME_SIGNAL, reason=reason).items():
        if status is None:
            console.print(f"cluster {name}: not paused (no fleet guard runs yet).")
        else:
            waiting = len(status.state.waiting)
            console.print(f"cluster {name}: resumed; {waiting} incident(s) waiting go on as slots free up.")


from starters.report import report  # noqa: E402 - the command lives in its own module

app.command()(report)
