"""The gpufleet worker: every activity and workflow on task queue ``gpufleet``."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from activities.kube import KubeActivities
from activities.notify import NotifyActivities
from activities.policy import PolicyActivities
from activities.slurm import SlurmActivities
from activities.spares import SpareActivities
from clients.kube import KubernetesApi
from clients.notify import WebhookNotifier
from clients.slurm import SlurmCli
from clients.spares import SparePool
from models.constants import TASK_QUEUE
from models.policy import load_policy
from models.settings import Settings
from workflows.remediation import NodeRemediationWorkflow

log = logging.getLogger("gpufleet.worker")


def build_activities(settings: Settings) -> list[Any]:
    """Every activity, bound to clients built from the settings."""
    slurm = SlurmCli(
        slurm_conf=settings.slurm_conf,
        bin_dir=settings.slurm_bin_dir,
        timeout_seconds=settings.slurm_timeout_seconds,
    )
    kube = KubernetesApi(kubeconfig=settings.kubeconfig, poll_seconds=settings.poll_seconds)
    pool = SparePool(kube=kube, slurm=slurm, partition=settings.partition)
    slurm_acts = SlurmActivities(slurm, poll_seconds=settings.poll_seconds)
    kube_acts = KubeActivities(kube, eviction_timeout_seconds=settings.eviction_timeout_seconds)
    spare_acts = SpareActivities(pool)
    notify_acts = NotifyActivities(WebhookNotifier(url=settings.webhook_url))
    policy_acts = PolicyActivities(load_policy(settings.policy_file))
    return [
        slurm_acts.node_state,
        slurm_acts.drain_node,
        slurm_acts.jobs_on_node,
        slurm_acts.signal_jobs,
        slurm_acts.still_running,
        slurm_acts.requeue_jobs,
        slurm_acts.wait_jobs_resumed,
        kube_acts.cordon_and_drain,
        spare_acts.claim_spare,
        spare_acts.retire_node,
        notify_acts.notify,
        policy_acts.classify,
    ]


async def run_worker(client: Client, settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or forever)."""
    activities = build_activities(settings)
    with ThreadPoolExecutor(max_workers=64, thread_name_prefix="activity") as executor:
        worker = Worker(
            client,
            task_queue=TASK_QUEUE,
            workflows=[NodeRemediationWorkflow],
            activities=activities,
            activity_executor=executor,
            max_concurrent_activities=64,
        )
        log.info("worker on task queue %s (cluster %s, partition %s)", TASK_QUEUE, settings.cluster, settings.partition)
        if stop is None:
            await worker.run()
            return
        async with worker:
            await stop.wait()
