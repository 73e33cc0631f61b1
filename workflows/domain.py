"""DomainIncidentWorkflow: failures that share a rack, a zone, an NVLink domain or a leaf switch,
handled as one (``domain-{cluster}-{kind}-{name}``).

The fleet guard opens it (workflows/guard_domains.py) when enough of a domain's nodes fail within
its window, and every later failure in the domain joins it. The incidents of its nodes go on
draining and requeueing as usual; their repairs and replacements wait at the guard. The operators
are told once, with the domain's summary (which nodes, which events, since when), and a person
answers:

- `gpufleet domains confirm KIND/NAME`: the nodes' own faults: they are fixed node by node, one
  at a time, within the guard's limits;
- `gpufleet domains release KIND/NAME`: the shared cause is fixed: the held incidents validate
  their nodes and return them to service, claiming no spare.

The decision is passed to the guard, and the workflow ends with its record (the Temporal UI
keeps it). After a confirm, a later failure in the domain is fixed in its turn with the rest (the
guard's log names it); after a release, failures count toward a new domain incident.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.retries import GUARD_READ, NOTIFY_ATTEMPT, NOTIFY_BUDGET, NOTIFY_RETRY, STEP_RETRY

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.notify import NotifyActivities
    from models.guard import GuardCommand
    from models.requests import NotifyRequest
    from models.topology import (
        DOMAIN_DECIDE_SIGNAL,
        DOMAIN_JOIN_SIGNAL,
        DOMAIN_WORKFLOW,
        GUARD_DOMAIN_SIGNAL,
        DomainDecision,
        DomainFailure,
        DomainIncidentInput,
        DomainIncidentStatus,
    )
    from models.trust import answer_problem

# Telling the guard of the decision: the guard may be busy or restarting; it is tried this long.
GUARD_TOLD_BUDGET = timedelta(minutes=30)


@workflow.defn(name=DOMAIN_WORKFLOW)
class DomainIncidentWorkflow:
    @workflow.init
    def __init__(self, params: DomainIncidentInput) -> None:
        self._status = DomainIncidentStatus(
            cluster=params.cluster, domain=params.domain, size=params.size, failures=list(params.failures)
        )
        self._decision: DomainDecision | None = None

    @workflow.signal(name=DOMAIN_JOIN_SIGNAL)
    def join(self, failure: DomainFailure) -> None:
        """A failure in the domain joins (each incident once)."""
        if all(f.incident_id != failure.incident_id for f in self._status.failures):
            self._status.failures.append(failure)
            self._describe()

    @workflow.signal(name=DOMAIN_DECIDE_SIGNAL)
    def decide(self, decision: DomainDecision) -> None:
        """A person's confirm or release; the first one counts, and it must say who."""
        problem = answer_problem(by=decision.by, reason=decision.reason)
        if problem:
            workflow.logger.warning("domain decision ignored: %s", problem)
            return
        if self._decision is None:
            self._decision = decision

    @workflow.query
    def status(self) -> DomainIncidentStatus:
        return self._status

    @workflow.run
    async def run(self, params: DomainIncidentInput) -> DomainIncidentStatus:
        status = self._status
        status.opened_at = min((f.at for f in status.failures), default=workflow.now())
        self._describe()
        await self._notify("domain_incident", self._summary())
        status.notified = True
        await workflow.wait_condition(lambda: self._decision is not None)
        decision = self._decision
        assert decision is not None
        status.decision, status.decided_at = decision, workflow.now()
        status.state = "confirmed" if decision.confirm else "released"
        self._describe()
        try:
            await workflow.execute_activity_method(
                GuardActivities.tell,
                args=[
                    GUARD_DOMAIN_SIGNAL,
                    GuardCommand(
                        domain=status.domain.key, confirm=decision.confirm, by=decision.by, reason=decision.reason
                    ),
                ],
                start_to_close_timeout=GUARD_READ,
                schedule_to_close_timeout=GUARD_TOLD_BUDGET,
                retry_policy=STEP_RETRY,
                summary=f"tell the fleet guard: {status.state} by {decision.by}",
            )
        except ActivityError as exc:
            raise ApplicationError(
                f"the fleet guard could not be told that {status.domain.key} was {status.state}: {exc.cause or exc}. "
                f"Its nodes still wait; run `gpufleet domains {'confirm' if decision.confirm else 'release'} "
                f"{status.domain.key} --cluster {status.cluster}` again.",
                type="GuardNotTold",
                non_retryable=True,
            ) from exc
        verb = "fixed node by node" if decision.confirm else "validated and returned to service"
        await self._notify(
            f"domain_{status.state}",
            f"{self._prefix()} {status.state} by {decision.by}"
            + (f" ({decision.reason})" if decision.reason else "")
            + f": its {len(status.failures)} failed node(s) are {verb}.",
        )
        return status

    def _prefix(self) -> str:
        return f"[domain-{self._status.cluster}-{self._status.domain.kind}-{self._status.domain.name}]"

    def _summary(self) -> str:
        """The operators' one message: which nodes, which events, since when, and what to do."""
        status = self._status
        key, cluster = status.domain.key, status.cluster
        since = status.opened_at.strftime("%Y-%m-%d %H:%M:%S UTC") if status.opened_at else "?"
        nodes = "; ".join(
            f"{f.node} ({f.event or 'event'} at {f.at:%H:%M:%S}, incident {f.incident_id})" for f in status.failures
        )
        of = f" of its {status.size}" if status.size else ""
        return (
            f"{self._prefix()} {len(status.failures)}{of} nodes in {status.domain.kind} {status.domain.name} failed "
            f"together since {since}: {nodes}. A shared cause (power, cooling, a switch, a cable) is likely: their "
            "jobs are requeued and the nodes drained, but no node is repaired or replaced, and no spare claimed, "
            f"until a person decides. `gpufleet domains confirm {key} --cluster {cluster} --reason ...` fixes the "
            f"nodes one by one; `gpufleet domains release {key} --cluster {cluster} --reason ...` once the domain is "
            "fixed returns them through validation. Later failures in it join this incident."
        )

    async def _notify(self, kind: str, text: str) -> None:
        try:
            await workflow.execute_activity_method(
                NotifyActivities.notify,
                NotifyRequest(kind=kind, text=text),
                start_to_close_timeout=NOTIFY_ATTEMPT,
                schedule_to_close_timeout=NOTIFY_BUDGET,
                retry_policy=NOTIFY_RETRY,
                summary=f"notify: {kind}",
            )
        except ActivityError as exc:
            workflow.logger.warning("%s not delivered: %s", kind, exc.cause or exc)

    def _describe(self) -> None:
        status = self._status
        nodes = ", ".join(f.node for f in status.failures)
        workflow.set_current_details(f"{status.domain.key}: {status.state}; {len(status.failures)} failed: {nodes}")
