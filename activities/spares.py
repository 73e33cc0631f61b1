"""Node provider steps: claim a spare, release an unused claim, retire the failed node, return a repaired one."""

from __future__ import annotations

from temporalio import activity

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.dryrun import dry_run
from clients.spares import NodeProvider
from models.constants import QUARANTINE_LABEL, QUARANTINE_REASON_ANNOTATION
from models.requests import ClaimRequest, QuarantinedNode, QuarantineRequest, RetireRequest, ReturnNodeRequest

# Spare steps run to their end even when their incident is cancelled (the workflow waits for
# them): a claim or partition edit cut off half-way could leave a Lease or a claim behind.


class SpareActivities:
    def __init__(self, provider: NodeProvider) -> None:
        self._provider = provider

    @activity.defn(name="claim_spare")
    @heartbeating
    def claim_spare(self, request: ClaimRequest) -> str | None:
        """The spare claimed for this incident (the same one on every retry), or None if none is free.
        A dry run answers with the spare a claim would take, claiming nothing. SpareLost (not
        retried; only when the request asks): the claimed spare could not come in and was released."""
        with activity.shield_thread_cancel_exception(), client_errors(), dry_run(request.dry_run):
            if request.dry_run:
                return self._provider.candidate()
            # A retry may follow an attempt that claimed before it died: look wide for that claim.
            retry = activity.info().attempt > 1
            return self._provider.claim(
                request.incident_id,
                partitions=request.partitions,
                retry=retry,
                pool=request.pool,
                report_lost=request.report_lost,
                node=request.node,
            )

    @activity.defn(name="release_spare")
    @heartbeating
    def release_spare(self, request: ClaimRequest) -> str | None:
        """Give back the spare this incident claimed and did not use (None: it holds none)."""
        with activity.shield_thread_cancel_exception(), client_errors():
            return self._provider.release(request.incident_id, unused_only=request.unused_only)

    @activity.defn(name="retire_node")
    @heartbeating
    def retire_node(self, request: RetireRequest) -> None:
        """Out of the partition; the Node kept cordoned, tainted gpufleet.io/retired and labelled retired.
        A dry run does nothing."""
        if request.dry_run:
            return
        with activity.shield_thread_cancel_exception(), client_errors():
            self._provider.retire(request.node, request.incident_id)

    @activity.defn(name="return_node")
    @heartbeating
    def return_node(self, request: ReturnNodeRequest) -> None:
        """Bring a repaired node back as a spare or for training (NotOwned: someone else holds it in Slurm)."""
        with activity.shield_thread_cancel_exception(), client_errors():
            self._provider.return_node(request.node, as_=request.as_)

    @activity.defn(name="quarantine_node")
    @heartbeating
    def quarantine_node(self, request: QuarantineRequest) -> None:
        """Label the node quarantined (never a spare, not returned until released)."""
        with activity.shield_thread_cancel_exception(), client_errors():
            self._provider.quarantine(
                request.node, code=request.code, reason=request.reason, incident_id=request.incident_id
            )

    @activity.defn(name="quarantined_nodes")
    @heartbeating
    def quarantined_nodes(self) -> list[QuarantinedNode]:
        with client_errors():
            return [
                QuarantinedNode(
                    node=node.name,
                    code=node.labels.get(QUARANTINE_LABEL, ""),
                    reason=node.annotations.get(QUARANTINE_REASON_ANNOTATION, ""),
                )
                for node in self._provider.quarantined()
            ]

    @activity.defn(name="release_quarantine")
    @heartbeating
    def release_quarantine(self, node: str) -> bool:
        """Take the quarantine off (False: it had none)."""
        with activity.shield_thread_cancel_exception(), client_errors():
            return self._provider.release_quarantine(node)
