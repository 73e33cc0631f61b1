"""FleetGuardWorkflow: how much of a cluster gpufleet may take down on its own.

One per cluster (``guard-{cluster}``), started (signal-with-start) by the first incident that
drains or asks, or by `gpufleet pause`. An incident tells it of its drain (never held back:
counted in the window) and asks for a slot before each destructive step (killing the jobs, a
repair, the retirement), giving it back when that step ends (before v0.3.0: drain to close).

Limits (``guard:`` in the policy): slots in flight, and the share of the partition's nodes drained
within a sliding window. Past the slots a request waits in line (patch guard-slots-wait); past
the share it trips the breaker: it and every later one wait (drained, nothing destroyed), and
the operator is paged once. `gpufleet breaker reset` lets them go on as slots free up, one at a
time; `gpufleet approve INCIDENT` lets one past; `gpufleet pause|resume` hold new destructive
steps without paging.

Messages are handled one at a time in arrival order, so two requests never race for the last
slot. Answers go out a batch at a time, by an activity, beside that loop (an answer that finds
its incident gone gives its slot back there; workflows/guard_answers.py). The state survives
worker and server restarts (it is the workflow's), and the run continues as new before its
history grows large.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.guard_answers import GuardAnswers
from workflows.guard_domains import DomainCounts
from workflows.guard_records import NodeRecords
from workflows.patches import GUARD_RESET_LETS_THROUGH, GUARD_SLOTS_WAIT
from workflows.retries import (
    GUARD_COUNT,
    GUARD_COUNT_BUDGET,
    GUARD_READ,
    GUARD_READ_BUDGET,
    HEARTBEAT,
    NOTIFY_ATTEMPT,
    NOTIFY_BUDGET,
    NOTIFY_RETRY,
    STEP_RETRY,
)

with workflow.unsafe.imports_passed_through():
    from activities.guard import GuardActivities
    from activities.notify import NotifyActivities
    from activities.policy import PolicyActivities
    from models.constants import (
        GUARD_ADMIT_SIGNAL,
        GUARD_DRAINED_SIGNAL,
        GUARD_FORGIVE_SIGNAL,
        GUARD_PAUSE_SIGNAL,
        GUARD_RELEASE_SIGNAL,
        GUARD_REQUEST_SIGNAL,
        GUARD_RESET_SIGNAL,
        GUARD_RESUME_SIGNAL,
        GUARD_RETURNED_SIGNAL,
        GUARD_VALIDATION_FAILED_SIGNAL,
        GUARD_WORKFLOW,
    )
    from models.guard import (
        GUARD_LOG_SIZE,
        GuardCommand,
        GuardEvent,
        GuardInput,
        GuardState,
        GuardStatus,
        NodeRecord,
        SlotRequest,
        WindowEntry,
    )
    from models.metrics import (
        BREAKER_CLOSED,
        BREAKER_PAUSED,
        BREAKER_TRIPPED,
        GUARD_BREAKER,
        GUARD_BREAKER_HELP,
        GUARD_IN_FLIGHT,
        GUARD_IN_FLIGHT_HELP,
        GUARD_UPDATED,
        GUARD_UPDATED_HELP,
        GUARD_WAITING,
        GUARD_WAITING_HELP,
    )
    from models.policy import GuardSettings
    from models.requests import NotifyRequest, WorkerConfig
    from models.topology import GUARD_DOMAIN_SIGNAL, DomainSettings

# The partition's size is counted again when older than this.
RECOUNT = timedelta(minutes=1)
# Messages handled per run before continuing as new (a few history events each).
MESSAGES_PER_RUN = 300


@workflow.defn(name=GUARD_WORKFLOW)
class FleetGuardWorkflow(GuardAnswers, NodeRecords, DomainCounts):
    @workflow.init
    def __init__(self, params: GuardInput) -> None:
        super().__init__()
        self._state = params.state or GuardState(cluster=params.cluster)
        self._inbox: list[tuple[str, SlotRequest | GuardCommand]] = []
        self._limits = GuardSettings()
        self._domain_settings = DomainSettings()
        self._nodes = 0
        self._counted_at: datetime | None = None
        self._pages: list[asyncio.Task[None]] = []

    # -- signals and query --------------------------------------------------------------------------

    @workflow.signal(name=GUARD_REQUEST_SIGNAL)
    def request(self, request: SlotRequest) -> None:
        self._inbox.append((GUARD_REQUEST_SIGNAL, request))

    @workflow.signal(name=GUARD_DRAINED_SIGNAL)
    def drained(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_DRAINED_SIGNAL, command))

    @workflow.signal(name=GUARD_RELEASE_SIGNAL)
    def release(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_RELEASE_SIGNAL, command))

    @workflow.signal(name=GUARD_ADMIT_SIGNAL)
    def admit(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_ADMIT_SIGNAL, command))

    @workflow.signal(name=GUARD_RESET_SIGNAL)
    def reset(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_RESET_SIGNAL, command))

    @workflow.signal(name=GUARD_PAUSE_SIGNAL)
    def pause(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_PAUSE_SIGNAL, command))

    @workflow.signal(name=GUARD_RESUME_SIGNAL)
    def resume(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_RESUME_SIGNAL, command))

    @workflow.signal(name=GUARD_RETURNED_SIGNAL)
    def returned(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_RETURNED_SIGNAL, command))

    @workflow.signal(name=GUARD_FORGIVE_SIGNAL)
    def forgive(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_FORGIVE_SIGNAL, command))

    @workflow.signal(name=GUARD_VALIDATION_FAILED_SIGNAL)
    def validation_failed(self, command: GuardCommand) -> None:
        self._inbox.append((GUARD_VALIDATION_FAILED_SIGNAL, command))

    @workflow.signal(name=GUARD_DOMAIN_SIGNAL)
    def domain(self, command: GuardCommand) -> None:
        """A person's confirm or release of a domain incident, passed on by it."""
        self._inbox.append((GUARD_DOMAIN_SIGNAL, command))

    @workflow.query
    def status(self) -> GuardStatus:
        return GuardStatus(
            state=self._state, limits=self._limits, nodes=self._nodes, nodes_in_window=self._nodes_in_window()
        )

    # -- run ----------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, params: GuardInput) -> None:
        await self._read_limits()
        handled = 0
        while True:
            await workflow.wait_condition(lambda: bool(self._inbox) or self._slot_freed)
            if self._slot_freed:
                self._slot_freed = False
                await self._let_waiting_in()
                await self._let_domain_in()
            while self._inbox:
                kind, message = self._inbox.pop(0)
                await self._handle(kind, message)
                handled += 1
                self._state.handled += 1
                # Those already waiting come before a request that arrives after a slot frees up.
                await self._let_waiting_in()
                await self._let_domain_in()
            self._prune()
            self._describe()
            if handled >= MESSAGES_PER_RUN or workflow.info().is_continue_as_new_suggested():
                await asyncio.gather(*self._pages, *self._answers_being_sent())
                await workflow.wait_condition(workflow.all_handlers_finished)
                # A slot an answer found free (its incident gone) is given before the run ends.
                if not self._inbox and not self._slot_freed:
                    workflow.continue_as_new(GuardInput(cluster=params.cluster, state=self._state))

    async def _handle(self, kind: str, message: SlotRequest | GuardCommand) -> None:
        if isinstance(message, SlotRequest):
            await self._decide(message)
            return
        state = self._state
        by_whom = f"{message.by or '?'}" + (f": {message.reason}" if message.reason else "")
        if kind == GUARD_RELEASE_SIGNAL:
            held = [r for r in state.in_flight + state.waiting if r.incident_id == message.incident_id]
            node = held[0].node if held else message.node  # a slot per step: none held at the close
            if node and message.repaired_by:
                record = state.nodes.setdefault(node, NodeRecord())
                record.repaired_by, record.repaired_at = message.repaired_by, workflow.now()
            state.in_flight = [r for r in state.in_flight if r.incident_id != message.incident_id]
            state.waiting = [r for r in state.waiting if r.incident_id != message.incident_id]
            state.domain_held = [r for r in state.domain_held if r.incident_id != message.incident_id]
            self._forget_released(message.incident_id)
            if held:
                self._log("released", held[0], message.reason)
        elif kind == GUARD_DRAINED_SIGNAL and message.node:
            # A drain is never held back: it is counted (storms trip the breaker at the next
            # request for a slot), and the node's record takes the incident.
            counted = any(entry.incident_id == message.incident_id for entry in state.window)
            if not counted and not self._let_through(message.incident_id):  # (a drain told again)
                state.window.append(WindowEntry(node=message.node, incident_id=message.incident_id, at=workflow.now()))
            self._record_incident(message.node, message.incident_id)
            self._log("drained", detail=f"{message.node} ({message.incident_id})")
            await self._count_in_domains(message)
        elif kind == GUARD_DOMAIN_SIGNAL:
            await self._decide_domain(message)
        elif kind == GUARD_ADMIT_SIGNAL:
            waiting = next((r for r in state.waiting if r.incident_id == message.incident_id), None)
            for_domain = next((r for r in state.domain_held if r.incident_id == message.incident_id), None)
            if waiting is None and for_domain is not None:  # approved past its domain incident too
                state.domain_held.remove(for_domain)
                state.waiting.append(for_domain)
                waiting = for_domain
            if waiting is not None:
                state.waiting.remove(waiting)
                self._take_slot(waiting)
                self._log("approved", waiting, f"let past the guard by {by_whom}")
        elif kind == GUARD_RESET_SIGNAL:
            was = "tripped" if state.tripped else "not tripped"
            if state.tripped and workflow.patched(GUARD_RESET_LETS_THROUGH):
                # What the trip held goes through: not counted again at each later step. (A reset
                # during a pause lets nothing through: the limits apply to what the pause held.)
                held = [*state.in_flight, *(r for r in state.waiting if r.held_by == "breaker")]
                ids = {*(entry.incident_id for entry in state.window), *(r.incident_id for r in held)}
                still = {i for i in state.let_through if self._let_through(i)}  # an earlier reset's, if it runs
                state.let_through = sorted(still | ids)
                state.let_through_until = workflow.now() + timedelta(seconds=self._limits.window_seconds)
            state.tripped, state.tripped_why = False, ""
            state.window, state.window_since = [], workflow.now()
            self._log("reset", detail=f"by {by_whom} (was {was}); the window starts again")
        elif kind == GUARD_PAUSE_SIGNAL:
            state.paused, state.paused_by, state.paused_reason = True, message.by, message.reason
            self._log("paused", detail=f"by {by_whom}")
        elif kind == GUARD_RETURNED_SIGNAL and message.node:
            record = state.nodes.setdefault(message.node, NodeRecord())
            record.returned_at = workflow.now()
            self._log("returned", detail=f"{message.node} back in service; cooldown starts")
        elif kind == GUARD_FORGIVE_SIGNAL and message.node:
            state.nodes.pop(message.node, None)
            self._log(
                "forgiven", detail=f"{message.node} released from quarantine by {by_whom}; its record starts again"
            )
        elif kind == GUARD_VALIDATION_FAILED_SIGNAL and message.node:
            record = self._record_failed_validation(message.node, message.incident_id)
            # A node its released domain returned failed its validation: a fault of its own, no
            # longer told `released` when its incident asks to replace it.
            self._forget_released(message.incident_id.split("/")[0])
            self._log(
                "validation failed",
                detail=f"{message.node}: {message.reason}; {len(record.incidents)} incident(s) in the window",
            )
        elif kind == GUARD_RESUME_SIGNAL and state.paused:
            state.paused, state.paused_by, state.paused_reason = False, "", ""
            self._log("resumed", detail=f"by {by_whom}")

    async def _decide(self, request: SlotRequest) -> None:
        """Grant a slot, or make the incident wait (tripping the breaker when over a limit)."""
        state = self._state
        held = next((r for r in state.in_flight if r.incident_id == request.incident_id), None)
        if held is not None:
            # The incident asks again (its answer lost, or a release of its was): answered as this ask.
            held.ask, held.step = request.ask, request.step
            await self._queue_answer(held, granted=True, why="slot already granted")  # an activity retried
            return
        queued = next((r for r in state.waiting if r.incident_id == request.incident_id), None)
        if queued is not None:
            queued.ask, queued.step = request.ask, request.step
            await self._queue_answer(queued, granted=False, why=self._waiting_why(queued))
            return
        if await self._domain_reask(request):
            return
        code, why = self._quarantine_earned(request.node, request.incident_id)
        escalate_to, escalate_why = self._escalation(request.node)
        request = request.model_copy(
            update={
                "asked_at": workflow.now(),
                "quarantine": code,
                "quarantine_why": why,
                "escalate_to": escalate_to,
                "escalate_why": escalate_why,
            }
        )
        if code:
            self._log("lemon", request, why)
        if escalate_to:
            self._log("escalated", request, f"to {escalate_to}: {escalate_why}")
        if await self._held_for_domain(request):
            return
        if state.paused or state.tripped:
            request.held_by = "breaker" if state.tripped else "pause"
            state.waiting.append(request)
            self._log("waiting", request, self._holding_why())
            await self._queue_answer(request, granted=False, why=self._holding_why())
            return
        if request.ask and workflow.patched(GUARD_SLOTS_WAIT) and await self._slots_full():
            # A slot is held for one destructive step at a time: every slot taken is a queue,
            # not a storm. It goes on as one is given back.
            request.held_by = "slots"
            state.waiting.append(request)
            self._log("waiting", request, self._waiting_why(request))
            await self._queue_answer(request, granted=False, why=self._waiting_why(request))
            return
        over = await self._over_limit(request)
        if over:
            state.waiting.append(request)
            self._trip(request, over)
            await self._queue_answer(request, granted=False, why=self._holding_why())
            return
        self._take_slot(request)
        in_flight = len(state.in_flight)
        self._log("granted", request, f"{in_flight} of {self._limits.max_in_flight} in flight")
        await self._queue_answer(request, granted=True, why=f"slot {in_flight} of {self._limits.max_in_flight}")

    async def _slots_full(self) -> bool:
        """Whether every slot is held by an incident that still runs."""
        if len(self._state.in_flight) >= self._limits.max_in_flight:
            await self._reap()
        return len(self._state.in_flight) >= self._limits.max_in_flight

    async def _over_limit(self, request: SlotRequest) -> str:
        """Why one more incident would be too many ("" when it is not)."""
        limits = self._limits
        if len(self._state.in_flight) + 1 > limits.max_in_flight:
            await self._reap()
        in_flight = len(self._state.in_flight)
        if in_flight + 1 > limits.max_in_flight:
            return f"{in_flight + 1} incidents would be in flight; the limit is {limits.max_in_flight}"
        await self._count_nodes()
        nodes = set(self._nodes_in_window())
        if not self._let_through(request.incident_id):
            nodes.add(self._window_key(request.node))
        if limits.max_share and self._nodes and len(nodes) / self._nodes > limits.max_share:
            return (
                f"{len(nodes)} of the partition's {self._nodes} nodes would have incidents within "
                f"{limits.window_seconds / 60:g} min ({len(nodes) / self._nodes:.0%}); "
                f"the limit is {limits.max_share:.0%}"
            )
        return ""

    async def _let_waiting_in(self) -> None:
        """With the breaker closed and not paused, waiting incidents go on as slots free up."""
        state = self._state
        while state.waiting and not state.tripped and not state.paused:
            if len(state.in_flight) >= self._limits.max_in_flight:
                await self._reap()
                if len(state.in_flight) >= self._limits.max_in_flight:
                    return
            request = state.waiting[0]
            if request.held_by in ("pause", "slots"):
                # Held only by a pause, or in line for a slot: the limits it never met apply now
                # (a reset's go-ahead does not).
                over = await self._over_limit(request)
                if over:
                    self._trip(request, over)
                    await self._queue_answer(request, granted=False, why=self._holding_why())
                    return
            if not state.waiting or state.waiting[0] is not request:
                continue  # it went (its incident is gone) while the limits were read: look again
            state.waiting.pop(0)
            self._take_slot(request)
            self._log("granted", request, "after waiting")
            await self._queue_answer(request, granted=True, why="slot freed after waiting")

    def _trip(self, request: SlotRequest, why: str) -> None:
        """Trip the breaker on ``request`` (already waiting) and page, beside the guard's work."""
        state = self._state
        state.tripped, state.tripped_at, state.tripped_why = True, workflow.now(), why
        for waiting in state.waiting:
            waiting.held_by = "breaker"
        self._log("tripped", request, why)
        # A slow webhook never holds up the next decision.
        self._pages = [task for task in self._pages if not task.done()]
        self._pages.append(asyncio.create_task(self._page(request)))

    def _take_slot(self, request: SlotRequest) -> None:
        self._state.in_flight.append(request)
        if self._let_through(request.incident_id):
            return  # a reset let it through: not counted again
        if not any(entry.incident_id == request.incident_id for entry in self._state.window):
            self._state.window.append(
                WindowEntry(
                    node=request.node,
                    incident_id=request.incident_id,
                    at=workflow.now(),
                    domain=self._in_domain(request.node),
                )
            )

    async def _reap(self) -> None:
        """Give back the slots of incidents that ended without saying so (terminated by a person)."""
        held = list(self._state.in_flight)
        if not held:
            return
        try:
            alive: list[str] = await workflow.execute_activity_method(
                GuardActivities.running,
                held,
                start_to_close_timeout=GUARD_READ,
                schedule_to_close_timeout=GUARD_READ_BUDGET,
                heartbeat_timeout=HEARTBEAT,
                retry_policy=STEP_RETRY,
                summary="check which incidents holding slots still run",
            )
        except ActivityError:
            return  # cannot tell: keep every slot held
        for request in [r for r in self._state.in_flight if r.incident_id not in alive]:
            self._state.in_flight.remove(request)
            self._log("reaped", request, "its incident ended without giving the slot back")

    async def _read_limits(self) -> None:
        """The worker's policy file (``guard:``); the last limits read are kept when it cannot
        be read (a guard that stops would leave every incident of the cluster waiting)."""
        try:
            config: WorkerConfig = await workflow.execute_activity_method(
                PolicyActivities.worker_config,
                self._state.cluster,
                start_to_close_timeout=GUARD_READ,
                schedule_to_close_timeout=GUARD_READ_BUDGET,
                retry_policy=STEP_RETRY,
                summary="read the guard's limits",
            )
        except ActivityError as exc:
            self._log("limits", detail=f"the worker's policy could not be read ({exc.cause or exc}); limits kept")
            return
        self._limits = config.policy.guard
        self._domain_settings = config.policy.domains

    async def _count_nodes(self) -> None:
        """The partition's size (and the limits, so that a policy edit reaches the guard), at
        most once a minute."""
        now = workflow.now()
        if self._counted_at is not None and now - self._counted_at < RECOUNT:
            return
        self._counted_at = now
        await self._read_limits()
        try:
            self._nodes = await workflow.execute_activity_method(
                GuardActivities.fleet_size,
                start_to_close_timeout=GUARD_COUNT,
                schedule_to_close_timeout=GUARD_COUNT_BUDGET,
                heartbeat_timeout=HEARTBEAT,
                retry_policy=STEP_RETRY,
                summary="count the partition's nodes",
            )
        except ActivityError as exc:
            self._log("count", detail=f"the partition could not be counted ({exc.cause or exc}); last count kept")

    def _window_start(self) -> datetime:
        since = workflow.now() - timedelta(seconds=self._limits.window_seconds)
        window_since = self._state.window_since
        return window_since if window_since is not None and window_since > since else since

    def _let_through(self, incident_id: str) -> bool:
        """Whether the last reset let this incident through, and the reset's window still runs."""
        state = self._state
        until = state.let_through_until
        return incident_id in state.let_through and until is not None and workflow.now() <= until

    def _nodes_in_window(self) -> list[str]:
        since = self._window_start()
        return sorted({entry.domain or entry.node for entry in self._state.window if entry.at >= since})

    def _prune(self) -> None:
        """Forget what no limit looks at any more: old window entries, nodes with no recent record."""
        state, limits, now = self._state, self._limits, workflow.now()
        since = self._window_start()
        state.window = [entry for entry in state.window if entry.at >= since]
        if state.let_through and (state.let_through_until is None or now > state.let_through_until):
            # Past the reset's window, as any incident's entry ages out: a later step counts anew.
            state.let_through, state.let_through_until = [], None
        self._prune_domains(now)
        keep = timedelta(
            seconds=max(limits.quarantine_window_seconds, limits.cooldown_seconds, limits.escalation_window_seconds)
        )
        for node, record in list(state.nodes.items()):
            stamps = [*record.incidents, record.returned_at, record.repaired_at]
            if all(stamp is None or now - stamp > keep for stamp in stamps):
                del state.nodes[node]

    def _waiting_why(self, request: SlotRequest) -> str:
        if request.held_by == "slots" and not (self._state.paused or self._state.tripped):
            return f"every slot is taken ({len(self._state.in_flight)} of {self._limits.max_in_flight}); next in line"
        return self._holding_why()

    def _holding_why(self) -> str:
        state = self._state
        if state.paused:
            return f"remediation is paused by {state.paused_by or '?'}" + (
                f" ({state.paused_reason})" if state.paused_reason else ""
            )
        return (
            f"the fleet guard's breaker tripped: {state.tripped_why}. No job is killed, nothing repaired or "
            "retired until "
            f"`gpufleet breaker reset --cluster {state.cluster}` or `gpufleet approve INCIDENT`"
        )

    async def _page(self, request: SlotRequest) -> None:
        """Page the operator, once per trip."""
        state = self._state
        state.pages += 1
        holding = ", ".join(f"{r.node} ({r.incident_id})" for r in state.in_flight) or "none"
        text = (
            f"[guard-{state.cluster}] breaker tripped: {state.tripped_why}. {request.node} ({request.incident_id}) "
            f"and every later incident wait: their nodes drained, no job killed. In flight: {holding}. "
            f"`gpufleet breaker status --cluster {state.cluster}` shows who waits; "
            f"`gpufleet breaker reset --cluster {state.cluster}` lets them go on, one slot at a time."
        )
        try:
            await workflow.execute_activity_method(
                NotifyActivities.notify,
                NotifyRequest(kind="breaker_tripped", text=text, guard=self.status()),
                start_to_close_timeout=NOTIFY_ATTEMPT,
                schedule_to_close_timeout=NOTIFY_BUDGET,
                retry_policy=NOTIFY_RETRY,
                summary="page: breaker tripped",
            )
            self._log("paged", request, "breaker_tripped sent")
        except ActivityError as exc:
            self._log("paged", request, f"breaker_tripped not delivered: {exc.cause or exc}")

    def _log(self, event: str, request: SlotRequest | None = None, detail: str = "") -> None:
        entry = GuardEvent(
            at=workflow.now(),
            event=event,
            incident_id=request.incident_id if request else "",
            node=request.node if request else "",
            detail=detail,
        )
        self._state.log = [*self._state.log, entry][-GUARD_LOG_SIZE:]

    def _describe(self) -> None:
        """What the Temporal UI shows for the guard."""
        state = self._state
        mode = "PAUSED" if state.paused else "TRIPPED" if state.tripped else "closed"
        workflow.set_current_details(
            f"breaker {mode}; in flight {len(state.in_flight)}/{self._limits.max_in_flight}: "
            f"{', '.join(r.node for r in state.in_flight) or '-'}; waiting: "
            f"{', '.join(r.node for r in state.waiting) or '-'}"
        )
        self._export_metrics()

    def _export_metrics(self) -> None:
        """The breaker, slots and waits as Prometheus gauges (workflow.metric_meter(): nothing is
        recorded while a history is replayed, so a restarted worker reports at the next message)."""
        if workflow.unsafe.is_replaying():
            return
        state, meter = self._state, workflow.metric_meter()
        labels = {"cluster": state.cluster}
        breaker = BREAKER_PAUSED if state.paused else BREAKER_TRIPPED if state.tripped else BREAKER_CLOSED
        meter.create_gauge(GUARD_BREAKER, GUARD_BREAKER_HELP).set(breaker, labels)
        meter.create_gauge(GUARD_IN_FLIGHT, GUARD_IN_FLIGHT_HELP).set(len(state.in_flight), labels)
        meter.create_gauge(GUARD_WAITING, GUARD_WAITING_HELP).set(len(state.waiting), labels)
        meter.create_gauge_float(GUARD_UPDATED, GUARD_UPDATED_HELP, "s").set(workflow.now().timestamp(), labels)
