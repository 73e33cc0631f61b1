"""The chaos scenarios about what outlives an incident or a process: an incident a person terminates
in its grace period (the reaper gives back what it held), a detector restarted without its cursor
(old Xids are not reported again, a fresh one is), and a bad value in the cluster's remediation
ConfigMap (the worker keeps its last good grace and says so in its metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes.client.exceptions import ApiException
from temporalio.service import RPCError

from clients.kube import KubernetesApi
from lab.chaos.fleet import (
    closed,
    double_claims,
    fleet_facts,
    gpufleet,
    job_lost,
    leaked_claims,
    return_retired,
    undrained_not_ours,
)
from lab.chaos.outages import Context, _core
from lab.drill import default_job, resumed_step, run_drill, training_job
from lab.faults import Effect
from lab.fleet import REPO_ROOT
from lab.procs import spawn, stop, wait_for
from models.constants import (
    CLAIMED_BY_ANNOTATION,
    NODE_LEASE_ANNOTATION,
    owned_reason,
    reaper_workflow_id,
    remediation_workflow_id,
)
from models.incident import IncidentStatus, JobInfo, Outcome, Step
from models.metrics import CONFIG_CONFIGMAP, CONFIG_OK
from models.requests import ReaperStatus
from models.slinky import REMEDIATION_CONFIGMAP, cluster_namespace
from starters.temporal import connect
from workflows.reaper import ReaperWorkflow
from workflows.remediation import NodeRemediationWorkflow

TERMINATED = "incident_terminated_in_grace"
CURSOR_LOST = "detector_cursor_lost"
CONFIGMAP_BAD = "configmap_bad_value"
TOTALS = ("jobs_lost", "double_claims", "nodes_undrained_not_ours", "claims_leaked")
SKIPPED = re.compile(r"(\d+) event\(s\) older than the replay cutoff skipped")


def _checks(before: dict[str, Any], after: dict[str, Any], jobs_lost: int) -> dict[str, int]:
    return {
        "jobs_lost": jobs_lost,
        "double_claims": double_claims(after),
        "nodes_undrained_not_ours": undrained_not_ours(before, after),
        "claims_leaked": leaked_claims(after),
    }


def _finish(result: dict[str, Any], problems: list[str], say: Any) -> dict[str, Any]:
    correct = not problems and not any(result.get(key, 0) for key in TOTALS)
    result.update(passed=correct, correct=correct, fault_fired=result.get("fault_fired", False))
    if problems:
        result["reason"] = "; ".join(problems)
    said = f" ({result['reason']})" if problems else ""
    say(f"{result['name']}: {'passed' if correct else 'FAILED'} ({result.get('outcome')}){said}")
    return result


async def _returned(ctx: Context, result: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The scenario's result, once the nodes it retired are back as spares and no GPU fault stands."""
    try:
        await return_retired(ctx.lab, ctx.say)
    except (RuntimeError, TimeoutError) as exc:  # reported with the scenario; the run goes on
        problems.append(f"after the scenario: {exc}")
    ctx.lab.faults.clear_all()
    return _finish(result, problems, ctx.say)


async def _until(check: Any, *, timeout: float, what: str, interval: float = 0.1) -> Any:
    """``await check()`` until it returns something true (returned); TimeoutError after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = await check()
        if found:
            return found
        if loop.time() >= deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f}s")
        await asyncio.sleep(interval)


# -- incident_terminated_in_grace ------------------------------------------------------------------


async def terminated_in_grace(ctx: Context) -> dict[str, Any]:
    """An incident terminated by a person (the Temporal UI's Terminate) while its job checkpoints:
    nothing of the incident runs again, so the cluster's reaper (asked for a sweep at once) must
    requeue the job it SIGTERMed, let go of the node's lease and leave no claim. The node stays
    drained: it is a person's now; they return it (`gpufleet nodes return NODE --as training`) and
    the job runs again from its checkpoint."""
    lab, say = ctx.lab, ctx.say
    ctx.fired = []
    cluster = lab.config.cluster
    slurm = lab.slurm.client()
    kube = KubernetesApi(kubeconfig=lab.home / "kubeconfig")
    job = await asyncio.to_thread(training_job, lab, slurm, job_kind=default_job(lab), say=say)
    target = slurm.hostnames(job.nodes)[0]
    before = fleet_facts(lab)
    client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
    handle = client.get_workflow_handle(remediation_workflow_id(cluster, target), result_type=IncidentStatus)
    reaper = client.get_workflow_handle(reaper_workflow_id(cluster))
    result: dict[str, Any] = {"name": TERMINATED, "node": target, "job_id": job.job_id}
    problems: list[str] = []
    after_job: JobInfo | None = None
    returned = False
    try:
        since = datetime.now(UTC)
        lab.inject_xid(target, 79, Effect.NONE)  # the job lives on: its grace is spent checkpointing

        async def in_grace() -> IncidentStatus | None:
            try:
                description = await handle.describe()
                if description.start_time < since:
                    return None  # an earlier incident's run
                status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
            except RPCError:
                return None
            if status.step == Step.CHECKPOINT and job.job_id in status.signalled:
                return status
            if status.step == Step.CLOSED or status.outcome == Outcome.FAILED:
                raise RuntimeError(f"the incident closed ({status.outcome.value}) before it was seen in its grace")
            return None

        status = await _until(in_grace, timeout=120, what="the incident in its grace, the job SIGTERMed", interval=0.01)
        incident = status.incident_id
        result["incident"] = incident
        await handle.terminate(reason="chaos: terminated by a person during the grace period")
        terminated = time.monotonic()
        described = await handle.describe()
        ctx.fired.append(f"{incident} terminated at {status.step.value}, job {job.job_id} SIGTERMed")
        result["fault_fired"] = described.status is not None and described.status.name == "TERMINATED"
        if not result["fault_fired"]:
            problems.append(f"the incident was not terminated (it is {described.status})")
        await reaper.signal(ReaperWorkflow.sweep)

        def given_back() -> bool:
            lease = kube.get_node(target).annotations.get(NODE_LEASE_ANNOTATION, "")
            return lease != incident and slurm.job(job.job_id).restarts > job.restarts

        try:
            await asyncio.to_thread(
                wait_for, given_back, timeout=60, what="the reaper to requeue the job and let go of the lease"
            )
            result["given_back_s"] = round(time.monotonic() - terminated, 3)
        except TimeoutError as exc:
            problems.append(str(exc))
        reaper_status: ReaperStatus = await reaper.query(ReaperWorkflow.status)
        result["reaped"] = [line for line in reaper_status.reaped if line.startswith(incident)]
        node = slurm.node(target)
        if not (node.drained and owned_reason(node.reason)):
            problems.append(f"{target} did not stay drained as the incident left it ({node.state}, {node.reason!r})")
        claimed = [n.name for n in kube.list_nodes() if n.annotations.get(CLAIMED_BY_ANNOTATION) == incident]
        if claimed:
            problems.append(f"the terminated incident still claims {', '.join(claimed)}")
        result["lease"] = kube.get_node(target).annotations.get(NODE_LEASE_ANNOTATION, "")
        # A person checks the node and returns it: the job, requeued, runs there again.
        lab.faults.clear(target)
        await gpufleet(lab, "nodes", "return", target, "--as", "training")
        returned = True
        say(f"returned {target} for training, as its owner would once checked")
        after_job = await asyncio.to_thread(
            wait_for,
            lambda: (j := slurm.job(job.job_id)).state == "RUNNING" and j.restarts > job.restarts and j,
            timeout=120,
            what=f"job {job.job_id} to run again",
        )
        resumed = resumed_step(after_job, job.restarts) if after_job is not None else None
        result.update(resumed_from_step=resumed, job_restarts=after_job.restarts if after_job else None)
        if after_job is not None and after_job.restarts != job.restarts + 1:
            problems.append(f"job {job.job_id} was requeued {after_job.restarts - job.restarts} times, not once")
        if not resumed:
            problems.append(f"job {job.job_id} did not resume from its checkpoint")
        result["outcome"] = "terminated, reaped"
    except Exception as exc:  # reported, and the run goes on
        result.update(outcome="error", error=f"{type(exc).__name__}: {exc}")
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        if not returned:  # the next scenario needs its node back
            lab.faults.clear(target)
            with contextlib.suppress(RuntimeError):
                await gpufleet(lab, "nodes", "return", target, "--as", "training")
    result["faults"] = list(ctx.fired)
    result.update(_checks(before, fleet_facts(lab), job_lost(job.restarts, after_job)))
    return await _returned(ctx, result, problems)


# -- detector_cursor_lost ----------------------------------------------------------------------------


class _Failed(Exception):
    """The scenario failed for a reason already in its problems: stop it there."""


def _cursor(ctx: Context, node: str) -> Path:
    """Where the lab's detector of ``node`` keeps its kernel log's cursor ($GPUFLEET_HOME/detector/NODE)."""
    return ctx.lab.home / "detector" / node / "kmsg.json"


async def detector_cursor_lost(ctx: Context) -> dict[str, Any]:
    """After an incident on a node is handled, its detector is stopped, its cursor deleted and
    the detector started again: it reads the node's kernel log from its start, and the Xids it
    reported before (older than the replay cutoff by their dmesg uptime stamps) must not open an
    incident again; a fresh Xid after the restart must be reported (on the retired node: recorded)."""
    lab, say = ctx.lab, ctx.say
    ctx.fired = []
    cluster = lab.config.cluster
    result: dict[str, Any] = {"name": CURSOR_LOST}
    problems: list[str] = []
    before = fleet_facts(lab)
    jobs_lost = 0
    # The replay cutoff (GPUFLEET_DETECTOR_REPLAY_CUTOFF_SECONDS) is 5 minutes by default; the
    # restarted detector gets 1 s, so that the handled incident's Xid (tens of seconds old) is as
    # old for it as for a detector back after a real outage.
    env = {"GPUFLEET_DETECTOR_REPLAY_CUTOFF_SECONDS": "1"}
    try:
        drill = await run_drill(lab, job_kind=default_job(lab), timeout=300, say=say, require_running=False)
        node = drill["node"]
        result.update(node=node, incident=drill["incident_id"], outcome=drill["outcome"])
        now = JobInfo(job_id=drill["job_id"], state=drill["job_state"], restarts=drill["job_restarts"])
        jobs_lost = job_lost(drill["restarts_before"], now)
        if drill["outcome"] != Outcome.RESOLVED.value:
            problems.append(f"the first incident did not resolve ({drill['outcome']})")
        client = await connect(address=lab.env()["TEMPORAL_ADDRESS"])
        handle = client.get_workflow_handle(remediation_workflow_id(cluster, node), result_type=IncidentStatus)
        handled = await handle.describe()
        kmsg = lab.kmsg_file(node)
        old = sum(1 for line in kmsg.read_text().splitlines() if "NVRM: Xid" in line)
        # The detector stops cleanly (its cursor saved), then the cursor is lost.
        name = f"detector-{node}"
        stop([int(lab.state()["services"][name]["pid"])])
        cursor = _cursor(ctx, node)
        if not cursor.exists():
            problems.append(f"the detector kept no cursor at {cursor}")
        cursor.unlink(missing_ok=True)
        log = lab.home / "logs" / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0

        def since_restart() -> str:
            with open(log, "rb") as text:
                text.seek(offset)
                return text.read().decode(errors="replace")

        # Without a cursor a detector reads /dev/kmsg from the oldest record of the boot, but a log
        # file from its end (its past unread: nothing to replay). The lab's kernel log stands in
        # for /dev/kmsg, so it is read whole here: put back only once the detector follows it (a
        # log that appears after the start is read from its start).
        away = kmsg.with_name(f"{kmsg.name}.away")
        os.replace(kmsg, away)
        ready = lab.detector_ready_file(node)
        ready.unlink(missing_ok=True)
        pid = spawn(lab.detector_argv(node), log=log, env={**lab.detector_env(node), **env}, cwd=REPO_ROOT)
        state = lab.state()
        state["services"][name]["pid"] = pid
        lab._save(state)
        try:
            await asyncio.to_thread(wait_for, ready.exists, timeout=60, what=f"{name} to follow its kernel log again")
        finally:
            os.replace(away, kmsg)
        ctx.fired.append(f"{name} restarted without its cursor ({old} Xid line(s) in its kernel log)")
        # Read whole, the log either yields its old Xids (skipped, and said) or reports them.
        reported = " -> incident "
        await asyncio.to_thread(
            wait_for,
            lambda: SKIPPED.search(text := since_restart()) or reported in text,
            timeout=60,
            what=f"{name} to skip or report the old Xids",
        )
        said = SKIPPED.search(since_restart())
        result["skipped"] = int(said.group(1)) if said else 0
        if result["skipped"] != old:
            problems.append(f"the detector skipped {result['skipped']} of the {old} old Xid(s)")
        again = await handle.describe()
        if again.run_id != handled.run_id or reported in since_restart():
            problems.append(f"the old Xids were reported again: a new incident on {node} (run {again.run_id})")
            result["fault_fired"] = True  # the restart without a cursor did happen
            raise _Failed
        # A fresh Xid after the restart is reported: on the retired node, a new incident records it.
        fresh_at = datetime.now(UTC)
        lab.inject_xid(node, 79, Effect.NONE)
        fresh = await closed(handle, since=fresh_at, timeout=60)
        result.update(fresh_incident=fresh.incident_id, fresh_outcome=fresh.outcome.value)
        if fresh.outcome != Outcome.ALREADY_RETIRED:
            problems.append(f"the fresh Xid's incident ended {fresh.outcome.value}, not already_retired")
        result["fault_fired"] = True
    except _Failed:
        pass  # said in problems; what the replayed incident did is closed below
    except Exception as exc:  # reported, and the run goes on
        result.update(outcome="error", error=f"{type(exc).__name__}: {exc}")
        problems.append(f"{type(exc).__name__}: {exc}")
    result["faults"] = list(ctx.fired)
    result.update(_checks(before, fleet_facts(lab), jobs_lost))
    return await _returned(ctx, result, problems)


# -- configmap_bad_value -----------------------------------------------------------------------------


def _configmap(ctx: Context) -> dict[str, Any]:
    """The cluster's remediation ConfigMap as `gpufleet cluster create` writes it, its grace a NaN."""
    cluster = ctx.lab.config.cluster
    return {
        "metadata": {"name": REMEDIATION_CONFIGMAP, "namespace": cluster_namespace(cluster)},
        "data": {"grace_seconds": "nan", "requeue": "true", "task_queue": f"gpufleet-{cluster}"},
    }


async def configmap_nan(ctx: Context, node: str) -> None:
    """Before the Xid: the cluster's ConfigMap edited to ``grace_seconds: nan`` (the lab's cluster
    has none: made as `gpufleet cluster create` would, its namespace too if missing)."""
    core, _ = _core(ctx.lab)
    namespace = cluster_namespace(ctx.lab.config.cluster)
    with contextlib.suppress(ApiException):  # there already
        body: Any = {"metadata": {"name": namespace}}
        core.create_namespace(body)
    try:
        core.read_namespaced_config_map(REMEDIATION_CONFIGMAP, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        configmap: Any = _configmap(ctx)
        core.create_namespaced_config_map(namespace, configmap)
    else:
        core.patch_namespaced_config_map(REMEDIATION_CONFIGMAP, namespace, {"data": {"grace_seconds": "nan"}})
    ctx.fired.append(f"ConfigMap {namespace}/{REMEDIATION_CONFIGMAP} edited to grace_seconds: nan")


async def configmap_restored(ctx: Context) -> None:
    """After the incident: the ConfigMap the lab did not have is deleted again."""
    core, _ = _core(ctx.lab)
    with contextlib.suppress(ApiException):
        core.delete_namespaced_config_map(REMEDIATION_CONFIGMAP, cluster_namespace(ctx.lab.config.cluster))


def config_ok(text: str, source: str) -> float | None:
    """The value of ``gpufleet_config_ok{...source="SOURCE"...}`` in a Prometheus scrape (None: absent)."""
    for line in text.splitlines():
        if line.startswith(CONFIG_OK + "{") and f'source="{source}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def configmap_kept_last_good(ctx: Context, drill: dict[str, Any]) -> list[str]:
    """The incident ran with the last good grace (the lab's policy file's, not NaN) and the
    worker's metrics say the ConfigMap is refused."""
    problems = []
    client = await connect(address=ctx.lab.env()["TEMPORAL_ADDRESS"])
    handle = client.get_workflow_handle(drill["workflow_id"], result_type=IncidentStatus)
    status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
    grace = status.settings.grace_seconds if status.settings is not None else None
    wanted = ctx.lab.config.grace_seconds
    if grace is None or not math.isfinite(grace) or grace != wanted:
        problems.append(f"the incident's grace was {grace}, not the last good {wanted:g} s")
    url = ctx.lab.state()["services"]["worker"].get("metrics")
    if not url:
        return [*problems, "the lab's worker serves no metrics"]
    scraped = await asyncio.to_thread(httpx.get, url, timeout=5)
    ok = config_ok(scraped.text, CONFIG_CONFIGMAP)
    if ok != 0:
        problems.append(f"the worker's metrics say {CONFIG_OK}{{source={CONFIG_CONFIGMAP!r}}} {ok}, not 0")
    ctx.fired.append(f"the incident's grace {grace} s; {CONFIG_OK}{{source={CONFIG_CONFIGMAP!r}}} {ok}")
    return problems
