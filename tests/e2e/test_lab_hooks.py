"""gpufleet health-check in the lab's Slurm hooks, end to end: a check that fails in one node's
Prolog, the job running on a healthy node, the node's incident opened from its detector's inbox
and taking Slurm's drain as its own (docs/health-check.md)."""

from __future__ import annotations

import asyncio
import getpass
import itertools
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.client import Client

from clients.kube import KubernetesApi
from lab.fleet import FleetLab, LabConfig
from lab.procs import free_port
from models.constants import PROBATION_LABEL
from tests.conftest import gpufleet_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetLab, list[str]]]:
    config = LabConfig(training=["gpu1", "gpu2", "gpu3"], spares=["spare1"], temporal_port=free_port(), ui_port=0)
    fleet = FleetLab(tmp_path_factory.mktemp("lab"), config)
    said: list[str] = []
    fleet.up(say=said.append)
    yield fleet, said
    fleet.down()


def gpufleet(fleet: FleetLab, *args: str) -> subprocess.CompletedProcess[str]:
    return gpufleet_cli(*args, env=fleet.env(), timeout=400)


async def reported_events(fleet: FleetLab, workflow_id: str) -> list[dict[str, Any]]:
    """The events signalled into an incident, as its history holds them."""
    client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"])
    found: list[dict[str, Any]] = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.HasField("workflow_execution_signaled_event_attributes"):
            signalled = event.workflow_execution_signaled_event_attributes
            if signalled.signal_name == "report_xid":
                found += [json.loads(payload.data) for payload in signalled.input.payloads]
    return found


def test_a_failed_prolog_health_check_opens_the_incident_and_the_job_runs_elsewhere(
    lab: tuple[FleetLab, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """gpufleet health-check is the lab's Prolog: a node whose NVML sees one GPU of its two fails
    it, Slurm drains the node ("Prolog error") and requeues the job (not held:
    nohold_on_prolog_fail), the job runs on a healthy node, and the health_check event, through
    the node's detector, opens the node's incident, which takes Slurm's drain as its own (nobody
    is asked), reboots the node and returns it once its GPUs answer again."""
    fleet, _ = lab
    slurm = fleet.slurm.client()
    # A health_check's action is REBOOT_NODE here: a repair in place, no spare needed.
    with fleet.policy_file.open("a", encoding="utf-8") as policy:
        policy.write("kinds: {health_check: REBOOT_NODE}\n")
    assert gpufleet(fleet, "breaker", "reset", "--reason", "the prolog health check").returncode == 0
    partition = fleet.config.partition
    # The drills' jobs are done with: two nodes of the partition free for this one.
    subprocess.run(fleet.slurm.argv(["scancel", "--user", getpass.getuser()]), env=fleet.slurm.env, check=True)

    def idle_nodes() -> list[str]:
        """The partition's idle nodes, once no job is left at all: a cancelled job's Epilog still
        to run (the job COMPLETING) would fail on the node made to fail below, first."""
        queue = subprocess.run(
            fleet.slurm.argv(["squeue", "-h", "-o", "%i"]), env=fleet.slurm.env, capture_output=True, text=True
        )
        if queue.returncode != 0 or queue.stdout.strip():
            return []
        return [n for n in fleet.all_nodes if n in slurm.partition_nodes(partition) and slurm.node(n).state == "idle"]

    kube = KubernetesApi(kubeconfig=fleet.home / "kubeconfig")

    def pairs() -> list[tuple[str, str]]:
        """Two idle nodes, Slurm's first try not on probation (the validation drill's node is:
        an event there replaces it at once, which is that drill's to show)."""
        idle = idle_nodes()
        return [(a, b) for a, b in itertools.pairwise(idle) if not kube.get_node(a).labels.get(PROBATION_LABEL)]

    for _ in range(120):
        found = pairs()
        if found:
            break
        asyncio.run(asyncio.sleep(0.5))
    assert found, [(n, slurm.node(n).state) for n in fleet.all_nodes]
    failing, healthy = found[0]  # Slurm tries the first idle node first
    fleet.slurm.hook_gpus_file(failing).write_text("1\n")  # one GPU of the two left
    others = [n for n in slurm.partition_nodes(partition) if n not in (failing, healthy)]
    folder = tmp_path_factory.mktemp("prolog")
    script = folder / "job.sh"
    script.write_text("#!/bin/sh\necho ran on $SLURMD_NODENAME\n")
    job = fleet.slurm.sbatch(
        script, "-N1", "-o", str(folder / "job.out"), *(["-x", ",".join(others)] if others else [])
    )
    incident = f"remediate-{fleet.config.cluster}-{failing}"
    try:
        out = ""
        for _ in range(240):  # the job ran elsewhere, and an incident took the node's drain
            taken = slurm.node(failing).reason.startswith("gpufleet: health_check")
            out = (folder / "job.out").read_text() if (folder / "job.out").exists() else ""
            if taken and "ran on" in out:
                break
            asyncio.run(asyncio.sleep(0.5))
        done = gpufleet(fleet, "incidents", "show", incident, "--json")
        assert done.returncode == 0, f"`gpufleet incidents show {incident}` answered {done.returncode}: {done.stderr}"
        shown = json.loads(done.stdout)
        timeline = " ".join(str(entry) for entry in shown["timeline"])
        # Slurm wrote the failed attempt's "Error running slurm prolog" there first.
        assert f"ran on {healthy}" in out, out
        # Requeued after the prolog failed, not held (nohold_on_prolog_fail): it ran to its end.
        # (Whether Slurm counts that requeue in Restarts differs from run to run; not asserted.)
        assert slurm.job(job).state == "COMPLETED", slurm.job(job)
        assert shown["events"][:1] == ["health_check"], shown
        assert "held by someone else" not in timeline
        assert not shown["waiting_for_approval"], shown
        # The node's detector sent the event, naming the check and what it read.
        sent = asyncio.run(reported_events(fleet, incident))
        assert sent and sent[0]["kind"] == "health_check" and sent[0]["source"] == "health-check", sent
        assert sent[0]["message"].startswith("prolog: gpu_count: NVML sees 1 GPU(s), the node should have 2")
        # Its drain wrote gpufleet's reason over Slurm's "Prolog error" (the drain step's detail says).
        assert "reason='gpufleet: health_check prolog REBOOT_NODE incident " in timeline, timeline
    finally:
        fleet.slurm.hook_gpus_file(failing).write_text("2\n")
    for _ in range(240):  # rebooted, its GPUs answer again: back in service
        status = json.loads(gpufleet(fleet, "incidents", "show", incident, "--json").stdout)
        if status["outcome"] != "open":
            break
        asyncio.run(asyncio.sleep(0.5))
    assert status["outcome"] == "resolved", status
    # Rebooted in place and resumed; unless the fleet guard quarantined or escalated a node that
    # earlier drills failed too, which is then replaced: gpufleet's drain either way.
    if status["action"] == "REBOOT_NODE":
        assert not slurm.node(failing).drained
    else:
        assert status["action"] == "REPLACE_NODE" and (status["quarantine"] or status["escalated_by_guard"]), status
