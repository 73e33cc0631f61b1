"""The fleet guard's failure domains (models/topology.py); part of FleetGuardWorkflow
(workflows/guard.py).

Each drained node's domains are read (its rack, zone, NVLink clique and Slurm leaf switch) and
its failure counted in each. When, within the window, enough of one domain's nodes have failed
(``domains.min_nodes``, and ``domains.min_share`` of its nodes), the guard opens one domain
incident for them (workflows/domain.py, ``domain-{cluster}-{kind}-{name}``): their drains and
requeues go on as usual, but their fixes (a repair in place, a replacement) wait, holding no slot,
for a person's word:

- **confirm**: the domain's nodes are fixed node by node, one at a time and within the guard's
  usual limits;
- **release** (the shared cause is fixed): the held incidents validate their nodes and return
  them, claiming no spare.

Later failures in the domain join its incident. A domain incident counts as one node in the
breaker's window, so a rack's storm does not trip the fleet-wide breaker for the rest; the
breaker stays the last net for failures no domain explains.

Of two domains the same failures would open (a rack and its leaf switch), the narrower opens
(PRECEDENCE), and a failed node belongs to one domain incident at most.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.patches import GUARD_DOMAINS
from workflows.retries import GUARD_READ, GUARD_READ_BUDGET, HEARTBEAT, STEP_RETRY

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.topology import TopologyActivities
    from models.guard import DomainWatch, GuardCommand, GuardState, SlotRequest
    from models.incident import Step
    from models.topology import (
        DomainFailure,
        DomainIncidentInput,
        DomainKind,
        DomainNodesRequest,
        DomainSettings,
        DomainsRequest,
        NodeDomains,
    )

# The steps that fix a node (and so wait for its domain incident's decision); its drain and the
# requeue of its jobs ("checkpoint") never wait for one.
FIX_STEPS = frozenset({Step.REPAIR.value, Step.RETIRE_NODE.value})
# From the narrowest kind of domain to the broadest.
PRECEDENCE = (DomainKind.NVLINK, DomainKind.RACK, DomainKind.SWITCH, DomainKind.ZONE)
# A released domain remembers, this long, the incidents it still has to tell that it was fixed.
RELEASED_KEPT = timedelta(days=1)
# A slot held for a fix (the retirement's or the repair's action) longer than this: the guard looks
# whether its incident still runs before the confirmed domain's next node waits on it any longer.
FIX_TAKES = timedelta(minutes=10)
OPEN, CONFIRMED, RELEASED, COUNTING = "open", "confirmed", "released", "counting"


class DomainCounts:
    """The failure domains of FleetGuardWorkflow."""

    _state: GuardState
    _domain_settings: DomainSettings
    _log: Callable[..., None]
    _queue_answer: Callable[..., Awaitable[None]]
    _decide: Callable[[SlotRequest], Awaitable[None]]
    _reap: Callable[[], Awaitable[None]]

    # -- counting (on each drain) -------------------------------------------------------------------

    async def _count_in_domains(self, command: GuardCommand) -> None:
        """Count a drained node's failure in each of its domains; open a domain incident where
        enough have failed, or join the open one its node is in."""
        settings = self._domain_settings
        if not (settings.enabled and settings.kinds and command.node and workflow.patched(GUARD_DOMAINS)):
            return
        found: NodeDomains | None = await self._read(
            TopologyActivities.node_domains,
            DomainsRequest(node=command.node, settings=settings),
            summary=f"read the failure domains of {command.node}",
        )
        if found is None:
            return
        now = workflow.now()
        failure = DomainFailure(node=command.node, incident_id=command.incident_id, event=command.event, at=now)
        domains = sorted(
            (d for d in found.domains if d.kind in settings.kinds), key=lambda d: (PRECEDENCE.index(d.kind), d.name)
        )
        joined = self._open_domain_of(command.node)
        if joined is not None:
            await self._join(joined, failure)
            return
        for domain in domains:
            watch = self._state.domains.setdefault(domain.key, DomainWatch(domain=domain))
            since = now - timedelta(seconds=settings.window_seconds)
            watch.failures = [f for f in watch.failures if f.at >= since and f.incident_id != failure.incident_id]
            watch.failures.append(failure)
            if watch.state in (OPEN, CONFIRMED):
                await self._join(watch, failure)
                return
            if await self._opens(watch):
                return

    async def _opens(self, watch: DomainWatch) -> bool:
        """Open the domain's incident if its failures (of nodes in no other domain incident)
        are enough; True when it opened."""
        settings = self._domain_settings
        failures = [f for f in watch.failures if self._open_domain_of(f.node) is None]
        nodes = {f.node for f in failures}
        if len(nodes) < settings.min_nodes:
            return False
        if not watch.size:
            members: list[str] | None = await self._read(
                TopologyActivities.domain_nodes,
                DomainNodesRequest(domain=watch.domain, settings=settings),
                summary=f"list the nodes of {watch.domain.key}",
            )
            watch.size = len(members) if members else 0
        size = max(watch.size, len(nodes))  # its size unread: the failures alone decide
        if settings.min_share and len(nodes) / size < settings.min_share:
            return False
        watch.state, watch.size, watch.opened_at, watch.decided_at = OPEN, size, workflow.now(), None
        watch.failures, watch.told = failures, False
        self._log(
            "domain opened",
            detail=f"{watch.domain.key}: {len(nodes)} of its {size} nodes failed within "
            f"{settings.window_seconds / 60:g} min ({', '.join(sorted(nodes))}); their repairs and "
            "replacements wait for `gpufleet domains confirm|release`",
        )
        await self._join(watch, failures[-1])
        return True

    async def _join(self, watch: DomainWatch, failure: DomainFailure) -> None:
        """The failure joins the domain's incident (starting it when it does not run yet)."""
        if all(f.incident_id != failure.incident_id for f in watch.failures):
            watch.failures.append(failure)
            self._log("domain joined", detail=f"{failure.node} ({failure.incident_id}) joins {watch.domain.key}")
        # The breaker counts the domain's failures as one node, from now until they leave its window.
        ids = {f.incident_id for f in watch.failures}
        for entry in self._state.window:
            if entry.incident_id in ids:
                entry.domain = watch.domain.key
        if watch.state == CONFIRMED:
            return  # decided already (its incident has ended): fixed one at a time with the rest
        opening = DomainIncidentInput(
            cluster=self._state.cluster, domain=watch.domain, size=watch.size, failures=watch.failures
        )
        try:
            await workflow.execute_activity_method(
                GuardActivities.domain_join,
                args=[opening, failure],
                start_to_close_timeout=GUARD_READ,
                schedule_to_close_timeout=GUARD_READ_BUDGET,
                heartbeat_timeout=HEARTBEAT,
                retry_policy=STEP_RETRY,
                summary=f"{failure.node} joins the domain incident {watch.domain.key}",
            )
            watch.told = True
        except ActivityError as exc:
            # Its nodes wait all the same; told again when one of them asks (every 30 min while held).
            watch.told = False
            self._log("domain", detail=f"{watch.domain.key}: its incident could not be told ({exc.cause or exc})")

    async def _read(self, method: Any, arg: Any, *, summary: str) -> Any:
        """A read for the domains; None (logged) when it cannot be done: no domain is counted."""
        try:
            return await workflow.execute_activity_method(
                method,
                arg,
                start_to_close_timeout=GUARD_READ,
                schedule_to_close_timeout=GUARD_READ_BUDGET,
                heartbeat_timeout=HEARTBEAT,
                retry_policy=STEP_RETRY,
                summary=summary,
            )
        except ActivityError as exc:
            self._log("domain", detail=f"{summary}: not read ({exc.cause or exc}); not counted in its domains")
            return None

    def _in_domain(self, node: str) -> str:
        """The key of the open or confirmed domain incident the node's failure is part of ("")."""
        watch = self._open_domain_of(node)
        return watch.domain.key if watch is not None else ""

    def _window_key(self, node: str) -> str:
        """What the node counts as in the breaker's window: its domain incident, or itself."""
        return self._in_domain(node) or node

    async def _tell_again(self, request: SlotRequest) -> None:
        """The request's domain incident, if its telling failed, is told again."""
        watch = self._open_domain_of(request.node)
        if watch is None or watch.told or watch.state != OPEN:
            return
        failure = next((f for f in watch.failures if f.incident_id == request.incident_id), watch.failures[-1])
        await self._join(watch, failure)

    def _forget_released(self, incident_id: str) -> None:
        """An incident closed: no released domain has it to tell any more."""
        for watch in self._state.domains.values():
            if incident_id in watch.released:
                watch.released.remove(incident_id)

    def _open_domain_of(self, node: str) -> DomainWatch | None:
        """The open or confirmed domain incident the node's failure is part of."""
        for watch in self._state.domains.values():
            if watch.state in (OPEN, CONFIRMED) and any(f.node == node for f in watch.failures):
                return watch
        return None

    # -- slots (each incident's ask) ------------------------------------------------------------

    async def _domain_reask(self, request: SlotRequest) -> bool:
        """An incident held for its domain asks again: answered again. True when it was held."""
        held = next((r for r in self._state.domain_held if r.incident_id == request.incident_id), None)
        if held is None:
            return False
        held.ask, held.step = request.ask, request.step
        await self._queue_answer(held, granted=False, why=self._domain_why(held))
        await self._tell_again(held)
        return True

    async def _held_for_domain(self, request: SlotRequest) -> bool:
        """Hold a fix (repair, replacement) of a node in an open domain incident, or in a confirmed
        one while another of its nodes is being fixed; tell an incident whose domain was released.
        True when answered here; False: the guard's usual decision."""
        state = self._state
        if request.step not in FIX_STEPS or not state.domains:
            return False
        for released in state.domains.values():
            if request.incident_id in released.released:  # told each time it asks, until it closes
                why = f"its domain {released.domain.key} was released (fixed): the node is validated and returned"
                self._log("domain released", request, why)
                await self._queue_answer(request, granted=False, why=why, domain_released=released.domain.key)
                return True
        watch = self._open_domain_of(request.node)
        if watch is None or (watch.state == CONFIRMED and not self._fixing(watch)):
            return False
        request.held_by = f"domain:{watch.domain.key}"
        state.domain_held.append(request)
        self._log("held by domain", request, watch.domain.key)
        await self._queue_answer(request, granted=False, why=self._domain_why(request))
        await self._tell_again(request)
        return True

    def _fixing(self, watch: DomainWatch) -> bool:
        """Whether one of the domain's nodes is being fixed (or in line for a slot to be)."""
        nodes = {f.node for f in watch.failures}
        return any(r.node in nodes and r.step in FIX_STEPS for r in [*self._state.in_flight, *self._state.waiting])

    def _fixing_long(self, watch: DomainWatch) -> bool:
        """Whether one of the domain's nodes has held its slot longer than a fix takes."""
        nodes, now = {f.node for f in watch.failures}, workflow.now()
        return any(
            r.node in nodes and r.step in FIX_STEPS and r.asked_at is not None and now - r.asked_at > FIX_TAKES
            for r in self._state.in_flight
        )

    def _domain_why(self, request: SlotRequest) -> str:
        key = request.held_by.removeprefix("domain:")
        watch = self._state.domains.get(key)
        cluster = self._state.cluster
        if watch is not None and watch.state == CONFIRMED:
            return f"domain incident {key} confirmed: its nodes are fixed one at a time; next in line"
        return (
            f"held by the domain incident {key} (failures in one {key.split('/')[0]}): "
            f"`gpufleet domains confirm {key} --cluster {cluster}` fixes its nodes one by one, "
            f"`gpufleet domains release {key} --cluster {cluster}` returns them once the domain is fixed"
        )

    async def _let_domain_in(self) -> None:
        """In each confirmed domain with none of its nodes being fixed, the next held one goes on
        (to the guard's usual slots and limits)."""
        state = self._state
        for watch in [w for w in state.domains.values() if w.state == CONFIRMED]:
            if self._fixing(watch) and self._fixing_long(watch):
                await self._reap()  # a node being fixed this long: its incident may be gone
            if self._fixing(watch):
                continue
            nodes = {f.node for f in watch.failures}
            request = next((r for r in state.domain_held if r.node in nodes), None)
            if request is None:
                continue
            state.domain_held.remove(request)
            request.held_by = ""
            self._log("domain next", request, f"{watch.domain.key}: fixed next")
            await self._decide(request)

    # -- a person's decision (the domain incident tells the guard) ----------------------------------

    async def _decide_domain(self, command: GuardCommand) -> None:
        state = self._state
        watch = state.domains.get(command.domain)
        verb = "confirm" if command.confirm else "release"
        by_whom = f"{command.by or '?'}" + (f": {command.reason}" if command.reason else "")
        if watch is None or watch.state not in (OPEN, CONFIRMED):
            self._log("domain", detail=f"{command.domain}: no open domain incident to {verb} ({by_whom})")
            return
        watch.decided_at = workflow.now()
        if command.confirm:
            watch.state = CONFIRMED
            self._log("domain confirmed", detail=f"{watch.domain.key} by {by_whom}: its nodes are fixed one by one")
            await self._let_domain_in()
            return
        nodes = {f.node for f in watch.failures}
        held = [r for r in state.domain_held if r.node in nodes]
        state.domain_held = [r for r in state.domain_held if r.node not in nodes]
        why = f"its domain {watch.domain.key} was released (fixed) by {by_whom}: the node is validated and returned"
        for request in held:
            await self._queue_answer(request, granted=False, why=why, domain_released=watch.domain.key)
        # Each is told again whenever it asks (those not asking yet: their jobs still being requeued).
        watch.released = sorted({*watch.released, *(f.incident_id for f in watch.failures)})
        watch.state, watch.failures, watch.size = RELEASED, [], 0
        self._log("domain released", detail=f"{watch.domain.key} by {by_whom}: {len(held)} node(s) returned")

    # -- forgetting -------------------------------------------------------------------------------

    def _prune_domains(self, now: datetime) -> None:
        """Forget counts older than the window, released domains with nothing left to tell, and
        confirmed ones whose nodes are all fixed and quiet for a window."""
        state, window = self._state, timedelta(seconds=self._domain_settings.window_seconds)
        for key, watch in list(state.domains.items()):
            if watch.state in (COUNTING, RELEASED):
                watch.failures = [f for f in watch.failures if now - f.at <= window]
            if watch.state == COUNTING and not watch.failures:
                del state.domains[key]
            elif watch.state == RELEASED and not watch.failures:
                if not watch.released or (watch.decided_at is not None and now - watch.decided_at > RELEASED_KEPT):
                    del state.domains[key]
            elif watch.state == CONFIRMED:
                nodes = {f.node for f in watch.failures}
                quiet = all(now - f.at > window for f in watch.failures)
                if quiet and not self._fixing(watch) and not any(r.node in nodes for r in state.domain_held):
                    del state.domains[key]
