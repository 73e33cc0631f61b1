"""Validation before a node goes back into service (docs/validation.md): the policy's ladder of
rungs, each a Job pinned to the node, run in order until one fails; a node that passes goes on
probation (an event in that time replaces and quarantines it at once).

``climb`` and ``begin_probation`` are shared by the incident (``Validation._validated``, after a
repair in place held) and by ``gpufleet nodes return`` (workflows/nodes.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.workflow import ParentClosePolicy

from workflows.remediation.repair import Repair
from workflows.retries import SHORT_STEP

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.validation import ValidationActivities
    from models.constants import (
        GUARD_VALIDATION_FAILED_SIGNAL,
        PROBATION_LABEL,
        PROBATION_WORKFLOW,
        QUARANTINE_PROBATION,
        probation_workflow_id,
    )
    from models.guard import GuardCommand
    from models.incident import Step
    from models.policy import Action, Policy
    from models.requests import NodeFacts
    from models.validation import ProbationInput, ProbationRequest, RungRequest, RungResult, ValidationResult

# Runs one activity: (method, argument, summary=..., timeout=...).
Call = Callable[..., Awaitable[Any]]


async def climb(
    call: Call, *, node: str, request_id: str, policy: Policy, attempt: int = 1, seen: Callable[[RungResult], None]
) -> ValidationResult:
    """The ladder's rungs in order, each a Job on the node, until one fails; ``seen`` hears each
    rung's result as it comes."""
    settings = policy.validation
    results: list[RungResult] = []
    for rung in settings.rungs:
        request = RungRequest(
            node=node,
            request_id=request_id,
            attempt=attempt,
            rung=rung,
            settings=settings,
            namespace=policy.repair.namespace,
            runtime_class=policy.repair.runtime_class,
        )
        result: RungResult = await call(
            ValidationActivities.run_rung,
            request,
            summary=f"validate {node}: {rung.name} ({rung.kind})",
            timeout=timedelta(seconds=rung.timeout_seconds) + SHORT_STEP,
        )
        results.append(result)
        seen(result)
        if not result.passed:
            return ValidationResult(node=node, passed=False, rungs=results)
    return ValidationResult(node=node, passed=True, rungs=results)


async def begin_probation(call: Call, *, cluster: str, node: str, policy: Policy) -> datetime | None:
    """Label the node on probation for the policy's time, and start the timer that ends it (a
    workflow of its own, left running when this one closes). None: the policy has no probation."""
    seconds = policy.validation.probation_seconds
    if not seconds:
        return None
    until = (workflow.now() + timedelta(seconds=seconds)).replace(microsecond=0)
    await call(
        ValidationActivities.set_probation,
        ProbationRequest(node=node, until=until),
        summary=f"{node} on probation until {until:%Y-%m-%d %H:%M} UTC",
        timeout=SHORT_STEP,
    )
    await workflow.start_child_workflow(
        PROBATION_WORKFLOW,
        ProbationInput(node=node, until=until),
        id=probation_workflow_id(cluster, node, until),
        parent_close_policy=ParentClosePolicy.ABANDON,
    )
    return until


def failed_validation(node: str, key: str, result: ValidationResult) -> GuardCommand:
    """What the fleet guard hears of a failed validation: an incident of the node, counted once."""
    failed = result.failed
    return GuardCommand(incident_id=key, node=node, reason=failed.line() if failed is not None else "validation failed")


class Validation(Repair):
    """The incident's side: the ladder after a repair in place held, and probation."""

    _validations: int = 0

    async def _validated(self) -> bool:
        """Climb the ladder on the incident's node. True: it passed (the node is on probation), or
        validation is disabled. False: a rung failed; the action is escalated to REPLACE_NODE and
        the failure counted toward the node's quarantine; the caller goes on to the replacement."""
        status = self._status
        assert self._policy is not None
        if not self._policy.validation.enabled:
            return True
        self._enter(Step.VALIDATE)
        if self._dry_run:
            rungs = ", ".join(rung.name for rung in self._policy.validation.rungs)
            self._done(Step.VALIDATE, f"dry run: would run the rungs {rungs}")
            return True
        self._validations += 1
        result = await climb(
            self._activity,
            node=self._input.node,
            request_id=status.incident_id,
            attempt=self._validations,
            policy=self._policy,
            seen=lambda rung: self._mark(Step.VALIDATE, "rung", rung.line()),
        )
        if not result.passed:
            key = f"{status.incident_id}/validation-{self._validations}"
            await self._activity(
                GuardActivities.tell,
                GUARD_VALIDATION_FAILED_SIGNAL,
                failed_validation(self._input.node, key, result),
                summary="tell the fleet guard: validation failed",
            )
            self._escalate(result.summary(), at_least=Action.REPLACE_NODE)
            self._domain_fixed = ""  # a fault of its own after all: replaced, with a slot of its own
            return False
        until = await begin_probation(
            self._activity, cluster=self._input.cluster, node=self._input.node, policy=self._policy
        )
        then = f"; on probation until {until:%Y-%m-%d %H:%M} UTC" if until is not None else ""
        self._done(Step.VALIDATE, f"{result.summary()}{then}")
        return True

    def _on_probation(self, facts: NodeFacts) -> None:
        """A node on probation that fails again is replaced and quarantined at once."""
        status = self._status
        until = facts.probation_until
        if until is None or until <= workflow.now() or status.action is None:
            return
        status.quarantine_label = QUARANTINE_PROBATION
        status.quarantine = f"failed again while on probation ({PROBATION_LABEL}, until {until:%Y-%m-%d %H:%M} UTC)"
        if status.action.severity < Action.REPLACE_NODE.severity:
            before, status.action = status.action, Action.REPLACE_NODE
            self._mark(Step.CLASSIFY, "escalated", f"{before} -> {Action.REPLACE_NODE}: {status.quarantine}")
        self._least_action = Action.REPLACE_NODE
