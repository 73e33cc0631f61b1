"""DRAIN_AFTER_JOBS: a soft failure (the GPU warns, the work on it goes on) drains the node and
lets its jobs finish, then validates, repairs or replaces it (policy ``drain_after_jobs``).

The drain is the usual one (gpufleet's reason, the guard told); nothing is signalled or requeued
but the jobs the failure already ended. The wait holds no guard slot: it lists the node's jobs
now and then on a timer that grows with a long wait (a few hundred looks at most, so the history
stays small), and wakes at once on a new event. An event that calls for more than
DRAIN_AFTER_JOBS ends the wait there: the jobs are checkpointed and requeued and the node
repaired or replaced as that action says. Past ``max_wait_seconds`` the node is REPLACE_NODE,
its jobs checkpointed and requeued as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from workflows.remediation.approvals import Approvals
from workflows.remediation.validate import Validation
from workflows.retries import SHORT_STEP

with workflow.unsafe.imports_passed_through():
    from activities.repair import RepairActivities
    from activities.slurm import ACTIVE_STATES, SlurmActivities
    from models.constants import held_by_someone_else
    from models.incident import JobInfo, NodeInfo, RemediationInput, Step
    from models.policy import Action, OwnerDrained
    from models.requests import RepairRequest, RepairResult


class DrainAfterJobs(Approvals, Validation):
    """The wait for the node's jobs, and what follows it."""

    if TYPE_CHECKING:

        async def _drain_in_slurm(self, params: RemediationInput) -> NodeInfo:
            """Drain in Slurm with this incident's reason for its action (flow.py)."""

        async def _approve_and_act(self, params: RemediationInput) -> None:
            """The action, approved where the policy says so: a repair, else the replacement (flow.py)."""

    async def _drain_after_jobs(self, params: RemediationInput, running: list[JobInfo]) -> None:
        """Once drained (and the jobs the failure ended requeued): wait for ``running`` to end,
        then the step after it; or, escalated meanwhile, the normal path at once."""
        status = self._status
        assert self._policy is not None
        ended = await self._wait_for_jobs(running)
        if not ended:
            # Escalated (a more severe event, or the wait ran out): the node's jobs are
            # checkpointed and requeued, then the node is repaired or replaced.
            if not await self._drain_again(params):  # its reason names the new action
                return
            if not await self._slot_for(Step.CHECKPOINT):
                return
            jobs = await self._checkpoint_jobs()
            await self._requeue_jobs(jobs)
            await self._end_slot("the node's jobs are requeued")
            await self._approve_and_act(params)
            return
        after = self._policy.drain_after_jobs.after_jobs(self._events)
        if after is None:
            self._enter(Step.APPROVE)
            status.action = self._raised_to_least_action(await self._classify())
            if status.action is not Action.DRAIN_AFTER_JOBS:  # an event since the wait, or the guard
                if await self._drain_again(params):
                    await self._approve_and_act(params)
                return
            if not await self._policy_gate():
                return
            self._done(Step.APPROVE, "validate: the node's jobs have ended")
            await self._then_validate(params)
            return
        before = status.action
        status.action = after
        self._least_action = (
            after if self._least_action is None or after.severity > self._least_action.severity else self._least_action
        )
        self._mark(Step.WAIT_FOR_JOBS, "after the jobs", f"{before} -> {after}")
        if await self._drain_again(params):
            await self._approve_and_act(params)

    async def _then_validate(self, params: RemediationInput) -> None:
        """The node's jobs have ended: it climbs the policy's validation ladder
        (docs/validation.md) where one is enabled, else its GPU is checked (the repair's check
        Job, alone); the node goes back into service when it passes. A failed ladder replaces it
        (the failure counted toward quarantine); a failed check escalates to a reset, which goes
        on as a repair that did not hold."""
        status = self._status
        assert self._policy is not None
        if self._policy.validation.enabled:
            if await self._validated():
                await self._return_to_service()
            elif await self._drain_again(params):  # its reason names REPLACE_NODE now
                await self._approve_and_act(params)
            return
        self._enter(Step.REPAIR)
        result: RepairResult = await self._activity(
            RepairActivities.repair,
            RepairRequest(
                node=params.node,
                action=Action.DRAIN_AFTER_JOBS,
                incident_id=status.incident_id,
                # Attempt 0: its own Job, never one of a repair's attempts (1, 2, ...) after it.
                attempt=0,
                gpu=self._failed_gpu(),
                settings=self._policy.repair,
                dry_run=self._dry_run,
            ),
            summary=f"check {params.node} (Job)",
            timeout=timedelta(seconds=self._policy.repair.job_timeout_seconds) + SHORT_STEP,
        )
        if result.succeeded:
            self._done(Step.REPAIR, f"validated: {result.detail}")
            await self._return_to_service()
            return
        self._escalate(f"the check after the jobs failed: {result.detail or result.job}")
        if await self._drain_again(params):  # its reason names the new action
            await self._approve_and_act(params)

    async def _drain_again(self, params: RemediationInput) -> bool:
        """The drain again, its reason naming the action the wait ended in. A node someone else
        drained meanwhile (the wait may last a day) is theirs until they say otherwise, as at the
        first drain: False when a person said to leave it (the incident is closed then)."""
        node = await self._drain_in_slurm(params)
        return not (
            held_by_someone_else(node.reason)
            and self._status.approval is None  # a go-ahead for their drain was given already
            and self._settings.owner_drained is OwnerDrained.ASK
            and not await self._owner_drained_gate(
                f"{params.node} was drained by someone else while its jobs ran on: {node.reason!r}"
            )
        )

    async def _wait_for_jobs(self, running: list[JobInfo]) -> bool:
        """Until the node's jobs have ended (True); False when the incident's action was raised
        meanwhile: by a more severe event, or to REPLACE_NODE when ``max_wait_seconds`` passed."""
        status = self._status
        assert self._policy is not None and status.action is not None
        settings = self._policy.drain_after_jobs
        node = self._input.node
        self._enter(Step.WAIT_FOR_JOBS)
        deadline = workflow.now() + timedelta(seconds=settings.max_wait_seconds)
        interval = settings.poll_seconds
        # About 300 looks at most, however long the wait: the history stays small.
        longest = max(settings.poll_seconds, settings.max_wait_seconds / 300)
        active = [job for job in running if job.state in ACTIVE_STATES]
        if self._dry_run:
            names = ", ".join(str(job.job_id) for job in active) or "none"
            self._done(
                Step.WAIT_FOR_JOBS,
                f"dry run: would wait up to {settings.max_wait_seconds:g}s for the node's jobs ({names})",
            )
            return True
        waited = False
        # A job the failure ends while the others run on (an Xid 94's process, killed a little
        # later) is requeued before slurmctld forgets it, as in every other wait.
        watch = asyncio.create_task(self._watch_ended_jobs(lambda: waited))
        try:
            while active:
                remaining = deadline - workflow.now()
                if remaining <= timedelta(0):
                    names = ", ".join(str(job.job_id) for job in active)
                    self._raise_action(
                        Action.REPLACE_NODE,
                        f"job(s) {names} still running after {settings.max_wait_seconds:g}s",
                        least=True,
                    )
                    return False
                self._show_wait(active, deadline)
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        self._unclassified, timeout=min(timedelta(seconds=interval), remaining)
                    )
                if self._unclassified() and await self._raised_while_waiting():
                    return False
                try:
                    listed: list[JobInfo] = await self._activity(
                        SlurmActivities.jobs_on_node, node, summary=f"list the jobs still on {node}"
                    )
                except ActivityError as exc:
                    if not _slurm_away(exc):
                        raise
                    # A wait of a day outlives a slurmctld restart: the jobs last seen run on,
                    # looked at again at the next look (max_wait_seconds still ends the wait).
                    self._mark(Step.WAIT_FOR_JOBS, "slurm away", f"the jobs could not be listed: {exc.cause or exc}")
                else:
                    active = [job for job in listed if job.state in ACTIVE_STATES]
                interval = min(interval * 1.5, longest)
            self._done(Step.WAIT_FOR_JOBS, "the node's jobs have ended")
            return True
        finally:
            waited = True
            status.waiting_for_jobs = None
            if not watch.done():
                await watch

    def _show_wait(self, active: list[JobInfo], deadline: datetime) -> None:
        """What the wait waits for, in the status (`gpufleet incidents show`) and the Temporal UI."""
        status = self._status
        names = ", ".join(str(job.job_id) for job in active)
        text = (
            f"{len(active)} job(s) still running: {names}; at most until {deadline:%Y-%m-%d %H:%M:%SZ}, "
            "then REPLACE_NODE"
        )
        if text.split(";")[0] != (status.waiting_for_jobs or "").split(";")[0]:
            self._mark(Step.WAIT_FOR_JOBS, "waiting", text)
        status.waiting_for_jobs = text
        workflow.set_current_details(f"{self._input.node} {self._events_seen()}: {Step.WAIT_FOR_JOBS.value}, {text}")

    async def _raised_while_waiting(self) -> bool:
        """Classify the events that joined during the wait. True when one calls for more than
        DRAIN_AFTER_JOBS: the incident's action is raised and the wait ends."""
        status = self._status
        assert status.action is not None
        events, calls_for = await self._classify_new()
        names = ", ".join(event.label for event in events)
        if calls_for.severity <= status.action.severity:
            self._mark(Step.WAIT_FOR_JOBS, "xid while waiting", f"{names} -> {calls_for}, which {status.action} covers")
            return False
        self._raise_action(calls_for, f"{names} came while the jobs ran on")
        return True

    def _raise_action(self, action: Action, why: str, *, least: bool = False) -> None:
        """The wait is over: the incident's action is ``action`` from now on (with ``least``, never
        lower, whatever a later classification says); the owner is told."""
        status = self._status
        before, status.action = status.action, self._raised_to_least_action(action)
        if least:
            self._least_action = status.action
        self._mark(Step.WAIT_FOR_JOBS, "escalated", f"{before} -> {status.action}: {why}")
        self._notify(
            "escalated",
            f"{self._message_prefix()}: {why}; {before} escalated to {status.action}: gpufleet checkpoints and "
            "requeues the node's jobs now.",
        )


def _slurm_away(exc: ActivityError) -> bool:
    """A look that ran out of retries (Slurm did not answer), not one refused for good (no such
    node) nor a cancel."""
    cause = exc.cause
    if isinstance(cause, CancelledError):
        return False
    return not (isinstance(cause, ApplicationError) and cause.non_retryable)
