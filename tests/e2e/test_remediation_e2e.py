"""End to end over every real part: Temporal dev server, worker, Slurm daemons, emulated Kubernetes, webhook.

A two-node checkpointing job runs on gpu1 and gpu2; ``gpufleet remediate gpu1 --xid 79 --wait``
must leave gpu1 drained and out of the partition, its Node retired (kept), spare1 serving, the job
requeued once and resumed from its checkpoint, and the owner told "opened" and "resolved".
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from clients.kube import KubernetesApi
from lab.fleet import REPO_ROOT, FleetLab, LabConfig
from lab.histories import record_histories
from lab.procs import alive, wait_for
from models.goodput import RECOVERY_PHASES, IncidentLedger, Phase
from models.incident import IncidentStatus
from models.xid import XidEvent
from starters.temporal import report_xid
from tests.conftest import gpufleet_cli
from workflows.remediation import NodeRemediationWorkflow

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

COUNTER_JOB = REPO_ROOT / "lab" / "jobs" / "counter.sbatch"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetLab]:
    config = LabConfig(training=["gpu1", "gpu2"], spares=["spare1"], temporal_port=0, ui_port=0, grace_seconds=30)
    lab = FleetLab(tmp_path_factory.mktemp("fleet"), config)
    lab.up()
    # Two training nodes, hit in turn by these tests: the fleet guard's default share (half the
    # partition in ten minutes) would hold the second. The breaker is proven in tests/workflows
    # and by the storm in `make chaos`; here its share limit is off (the in-flight limit stays).
    # The lab's checkpoint-sync pods may be one down (their PodDisruptionBudget): a node's evicted
    # pod is not back when the next node is drained, so that eviction is refused until it is
    # forced, after 5 s here rather than the default minute (forcing is not what is tested here).
    policy = lab.policy_file.read_text().replace("remediation:\n", "remediation:\n  eviction_timeout_seconds: 5\n", 1)
    lab.policy_file.write_text(policy + "guard:\n  max_share: 0\n", encoding="utf-8")
    yield lab
    record_histories(lab.env()["TEMPORAL_ADDRESS"])
    pids = lab.down()
    assert not [pid for pid in pids if alive(pid)]


def gpufleet(lab: FleetLab, *args: str) -> subprocess.CompletedProcess[str]:
    return gpufleet_cli(*args, env=lab.env(), timeout=240)


def activity_types(lab: FleetLab, workflow_id: str) -> list[str]:
    async def fetch() -> list[str]:
        client = await Client.connect(lab.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        return [
            event.activity_task_scheduled_event_attributes.activity_type.name
            for event in history.events
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        ]

    return asyncio.run(fetch())


def test_xid_79_recovers_a_running_job(fleet: FleetLab, tmp_path: Path) -> None:
    slurm = fleet.slurm.client()
    kube = KubernetesApi(kubeconfig=Path(fleet.env()["GPUFLEET_KUBECONFIG"]))
    log = tmp_path / "counter.log"
    job_id = fleet.slurm.sbatch(
        COUNTER_JOB,
        "-o",
        str(log),
        env={"PYTHON": sys.executable, "CHECKPOINT": str(tmp_path / "ckpt.json"), "PYTHONPATH": str(REPO_ROOT)},
    )
    wait_for(lambda: "checkpoint saved" in log.read_text(), timeout=60, what="a first checkpoint")
    # The job reports its checkpoints (`gpufleet checkpoint-done` inside it): the mark in its Comment.
    wait_for(lambda: slurm.job(job_id).checkpointed_at, timeout=60, what="the job's checkpoint mark")

    done = gpufleet(fleet, "remediate", "gpu1", "--xid", "79", "--wait", "--json")
    assert done.returncode == 0, done.stderr
    incident = json.loads(done.stdout.strip().splitlines()[-1])
    assert incident["outcome"] == "resolved"
    assert incident["spare"] == "spare1"
    # What it cost: the recovery's phases add up to its time, the job's GPUs were counted, and
    # the work lost since its reported checkpoint is known.
    ledger = IncidentLedger.model_validate(incident["ledger"])
    recovery = sum(ledger.cost(phase).seconds for phase in RECOVERY_PHASES)
    assert recovery == pytest.approx(ledger.recovery_seconds, abs=1e-3)
    assert ledger.gpus > 0 and ledger.lost_work_unknown == []
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds is not None

    gpu1 = slurm.node("gpu1")
    assert gpu1.drained or gpu1.state == "down"
    assert gpu1.reason.startswith("gpufleet:") and "xid 79" in gpu1.reason
    assert "train" not in gpu1.partitions
    retired = kube.get_node("gpu1")  # kept: cordoned, tainted and labelled, never deleted
    assert retired.unschedulable and retired.labels["gpufleet.io/pool"] == "retired"
    assert "spare1" in slurm.partition_nodes("train")
    assert kube.get_node("spare1").ready and not slurm.node("spare1").drained

    job = slurm.job(job_id)
    assert job.restarts == 1 and job.state == "RUNNING"
    assert set(job.nodes.split(",")) == {"gpu2", "spare1"}
    resumed = wait_for(lambda: re.search(r"resumed from step (\d+)", log.read_text()), timeout=60, what="resume")
    assert int(resumed.group(1)) > 0

    kinds = [message["kind"] for message in fleet.notifications()]
    assert "opened" in kinds and "resolved" in kinds
    assert all(message["incident"]["node"] == "gpu1" for message in fleet.notifications())

    scheduled = activity_types(fleet, "remediate-lab-gpu1")
    for step in [
        "slurm_node_state",
        "classify_xids",
        "notify",
        "drain_slurm_node",
        "jobs_hit_by_failure",  # the job still runs (remediate injects no GPU fault): SIGTERM
        "guard_request_slot",
        "signal_job",
        "jobs_still_running",
        "requeue_job",
        "cordon_and_drain_node",
        "claim_spare",
        "retire_node",
        "jobs_resumed",
    ]:
        assert step in scheduled, f"{step} missing from the workflow history"

    shown = gpufleet(fleet, "incidents", "show", "remediate-lab-gpu1")
    assert shown.returncode == 0 and "resolved" in shown.stdout and "drain_slurm" in shown.stdout
    listed = json.loads(gpufleet(fleet, "incidents", "list", "--json").stdout)
    assert any(row["id"] == "remediate-lab-gpu1" and row["status"] == "COMPLETED" for row in listed)


def fleet_state(fleet: FleetLab) -> dict[str, Any]:
    """What a dry run must leave alone: every Node's and Pod's resourceVersion, each Slurm node's
    state, reason and partitions, each job's state and restarts."""
    kube = KubernetesApi(kubeconfig=Path(fleet.env()["GPUFLEET_KUBECONFIG"]))
    slurm = fleet.slurm.client()
    return {
        "nodes": {node.name: node.resource_version for node in kube.list_nodes()},
        "slurm": {n.name: (n.state, n.reason, n.partitions) for n in slurm.nodes()},
        "jobs": {j.job_id: (j.state, j.restarts) for j in slurm.jobs()},
    }


def test_a_dry_run_records_every_step_and_changes_nothing(fleet: FleetLab) -> None:
    before = fleet_state(fleet)
    done = gpufleet(fleet, "remediate", "gpu2", "--xid", "79", "--dry-run", "--wait", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    status = IncidentStatus.model_validate_json(done.stdout.strip().splitlines()[-1])
    assert status.dry_run and status.incident_id.startswith("dryrun-lab-gpu2-")
    assert status.outcome == "resolved" and status.action == "REPLACE_NODE"
    steps = {entry.step.value for entry in status.timeline}
    assert {"drain_slurm", "checkpoint", "requeue", "drain_kubernetes", "claim_spare", "resume"} <= steps
    assert status.signalled and status.requeued == status.signalled  # the job on gpu2, as it would be
    assert all(n.outcome == "dry_run" for n in status.notifications)
    assert fleet_state(fleet) == before  # Slurm, Kubernetes and the job exactly as they were
    shown = gpufleet(fleet, "incidents", "show", status.incident_id)
    assert shown.returncode == 0 and "DRY RUN" in shown.stdout, shown.stdout + shown.stderr


def test_breaker_status_pause_and_resume_from_the_cli(fleet: FleetLab) -> None:
    done = gpufleet(fleet, "breaker", "status", "--json")
    assert done.returncode == 0, done.stderr
    guard = json.loads(done.stdout)
    assert guard["running"] and not guard["state"]["tripped"] and not guard["state"]["in_flight"]
    assert any(e["event"] == "granted" and e["node"] == "gpu1" for e in guard["state"]["log"])
    assert gpufleet(fleet, "pause", "--reason", "driver roll-out").returncode == 0
    paused = json.loads(gpufleet(fleet, "breaker", "status", "--json").stdout)["state"]
    assert paused["paused"] and paused["paused_reason"] == "driver roll-out"
    assert "PAUSED" in gpufleet(fleet, "breaker", "status").stdout
    resumed = gpufleet(fleet, "resume", "--all")  # every cluster with a guard: here, the lab's
    assert resumed.returncode == 0 and "cluster lab: resumed" in resumed.stdout, resumed.stdout + resumed.stderr
    assert not json.loads(gpufleet(fleet, "breaker", "status", "--json").stdout)["state"]["paused"]
    reset = gpufleet(fleet, "breaker", "reset", "--reason", "nothing tripped")
    assert reset.returncode == 0 and "breaker closed" in reset.stdout


def test_unknown_node_fails_with_a_message_and_leaves_nothing_running(fleet: FleetLab) -> None:
    done = gpufleet(fleet, "remediate", "nosuch", "--xid", "79")
    assert done.returncode != 0
    assert "no node named 'nosuch'" in done.stderr

    async def status() -> WorkflowExecutionStatus | None:
        client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"])
        return (await client.get_workflow_handle("remediate-lab-nosuch").describe()).status

    assert asyncio.run(status()) == WorkflowExecutionStatus.FAILED


def test_unsafe_node_name_is_rejected_before_anything_runs(fleet: FleetLab) -> None:
    done = gpufleet(fleet, "remediate", "gpu1;reboot", "--xid", "79")
    assert done.returncode == 2
    assert "invalid node name" in done.stderr
    listed = json.loads(gpufleet(fleet, "incidents", "list", "--json").stdout)
    assert not any("reboot" in row["id"] for row in listed)


def test_one_policy_file_decides_for_the_detector_and_the_worker(fleet: FleetLab) -> None:
    """Xid 31 is an application fault (OBSERVE: the detector sends nothing) until the lab's one
    policy file says otherwise; the same edit gives the worker a shorter grace. The reboot is done
    in place (the lab's stand-in for the reboot Job) and the node goes back into service."""
    policy = fleet.policy_file.read_text()
    edited = yaml.safe_load(policy)
    edited["xids"] = {31: "REBOOT_NODE"}
    edited["remediation"] = {"grace_seconds": 7, "spare_recheck_seconds": 11}
    fleet.policy_file.write_text(yaml.safe_dump(edited))
    try:
        done = gpufleet(fleet, "lab", "inject-xid", "gpu2", "--xid", "31")
        assert done.returncode == 0, done.stdout + done.stderr

        async def incident() -> IncidentStatus:
            client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
            handle = client.get_workflow_handle("remediate-lab-gpu2", result_type=IncidentStatus)
            deadline = asyncio.get_running_loop().time() + 120
            while True:
                try:
                    return await handle.result()
                except RPCError:  # the detector has not started it yet
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.2)

        status = asyncio.run(incident())
    finally:
        fleet.policy_file.write_text(policy)
    assert status.xids == [31]
    assert status.action == "REBOOT_NODE"  # the detector sent it, the worker classified it so
    assert status.outcome == "resolved"  # rebooted in place, back in service
    assert status.settings is not None
    assert (status.settings.grace_seconds, status.settings.spare_recheck_seconds) == (7, 11)
    drained = next(e.detail for e in status.timeline if e.step == "drain_slurm" and e.event == "finished")
    assert "gpufleet: xid 31 REBOOT_NODE" in drained
    repaired = next(e.detail for e in status.timeline if e.step == "repair" and e.event == "finished")
    # Judged by the node's new boot ID (the reboot Job's pod died with it), then the GPUs answer.
    assert "gpu2 rebooted: Ready on boot ID" in repaired and "answers (lab stand-in)" in repaired
    assert not fleet.slurm.client().node("gpu2").drained


def test_no_spare_waits_until_a_repaired_node_is_returned(fleet: FleetLab) -> None:
    """The lab's one spare is in use and gpu1 is retired: an Xid 79 on gpu2 waits for a spare,
    says so once, and takes gpu1 when an operator returns it as a spare after its repair."""

    async def scenario() -> IncidentStatus:
        client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
        handle = await report_xid(client, XidEvent(node="gpu2", xid=79, source="test"), cluster="lab")
        deadline = asyncio.get_running_loop().time() + 120
        while not (status := await handle.query(NodeRemediationWorkflow.status)).waiting_for_spare:
            assert asyncio.get_running_loop().time() < deadline, status.step
            await asyncio.sleep(0.2)
        returned = await asyncio.to_thread(gpufleet, fleet, "nodes", "return", "gpu1", "--as", "spare")
        assert returned.returncode == 0, returned.stdout + returned.stderr
        signalled = await asyncio.to_thread(gpufleet, fleet, "spare-available", "gpu2")
        assert signalled.returncode == 0, signalled.stderr
        result: IncidentStatus = await asyncio.wait_for(handle.result(), timeout=180)
        return result

    status = asyncio.run(scenario())
    assert status.outcome == "resolved"
    assert status.spare == "gpu1"
    assert [n.kind for n in status.notifications].count("no_spare") == 1
    kube = KubernetesApi(kubeconfig=Path(fleet.env()["GPUFLEET_KUBECONFIG"]))
    gpu1 = kube.get_node("gpu1")
    assert not any(taint["key"] == "gpufleet.io/retired" for taint in gpu1.taints)
    assert gpu1.labels["gpufleet.io/pool"] == "training"
    assert "gpu1" in fleet.slurm.client().partition_nodes("train")


async def _incident_until(fleet: FleetLab, node: str, done: Any, what: str) -> IncidentStatus:
    """The node's open incident's status once ``done(status)`` holds (fails after two minutes)."""
    client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
    handle = client.get_workflow_handle(f"remediate-lab-{node}")
    deadline = asyncio.get_running_loop().time() + 120
    while True:
        try:
            status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
            if done(status):
                return status
        except RPCError:  # not started yet
            status = None  # type: ignore[assignment]
        assert asyncio.get_running_loop().time() < deadline, f"{node}: {what}; last seen {status}"
        await asyncio.sleep(0.2)


def _result(fleet: FleetLab, node: str) -> IncidentStatus:
    async def wait() -> IncidentStatus:
        client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
        handle = client.get_workflow_handle(f"remediate-lab-{node}", result_type=IncidentStatus)
        result: IncidentStatus = await asyncio.wait_for(handle.result(), timeout=180)
        return result

    return asyncio.run(wait())


def test_a_node_that_fails_soon_after_its_return_is_quarantined_until_released(fleet: FleetLab) -> None:
    """gpu1 was returned in the test above and serves again: failing within its cooldown makes it
    a lemon. Its incident replaces it (waiting for gpu2, returned after its repair) and labels it
    quarantined at the close; `nodes return` refuses it until `nodes release`."""
    done = gpufleet(fleet, "remediate", "gpu1", "--xid", "79")
    assert done.returncode == 0, done.stdout + done.stderr
    asyncio.run(_incident_until(fleet, "gpu1", lambda s: s.waiting_for_spare, "waiting for a spare"))
    returned = gpufleet(fleet, "nodes", "return", "gpu2", "--as", "spare")
    assert returned.returncode == 0, returned.stdout + returned.stderr
    assert gpufleet(fleet, "spare-available", "gpu1").returncode == 0
    status = _result(fleet, "gpu1")
    assert status.outcome == "resolved" and status.spare == "gpu2"
    assert status.quarantined and "after it was returned to service" in (status.quarantine or "")
    kube = KubernetesApi(kubeconfig=Path(fleet.env()["GPUFLEET_KUBECONFIG"]))
    assert kube.get_node("gpu1").labels.get("gpufleet.io/quarantine")
    listed = gpufleet(fleet, "nodes", "quarantined")
    assert listed.returncode == 0 and "gpu1" in listed.stdout
    refused = gpufleet(fleet, "nodes", "return", "gpu1", "--as", "spare")
    assert refused.returncode != 0 and "quarantine" in (refused.stdout + refused.stderr)
    released = gpufleet(fleet, "nodes", "release", "gpu1", "--reason", "GPU swapped")
    assert released.returncode == 0, released.stdout + released.stderr
    assert not kube.get_node("gpu1").labels.get("gpufleet.io/quarantine")
    back = gpufleet(fleet, "nodes", "return", "gpu1", "--as", "spare")
    assert back.returncode == 0, back.stdout + back.stderr


def test_a_rejected_repair_leaves_the_node_drained_and_a_later_xid_is_only_recorded(fleet: FleetLab) -> None:
    """With RESET_GPU behind an approval, an Xid 48 on spare1 (serving since the first test)
    drains it, requeues its jobs and waits; rejected, the node stays drained. Another Xid 48
    there is recorded against that drain (awaiting repair), changing nothing."""
    policy = fleet.policy_file.read_text()
    edited = yaml.safe_load(policy)
    edited.setdefault("guard", {})["require_approval"] = ["RESET_GPU"]
    fleet.policy_file.write_text(yaml.safe_dump(edited))
    slurm = fleet.slurm.client()
    try:
        assert gpufleet(fleet, "remediate", "spare1", "--xid", "48").returncode == 0
        waiting = asyncio.run(
            _incident_until(fleet, "spare1", lambda s: s.waiting_for_approval, "waiting at the approval gate")
        )
        assert waiting.action == "RESET_GPU" and slurm.node("spare1").drained
        rejected = gpufleet(fleet, "reject", "spare1", "--cluster", "lab", "--reason", "hardware ticket instead")
        assert rejected.returncode == 0, rejected.stdout + rejected.stderr
        first = _result(fleet, "spare1")
        assert first.outcome == "rejected"
        reason = slurm.node("spare1").reason
        assert slurm.node("spare1").drained and "RESET_GPU" in reason
        assert gpufleet(fleet, "remediate", "spare1", "--xid", "48", "--wait").returncode == 0
        second = _result(fleet, "spare1")
    finally:
        fleet.policy_file.write_text(policy)
    assert second.outcome == "awaiting_repair" and second.incident_id != first.incident_id
    assert [n.kind for n in second.notifications] == ["recorded"]
    assert "the node is already drained for RESET_GPU" in fleet.notifications_file.read_text()
    assert slurm.node("spare1").drained and slurm.node("spare1").reason == reason  # changed nothing


def _payload_texts(node: Any) -> Iterator[str]:
    """Every payload of a history in JSON form, decoded (payload data is base64 there)."""
    if isinstance(node, dict):
        if isinstance(node.get("data"), str) and "metadata" in node:
            yield base64.b64decode(node["data"]).decode("utf-8", "replace")
        for value in node.values():
            yield from _payload_texts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _payload_texts(value)


def test_the_webhook_secret_is_nowhere_in_logs_histories_or_search_attributes(fleet: FleetLab) -> None:
    """After the incidents above: the webhook URL's secret path appears in no log of gpufleet's,
    no workflow input, result, failure or query payload, no search attribute, no CLI output."""
    url = fleet.env()["GPUFLEET_WEBHOOK_URL"]
    secret = url.rsplit("/", 1)[1]
    assert len(secret) >= 16 and fleet.notifications_file.read_text()  # notifications did go there

    async def recorded() -> list[str]:
        client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
        texts = []
        async for execution in client.list_workflows():
            texts.append(repr(execution.search_attributes) + repr(execution.typed_search_attributes))
            history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
            raw = history.to_json()
            texts.append(raw)
            texts.extend(_payload_texts(json.loads(raw)))
        return texts

    texts = asyncio.run(recorded())
    assert len(texts) > 10  # the incidents, the guard, the node returns
    # gpufleet's own logs; the receiver's (it stands for Slack) logs the paths it is sent to.
    logs = [p for p in (fleet.home / "logs").glob("*.log") if p.name != "webhook.log"]
    assert any(p.name.startswith("worker") for p in logs)
    texts.extend(p.read_text(errors="replace") for p in logs)
    for command in (["incidents", "list"], ["incidents", "show", "gpu2"], ["lab", "status"]):
        done = gpufleet(fleet, *command)
        texts.append(done.stdout + done.stderr)
    leaks = [text[max(0, text.find(secret) - 80) : text.find(secret) + 20] for text in texts if secret in text]
    assert not leaks, leaks


def _until_running(fleet: FleetLab, job_id: int) -> None:
    slurm = fleet.slurm.client()
    try:
        wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what=f"job {job_id} running")
    except TimeoutError as exc:
        queue = subprocess.run(fleet.slurm.argv(["squeue", "-l"]), env=fleet.slurm.env, text=True, capture_output=True)
        nodes = subprocess.run(
            fleet.slurm.argv(["sinfo", "-N", "-l"]), env=fleet.slurm.env, text=True, capture_output=True
        )
        job = subprocess.run(
            fleet.slurm.argv(["scontrol", "show", "job", str(job_id)]),
            env=fleet.slurm.env,
            text=True,
            capture_output=True,
        )
        raise AssertionError(f"{exc}\n{queue.stdout}{queue.stderr}\n{nodes.stdout}\n{job.stdout}{job.stderr}") from None


def test_a_soft_failure_lets_the_job_finish_and_a_fatal_xid_meanwhile_escalates(
    fleet: FleetLab, tmp_path: Path
) -> None:
    """With `drain_after_jobs.then: REPLACE_NODE`, an Xid 94 (a contained memory error) on gpu2
    drains it while a short job runs there: the job is not signalled and finishes, then gpu2 is
    replaced by gpu1 (a spare again since the quarantine test). Then an Xid 94 on gpu1, serving
    now with a long job, waits for that job; an Xid 79 meanwhile ends the wait at once: the job
    is signalled and requeued and gpu1 goes to be replaced (no spare is left: the incident is
    cancelled there)."""
    policy = fleet.policy_file.read_text()
    edited = yaml.safe_load(policy)
    edited["drain_after_jobs"] = {"then": "REPLACE_NODE", "max_wait_seconds": 600, "poll_seconds": 1}
    fleet.policy_file.write_text(yaml.safe_dump(edited))
    slurm = fleet.slurm.client()
    script = tmp_path / "sleep.sbatch"
    script.write_text('#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --requeue\nsleep "$SLEEP_SECONDS"\n')
    # The counter job of the first test waits in the queue for two nodes, ahead of any other:
    # it has done its part, so it goes.
    ended = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "DEADLINE"}
    earlier = [str(job.job_id) for job in slurm.jobs() if job.state not in ended]
    if earlier:
        subprocess.run(fleet.slurm.argv(["scancel", *earlier]), env=fleet.slurm.env, check=True, timeout=30)
    try:
        short = fleet.slurm.sbatch(script, "-w", "gpu2", "-o", str(tmp_path / "short.log"), env={"SLEEP_SECONDS": "12"})
        _until_running(fleet, short)
        assert gpufleet(fleet, "remediate", "gpu2", "--xid", "94").returncode == 0
        waiting = asyncio.run(_incident_until(fleet, "gpu2", lambda s: s.waiting_for_jobs, "waiting for the job"))
        assert waiting.action == "DRAIN_AFTER_JOBS" and f"still running: {short}" in (waiting.waiting_for_jobs or "")
        gpu2 = slurm.node("gpu2")
        assert gpu2.drained and "xid 94 DRAIN_AFTER_JOBS" in gpu2.reason
        assert slurm.job(short).state == "RUNNING"  # drained, not signalled
        shown = gpufleet(fleet, "incidents", "show", "gpu2")
        assert "drained after its jobs: 1 job(s) still running" in shown.stdout, shown.stdout + shown.stderr
        first = _result(fleet, "gpu2")
        assert first.outcome == "resolved" and first.action == "REPLACE_NODE" and first.spare == "gpu1"
        assert first.signalled == [] and first.requeued == []
        done = slurm.job(short)
        assert done.state == "COMPLETED" and done.restarts == 0  # ran to its end, once

        long = fleet.slurm.sbatch(script, "-w", "gpu1", "-o", str(tmp_path / "long.log"), env={"SLEEP_SECONDS": "600"})
        _until_running(fleet, long)
        assert gpufleet(fleet, "remediate", "gpu1", "--xid", "94").returncode == 0
        asyncio.run(_incident_until(fleet, "gpu1", lambda s: s.waiting_for_jobs, "waiting for the job"))
        assert gpufleet(fleet, "remediate", "gpu1", "--xid", "79").returncode == 0
        escalated = asyncio.run(
            _incident_until(fleet, "gpu1", lambda s: long in s.requeued, "the job requeued after the escalation")
        )
    finally:
        fleet.policy_file.write_text(policy)
    assert escalated.action == "REPLACE_NODE" and escalated.signalled == [long]
    [why] = [e.detail for e in escalated.timeline if e.event == "escalated" and e.step == "wait_for_jobs"]
    assert why.startswith("DRAIN_AFTER_JOBS -> REPLACE_NODE: Xid 79 came while the jobs ran on")
    assert "REPLACE_NODE" in slurm.node("gpu1").reason
    cancelled = gpufleet(fleet, "incidents", "cancel", "gpu1", "--reason", "no spare left in the lab")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
