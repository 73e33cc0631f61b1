"""The reaper gives back what a terminated incident held: the jobs it signalled are requeued, its
repair Job is stopped, its spare claim released and its node's lease let go; a running incident's
lease and a pool move's are left alone, and a second sweep finds nothing more. On the time-skipping
server, with the real reaper, lease, claim and repair activities against the emulated Kubernetes
API (Slurm's requeue and the notifications are the incident tests' stand-ins)."""

from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.kube import KubeActivities
from activities.reaper import ReaperActivities, incident_node
from activities.repair import RepairActivities, repair_job
from activities.spares import SpareActivities
from clients.kube import KubernetesApi
from clients.spares import SparePool
from models.constants import CLAIMED_BY_ANNOTATION, NODE_LEASE_ANNOTATION, POOL_LABEL, VERDICT_ANNOTATION
from models.incident import IncidentStatus
from models.policy import Action
from models.requests import ReaperInput, ReaperStatus, RepairRequest, RequeueJobRequest
from tests.conftest import KubeApiProcess
from tests.workflows.test_cancel import checking_in_grace, in_grace, without
from tests.workflows.test_guard import guard, running, until
from tests.workflows.test_remediation import Fleet, start
from workflows.reaper import ReaperWorkflow
from workflows.remediation import NodeRemediationWorkflow


def test_an_incident_id_names_its_node_only_for_its_own_cluster() -> None:
    assert incident_node("lab", "lab-gpu1-20261205T054018Z") == "gpu1"
    assert incident_node("lab", "lab-ip-10-0-1-2.ec2.internal-20261205T054018Z") == "ip-10-0-1-2.ec2.internal"
    assert incident_node("lab", "dryrun-lab-gpu1-20261205T054018Z") is None
    assert incident_node("lab", "other-gpu1-20261205T054018Z") is None
    assert incident_node("lab", "pool-train-move-3") is None


async def test_the_reaper_gives_back_what_a_terminated_incident_held(
    env: WorkflowEnvironment, kube_api: KubeApiProcess
) -> None:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig, poll_seconds=0.05)
    fleet = Fleet(nodes={"gpu1", "gpu2"})
    pool = SparePool(kube=kube, slurm=None, partition="train", cluster=fleet.cluster, namespace="gpufleet")  # type: ignore[arg-type]
    real = [
        ReaperActivities(kube, cluster=fleet.cluster).find_leftovers,
        RepairActivities(kube).stop_repairs,
        SpareActivities(pool).release_spare,
        KubeActivities(kube).give_back_node_lease,
    ]
    acts = checking_in_grace(fleet)
    for name in ("release_spare", "give_back_node_lease"):
        acts = without(acts, name)
    acts = [*acts, *real]
    reaper_queue = f"reaper-{uuid.uuid4().hex[:8]}"
    threads = ThreadPoolExecutor(max_workers=8)
    async with (
        running(env, fleet, manual_clock=True, activities=acts, activity_executor=threads),
        Worker(
            env.client, task_queue=reaper_queue, workflows=[ReaperWorkflow], activities=acts, activity_executor=threads
        ),
    ):
        dead = await start(env.client, fleet, node="gpu1")
        alive = await start(env.client, fleet, node="gpu2")
        gone: IncidentStatus = await until(dead, NodeRemediationWorkflow.status, in_grace, "gpu1 in its grace")
        living: IncidentStatus = await until(alive, NodeRemediationWorkflow.status, in_grace, "gpu2 in its grace")
        # What the real activities would have written for them (the stand-ins keep it in memory).
        kube.update_metadata("gpu1", annotations={NODE_LEASE_ANNOTATION: gone.incident_id})
        kube.update_metadata("gpu2", annotations={NODE_LEASE_ANNOTATION: living.incident_id})
        kube.update_metadata("gpu3", annotations={NODE_LEASE_ANNOTATION: "pool-train-move-1"})
        kube.update_metadata("spare1", annotations={CLAIMED_BY_ANNOTATION: gone.incident_id})
        # Another spare it had claimed and brought into service (training): it serves, and stays.
        kube.update_metadata(
            "spare2", labels={POOL_LABEL: "training"}, annotations={CLAIMED_BY_ANNOTATION: gone.incident_id}
        )
        job = repair_job(RepairRequest(node="gpu1", action=Action.REBOOT_NODE, incident_id=gone.incident_id), "reboot")
        kube.create_job("gpufleet", job)
        await dead.terminate("by hand, in the Temporal UI")

        reaper: WorkflowHandle[ReaperWorkflow, None] = await env.client.start_workflow(
            ReaperWorkflow.run,
            ReaperInput(cluster=fleet.cluster),
            id=f"reaper-{fleet.cluster}",
            task_queue=reaper_queue,
        )
        swept: ReaperStatus = await until(reaper, ReaperWorkflow.status, lambda s: s.sweeps >= 1, "a sweep")
        await reaper.signal(ReaperWorkflow.sweep)
        again: ReaperStatus = await until(reaper, ReaperWorkflow.status, lambda s: s.sweeps >= 2, "a second sweep")
        await reaper.terminate("test over")
        await alive.terminate("test over")
        with contextlib.suppress(Exception):
            await guard(env.client, fleet).terminate("test over")

    assert len(swept.reaped) == 1, swept.reaped
    assert swept.reaped[0].startswith(f"{gone.incident_id} (terminated): job 7 requeued; repair Job(s) ")
    assert again.reaped == swept.reaped  # nothing more to give back
    # The job the incident sent SIGTERM is requeued, as signalled, guarded by its restart count.
    requeues = [w for w in fleet.writes if isinstance(w, RequeueJobRequest)]
    assert [(r.job_id, r.signalled, r.incident_id) for r in requeues] == [(7, True, gone.incident_id)]
    gpu1, gpu2, gpu3, spare1 = (kube.get_node(n) for n in ("gpu1", "gpu2", "gpu3", "spare1"))
    assert NODE_LEASE_ANNOTATION not in gpu1.annotations
    assert gpu2.annotations[NODE_LEASE_ANNOTATION] == living.incident_id  # its incident runs
    assert gpu3.annotations[NODE_LEASE_ANNOTATION] == "pool-train-move-1"  # a pool move's
    assert CLAIMED_BY_ANNOTATION not in spare1.annotations and spare1.labels[POOL_LABEL] == "spare"
    spare2 = kube.get_node("spare2")
    assert spare2.labels[POOL_LABEL] == "training" and spare2.annotations[CLAIMED_BY_ANNOTATION] == gone.incident_id
    stopped = kube.job_annotations("gpufleet", job["metadata"]["name"])
    assert stopped[VERDICT_ANNOTATION] == f"stopped: incident {gone.incident_id} terminated"
    told = [n.text for n in fleet.notifications if n.kind == "incident_reaped"]
    assert len(told) == 1 and "gpu1 stays as the incident left it" in told[0]
