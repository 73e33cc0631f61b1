"""Repair in place: RESET_GPU or REBOOT_NODE through a Job pinned to the node, then a settle
period without a new event; escalating a level (up to REPLACE_NODE) when it does not hold, and
putting the node back into service when it does."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.remediation.close import Closing
from workflows.remediation.jobs import Jobs
from workflows.retries import SHORT_STEP

with workflow.unsafe.imports_passed_through():
    from activities.repair import RepairActivities
    from activities.slurm import SlurmActivities
    from models.incident import NodeInfo, Outcome, Step
    from models.policy import Action
    from models.requests import RepairRequest, RepairResult, ResumeNodeRequest


class Repair(Closing, Jobs):
    """Repair in place, the settle after it, and the node back into service."""

    def _escalate(self, why: str, *, at_least: Action | None = None) -> None:
        status = self._status
        assert status.action is not None
        after = status.action.escalated()
        if at_least is not None and at_least.severity > after.severity:
            after = at_least
        before, status.action = status.action, after
        self._least_action = status.action
        self._mark(status.step, "escalated", f"{before} -> {status.action}: {why}")
        self._notify(
            "escalated", f"{self._message_prefix()}: {before} did not hold ({why}); escalated to {status.action}."
        )

    def _failed_gpu(self) -> str:
        """The failed GPU as the driver named it (UUID, else PCI address), from the deciding event."""
        deciding = self._deciding_event()
        return deciding.gpu_uuid or deciding.pci or ""

    async def _repair(self) -> bool:
        """RESET_GPU or REBOOT_NODE through a Job pinned to the node, then a settle period without
        a new event. True when the node is fit to go back; False once escalated to REPLACE_NODE
        (the Job failed, or the node reported again while settling)."""
        status = self._status
        assert self._policy is not None
        settings = self._policy.repair
        attempt = 0
        while status.action in (Action.RESET_GPU, Action.REBOOT_NODE):
            attempt += 1
            self._enter(Step.REPAIR)
            if self._slot_per_step:
                if not await self._slot_for(Step.REPAIR):
                    return False  # rejected while the guard held it: closed
                if self._domain_fixed:
                    return True  # its domain's fix stands for the repair: validated and returned
                if status.action not in (Action.RESET_GPU, Action.REBOOT_NODE):
                    break  # the guard knows the node for a lemon: replaced
            seen = len(self._events)
            request = RepairRequest(
                node=self._input.node,
                action=status.action,
                incident_id=status.incident_id,
                attempt=attempt,
                gpu=self._failed_gpu(),
                settings=settings,
                dry_run=self._dry_run,
            )
            self._repair_started = True
            try:
                if self._slot_per_step and status.action is Action.REBOOT_NODE and not self._dry_run:
                    # The reboot is the action: once it is issued, the slot goes back; the node's
                    # coming back is a wait, like a spare's.
                    await self._activity(
                        RepairActivities.start_reboot, request, summary=f"start the reboot of {self._input.node}"
                    )
                    await self._end_slot("reboot issued")
                result: RepairResult = await self._activity(
                    RepairActivities.repair,
                    request,
                    summary=f"{status.action} {self._input.node} (Job)",
                    # The reset's Job or the reboot, then the check's Job.
                    timeout=timedelta(
                        seconds=settings.job_timeout_seconds
                        + (
                            settings.reboot_timeout_seconds
                            if status.action == Action.REBOOT_NODE
                            else settings.job_timeout_seconds
                        )
                    )
                    + SHORT_STEP,
                )
            except ActivityError as exc:
                # The event named no usable GPU: a reboot needs none. Anything else (no such
                # namespace, a refused Job) is a configuration to fix: the incident fails, loudly,
                # with the node drained, rather than replacing nodes that a fix would have saved.
                if not isinstance(exc.cause, ApplicationError) or exc.cause.type != "InvalidInput":
                    raise
                self._escalate(f"the repair could not start: {exc.cause.message}")
                continue
            if not result.succeeded:
                self._escalate(result.detail or f"Job {result.job} failed")
                continue
            self._done(Step.REPAIR, result.detail or f"Job {result.job} completed")
            await self._end_slot(f"{status.action} done")
            if self._dry_run:
                return True
            self._enter(Step.SETTLE)
            try:
                await workflow.wait_condition(
                    lambda seen=seen: len(self._events) > seen,  # type: ignore[misc]
                    timeout=timedelta(seconds=settings.settle_seconds),
                )
            except TimeoutError:
                self._done(Step.SETTLE, f"no new event for {settings.settle_seconds:g}s")
                return True
            late = await self._classify()  # the new event may call for more than one level up
            self._escalate(f"{self._events[-1].label} while settling", at_least=late)
        return False

    async def _return_to_service(self) -> None:
        """The node back into service in Slurm, the jobs running again, the owner told."""
        status = self._status
        node: NodeInfo = await self._activity(
            SlurmActivities.resume_node,
            ResumeNodeRequest(node=self._input.node, incident_id=status.incident_id, dry_run=self._dry_run),
            summary=f"resume {self._input.node} in Slurm",
        )
        if node.drained or node.state in {"down", "drained"}:
            # Someone else drained it meanwhile: theirs now; the repair is not counted as holding.
            status.outcome = Outcome.AWAITING_REPAIR
            self._mark(Step.SETTLE, "held", f"repaired, but drained by someone else: {node.reason!r}")
            self._notify(
                "awaiting_repair",
                f"{self._message_prefix()}: {status.action} done, but the node was drained meanwhile by someone else "
                f"({node.reason!r}); gpufleet leaves it to them. Its jobs are requeued.",
            )
            await self._close()
            return
        self._mark(Step.SETTLE, "back in service", f"state={node.state} reason={node.reason!r}")
        self._enter(Step.RESUME)
        if self._dry_run:
            self._done(Step.RESUME, "dry run: would wait for the jobs to run again")
        elif status.requeued:
            status.jobs = await self._wait_resumed(status.requeued)
            self._done(Step.RESUME, ", ".join(f"{job.job_id} on {job.nodes}" for job in status.jobs))
        else:
            self._done(Step.RESUME, "no jobs to resume")
        jobs = self._resolved()
        how = (
            f"the fix of its domain {self._domain_fixed} (released)"
            if self._domain_fixed
            else f"{status.action} in place"
        )
        self._notify(
            str(status.outcome),
            f"{self._message_prefix()}: {status.outcome} by {how}; {self._input.node} is back in service, {jobs}.",
        )
        await self._close()
