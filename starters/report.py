"""`gpufleet report`: what failures cost a fleet over a period (docs/goodput.md#the-report).

The report reads Temporal and nothing else: the closed incidents' ledgers (the memo key
``ledger``, else the run's result, IncidentStatus.ledger), the incidents still open, and the fleet
guard's count of a cluster's nodes. Its reach is therefore the namespace's retention;
``--export-trace`` keeps the incidents as a failure trace (models/trace.py) for longer.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel, Field, ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecution,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from models.constants import (
    REMEDIATION_WORKFLOW,
    SA_CLUSTER,
    dry_run_workflow_id,
    guard_workflow_id,
    remediation_workflow_id,
)
from models.goodput import RECOVERY_PHASES, IncidentLedger, Phase
from models.guard import GuardStatus
from models.incident import IncidentStatus, RemediationInput
from models.names import InvalidName, validate_cluster_name, validate_node_name
from models.trace import Trace, TraceEvent, TraceFailure
from models.xid import GpuEventKind
from starters.temporal import connect, refused
from workflows.guard import FleetGuardWorkflow

REPORT_FORMAT = "gpufleet-report/1"
# GPUs per node when no incident's settings say (RemediationSettings.node_gpus).
DEFAULT_NODE_GPUS = 8
# An incident's recovery phases must add up to its recovery time within this (float rounding).
PHASE_TOLERANCE_SECONDS = 0.01
# How long the fleet guard has to answer its status query.
GUARD_QUERY_SECONDS = 5.0

_SINCE = re.compile(r"(\d{1,9})([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``600s`` as a span of time.

    Raises:
        ValueError: saying what was wrong and the form expected.
    """
    match = _SINCE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--since {text!r}: give a number and a unit, s, m, h or d (e.g. 30d, 12h, 90m)")
    seconds = int(match[1]) * _UNIT[match[2]]
    if seconds <= 0:
        raise ValueError(f"--since {text!r}: the period must be longer than 0")
    if seconds > 3650 * 86400:
        raise ValueError(f"--since {text!r}: at most 3650d (ten years)")
    return timedelta(seconds=seconds)


# -- what the report holds ----------------------------------------------------------------------


class PhaseFigure(BaseModel):
    seconds: float = 0.0
    # None: unknown (lost work where no stopped job reported a checkpoint).
    gpu_seconds: float | None = 0.0


class ReportIncident(BaseModel):
    """One incident of the period with its ledger."""

    workflow_id: str
    run_id: str
    incident_id: str = ""
    cluster: str = ""
    node: str = ""
    outcome: str = ""
    action: str = ""
    spare: str | None = None
    closed_at: datetime
    # Where its ledger was found: "memo" (memo key "ledger") or "result" (IncidentStatus.ledger).
    ledger_from: str
    cause: str
    failed_at: datetime
    detected_at: datetime
    recovered_at: datetime
    recovery_seconds: float
    gpus: int
    gpu_seconds_lost: float
    # Every phase of models.goodput.Phase, in order: its seconds and GPU-seconds.
    phases: dict[str, PhaseFigure]
    # The recovery phases' seconds add up to recovery_seconds (within PHASE_TOLERANCE_SECONDS).
    phases_add_up: bool
    lost_work_unknown: list[int] = Field(default_factory=list)
    # Whether the failure itself ended jobs (IncidentStatus.ended); None when only the memo was read.
    ended_jobs: bool | None = None
    # The event that decided the incident, for --export-trace (from the run's result, else the cause).
    event: TraceEvent | None = None


class UnledgeredIncident(BaseModel):
    """A closed incident whose run carries no ledger (older than ledgers, or ended before its close)."""

    workflow_id: str
    run_id: str
    cluster: str = ""
    node: str = ""
    status: str
    closed_at: datetime


class CauseFigure(BaseModel):
    incidents: int = 0
    gpu_hours_lost: float = 0.0


class PhaseTotal(BaseModel):
    seconds: float = 0.0
    gpu_hours_lost: float = 0.0
    # Incidents whose GPU-seconds for the phase are unknown (lost work: no checkpoint reported).
    unknown: int = 0


class NodeFigure(BaseModel):
    cluster: str
    node: str
    incidents: int = 0
    gpu_hours_lost: float = 0.0
    causes: list[str] = Field(default_factory=list)


class Recovery(BaseModel):
    # The incidents that stopped GPUs (ledger gpus > 0): the others recovered nothing.
    incidents: int = 0
    mean_seconds: float | None = None
    # Nearest rank: the smallest recovery time that at least 95 % of the incidents do not exceed.
    p95_seconds: float | None = None


class TrainingGpus(BaseModel):
    count: int | None = None
    # "--training-gpus", "fleet guard" (its node count times GPUs per node), or "" when unknown.
    source: str = ""
    # Why it is unknown, and how to give it.
    unknown: str = ""
    gpus_per_node: int = DEFAULT_NODE_GPUS
    nodes: int | None = None


class Totals(BaseModel):
    incidents: int = 0
    gpu_seconds_lost: float = 0.0
    gpu_hours_lost: float = 0.0
    # Jobs stopped that reported no checkpoint: their lost work is unknown, not counted.
    lost_work_unknown_jobs: int = 0
    spares_used: int = 0
    spare_wait_seconds: float = 0.0
    spare_wait_gpu_hours: float = 0.0


class Skipped(BaseModel):
    dry_runs: int = 0
    # Runs that continued as new mid-incident (the incident closes in a later run).
    continued_as_new: int = 0
    # Runs whose ledger names an incident already counted from another run.
    repeated: int = 0


class Report(BaseModel):
    """`gpufleet report --json`: one document (docs/goodput.md#the-json-document)."""

    format: str = REPORT_FORMAT
    namespace: str = ""
    cluster: str | None = None
    since: datetime
    until: datetime
    period_seconds: float
    training_gpus: TrainingGpus
    # (training GPU-seconds in the period - GPU-seconds lost) / (training GPUs x period); None: unknown.
    effective_training_time: float | None = None
    totals: Totals
    by_cause: dict[str, CauseFigure]
    by_phase: dict[str, PhaseTotal]
    by_node: list[NodeFigure]
    recovery: Recovery
    repeat_offenders: list[NodeFigure]
    # Incidents whose recovery phases do not add up to their recovery time.
    phases_not_adding_up: list[str]
    incidents: list[ReportIncident]
    without_ledger: list[UnledgeredIncident]
    # Incidents still open (workflow IDs): in no figure until they close.
    open: list[str]
    skipped: Skipped


# -- reading Temporal ---------------------------------------------------------------------------


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _cluster_of(workflow_id: str, memo_cluster: str | None, attribute: str | None, cluster: str | None) -> str:
    """The incident's cluster: its memo's, its Cluster search attribute, else the one its ID
    names when it is the cluster asked for ("" when nothing says)."""
    if memo_cluster:
        return memo_cluster
    if attribute:
        return attribute
    if cluster is not None and workflow_id.startswith(remediation_workflow_id(cluster, "")):
        return cluster
    return ""


def _node_of(workflow_id: str, cluster: str) -> str:
    prefix = remediation_workflow_id(cluster, "") if cluster else "remediate-"
    return workflow_id.removeprefix(prefix) if workflow_id.startswith(prefix) else ""


def _ledger(raw: Any) -> IncidentLedger | None:
    if raw is None:
        return None
    try:
        return IncidentLedger.model_validate(raw)
    except ValidationError:
        return None


async def _result(client: Client, execution: WorkflowExecution) -> IncidentStatus | None:
    """The run's result (IncidentStatus) from its history; None when it has none (failed, cancelled,
    terminated) or one of another shape."""
    if execution.status != WorkflowExecutionStatus.COMPLETED:
        return None
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id, result_type=IncidentStatus)
    try:
        status: IncidentStatus = await handle.result(follow_runs=False)
    except RPCError as exc:
        if refused(exc):
            raise
        return None
    except (WorkflowFailureError, ValidationError, TypeError, ValueError):
        return None
    return status if isinstance(status, IncidentStatus) else None


async def _closes_incident(client: Client, execution: WorkflowExecution) -> bool:
    """Whether a run that continued as new closed its incident (and Xids that came late open the
    next one), rather than carrying the same incident on (a long wait for a spare)."""
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
    try:
        history = await handle.fetch_history()
    except RPCError as exc:
        if refused(exc):
            raise
        return False
    for event in reversed(history.events):
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            payloads = event.workflow_execution_continued_as_new_event_attributes.input.payloads
            try:
                (params,) = await client.data_converter.decode(payloads, [RemediationInput])
            except (ValidationError, TypeError, ValueError):
                return False
            return isinstance(params, RemediationInput) and params.carried is None
    return False


def _event_of(cause: str, status: IncidentStatus | None) -> TraceEvent | None:
    """The deciding event as the detector reports it, read from the ledger's cause ("Xid 79",
    "SXid 22013", "bus_lost (Xid 79)", "init_failed"), else the incident's first Xid."""
    match = re.fullmatch(r"(S?Xid) (\d{1,5})", cause.strip())
    if match:
        kind = GpuEventKind.SXID if match[1] == "SXid" else GpuEventKind.XID
        return TraceEvent(kind=kind, xid=int(match[2]))
    word = cause.strip().split(" ", 1)[0]
    with contextlib.suppress(ValueError):
        kind = GpuEventKind(word)
        return TraceEvent(kind=kind, xid=79 if kind is GpuEventKind.BUS_LOST else None)
    if status is not None and status.xids:
        return TraceEvent(kind=GpuEventKind.XID, xid=status.xids[0])
    return None


def _adds_up(ledger: IncidentLedger) -> bool:
    total = sum(ledger.cost(phase).seconds for phase in RECOVERY_PHASES)
    return math.isclose(total, ledger.recovery_seconds, abs_tol=PHASE_TOLERANCE_SECONDS)


def _incident(
    execution: WorkflowExecution,
    ledger: IncidentLedger,
    *,
    source: str,
    summary: dict[str, Any],
    status: IncidentStatus | None,
    cluster: str,
) -> ReportIncident:
    if status is not None:
        summary = {
            "incident_id": status.incident_id,
            "cluster": status.cluster,
            "node": status.node,
            "outcome": status.outcome.value,
            "action": status.action.value if status.action else "",
            "spare": status.spare,
            **{key: value for key, value in summary.items() if value},
        }
    this_cluster = str(summary.get("cluster") or cluster)
    phases = {
        phase.value: PhaseFigure(seconds=ledger.cost(phase).seconds, gpu_seconds=ledger.cost(phase).gpu_seconds)
        for phase in Phase
    }
    return ReportIncident(
        workflow_id=execution.id,
        run_id=execution.run_id,
        incident_id=str(summary.get("incident_id") or ""),
        cluster=this_cluster,
        node=str(summary.get("node") or _node_of(execution.id, this_cluster)),
        outcome=str(summary.get("outcome") or ""),
        action=str(summary.get("action") or ""),
        spare=summary.get("spare") or None,
        closed_at=execution.close_time or datetime.now(UTC),
        ledger_from=source,
        cause=ledger.cause,
        failed_at=ledger.failed_at,
        detected_at=ledger.detected_at,
        recovered_at=ledger.recovered_at,
        recovery_seconds=ledger.recovery_seconds,
        gpus=ledger.gpus,
        gpu_seconds_lost=ledger.gpu_seconds_lost,
        phases=phases,
        phases_add_up=_adds_up(ledger),
        lost_work_unknown=list(ledger.lost_work_unknown),
        ended_jobs=bool(status.ended) if status is not None else None,
        event=_event_of(ledger.cause, status),
    )


class Found(BaseModel):
    """What the namespace holds for the period, before any figure."""

    incidents: list[ReportIncident] = Field(default_factory=list)
    without_ledger: list[UnledgeredIncident] = Field(default_factory=list)
    open: list[str] = Field(default_factory=list)
    skipped: Skipped = Field(default_factory=Skipped)
    # GPUs per node, by cluster, as the incidents' settings say (RemediationSettings.node_gpus).
    node_gpus: dict[str, int] = Field(default_factory=dict)


def _query(cluster: str | None, *, closed_since: datetime | None) -> str:
    """The visibility query: the incidents of the cluster (by its search attribute, or by the
    workflow ID for incidents started without search attributes), closed since, or open."""
    parts = [f"WorkflowType = '{REMEDIATION_WORKFLOW}'"]
    if closed_since is None:
        parts.append("ExecutionStatus = 'Running'")
    else:
        stamp = closed_since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        parts += ["ExecutionStatus != 'Running'", f"CloseTime >= '{stamp}'"]
    if cluster is not None:
        prefix = _quote(remediation_workflow_id(cluster, ""))
        parts.append(f"({SA_CLUSTER.name} = '{_quote(cluster)}' OR WorkflowId STARTS_WITH '{prefix}')")
    return " AND ".join(parts)


async def _runs(
    client: Client, cluster: str | None, *, closed_since: datetime | None
) -> AsyncIterator[WorkflowExecution]:
    """The runs ``_query`` lists; a server that cannot filter on the cluster (no ``Cluster``
    search attribute registered, no STARTS_WITH) lists every cluster's, for the caller to sort."""
    listed = False
    try:
        async for execution in client.list_workflows(_query(cluster, closed_since=closed_since)):
            listed = True
            yield execution
    except RPCError as exc:
        if listed or cluster is None or exc.status != RPCStatusCode.INVALID_ARGUMENT:
            raise
        async for execution in client.list_workflows(_query(None, closed_since=closed_since)):
            yield execution


def _node_gpus(status: IncidentStatus | None, summary: dict[str, Any]) -> int | None:
    """GPUs per node as the incident's settings said: its result's, else its memo summary's."""
    value = getattr(status.settings, "node_gpus", None) if status is not None else None
    if value is None:
        value = summary.get("node_gpus")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def find(client: Client, *, since: datetime, cluster: str | None, want_events: bool = False) -> Found:
    """Every incident of the period: closed since ``since`` (with or without a ledger), and open.

    Args:
        want_events: read each incident's result too (whether the failure ended jobs, its first
            Xid), for --export-trace; otherwise only incidents without a memo ledger are read.
    """
    found = Found()
    dry_prefix = dry_run_workflow_id("", "").rstrip("-")
    seen_incidents: set[str] = set()
    async for execution in _runs(client, cluster, closed_since=since):
        if execution.id.startswith(dry_prefix):
            found.skipped.dry_runs += 1
            continue
        memo = await execution.memo()
        raw_summary = memo.get("incident")
        summary: dict[str, Any] = raw_summary if isinstance(raw_summary, dict) else {}
        if summary.get("dry_run"):
            found.skipped.dry_runs += 1
            continue
        this_cluster = _cluster_of(
            execution.id,
            str(summary.get("cluster") or ""),
            execution.typed_search_attributes.get(SA_CLUSTER),
            cluster,
        )
        if cluster is not None and this_cluster != cluster:
            continue  # another cluster whose name begins with this one's
        if execution.status == WorkflowExecutionStatus.CONTINUED_AS_NEW and not await _closes_incident(
            client, execution
        ):
            found.skipped.continued_as_new += 1
            continue
        ledger, source = _ledger(memo.get("ledger")), "memo"
        status: IncidentStatus | None = None
        if ledger is None or want_events:
            status = await _result(client, execution)
        if ledger is None and status is not None and status.ledger is not None:
            ledger, source = status.ledger, "result"
        if status is not None:
            if cluster is not None and status.cluster and status.cluster != cluster:
                continue  # started without search attributes, of a cluster whose name begins with this one's
            this_cluster = status.cluster or this_cluster
            if status.dry_run:
                found.skipped.dry_runs += 1
                continue
        gpus = _node_gpus(status, summary)
        if gpus is not None and this_cluster:
            found.node_gpus.setdefault(this_cluster, gpus)
        if ledger is None:
            found.without_ledger.append(
                UnledgeredIncident(
                    workflow_id=execution.id,
                    run_id=execution.run_id,
                    cluster=this_cluster,
                    node=status.node if status is not None else _node_of(execution.id, this_cluster),
                    status=execution.status.name if execution.status else "",
                    closed_at=execution.close_time or datetime.now(UTC),
                )
            )
            continue
        incident = _incident(execution, ledger, source=source, summary=summary, status=status, cluster=this_cluster)
        key = incident.incident_id or f"{incident.workflow_id}/{incident.run_id}"
        if key in seen_incidents:
            found.skipped.repeated += 1
            continue
        seen_incidents.add(key)
        found.incidents.append(incident)
    async for execution in _runs(client, cluster, closed_since=None):
        if execution.id.startswith(dry_prefix):
            continue
        attribute = execution.typed_search_attributes.get(SA_CLUSTER)
        if cluster is not None and _cluster_of(execution.id, None, attribute, cluster) != cluster:
            continue
        found.open.append(execution.id)
    found.incidents.sort(key=lambda incident: (incident.failed_at, incident.workflow_id))
    found.without_ledger.sort(key=lambda incident: (incident.closed_at, incident.workflow_id))
    found.open.sort()
    return found


async def guard_nodes(client: Client, cluster: str) -> int | None:
    """The cluster's node count as its fleet guard last counted it; None when no guard answers
    or it has not counted yet."""
    handle = client.get_workflow_handle(guard_workflow_id(cluster))
    try:
        status = await handle.query(FleetGuardWorkflow.status, rpc_timeout=timedelta(seconds=GUARD_QUERY_SECONDS))
    except RPCError as exc:
        if refused(exc):
            raise
        return None
    except (WorkflowQueryFailedError, ValidationError, TypeError, ValueError):
        return None
    return status.nodes if isinstance(status, GuardStatus) and status.nodes > 0 else None


async def training_gpus(client: Client, found: Found, *, cluster: str | None, given: int | None) -> TrainingGpus:
    """The training GPUs: as given, else each cluster's guard's node count times its GPUs per node."""
    gpus_per_node = max(found.node_gpus.values(), default=DEFAULT_NODE_GPUS)
    if given is not None:
        return TrainingGpus(count=given, source="--training-gpus", gpus_per_node=gpus_per_node)
    if cluster is not None:
        clusters = [cluster]
    else:
        named = {incident.cluster for incident in found.incidents} | {i.cluster for i in found.without_ledger}
        clusters = sorted(named - {""})
    how = "give --training-gpus N (the GPUs that run training)"
    if not clusters:
        return TrainingGpus(unknown=f"no cluster is named and no incident names one: {how}")
    total, nodes, missing = 0, 0, []
    for name in clusters:
        counted = await guard_nodes(client, name)
        if counted is None:
            missing.append(name)
            continue
        per_node = found.node_gpus.get(name, DEFAULT_NODE_GPUS)
        nodes += counted
        total += counted * per_node
    if missing:
        return TrainingGpus(
            unknown=f"the fleet guard of {', '.join(missing)} has not counted its nodes (no guard runs, or no "
            f"worker answers): {how}",
            gpus_per_node=gpus_per_node,
        )
    return TrainingGpus(count=total, source="fleet guard", gpus_per_node=gpus_per_node, nodes=nodes)


# -- the figures --------------------------------------------------------------------------------


def p95(values: Iterable[float]) -> float | None:
    """The 95th percentile by nearest rank: the ceil(0.95 n)-th smallest value; None for none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(math.ceil(0.95 * len(ordered)), 1) - 1]


def figures(
    found: Found, *, since: datetime, until: datetime, training: TrainingGpus, cluster: str | None, namespace: str
) -> Report:
    """The report's figures from the incidents found (pure)."""
    incidents = found.incidents
    period = (until - since).total_seconds()
    lost = sum(incident.gpu_seconds_lost for incident in incidents)
    by_cause: dict[str, CauseFigure] = defaultdict(CauseFigure)
    by_phase = {phase.value: PhaseTotal() for phase in Phase}
    nodes: dict[tuple[str, str], NodeFigure] = {}
    totals = Totals(incidents=len(incidents), gpu_seconds_lost=lost, gpu_hours_lost=lost / 3600)
    for incident in incidents:
        cause = by_cause[incident.cause or "unknown"]
        cause.incidents += 1
        cause.gpu_hours_lost += incident.gpu_seconds_lost / 3600
        for name, figure in incident.phases.items():
            total = by_phase[name]
            total.seconds += figure.seconds
            if figure.gpu_seconds is None:
                total.unknown += 1
            else:
                total.gpu_hours_lost += figure.gpu_seconds / 3600
        node = nodes.setdefault(
            (incident.cluster, incident.node), NodeFigure(cluster=incident.cluster, node=incident.node)
        )
        node.incidents += 1
        node.gpu_hours_lost += incident.gpu_seconds_lost / 3600
        node.causes.append(incident.cause or "unknown")
        totals.lost_work_unknown_jobs += len(incident.lost_work_unknown)
        totals.spares_used += 1 if incident.spare else 0
        spare_wait = incident.phases[Phase.SPARE_WAIT.value]
        totals.spare_wait_seconds += spare_wait.seconds
        totals.spare_wait_gpu_hours += (spare_wait.gpu_seconds or 0.0) / 3600
    # A recovery is of stopped jobs: an incident that stopped none (an Xid only observed, a node
    # retired already) closes in seconds and would pull the figures down.
    recoveries = [incident.recovery_seconds for incident in incidents if incident.gpus > 0]
    by_node = sorted(nodes.values(), key=lambda node: (-node.gpu_hours_lost, node.cluster, node.node))
    effective = None
    if training.count and period > 0:
        effective = (training.count * period - lost) / (training.count * period)
    return Report(
        namespace=namespace,
        cluster=cluster,
        since=since,
        until=until,
        period_seconds=period,
        training_gpus=training,
        effective_training_time=effective,
        totals=totals,
        by_cause=dict(sorted(by_cause.items(), key=lambda item: (-item[1].gpu_hours_lost, item[0]))),
        by_phase=by_phase,
        by_node=by_node,
        recovery=Recovery(
            incidents=len(recoveries),
            mean_seconds=sum(recoveries) / len(recoveries) if recoveries else None,
            p95_seconds=p95(recoveries),
        ),
        repeat_offenders=[node for node in by_node if node.incidents >= 2],
        phases_not_adding_up=[i.incident_id or i.workflow_id for i in incidents if not i.phases_add_up],
        incidents=incidents,
        without_ledger=found.without_ledger,
        open=found.open,
        skipped=found.skipped,
    )


async def build(
    client: Client,
    *,
    period: timedelta,
    cluster: str | None,
    training: int | None,
    want_events: bool = False,
    now: datetime | None = None,
) -> Report:
    """Read the namespace and compute the report for the period ending ``now``."""
    until = now or datetime.now(UTC)
    since = until - period
    found = await find(client, since=since, cluster=cluster, want_events=want_events)
    gpus = await training_gpus(client, found, cluster=cluster, given=training)
    return figures(found, since=since, until=until, training=gpus, cluster=cluster, namespace=client.namespace)


# -- output -------------------------------------------------------------------------------------


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def render(report: Report, console: Console) -> None:
    """The report as people read it: the headline figures, then a table per breakdown."""
    where = f"cluster {report.cluster}" if report.cluster else "every cluster"
    console.print(
        f"[bold]Goodput report[/], {where}, namespace {escape(report.namespace)}: "
        f"{report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC"
    )
    training = report.training_gpus
    if report.effective_training_time is not None:
        console.print(
            f"effective training time [bold]{report.effective_training_time:.2%}[/] "
            f"of {training.count} training GPUs ({training.source})"
        )
    else:
        console.print(f"effective training time: [yellow]unknown[/]: {escape(training.unknown)}")
    totals = report.totals
    console.print(
        f"{totals.incidents} incident(s) with a ledger; {_hours(totals.gpu_seconds_lost)} GPU-hours lost; "
        f"recovery mean {_duration(report.recovery.mean_seconds)}, p95 {_duration(report.recovery.p95_seconds)}"
    )
    console.print(
        f"spares used {totals.spares_used}; waited for spares {_duration(totals.spare_wait_seconds)} "
        f"({_hours(totals.spare_wait_gpu_hours * 3600)} GPU-hours); lost work unknown for "
        f"{totals.lost_work_unknown_jobs} job(s) (no checkpoint reported)"
    )
    if report.incidents:
        phases = Table("phase", "time", "GPU-hours lost", title="where the time went")
        for name, total in report.by_phase.items():
            unknown = f" (+{total.unknown} unknown)" if total.unknown else ""
            phases.add_row(name, _duration(total.seconds), _hours(total.gpu_hours_lost * 3600) + unknown)
        console.print(phases)
        causes = Table("cause", "incidents", "GPU-hours lost", title="by cause")
        for cause, figure in report.by_cause.items():
            causes.add_row(escape(cause), str(figure.incidents), _hours(figure.gpu_hours_lost * 3600))
        console.print(causes)
        nodes = Table("cluster", "node", "incidents", "GPU-hours lost", "causes", title="by node")
        for node in report.by_node:
            nodes.add_row(
                node.cluster,
                node.node,
                str(node.incidents),
                _hours(node.gpu_hours_lost * 3600),
                escape(", ".join(node.causes)),
            )
        console.print(nodes)
    if report.repeat_offenders:
        names = ", ".join(
            f"{node.node} ({node.incidents}: {', '.join(node.causes)})" for node in report.repeat_offenders
        )
        console.print(f"[bold yellow]repeat offenders[/] (2 or more incidents): {escape(names)}")
    if report.phases_not_adding_up:
        console.print(
            "[bold red]phases that do not add up to the recovery time[/]: "
            + escape(", ".join(report.phases_not_adding_up))
        )
    if report.without_ledger:
        names = ", ".join(incident.workflow_id for incident in report.without_ledger)
        console.print(
            f"[yellow]{len(report.without_ledger)} closed incident(s) without a ledger[/] (in no figure): "
            f"{escape(names)}"
        )
    if report.open:
        console.print(f"{len(report.open)} incident(s) still open (in no figure): {escape(', '.join(report.open))}")


def write_png(report: Report, path: Path) -> Path:
    """Where the time went, as a PNG: GPU-hours lost by phase and by cause.

    Raises:
        ValueError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib (pip install matplotlib); --json and the table need nothing") from None
    phases = list(report.by_phase.items())
    causes = list(report.by_cause.items())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.4 * max(len(phases), len(causes), 4) + 2))
    left.barh([name for name, _ in phases], [total.gpu_hours_lost for _, total in phases], color="#2e6fd8")
    left.invert_yaxis()
    left.set_xlabel("GPU-hours lost")
    left.set_title("by phase")
    right.barh(
        [name for name, _ in causes] or ["(none)"], [c.gpu_hours_lost for _, c in causes] or [0], color="#b42318"
    )
    right.invert_yaxis()
    right.set_xlabel("GPU-hours lost")
    right.set_title("by cause")
    effective = (
        f"effective training time {report.effective_training_time:.2%}"
        if report.effective_training_time is not None
        else "effective training time unknown"
    )
    fig.suptitle(
        f"{report.cluster or 'every cluster'}, {report.since:%Y-%m-%d} to {report.until:%Y-%m-%d}: "
        f"{report.totals.gpu_hours_lost:,.1f} GPU-hours lost in {report.totals.incidents} incident(s); {effective}"
    )
    fig.tight_layout()
    _atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _cause_word(cause: str) -> str:
    """The ledger's cause as a trace's cause word ("Xid 79" -> "xid_79")."""
    return re.sub(r"[^a-z0-9_.-]+", "_", cause.lower()).strip("_")[:64] or "unknown"


def trace_of(report: Report) -> Trace:
    """The period's incidents as a failure trace: each at its failure's time since the period's
    start (or the earliest failure, when one came before it and closed within)."""
    start = min([report.since, *(incident.failed_at for incident in report.incidents)])
    seconds = max([(report.until - start).total_seconds(), 1.0])
    failures = []
    for incident in sorted(report.incidents, key=lambda incident: incident.failed_at):
        node = incident.node or None
        if node is not None:
            try:
                validate_node_name(node)
            except InvalidName:
                node = None
        kills = incident.ended_jobs if incident.ended_jobs is not None else incident.gpus > 0
        failures.append(
            TraceFailure(
                at=min(max((incident.failed_at - start).total_seconds(), 0.0), seconds),
                node=node,
                cause=_cause_word(incident.cause),
                event=incident.event,
                kills_job=kills,
            )
        )
    training = report.training_gpus
    return Trace(
        source=f"report {report.namespace} {report.cluster or 'every cluster'}",
        start=start,
        seconds=seconds,
        nodes=training.nodes,
        gpus_per_node=training.gpus_per_node,
        failures=failures,
    )


def _atomic(path: Path, write: Any) -> None:
    """Write through a temporary file beside ``path``, then rename it there: never half a file."""
    directory = path.parent if str(path.parent) else Path()
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    os.close(handle)
    try:
        write(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as an ordinary new file, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_trace(trace: Trace, path: Path) -> Path:
    """Write the trace as JSON, atomically."""
    text = trace.model_dump_json(indent=2) + "\n"
    _atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


# -- the command --------------------------------------------------------------------------------


def report(
    since: Annotated[
        str, typer.Option(help="The period: the incidents closed in the last N seconds, minutes, hours or days (30d).")
    ] = "30d",
    cluster: Annotated[
        str | None, typer.Option(help="Only this cluster's incidents (default: every cluster in the namespace).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document (docs/goodput.md#the-report).")] = False,
    png: Annotated[
        Path | None, typer.Option(help="Also draw where the time went (GPU-hours by phase and cause) as a PNG.")
    ] = None,
    export_trace: Annotated[
        Path | None,
        typer.Option(help="Also write the incidents as a failure trace (for `gpufleet whatif --trace`, or to keep)."),
    ] = None,
    training_gpus: Annotated[
        int | None,
        typer.Option(min=1, help="The GPUs that run training (default: the fleet guard's node count x GPUs per node)."),
    ] = None,
) -> None:
    """What failures cost: effective training time, GPU-hours lost by cause, phase and node,
    recovery times, repeat offenders and spares, from the incidents Temporal still keeps."""
    # The CLI's own helpers (one-line errors, exit codes); imported here, as starters.cli registers
    # this command at its end.
    from starters.cli import fail, run_async

    try:
        period = parse_since(since)
        if cluster is not None:
            validate_cluster_name(cluster)
    except (ValueError, InvalidName) as exc:
        fail(str(exc), code=2)
    if png is not None and not _has_matplotlib():
        fail("--png needs matplotlib (pip install matplotlib); --json and the table need nothing", code=2)
    for given, option in ((png, "--png"), (export_trace, "--export-trace")):
        if given is not None and not given.resolve().parent.is_dir():
            fail(f"{option} {given}: its directory {given.resolve().parent} does not exist", code=2)

    async def go() -> Report:
        client = await connect()
        try:
            return await build(
                client, period=period, cluster=cluster, training=training_gpus, want_events=export_trace is not None
            )
        except RPCError as exc:
            if refused(exc):
                raise
            answer = exc.status.name if exc.status else "an error"
            fail(f"Temporal answered {answer} while the report read the incidents: {exc.message}")

    result: Report = run_async(go())
    if as_json:
        print(result.model_dump_json())
    else:
        render(result, Console())
    try:
        if png is not None:
            write_png(result, png)
        if export_trace is not None:
            write_trace(trace_of(result), export_trace)
    except ValueError as exc:
        fail(str(exc), code=2)
    except OSError as exc:
        fail(f"cannot write {exc.filename}: {exc.strerror or exc}")
    if not as_json:
        for path, what in ((png, "picture"), (export_trace, "trace")):
            if path is not None:
                Console().print(f"{what} written to {path}")
