"""The reaper's look at the cluster: what incidents that no longer run still hold.

An incident gives back its node's lease, its unused spare claim and its slot when it closes,
and stops its repair Job and requeues the jobs it signalled when it is cancelled. A workflow that
is terminated (by a person in the Temporal UI, say) runs none of that. What it held is found
here by the incident ID written on each thing: the lease annotation on its node, the claim
annotation on a spare, the incident annotation on a repair Job. An incident counts as no longer
running when its node's workflow is closed, gone, or runs another incident; when Temporal cannot
say, nothing of it is touched this time.
"""

from __future__ import annotations

import asyncio
import re

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import TemporalError
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import client_errors
from activities.heartbeat import heartbeats
from clients.kube import KubeClient, KubeNode
from models.constants import (
    CLAIMED_BY_ANNOTATION,
    CLUSTER_LABEL,
    INCIDENT_ANNOTATION,
    INCIDENT_STAMP,
    NODE_LEASE_ANNOTATION,
    POOL_LABEL,
    POOL_SPARE,
    REMEDIATION_WORKFLOW,
    REPAIR_LABEL,
    remediation_workflow_id,
)
from models.incident import IncidentStatus
from models.requests import Leftover, SignalledJob


def incident_node(cluster: str, incident_id: str) -> str | None:
    """The node an incident ID of ``cluster`` names (CLUSTER-NODE-STAMP); None for anything else
    (a pool move's lease, a dry run, another cluster's incident)."""
    found = re.fullmatch(rf"{re.escape(cluster)}-(?P<node>.+)-{INCIDENT_STAMP}", incident_id)
    return found.group("node") if found else None


class ReaperActivities:
    def __init__(self, kube: KubeClient, *, cluster: str) -> None:
        self._kube = kube
        self._cluster = cluster

    @activity.defn(name="reaper_find_leftovers")
    async def find_leftovers(self, repair_namespace: str) -> list[Leftover]:
        """What incidents of this cluster that no longer run still hold (read only)."""
        async with heartbeats():
            return await self._find(repair_namespace)

    async def _find(self, repair_namespace: str) -> list[Leftover]:
        with client_errors():
            nodes = await asyncio.to_thread(self._kube.list_nodes)
            jobs = await asyncio.to_thread(self._kube.list_jobs, repair_namespace, label_selector=REPAIR_LABEL)
        held: dict[str, Leftover] = {}

        def of(incident_id: str, node: str | None) -> Leftover | None:
            named = incident_node(self._cluster, incident_id)
            if named is None or (node is not None and named != node):
                return None
            return held.setdefault(incident_id, Leftover(incident_id=incident_id, node=named, ended=""))

        for node in nodes:
            lease = node.annotations.get(NODE_LEASE_ANNOTATION, "")
            if lease and (found := of(lease, node.name)) is not None:
                found.lease = True
            claimer = node.annotations.get(CLAIMED_BY_ANNOTATION, "")
            if claimer and self._unused_claim(node) and (found := of(claimer, None)) is not None:
                found.claim = node.name
        for job in jobs:
            incident_id = job.annotations.get(INCIDENT_ANNOTATION, "")
            if job.active and incident_id and (found := of(incident_id, job.node or None)) is not None:
                found.repair_jobs.append(job.name)
        checked = await asyncio.gather(*(self._ended(leftover) for leftover in held.values()), return_exceptions=True)
        leftovers: list[Leftover] = []
        for leftover, result in zip(held.values(), checked, strict=True):
            if isinstance(result, BaseException):
                activity.logger.warning("left alone this sweep: %s (%s)", leftover.incident_id, result)
            elif result is not None:
                leftovers.append(result)
        return leftovers

    def _unused_claim(self, node: KubeNode) -> bool:
        """A spare of this cluster claimed and not brought into service (still labelled a spare)."""
        return node.labels.get(POOL_LABEL) == POOL_SPARE and node.labels.get(CLUSTER_LABEL, self._cluster) == (
            self._cluster
        )

    async def _ended(self, leftover: Leftover) -> Leftover | None:
        """``leftover`` with how its incident ended and the jobs it left signalled; None while it
        runs, or when Temporal cannot say."""
        handle = activity.client().get_workflow_handle(remediation_workflow_id(self._cluster, leftover.node))
        try:
            described = await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                leftover.ended = "gone"  # past the namespace's retention: no status to read
                return leftover
            return None
        if described.workflow_type != REMEDIATION_WORKFLOW:
            return None
        try:
            status: IncidentStatus = await handle.query("status", result_type=IncidentStatus)
        except (TemporalError, RPCError) as exc:
            # Its status is what says which jobs it left signalled: without it, nothing is touched.
            activity.logger.warning("%s: its status could not be read (%s); left alone", leftover.incident_id, exc)
            return None
        running = described.status == WorkflowExecutionStatus.RUNNING
        if running and status.incident_id == leftover.incident_id:
            return None  # its own incident runs: it holds what it holds
        if status.incident_id == leftover.incident_id:
            if status.spare and status.spare == leftover.claim:
                leftover.claim = ""  # brought into service by the incident: the spare serves now
            done = {*status.requeued, *status.unrequeued, *status.skipped}
            restarts = {job.job_id: job.restarts for job in status.jobs}
            leftover.requeue = [
                SignalledJob(job_id=job_id, restarts_before=restarts.get(job_id, 0))
                for job_id in status.signalled
                if job_id not in done
            ]
        ended = described.status.name.lower() if described.status and not running else "replaced"
        leftover.ended = ended.replace("_", " ")
        holds = leftover.lease or leftover.claim or leftover.repair_jobs or leftover.requeue
        return leftover if holds else None
