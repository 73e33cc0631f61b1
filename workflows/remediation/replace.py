"""Replacing the node: the failed node is cordoned, drained and retired side by side with a
spare's claim, and the jobs may run again as soon as the spare is in, whatever the retirement
still does. A long wait for a spare continues as new, so the history stays small."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from workflows.patches import SPARE_CLAIMS_CHECKED
from workflows.remediation.close import Closing
from workflows.remediation.jobs import Jobs
from workflows.retries import KUBE_DRAIN_STEP, SPARE_STEP

with workflow.unsafe.imports_passed_through():
    from activities.kube import KubeActivities
    from activities.spares import SpareActivities
    from models.constants import POOL_INFERENCE
    from models.incident import CarriedIncident, RemediationInput, Step
    from models.policy import InferenceSpare, Policy, RemediationSettings
    from models.requests import ClaimRequest, KubeDrainRequest, RetireRequest

# Spare checks per run before continuing as new (about ten history events each).
SPARE_CHECKS_PER_RUN = 30
# ... or sooner, when a run with many jobs has a long history already.
HISTORY_SOFT_LIMIT = 400
# Claimed spares lost one after another (each drained by someone else before it came in) before
# the incident waits as for no free spare, instead of claiming again at once.
LOST_SPARES_BEFORE_WAITING = 3


class _ContinueAsNew(Exception):
    """Raised inside the spare wait; the run continues as new once the other branch is done."""


class Replacement(Closing, Jobs):
    """The failed node retired side by side with a spare's claim."""

    async def _side_by_side(self, *branches: Any) -> None:
        """Run the branches together; when one fails, cancel the others and wait for them to stop."""
        tasks = [asyncio.create_task(branch) for branch in branches]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            raise

    async def _continue_carried(self, params: RemediationInput) -> None:
        """A run continued as new while waiting for a spare: the retirement is done, wait on."""
        self._retire_finished = True
        self._events_classified = self._input.carried.classified if self._input.carried else len(self._events)
        self._settings = self._status.settings or RemediationSettings()
        self._mark(Step.WAIT_FOR_SPARE, "continued", "history continued as new")
        await self._replace_and_resume(params)
        await self._close_resolved(params)

    async def _close_resolved(self, params: RemediationInput) -> None:
        status = self._status
        jobs = self._resolved()
        if self._dry_run:
            self._mark(Step.RESUME, "dry run", "resolved as planned; nothing was changed")
        replaced = f"replaced by {status.spare}" if status.spare is not None else "retired, not replaced by a spare"
        self._notify(
            str(status.outcome), f"{self._message_prefix()}: {status.outcome}. {params.node} {replaced}; {jobs}."
        )
        await self._close()

    async def _retire(self, params: RemediationInput) -> None:
        self._enter(Step.DRAIN_KUBERNETES)
        try:
            drained = await self._activity(
                KubeActivities.cordon_and_drain,
                KubeDrainRequest(
                    node=params.node,
                    incident_id=self._status.incident_id,
                    eviction_timeout_seconds=self._settings.eviction_timeout_seconds,
                    dry_run=self._dry_run,
                ),
                summary=f"cordon and drain {params.node} in Kubernetes",
                timeout=KUBE_DRAIN_STEP,
            )
        except ActivityError as exc:
            # The spare's claim, beside it, entered its step last: the incident fails at the drain
            # (unless the drain was only cancelled because the claim failed first).
            if not isinstance(exc.cause, CancelledError):
                self._status.step = Step.DRAIN_KUBERNETES
            raise
        self._done(
            Step.DRAIN_KUBERNETES,
            "no Kubernetes node"
            if not drained.node_found
            else f"evicted {len(drained.evicted)}, forced {len(drained.forced)}",
        )
        self._enter(Step.RETIRE_NODE)
        await self._activity(
            SpareActivities.retire_node,
            RetireRequest(node=params.node, incident_id=self._status.incident_id, dry_run=self._dry_run),
            summary=f"retire {params.node}",
            timeout=SPARE_STEP,
        )
        self._done(Step.RETIRE_NODE, "cordoned, tainted and kept")
        # Given back before the spare branch may continue as new (it waits for _retire_finished).
        await self._end_slot("the node is retired")
        self._retire_finished = True

    async def _replace_and_resume(self, params: RemediationInput) -> None:
        try:
            await self._bring_in_spare(params)
        except _ContinueAsNew:
            await workflow.wait_condition(lambda: self._retire_finished)
            await self._flush_notifications()
            workflow.continue_as_new(
                RemediationInput(
                    cluster=params.cluster,
                    node=params.node,
                    search_attributes=params.search_attributes,
                    dry_run=self._dry_run,
                    carried=CarriedIncident(
                        status=self._status,
                        events=self._events,
                        restarts_before=self._restarts_before,
                        classified=self._events_classified,
                    ),
                )
            )
        self._enter(Step.RESUME)
        requeued = self._status.requeued
        if not requeued:
            self._done(Step.RESUME, "no jobs to resume")
            return
        if self._dry_run:
            self._done(Step.RESUME, f"dry run: would wait for job(s) {', '.join(map(str, requeued))} to run again")
            return
        resumed = await self._wait_resumed(requeued)
        self._status.jobs = resumed
        self._done(Step.RESUME, ", ".join(f"{job.job_id} on {job.nodes}" for job in resumed))

    def _spare_lost(self, exc: ActivityError) -> str | None:
        """What a claim that failed with SpareLost says (which spare, why), else None."""
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == "SpareLost":
            return cause.message
        return None

    async def _bring_in_spare(self, params: RemediationInput) -> None:
        status = self._status
        # From v0.3.0 (patch spare-claims-checked): a lost spare is said, and an inference
        # node's replacement serves inference (or there is none), never training.
        checked = workflow.patched(SPARE_CLAIMS_CHECKED)
        for_inference = checked and status.pool == POOL_INFERENCE
        if for_inference and (self._policy or Policy()).spares.inference is InferenceSpare.NONE:
            self._enter(Step.CLAIM_SPARE)
            self._done(
                Step.CLAIM_SPARE,
                "none claimed: an inference node is not replaced by a spare (policy spares.inference: none)",
            )
            return
        self._enter(Step.WAIT_FOR_SPARE if status.waiting_for_spare else Step.CLAIM_SPARE)
        checks = 0
        lost = 0
        while True:
            # Cleared before the claim, so a spare_available that arrives during it is not lost.
            self._spare_signalled = False
            self._claim_attempted = True
            try:
                spare: str | None = await self._activity(
                    SpareActivities.claim_spare,
                    ClaimRequest(
                        incident_id=status.incident_id,
                        dry_run=self._dry_run,
                        partitions=status.partitions,
                        pool=POOL_INFERENCE if for_inference else "training",
                        report_lost=checked,
                        node=params.node,
                    ),
                    summary="claim a spare for inference" if for_inference else "claim a spare",
                    on_result=lambda claimed: setattr(status, "spare", claimed),
                    timeout=SPARE_STEP,
                )
            except ActivityError as exc:
                why = self._spare_lost(exc) if checked else None
                if why is None:
                    raise
                # Drained by someone else (an Xid on the spare: its own incident) before it came
                # in: theirs. Its claim is released; the next free spare is claimed, or waited for.
                lost += 1
                self._mark(Step.CLAIM_SPARE, "spare lost", why)
                if lost < LOST_SPARES_BEFORE_WAITING:
                    continue
                lost, spare = 0, None
            if spare is not None:
                break
            if self._dry_run:
                self._done(Step.CLAIM_SPARE, "dry run: no free spare; would wait for one")
                return
            if for_inference:
                # Inference is not queued behind a spare: the shared pool makes up its capacity.
                self._done(Step.CLAIM_SPARE, "no free spare; inference's capacity is left to the shared pool")
                return
            if not status.waiting_for_spare:
                status.waiting_for_spare = True
                self._mark(Step.WAIT_FOR_SPARE, "started", "no free spare")
                self._notify(
                    "no_spare",
                    f"{self._message_prefix()}: no free spare. {params.node} stays drained and its jobs are queued; "
                    "gpufleet takes the next spare that appears (signal spare_available to hurry it).",
                )
            checks += 1
            info = workflow.info()
            if self._retire_finished and (
                checks >= SPARE_CHECKS_PER_RUN
                or info.get_current_history_length() > HISTORY_SOFT_LIMIT
                or info.is_continue_as_new_suggested()
            ):
                raise _ContinueAsNew
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._spare_signalled, timeout=timedelta(seconds=self._settings.spare_recheck_seconds)
                )
        status.spare = spare
        status.waiting_for_spare = False
        joined = "the inference pool" if for_inference else "the partition"
        self._done(Step.CLAIM_SPARE, f"dry run: would claim {spare}" if self._dry_run else f"{spare} joined {joined}")
