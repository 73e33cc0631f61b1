"""Operator workflows on nodes: return a repaired node (after its validation), list and release
quarantined ones, the end of a node's probation, and a node's failure domains.

Each is a short workflow (so the CLI reaches Kubernetes and Slurm only through the worker of
the cluster) and tells the cluster's fleet guard what happened to the node.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

from workflows.patches import VALIDATION_LADDER
from workflows.remediation.validate import begin_probation, climb, failed_validation
from workflows.retries import HEARTBEAT, NODES_RETRY, NODES_STEP, PROBATION_END_RETRY

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.policy import PolicyActivities
    from activities.spares import SpareActivities
    from activities.topology import TopologyActivities
    from activities.validation import ValidationActivities
    from models.constants import (
        GUARD_FORGIVE_SIGNAL,
        GUARD_RETURNED_SIGNAL,
        GUARD_VALIDATION_FAILED_SIGNAL,
        PROBATION_WORKFLOW,
        QUARANTINED_NODES_WORKFLOW,
        RELEASE_NODE_WORKFLOW,
        RETURN_NODE_WORKFLOW,
    )
    from models.guard import GuardCommand
    from models.requests import QuarantinedNode, ReleaseNodeRequest, ReturnNodeRequest, WorkerConfig
    from models.topology import NODE_DOMAINS_WORKFLOW, DomainKind, DomainsRequest, NodeDomains, NodeDomainsInput
    from models.trust import answer_problem
    from models.validation import ProbationInput, ProbationRequest, RungResult, ValidationResult


async def _tell_guard(signal: str, command: GuardCommand) -> None:
    await workflow.execute_activity_method(
        GuardActivities.tell,
        args=[signal, command],
        start_to_close_timeout=NODES_STEP,
        retry_policy=NODES_RETRY,
        summary=f"tell the fleet guard: {signal} {command.node}",
    )


async def _step(
    method: Any, *args: Any, summary: str, timeout: timedelta = NODES_STEP, retry: RetryPolicy = NODES_RETRY
) -> Any:
    """One activity of an operator's workflow on a node."""
    return await workflow.execute_activity_method(
        method,
        args=args,
        start_to_close_timeout=timeout,
        heartbeat_timeout=HEARTBEAT if timeout > NODES_STEP else None,
        retry_policy=retry,
        summary=summary,
    )


@workflow.defn(name=RETURN_NODE_WORKFLOW)
class ReturnNodeWorkflow:
    """`gpufleet nodes return`: the validation ladder (unless skipped), then the node back in
    service, on probation. A failed rung keeps the node out and fails the workflow, naming it."""

    def __init__(self) -> None:
        self._validation: ValidationResult | None = None

    @workflow.query
    def status(self) -> ValidationResult | None:
        """The rungs climbed so far and the one running (None: validation has not started, or
        there is none). Named ``status``, as every query a gpufleet command makes (gateway/calls.py)."""
        return self._validation

    @workflow.run
    async def run(self, request: ReturnNodeRequest) -> str:
        said = ""
        validated = workflow.patched(VALIDATION_LADDER)
        if validated:
            said = await self._validate(request)
        await workflow.execute_activity_method(
            SpareActivities.return_node,
            request,
            start_to_close_timeout=NODES_STEP,
            retry_policy=NODES_RETRY,
            summary=f"return {request.node} as {request.as_}",
        )
        # Its cooldown starts now: failing again soon makes it a lemon.
        await _tell_guard(GUARD_RETURNED_SIGNAL, GuardCommand(node=request.node))
        return f"{request.node} returned as {request.as_}" + (f"; {said}" if said else "")

    async def _validate(self, request: ReturnNodeRequest) -> str:
        """The ladder before the return (or its skip, recorded); what to say of it. A failure is
        counted by the fleet guard toward the node's quarantine and fails the workflow."""
        node = request.node
        if request.skip_validation:
            problem = answer_problem(by=request.by, reason=request.reason)
            if problem:
                raise ApplicationError(f"--skip-validation needs who and why: {problem}", type="InvalidInput")
            when = workflow.now().strftime("%Y-%m-%dT%H:%M:%SZ")
            self._validation = ValidationResult(
                node=node, passed=True, skipped_by=request.by, skip_reason=request.reason
            )
            await _step(
                ValidationActivities.record_skipped,
                ProbationRequest(node=node, why=f"{request.by} at {when}: {request.reason}"),
                summary=f"record on {node}: validation skipped by {request.by}",
            )
            workflow.logger.warning("validation of %s skipped by %s: %s", node, request.by, request.reason)
            return self._validation.summary()
        cluster = request.cluster or workflow.info().task_queue.removeprefix("gpufleet-")
        config: WorkerConfig = await _step(
            PolicyActivities.worker_config, cluster, summary="read the worker's settings and policy"
        )
        policy = config.policy
        if not policy.validation.enabled:
            return ""
        self._validation = ValidationResult(node=node, passed=False)

        def seen(rung: RungResult) -> None:
            assert self._validation is not None
            self._validation.rungs.append(rung)
            self._validation.running = ""

        async def call(method: Any, *args: Any, summary: str, timeout: timedelta) -> Any:
            if method is ValidationActivities.run_rung and self._validation is not None:
                self._validation.running = args[0].rung.name
            return await _step(method, *args, summary=summary, timeout=timeout)

        info = workflow.info()
        result = await climb(call, node=node, request_id=f"{info.workflow_id}/{info.run_id}", policy=policy, seen=seen)
        self._validation = result
        if not result.passed:
            await _tell_guard(
                GUARD_VALIDATION_FAILED_SIGNAL, failed_validation(node, f"{info.workflow_id}/{info.run_id}", result)
            )
            raise ApplicationError(
                f"{result.summary()}. {node} stays out of service; the fleet guard counts it toward its quarantine. "
                f"`gpufleet nodes return {node}` tries again once it is fixed.",
                result,
                type="ValidationFailed",
                non_retryable=True,
            )
        until = await begin_probation(_step, cluster=cluster, node=node, policy=policy)
        result.probation_until = until
        then = f"; on probation until {until:%Y-%m-%d %H:%M} UTC" if until is not None else ""
        return f"{result.summary()}{then}"


@workflow.defn(name=PROBATION_WORKFLOW)
class ProbationWorkflow:
    """The end of a node's probation: a durable timer, then the label off (only if the node's
    probation still ends then: a later one is left to its own timer)."""

    @workflow.run
    async def run(self, params: ProbationInput) -> str:
        wait = (params.until - workflow.now()).total_seconds()
        if wait > 0:
            await workflow.sleep(wait)
        ended: bool = await _step(
            ValidationActivities.set_probation,
            ProbationRequest(node=params.node, ending=params.until),
            summary=f"end the probation of {params.node}",
            retry=PROBATION_END_RETRY,
        )
        return f"{params.node}: probation ended" if ended else f"{params.node}: a later probation stands"


@workflow.defn(name=QUARANTINED_NODES_WORKFLOW)
class QuarantinedNodesWorkflow:
    @workflow.run
    async def run(self) -> list[QuarantinedNode]:
        nodes: list[QuarantinedNode] = await workflow.execute_activity_method(
            SpareActivities.quarantined_nodes,
            start_to_close_timeout=NODES_STEP,
            retry_policy=NODES_RETRY,
            summary="list quarantined nodes",
        )
        return nodes


@workflow.defn(name=RELEASE_NODE_WORKFLOW)
class ReleaseNodeWorkflow:
    @workflow.run
    async def run(self, request: ReleaseNodeRequest) -> str:
        released: bool = await workflow.execute_activity_method(
            SpareActivities.release_quarantine,
            request.node,
            start_to_close_timeout=NODES_STEP,
            retry_policy=NODES_RETRY,
            summary=f"release {request.node} from quarantine",
        )
        if not released:
            return f"{request.node} is not quarantined; nothing to release"
        await _tell_guard(GUARD_FORGIVE_SIGNAL, GuardCommand(node=request.node, by=request.by, reason=request.reason))
        return f"{request.node} released from quarantine; `gpufleet nodes return {request.node}` brings it back"


@workflow.defn(name=NODE_DOMAINS_WORKFLOW)
class NodeDomainsWorkflow:
    """`gpufleet nodes show`: the node's failure domains of every kind, read where the policy's
    ``domains:`` says (its labels, whether Slurm's switches count), and what could not be read. A
    kind the policy does not group failures by is shown all the same."""

    @workflow.run
    async def run(self, request: NodeDomainsInput) -> NodeDomains:
        cluster = request.cluster or workflow.info().task_queue.removeprefix("gpufleet-")
        config: WorkerConfig = await _step(
            PolicyActivities.worker_config, cluster, summary="read the worker's settings and policy"
        )
        every_kind = config.policy.domains.model_copy(update={"kinds": list(DomainKind)})
        found: NodeDomains = await _step(
            TopologyActivities.node_domains,
            DomainsRequest(node=request.node, settings=every_kind),
            summary=f"read the failure domains of {request.node}",
        )
        return found
