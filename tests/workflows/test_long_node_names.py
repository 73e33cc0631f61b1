"""Incidents end to end on nodes named as clouds and bare-metal fleets name them: a 63-character
DNS label and fully qualified names. Real Slurm (run under the lab lock), the emulated Kubernetes
API over HTTP (which refuses what a real API server refuses), the lab's Job runner for repair
Jobs, the worker's own activities; the time-skipping Temporal server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from temporalio import activity
from temporalio.testing import WorkflowEnvironment

from activities.guard import GuardActivities
from activities.kube import KubeActivities
from activities.repair import RepairActivities
from activities.slurm import SlurmActivities
from activities.spares import SpareActivities
from clients.kube import KubernetesApi
from clients.spares import SparePool
from lab import kubevalidate
from lab.kubeapi import node_object
from lab.slurm import SlurmLab, SlurmLabSpec
from models.constants import CLAIM_LABEL, CLAIMED_BY_ANNOTATION, INCIDENT_ANNOTATION, claim_label_value
from models.incident import Outcome, Step
from models.policy import Action, GuardSettings, Policy, RemediationSettings, RepairSettings
from models.requests import ClassifyRequest, NotifyRequest, WorkerConfig
from models.xid import XidEvent
from starters.temporal import report_xid
from tests.conftest import REPO, KubeApiProcess, _require_slurm
from tests.workflows.test_remediation import Fleet, worker

pytestmark = pytest.mark.slurm

LONGEST_LABEL = "gpu-" + "n" * 55 + "0001"  # 63 characters, the most a DNS label holds
BARE_METAL = "gpu-node-0001.rack12.row03.dc1.example.com"  # with its cluster and time, over 63
CLOUD_SPARE = "ip-10-0-12-34.us-west-2.compute.internal"
STAND_IN = [sys.executable, "-m", "lab.repair"]
LAB_REPAIRS = RepairSettings(
    reset_command=[*STAND_IN, "reset", "--gpu", "{gpu}", "--node", "{node}"],
    reboot_command=[*STAND_IN, "reboot", "--node", "{node}", "--boot-id", "{boot_id}"],
    check_command=[*STAND_IN, "check", "--gpu", "{gpu}", "--node", "{node}"],
    node_check_command=[*STAND_IN, "check", "--node", "{node}"],
    job_timeout_seconds=60,
)


@dataclass
class Lab:
    slurm: SlurmLab
    api: KubeApiProcess


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    _require_slurm()
    root = tmp_path_factory.mktemp("names")
    slurm = SlurmLab(root / "slurm", SlurmLabSpec(nodes=[LONGEST_LABEL, BARE_METAL], spares=[CLOUD_SPARE]))
    slurm.start()
    seed: dict[str, object] = {
        "nodes": [
            node_object(LONGEST_LABEL, pool="training"),
            node_object(BARE_METAL, pool="training"),
            node_object(CLOUD_SPARE, pool="spare"),
        ]
    }
    api = KubeApiProcess(root / "kube", seed)
    # The lab's Job runner stands for the kubelet: it runs each repair Job's command.
    ready = root / "jobrunner.ready"
    runner = subprocess.Popen(
        [sys.executable, "-m", "lab.jobrunner", "--api", api.url, "--ready-file", str(ready)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "GPUFLEET_HOME": str(root / "home")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert runner.poll() is None and time.monotonic() < deadline, "the Job runner did not start"
        time.sleep(0.05)
    try:
        yield Lab(slurm, api)
    finally:
        runner.terminate()
        runner.wait(timeout=10)
        api.stop()
        slurm.stop()


def activities(lab: Lab, fleet: Fleet) -> list[Any]:
    """The worker's activities on the lab's Slurm and Kubernetes; the configuration, the
    classification and the webhook as the other workflow tests stand them in."""
    kube = KubernetesApi(kubeconfig=lab.api.kubeconfig, poll_seconds=0.05)
    slurm = lab.slurm.client()
    pool = SparePool(kube=kube, slurm=slurm, partition="train", cluster=fleet.cluster, namespace="gpufleet")
    slurm_acts = SlurmActivities(slurm, poll_seconds=0.05)
    kube_acts = KubeActivities(kube)
    spare_acts = SpareActivities(pool)
    repair_acts = RepairActivities(kube, poll_seconds=0.05)
    guard = GuardActivities(slurm, cluster=fleet.cluster, partition="train")
    policy = Policy(repair=LAB_REPAIRS, guard=GuardSettings(max_in_flight=10, max_share=0))

    @activity.defn(name="worker_config")
    async def worker_config(cluster: str) -> WorkerConfig:
        return WorkerConfig(cluster=cluster, settings=RemediationSettings(grace_seconds=5), policy=policy)

    @activity.defn(name="classify_xids")
    async def classify(request: ClassifyRequest) -> Action:
        return (request.policy or policy).decide(request.events)

    @activity.defn(name="notify")
    async def notify(request: NotifyRequest) -> int:
        fleet.notifications.append(request)
        return 1

    return [
        worker_config,
        classify,
        notify,
        slurm_acts.node_state,
        slurm_acts.drain_node,
        slurm_acts.jobs_on_node,
        slurm_acts.jobs_hit,
        slurm_acts.signal_job,
        slurm_acts.still_running,
        slurm_acts.requeue_job,
        slurm_acts.jobs_resumed,
        slurm_acts.resume_node,
        kube_acts.node_facts,
        kube_acts.cordon_and_drain,
        kube_acts.take_node_lease,
        kube_acts.give_back_node_lease,
        spare_acts.claim_spare,
        spare_acts.release_spare,
        spare_acts.retire_node,
        spare_acts.quarantine_node,
        repair_acts.repair,
        repair_acts.start_reboot,
        guard.request_slot,
        guard.drained,
        guard.answer,
        guard.tell,
        guard.fleet_size,
        guard.running,
    ]


def fits(value: str) -> bool:
    return kubevalidate.label_value(value) == []


async def test_a_node_with_a_63_character_name_is_replaced_by_a_spare_with_a_fully_qualified_name(
    env: WorkflowEnvironment, lab: Lab
) -> None:
    fleet = Fleet()
    kube = KubernetesApi(kubeconfig=lab.api.kubeconfig)
    with ThreadPoolExecutor(8) as pool:
        async with worker(env, fleet, activities=activities(lab, fleet), activity_executor=pool):
            event = XidEvent(node=LONGEST_LABEL, xid=79, source="test")
            handle = await report_xid(env.client, event, cluster=fleet.cluster, search_attributes=False)
            status = await handle.result()
    assert status.outcome == Outcome.RESOLVED, status.error
    assert status.action == Action.REPLACE_NODE and status.spare == CLOUD_SPARE
    incident = status.incident_id
    assert len(incident) > 63  # too long for a label value: what is written must be shortened
    node = kube.get_node(LONGEST_LABEL)
    assert node.unschedulable and node.annotations[INCIDENT_ANNOTATION] == incident  # the whole ID
    assert {t["key"] for t in node.taints} >= {"gpufleet.io/unhealthy", "gpufleet.io/retired"}
    assert all(fits(t["value"]) for t in node.taints)
    assert all(t["value"].startswith(incident[:20]) for t in node.taints if t["key"].startswith("gpufleet.io/"))
    spare = kube.get_node(CLOUD_SPARE)
    assert spare.annotations[CLAIMED_BY_ANNOTATION] == incident
    assert spare.labels[CLAIM_LABEL] == claim_label_value(incident)
    assert CLOUD_SPARE in lab.slurm.scontrol("show", "partition", "train")
    assert "DRAIN" in lab.slurm.scontrol("show", "node", LONGEST_LABEL)


async def test_a_node_with_a_fully_qualified_name_is_reset_in_place_by_a_job(
    env: WorkflowEnvironment, lab: Lab
) -> None:
    fleet = Fleet()
    kube = KubernetesApi(kubeconfig=lab.api.kubeconfig)
    with ThreadPoolExecutor(8) as pool:
        async with worker(env, fleet, activities=activities(lab, fleet), activity_executor=pool):
            event = XidEvent(node=BARE_METAL, xid=48, gpu_uuid="GPU-1", source="test")
            handle = await report_xid(env.client, event, cluster=fleet.cluster, search_attributes=False)
            status = await handle.result()
    assert status.outcome == Outcome.RESOLVED, status.error
    assert status.action == Action.RESET_GPU
    [done] = [e.detail for e in status.timeline if e.step == Step.REPAIR and e.event == "finished"]
    job = re.search(r"Job (\S+)", done)
    assert job is not None, done
    name = job.group(1).rstrip(":;,")
    # A Job's name is its pods' job-name label too: a DNS-1123 name of at most 63 characters.
    assert kubevalidate.dns1123_subdomain(name) == [] and fits(name)
    assert kube.job_state("gpufleet", name).succeeded
    node = kube.get_node(BARE_METAL)  # back in service in Kubernetes: nothing of the incident left on it
    assert not node.unschedulable and INCIDENT_ANNOTATION not in node.annotations
    assert not [t for t in node.taints if t["key"] == "gpufleet.io/unhealthy"]
    assert "State=IDLE" in lab.slurm.scontrol("show", "node", BARE_METAL)  # back in service in Slurm
