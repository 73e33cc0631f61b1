"""How an incident ends, whichever way: a lemon quarantined, the guard's slot and the node's lease
given back, an unused spare released, the last messages out, and Xids that came too late for
this incident carried into the node's next one."""

from __future__ import annotations

import contextlib

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.remediation.notify import Notifications
from workflows.remediation.slot import GuardSlot
from workflows.retries import SPARE_STEP

with workflow.unsafe.imports_passed_through():
    from activities.kube import KubeActivities
    from activities.spares import SpareActivities
    from models.constants import QUARANTINE_LABEL
    from models.incident import Outcome, RemediationInput, Step
    from models.requests import ClaimRequest, NodeLeaseRequest, QuarantineRequest


class Closing(GuardSlot, Notifications):
    """How the incident ends, whichever way it ends."""

    async def _record_only(self, outcome: Outcome, kind: str, text: str) -> None:
        """Close without touching the node: the outcome, one message to the owner, the close."""
        self._status.outcome = outcome
        self._notify(kind, f"{self._message_prefix()}: {text}")
        await self._close()

    async def _close(self) -> None:
        await self._quarantine()
        await self._release_slot(self._status.outcome.value)
        await self._give_back_node()
        self._enter(Step.CLOSED)
        self._mark(Step.CLOSED, self._status.outcome.value)
        self._count_closed()
        await self._flush_notifications()
        late = self._events[self._events_classified :]
        if late and self._events_classified:
            # Xids that arrived after the last classification (while messages were still going
            # out) would be lost with this run: they open the node's next incident instead.
            workflow.continue_as_new(
                RemediationInput(
                    cluster=self._input.cluster,
                    node=self._input.node,
                    search_attributes=self._input.search_attributes,
                    pending_events=late,
                    dry_run=self._dry_run,
                )
            )

    async def _quarantine(self) -> None:
        """A lemon this incident took out of service stays out: labelled quarantined."""
        status = self._status
        if not (status.quarantine_label and self._took_node_out) or status.quarantined:
            return
        await self._activity(
            SpareActivities.quarantine_node,
            QuarantineRequest(
                node=self._input.node,
                code=status.quarantine_label,
                reason=status.quarantine,
                incident_id=status.incident_id,
            ),
            summary=f"quarantine {self._input.node}",
            timeout=SPARE_STEP,
        )
        status.quarantined = True
        self._mark(status.step, "quarantined", f"{QUARANTINE_LABEL}={status.quarantine_label}: {status.quarantine}")
        self._notify(
            "quarantined",
            f"{self._message_prefix()}: {self._input.node} is quarantined ({status.quarantine}): never a spare, and "
            f"`gpufleet nodes return` refuses it until `gpufleet nodes release {self._input.node}`.",
        )

    async def _give_back_node(self) -> None:
        """Let go of the node's lease: nothing of this incident changes it any more (a retired or
        quarantined node stays out of every pool by its labels, not by the lease)."""
        if not self._status.node_leased:
            return
        with contextlib.suppress(ActivityError):
            await self._activity(
                KubeActivities.give_back_node_lease,
                NodeLeaseRequest(node=self._input.node, holder=self._status.incident_id),
                summary=f"let go of {self._input.node}",
            )
            self._status.node_leased = False

    async def _release_unused_claim(self) -> None:
        """A spare claimed but never brought into service goes back to the pool."""
        if self._status.spare is not None or not self._claim_attempted or self._dry_run:
            return
        with contextlib.suppress(ActivityError):
            released = await self._activity(
                SpareActivities.release_spare,
                ClaimRequest(incident_id=self._status.incident_id),
                summary="release an unused spare claim",
                timeout=SPARE_STEP,
            )
            if released:
                self._mark(self._status.step, "released", f"claim on {released} released")
