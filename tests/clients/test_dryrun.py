"""The dry-run switch, over real Slurm and the emulated Kubernetes API.

Every activity that changes the fleet, asked for a dry run, answers what it would do and
leaves Slurm and Kubernetes exactly as they were (every object's resourceVersion, every
node's Slurm state and reason); and a write that slipped past an activity is refused by the
client itself.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.kube import KubeActivities
from activities.slurm import SlurmActivities
from activities.spares import SpareActivities
from clients.dryrun import DryRunViolation, dry_run
from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from clients.spares import SparePool
from lab.slurm import SlurmLab
from models.requests import (
    ClaimRequest,
    DrainRequest,
    KubeDrainRequest,
    RequeueJobRequest,
    RetireRequest,
    SignalJobRequest,
)
from tests.conftest import KubeApiProcess

pytestmark = pytest.mark.slurm


def kube_objects(api: KubeApiProcess) -> dict[str, Any]:
    """Every Node and Pod with its resourceVersion, as the API serves them."""
    found = {}
    for path in ("/api/v1/nodes", "/api/v1/pods"):
        with urllib.request.urlopen(api.url + path, timeout=10) as response:
            for item in json.load(response)["items"]:
                meta = item["metadata"]
                found[f"{path}/{meta.get('namespace', '')}/{meta['name']}"] = meta["resourceVersion"]
    return found


def slurm_nodes(slurm_lab: SlurmLab) -> str:
    done = subprocess.run(
        ["scontrol", "show", "-o", "node"], env=slurm_lab.env, capture_output=True, text=True, check=True
    )
    # What a drain, a resume or a partition edit would change (not the load or the clock).
    keep = ("NodeName=", "State=", "Reason=", "Partitions=")
    return "\n".join(" ".join(f for f in line.split() if f.startswith(keep)) for line in done.stdout.splitlines())


def test_every_fleet_changing_activity_changes_nothing_in_a_dry_run(
    slurm_lab: SlurmLab, kube_api: KubeApiProcess
) -> None:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    slurm = SlurmCli(slurm_conf=slurm_lab.conf)
    spares = SpareActivities(SparePool(kube=kube, slurm=slurm, partition="train", cluster="lab"))
    slurm_acts, kube_acts = SlurmActivities(slurm), KubeActivities(kube)
    before_kube, before_slurm = kube_objects(kube_api), slurm_nodes(slurm_lab)
    env = ActivityEnvironment()
    incident = "dryrun-lab-gpu1-20261203T000000Z"

    drained = env.run(slurm_acts.drain_node, DrainRequest(node="gpu1", reason="gpufleet: dry", dry_run=True))
    assert drained.drained and drained.reason == "gpufleet: dry"  # as the drain would leave it
    signalled = env.run(
        slurm_acts.signal_job, SignalJobRequest(job_id=999999, restarts_before=0, incident_id=incident, dry_run=True)
    )
    assert not signalled.signalled  # no such job: nothing to signal, said so
    requeued = env.run(
        slurm_acts.requeue_job,
        RequeueJobRequest(job_id=999999, restarts_before=0, signalled=True, incident_id=incident, dry_run=True),
    )
    assert requeued.outcome.value == "failed" and "no longer knows" in requeued.why
    evicted = env.run(kube_acts.cordon_and_drain, KubeDrainRequest(node="gpu1", incident_id=incident, dry_run=True))
    assert evicted.node_found
    assert env.run(spares.claim_spare, ClaimRequest(incident_id=incident, dry_run=True)) == "spare1"
    env.run(spares.retire_node, RetireRequest(node="gpu1", incident_id=incident, dry_run=True))

    assert kube_objects(kube_api) == before_kube
    assert slurm_nodes(slurm_lab) == before_slurm


def test_a_write_that_slips_through_is_refused_by_the_client(slurm_lab: SlurmLab, kube_api: KubeApiProcess) -> None:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    slurm = SlurmCli(slurm_conf=slurm_lab.conf)
    before_kube, before_slurm = kube_objects(kube_api), slurm_nodes(slurm_lab)
    with dry_run(True):
        assert kube.get_node("gpu1").name == "gpu1"  # reads go through
        assert slurm.node("gpu1").name == "gpu1"
        with pytest.raises(DryRunViolation, match="patch node gpu1"):
            kube.set_unschedulable("gpu1", True)
        with pytest.raises(DryRunViolation, match="scontrol update NodeName=gpu1 State=DRAIN"):
            slurm.drain("gpu1", reason="gpufleet: never")
        with pytest.raises(DryRunViolation, match="scancel"):
            slurm.signal_job(1)
    assert kube_objects(kube_api) == before_kube
    assert slurm_nodes(slurm_lab) == before_slurm
    kube.set_unschedulable("gpu1", False)  # off again: writes go through (a no-op here)
