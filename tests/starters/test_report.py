"""`gpufleet report` over the Temporal dev server: closed incidents whose memo or result carries
a ledger (resolved, failed, one continued as new while it waited, one closed with late Xids, a dry
run, one older with its ledger only in its result, one without any ledger, and a second cluster
whose name begins with the first's), one still open, and a fleet guard that has counted its nodes.

The incidents are scripted by stand-in workflows registered under the real types' names, so the
report reads exactly what Temporal's visibility and histories hold, and nothing else. One dev server
for the module; the command runs as a user runs it, in a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from lab.procs import free_port
from models.constants import (
    GUARD_WORKFLOW,
    REMEDIATION_WORKFLOW,
    SA_CLUSTER,
    SEARCH_ATTRIBUTES,
    dry_run_workflow_id,
    guard_workflow_id,
    remediation_workflow_id,
)
from models.goodput import RECOVERY_PHASES, IncidentLedger, Phase, PhaseCost
from models.guard import GuardState, GuardStatus
from models.incident import CarriedIncident, IncidentStatus, Outcome, RemediationInput
from models.policy import Action, GuardSettings, RemediationSettings
from models.trace import Trace
from models.xid import GpuEventKind, XidEvent
from starters.report import Found, PhaseFigure, ReportIncident, TrainingGpus, figures, p95, parse_since
from tests.conftest import REPO, gpufleet_cli, start_dev_server
from tests.starters.test_cli_every_command import gpufleet
from tests.starters.test_cli_properties import answered

QUEUE = "report-test"
ALPHA, BETA = "alpha", "alpha-b"  # the second's workflow IDs begin with the first's prefix
T0 = datetime(2026, 12, 6, 8, 0, tzinfo=UTC)


class Script(BaseModel):
    """What a stand-in incident does: close with ``status``, its ledger in the memo or the result."""

    status: IncidentStatus
    memo: bool = True
    result_ledger: bool = True
    fail: bool = False
    # Continue as new carrying the incident on (a long wait for a spare), the memo holding
    # ``stale`` meanwhile (as a run inherits its predecessor's memo).
    carry_on: bool = False
    stale: IncidentLedger | None = None
    # Close, then continue as new with an Xid that came late (it opens the node's next incident).
    late: bool = False


def _memo(status: IncidentStatus, ledger: IncidentLedger, **summary: Any) -> dict[str, Any]:
    incident = {
        "incident_id": status.incident_id,
        "cluster": status.cluster,
        "node": status.node,
        "outcome": status.outcome.value,
        "action": status.action.value if status.action else None,
        "spare": status.spare,
        "dry_run": status.dry_run,
        "node_gpus": status.settings.node_gpus if status.settings else None,
        **summary,
    }
    return {"ledger": ledger, "incident": incident}


@workflow.defn(name=REMEDIATION_WORKFLOW)
class ScriptedIncident:
    def __init__(self) -> None:
        self._script: Script | None = None

    @workflow.signal
    def script(self, script: Script) -> None:
        self._script = script

    @workflow.run
    async def run(self, params: RemediationInput) -> IncidentStatus:
        if params.carried is not None:  # the incident's next run: it closes now
            status = params.carried.status
            assert status.ledger is not None
            workflow.upsert_memo(_memo(status, status.ledger))
            return status
        await workflow.wait_condition(lambda: self._script is not None)
        script = self._script
        assert script is not None
        status = script.status
        if script.carry_on:
            if script.stale is not None:
                workflow.upsert_memo(_memo(status, script.stale, incident_id="stale"))
            workflow.continue_as_new(
                RemediationInput(
                    cluster=params.cluster,
                    node=params.node,
                    carried=CarriedIncident(status=status, events=[]),
                )
            )
        if script.memo and status.ledger is not None:
            workflow.upsert_memo(_memo(status, status.ledger))
        if script.fail:
            raise ApplicationError("scripted: the incident failed at its step", non_retryable=True)
        if script.late:
            workflow.continue_as_new(
                RemediationInput(
                    cluster=params.cluster,
                    node=params.node,
                    pending_events=[XidEvent(node=params.node, xid=79, source="test")],
                )
            )
        return status if script.result_ledger else status.model_copy(update={"ledger": None})


@workflow.defn(name=GUARD_WORKFLOW)
class CountingGuard:
    def __init__(self) -> None:
        self._nodes = 0
        self._cluster = ""

    @workflow.run
    async def run(self, cluster: str, nodes: int) -> None:
        self._cluster, self._nodes = cluster, nodes
        await workflow.wait_condition(lambda: False)

    @workflow.query
    def status(self) -> GuardStatus:
        return GuardStatus(state=GuardState(cluster=self._cluster), limits=GuardSettings(), nodes=self._nodes)


def ledger(
    cause: str,
    failed_at: datetime,
    seconds: dict[Phase, float],
    *,
    gpus: int,
    lost_work: float | None = 0.0,
    unknown: tuple[int, ...] = (),
    skew: float = 0.0,
) -> IncidentLedger:
    """A ledger whose phases add up (``skew``: recovery_seconds off by that much)."""
    phases = [
        PhaseCost(phase=p, seconds=seconds.get(p, 0.0), gpu_seconds=seconds.get(p, 0.0) * gpus) for p in RECOVERY_PHASES
    ]
    phases.append(PhaseCost(phase=Phase.LOST_WORK, seconds=(lost_work or 0.0) / gpus, gpu_seconds=lost_work))
    recovery = sum(seconds.values())
    detected = failed_at + timedelta(seconds=seconds.get(Phase.DETECTION, 0.0))
    return IncidentLedger(
        cause=cause,
        failed_at=failed_at,
        detected_at=detected,
        recovered_at=failed_at + timedelta(seconds=recovery),
        recovery_seconds=recovery + skew,
        gpus=gpus,
        phases=phases,
        lost_work_unknown=list(unknown),
        gpu_seconds_lost=sum(p.gpu_seconds or 0.0 for p in phases),
    )


def incident(cluster: str, node: str, at: datetime, book: IncidentLedger, **fields: Any) -> IncidentStatus:
    return IncidentStatus(
        incident_id=f"{cluster}-{node}-{at:%Y%m%dT%H%M%SZ}",
        cluster=cluster,
        node=node,
        outcome=fields.pop("outcome", Outcome.RESOLVED),
        action=fields.pop("action", Action.REPLACE_NODE),
        ledger=book,
        **fields,
    )


D, DR, G, RQ, SW, RS = (Phase.DETECTION, Phase.DRAIN, Phase.GRACE, Phase.REQUEUE, Phase.SPARE_WAIT, Phase.RESTART)


@dataclass
class Case:
    workflow_id: str
    script: Script
    search_attributes: bool = True
    cluster: str = ALPHA


def cases() -> list[Case]:
    a1 = ledger("Xid 79", T0, {D: 10, DR: 20, G: 30, RQ: 5, SW: 100, RS: 35}, gpus=16, lost_work=3200.0)
    a2 = ledger("Xid 48", T0 + timedelta(hours=1), {D: 5, DR: 15, RS: 380}, gpus=8, lost_work=None, unknown=(12,))
    a3 = ledger("Xid 79", T0 + timedelta(hours=2), {D: 2, DR: 8, G: 20, RQ: 0, SW: 600, RS: 70}, gpus=8)
    stale = ledger("Xid 31", T0 - timedelta(days=1), {D: 1}, gpus=8, lost_work=99999.0)
    a4 = ledger("SXid 22013", T0 + timedelta(hours=3), {D: 3, DR: 7, RS: 50}, gpus=8, lost_work=800.0)
    a6 = ledger("init_failed", T0 + timedelta(hours=4), {D: 1, DR: 4, RS: 55}, gpus=8)
    dry = ledger("Xid 79", T0 + timedelta(hours=5), {D: 1, RS: 10}, gpus=8)
    b1 = ledger("Xid 94", T0 + timedelta(hours=6), {D: 4, DR: 6, G: 10, RS: 20}, gpus=4, lost_work=40.0, skew=50.0)
    return [
        Case(
            remediation_workflow_id(ALPHA, "gpu1"),
            # Nodes of 4 GPUs: its memo says so (the guard counts nodes).
            Script(
                status=incident(ALPHA, "gpu1", T0, a1, spare="spare1", ended=[7], requeued=[7]).model_copy(
                    update={"settings": RemediationSettings(node_gpus=4)}
                )
            ),
        ),
        Case(
            remediation_workflow_id(ALPHA, "gpu2"),
            Script(status=incident(ALPHA, "gpu2", a2.failed_at, a2, outcome=Outcome.FAILED), fail=True),
        ),
        Case(
            remediation_workflow_id(ALPHA, "gpu1"),
            Script(status=incident(ALPHA, "gpu1", a3.failed_at, a3, spare="spare2"), carry_on=True, stale=stale),
        ),
        # Older than the memo: its ledger is only in its result, and it has no search attributes.
        Case(
            remediation_workflow_id(ALPHA, "gpu4"),
            Script(status=incident(ALPHA, "gpu4", a4.failed_at, a4), memo=False),
            search_attributes=False,
        ),
        Case(
            remediation_workflow_id(ALPHA, "gpu5"),
            Script(status=incident(ALPHA, "gpu5", T0, a4), memo=False, result_ledger=False),
            search_attributes=False,
        ),
        Case(
            remediation_workflow_id(ALPHA, "gpu6"), Script(status=incident(ALPHA, "gpu6", a6.failed_at, a6), late=True)
        ),
        Case(
            dry_run_workflow_id(ALPHA, "gpu3"), Script(status=incident(ALPHA, "gpu3", dry.failed_at, dry, dry_run=True))
        ),
        Case(remediation_workflow_id(BETA, "n1"), Script(status=incident(BETA, "n1", b1.failed_at, b1)), cluster=BETA),
    ]


@dataclass
class Fleet:
    env: WorkflowEnvironment
    address: str
    counted: list[IncidentStatus]  # the incidents the report must count, each once


async def _start(client: Client, case: Case) -> None:
    attributes = (
        TypedSearchAttributes([SearchAttributePair(SA_CLUSTER, case.cluster)]) if case.search_attributes else None
    )
    node = case.script.status.node
    handle = await client.start_workflow(
        ScriptedIncident.run,
        RemediationInput(cluster=case.cluster, node=node, search_attributes=case.search_attributes),
        id=case.workflow_id,
        task_queue=QUEUE,
        start_signal="script",
        start_signal_args=[case.script],
        search_attributes=attributes,
    )
    if case.script.late:
        return  # its next run stays open
    if case.script.fail:
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    else:
        await handle.result()


async def _listed(client: Client, query: str, count: int) -> None:
    """Visibility lags a moment behind a close: wait until ``count`` runs are listed."""
    for _ in range(600):
        if len([w async for w in client.list_workflows(query)]) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} listed: {query}")


@pytest.fixture(scope="module")
async def fleet(temporal_cli: str) -> AsyncIterator[Fleet]:
    env = await start_dev_server(
        temporal_cli, data_converter=pydantic_data_converter, search_attributes=SEARCH_ATTRIBUTES
    )
    client = env.client
    async with Worker(
        client,
        task_queue=QUEUE,
        workflows=[ScriptedIncident, CountingGuard],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        await client.start_workflow(CountingGuard.run, args=[ALPHA, 4], id=guard_workflow_id(ALPHA), task_queue=QUEUE)
        every = cases()
        for case in every:
            await _start(client, case)
        # 8 starts, 2 of which continued as new: 9 closed runs and one open.
        await _listed(client, f"WorkflowType='{REMEDIATION_WORKFLOW}' AND ExecutionStatus != 'Running'", 9)
        await _listed(client, f"WorkflowType='{REMEDIATION_WORKFLOW}' AND ExecutionStatus = 'Running'", 1)
        yield Fleet(env=env, address=client.service_client.config.target_host, counted=counted())
    await env.shutdown()


async def report(fleet: Fleet, *args: str) -> tuple[int, str, str]:
    """``gpufleet report ARGS`` in a process of its own (the worker answers the guard meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers.entry",
        "report",
        *args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "TEMPORAL_ADDRESS": fleet.address},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _ledgers(statuses: list[IncidentStatus]) -> list[IncidentLedger]:
    return [status.ledger for status in statuses if status.ledger is not None]


async def test_the_json_accounts_for_every_incident_once_and_adds_up(fleet: Fleet, tmp_path: Path) -> None:
    trace_file, png = tmp_path / "trace.json", tmp_path / "where.png"
    code, out, err = await report(
        fleet, "--json", "--since", "2h", "--training-gpus", "64", "--export-trace", str(trace_file), "--png", str(png)
    )
    assert code == 0, err
    got = json.loads(out)
    ids = [row["incident_id"] for row in got["incidents"]]
    assert sorted(ids) == sorted(status.incident_id for status in fleet.counted)  # each exactly once
    assert "stale" not in ids  # the memo a run carried on while its incident went on is not an incident
    by_id = {row["incident_id"]: row for row in got["incidents"]}
    assert by_id["alpha-gpu4-20261206T110000Z"]["ledger_from"] == "result"
    assert by_id["alpha-gpu2-20261206T090000Z"]["outcome"] == "failed"
    assert [(row["workflow_id"], row["cluster"], row["node"]) for row in got["without_ledger"]] == [
        (remediation_workflow_id(ALPHA, "gpu5"), ALPHA, "gpu5")
    ]
    assert got["open"] == [remediation_workflow_id(ALPHA, "gpu6")]
    assert got["skipped"] == {"dry_runs": 1, "continued_as_new": 1, "repeated": 0}

    books = _ledgers(fleet.counted)
    lost = sum(book.gpu_seconds_lost for book in books)
    assert got["totals"]["gpu_seconds_lost"] == pytest.approx(lost)
    for phase in Phase:
        known = sum(book.cost(phase).gpu_seconds or 0.0 for book in books)
        assert got["by_phase"][phase.value]["gpu_hours_lost"] == pytest.approx(known / 3600)
    assert got["by_phase"]["lost_work"]["unknown"] == 1
    assert got["totals"]["lost_work_unknown_jobs"] == 1
    assert got["totals"]["spares_used"] == 2
    assert got["totals"]["spare_wait_seconds"] == pytest.approx(700)
    assert sum(c["gpu_hours_lost"] for c in got["by_cause"].values()) == pytest.approx(lost / 3600)
    assert got["by_cause"]["Xid 79"]["incidents"] == 2

    recoveries = sorted(book.recovery_seconds for book in books)  # 60, 60, 120, 200, 400, 700+50 (skewed)
    assert got["recovery"]["mean_seconds"] == pytest.approx(sum(recoveries) / len(recoveries))
    assert got["recovery"]["p95_seconds"] == pytest.approx(recoveries[math.ceil(0.95 * len(recoveries)) - 1])
    assert got["repeat_offenders"] == [
        {
            "cluster": ALPHA,
            "node": "gpu1",
            "incidents": 2,
            "gpu_hours_lost": pytest.approx(lost_on("gpu1")),
            "causes": ["Xid 79", "Xid 79"],
        }
    ]
    # The recovery phases add up for all but the one whose recovery time was skewed.
    assert got["phases_not_adding_up"] == ["alpha-b-n1-20261206T140000Z"]
    for row in got["incidents"]:
        phases = sum(row["phases"][p.value]["seconds"] for p in RECOVERY_PHASES)
        assert row["phases_add_up"] == (phases == pytest.approx(row["recovery_seconds"]))
    period = got["period_seconds"]
    assert got["effective_training_time"] == pytest.approx((64 * period - lost) / (64 * period))
    # Across both clusters no guard counts alpha-b: the training GPUs would be unknown without the option.
    assert got["training_gpus"]["source"] == "--training-gpus"

    trace = Trace.model_validate_json(trace_file.read_text())
    assert trace.model_dump() == Trace.model_validate(trace.model_dump()).model_dump()
    assert len(trace.failures) == len(books)
    assert trace.start is not None
    assert [f.at for f in trace.failures] == sorted((b.failed_at - trace.start).total_seconds() for b in books)
    first = trace.failures[0]
    assert (first.node, first.cause, first.kills_job) == ("gpu1", "xid_79", True)  # its failure ended job 7
    assert first.event is not None and (first.event.kind, first.event.xid) == (GpuEventKind.XID, 79)
    sxid = next(f for f in trace.failures if f.node == "gpu4")
    assert sxid.event is not None and (sxid.event.kind, sxid.event.xid) == (GpuEventKind.SXID, 22013)
    # No job ended by the failure (its result says so); one whose result is not kept (it continued
    # as new as it closed) counts as stopping the GPUs its ledger names.
    assert not next(f for f in trace.failures if f.node == "gpu4").kills_job
    assert next(f for f in trace.failures if f.node == "gpu6").kills_job
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert not list(tmp_path.glob(".*"))  # no temporary file left beside them


def lost_on(node: str) -> float:
    """GPU-hours lost on the node by the incidents the report counts."""
    return sum(book.gpu_seconds_lost for book in _ledgers([s for s in counted() if s.node == node])) / 3600


def counted() -> list[IncidentStatus]:
    """The incidents the report must count, each once: all but the dry run and the one without a ledger."""
    return [case.script.status for case in cases() if not case.script.status.dry_run and case.script.result_ledger]


async def test_cluster_filters_and_the_guard_counts_the_training_gpus(fleet: Fleet) -> None:
    code, out, err = await report(fleet, "--json", "--since", "2h", "--cluster", ALPHA)
    assert code == 0, err
    got = json.loads(out)
    assert {row["cluster"] for row in got["incidents"]} == {ALPHA}
    alpha = [s for s in fleet.counted if s.cluster == ALPHA]
    assert sorted(row["incident_id"] for row in got["incidents"]) == sorted(s.incident_id for s in alpha)
    assert got["totals"]["gpu_seconds_lost"] == pytest.approx(sum(b.gpu_seconds_lost for b in _ledgers(alpha)))
    # The guard counted 4 nodes; an incident's memo says 4 GPUs per node (read from no result).
    assert got["training_gpus"] == {"count": 16, "source": "fleet guard", "unknown": "", "gpus_per_node": 4, "nodes": 4}
    period = got["period_seconds"]
    assert got["effective_training_time"] == pytest.approx(1 - got["totals"]["gpu_seconds_lost"] / (16 * period))

    code, out, err = await report(fleet, "--json", "--since", "2h", "--cluster", BETA)
    assert code == 0, err
    beta = json.loads(out)
    assert [row["incident_id"] for row in beta["incidents"]] == ["alpha-b-n1-20261206T140000Z"]
    assert beta["open"] == [] and beta["without_ledger"] == []
    assert beta["effective_training_time"] is None
    assert "--training-gpus" in beta["training_gpus"]["unknown"]


async def test_the_table_names_what_is_in_no_figure(fleet: Fleet) -> None:
    code, out, err = await report(fleet, "--since", "2h", "--cluster", ALPHA)
    assert code == 0, err
    assert "effective training time" in out
    assert "repeat offenders (2 or more incidents): gpu1 (2: Xid 79, Xid 79)" in out
    assert f"1 closed incident(s) without a ledger (in no figure): {remediation_workflow_id(ALPHA, 'gpu5')}" in out
    assert f"1 incident(s) still open (in no figure): {remediation_workflow_id(ALPHA, 'gpu6')}" in out


@pytest.mark.parametrize("since", ["30", "3x", "-1d", "0h", "1.5d", "d"])
def test_a_bad_since_is_refused_in_one_line(since: str) -> None:
    ran = gpufleet_cli("report", "--since", since, env={"TEMPORAL_ADDRESS": "127.0.0.1:1"})
    assert ran.returncode == 2
    assert ran.stderr.strip().startswith("error: --since")
    assert len(ran.stderr.strip().splitlines()) == 1


def test_png_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    ran = gpufleet_cli(
        "report",
        "--png",
        str(tmp_path / "where.png"),
        env={"TEMPORAL_ADDRESS": "127.0.0.1:1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
    )
    assert (ran.returncode, ran.stderr.strip()) == (
        2,
        "error: --png needs matplotlib (pip install matplotlib); --json and the table need nothing",
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    since=st.text(max_size=12) | st.sampled_from(["30d", "1s", "99999999d", "0s", "3650d", "3651d"]),
    cluster=st.text(max_size=12) | st.sampled_from(["alpha", "Alpha", "a" * 41]),
    training=st.text(max_size=6) | st.sampled_from(["0", "-3", "64", "1e9"]),
)
def test_any_argument_is_taken_or_refused_in_one_line(since: str, cluster: str, training: str) -> None:
    stopped = {"TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}"}
    ran = gpufleet("report", "--since", since, "--cluster", cluster, "--training-gpus", training, env=stopped)
    answered(ran, {**stopped, "GPUFLEET_SLURMRESTD_URL": "-"}, ok=False)


def test_since_and_p95() -> None:
    assert parse_since("30d") == timedelta(days=30)
    assert parse_since("90m") == timedelta(minutes=90)
    assert parse_since("600s") == timedelta(seconds=600)
    assert parse_since("12h") == timedelta(hours=12)
    assert p95([]) is None
    assert p95([5.0]) == 5.0
    assert p95(float(n) for n in range(1, 21)) == 19.0  # ceil(0.95 x 20) = the 19th of 20
    assert p95(float(n) for n in range(1, 101)) == 95.0
    assert p95([1.0, 2.0, 3.0]) == 3.0


def _row(name: str, recovery: float, gpus: int) -> ReportIncident:
    return ReportIncident(
        workflow_id=remediation_workflow_id(ALPHA, name),
        run_id="r",
        incident_id=f"{ALPHA}-{name}",
        cluster=ALPHA,
        node=name,
        closed_at=T0,
        ledger_from="memo",
        cause="Xid 13",
        failed_at=T0,
        detected_at=T0,
        recovered_at=T0 + timedelta(seconds=recovery),
        recovery_seconds=recovery,
        gpus=gpus,
        gpu_seconds_lost=recovery * gpus,
        phases={phase.value: PhaseFigure() for phase in Phase},
        phases_add_up=True,
    )


def test_recovery_times_are_those_of_incidents_that_stopped_jobs() -> None:
    # An Xid only observed (or a node retired already) stops nothing: it closes in a second, and
    # is no recovery; counted, it would pull the mean and the 95th percentile down.
    found = Found(incidents=[_row("gpu1", 600.0, 8), _row("gpu2", 1.0, 0), _row("gpu3", 2.0, 0)])
    got = figures(
        found,
        since=T0 - timedelta(days=1),
        until=T0 + timedelta(hours=1),
        training=TrainingGpus(count=64, source="--training-gpus"),
        cluster=None,
        namespace="default",
    )
    assert got.totals.incidents == 3
    assert (got.recovery.incidents, got.recovery.mean_seconds, got.recovery.p95_seconds) == (1, 600.0, 600.0)
