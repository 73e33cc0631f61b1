"""ClusterCreationWorkflow: a Slurm cluster from a spec, one idempotent activity per step.

validate -> reserve nodes -> render slurm.conf -> Kubernetes objects -> bring up -> accounts and
users -> smoke test -> make remediable -> notify. On a failure the steps done so far are undone
in reverse (each undo an idempotent activity too), unless the creation keeps what it made: it
then waits, as ``failed_kept``, for ``resume`` (the failed step again, after a fix) or
``roll_back``. A step's activity retries only what may pass on its own (a lost connection) and
only briefly, so the real cause shows in the status within a minute; a wrong spec or an empty
pool fails at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.patches import DELETE_STOPS_INCIDENTS, INPUTS_CHECKED
from workflows.retries import CLUSTER_DELETE_STEP, CLUSTER_HEARTBEAT, CLUSTER_RETRY, CLUSTER_SLOW_STEP, CLUSTER_STEP

with workflow.unsafe.imports_passed_through():
    from models.clusterops import (
        CLUSTER_CREATION_WORKFLOW,
        CLUSTER_DELETION_WORKFLOW,
        RESUME_SIGNAL,
        ROLL_BACK_SIGNAL,
        STEPS,
        UNDOABLE,
        ClusterCreateInput,
        ClusterDeleteInput,
        ClusterOutcome,
        ClusterRequest,
        ClusterStatus,
        ClusterStep,
        DeleteEvent,
        DeleteStep,
        DeletionStatus,
        JobsResult,
        StepEvent,
        StepResult,
    )
    from models.trust import deletion_problem

# The activity of each step, and of its undo.
DO = {
    ClusterStep.VALIDATE: "cluster_validate",
    ClusterStep.RESERVE: "cluster_reserve",
    ClusterStep.RENDER: "cluster_render",
    ClusterStep.OBJECTS: "cluster_create_objects",
    ClusterStep.BRING_UP: "cluster_bring_up",
    ClusterStep.USERS: "cluster_add_users",
    ClusterStep.SMOKE: "cluster_smoke_test",
    ClusterStep.REMEDIABLE: "cluster_make_remediable",
    ClusterStep.NOTIFY: "cluster_notify",
}
UNDO = {
    ClusterStep.RESERVE: "cluster_release",
    ClusterStep.OBJECTS: "cluster_delete_objects",
    ClusterStep.BRING_UP: "cluster_tear_down",
    ClusterStep.USERS: "cluster_remove_users",
    ClusterStep.REMEDIABLE: "cluster_unmake_remediable",
}
# The slow steps (workflows/retries.py says why).
TIMEOUTS = {ClusterStep.BRING_UP: CLUSTER_SLOW_STEP, ClusterStep.SMOKE: CLUSTER_SLOW_STEP}


async def _activity(
    name: str, work: ClusterRequest, result_type: type[Any], *, timeout: timedelta, summary: str
) -> Any:
    """One step's (or undo's) activity, with the options every cluster step shares."""
    return await workflow.execute_activity(
        name,
        work,
        result_type=result_type,
        start_to_close_timeout=timeout,
        heartbeat_timeout=CLUSTER_HEARTBEAT,
        retry_policy=CLUSTER_RETRY,
        summary=summary,
    )


def _cause(exc: BaseException) -> str:
    """The innermost message: what actually went wrong."""
    while isinstance(exc, ActivityError) and exc.cause is not None:
        exc = exc.cause
    return exc.message if isinstance(exc, ApplicationError) else str(exc)


@workflow.defn(name=CLUSTER_CREATION_WORKFLOW)
class ClusterCreationWorkflow:
    def __init__(self) -> None:
        self._status: ClusterStatus | None = None
        self._answer: str | None = None  # resume | roll_back, while failed_kept

    @workflow.run
    async def run(self, request: ClusterCreateInput) -> ClusterStatus:
        spec = request.spec
        status = self._status = ClusterStatus(
            name=spec.name,
            backend=request.backend,
            spec=spec,
            creation=workflow.info().run_id,
            partitions={p.name: p.nodes for p in spec.partitions},
            users=[u.name for u in spec.users],
            started_at=workflow.now(),
        )
        work = ClusterRequest(spec=spec, backend=request.backend, creation=workflow.info().run_id)
        index = 0
        while index < len(STEPS):
            step = STEPS[index]
            try:
                result = await self._step(step, work)
            except ActivityError as exc:
                cause = _cause(exc)
                status.failed_step, status.error = step, cause
                self._event(step, "failed", cause)
                if request.keep_on_failure and await self._kept():
                    status.failed_step, status.error = None, ""
                    self._event(step, "resumed", "resumed after a fix")
                    continue  # the failed step again
                await self._undo(work)
                return self._finish()
            status.done.append(step)
            if result.placement:
                work.placement = status.placement = result.placement
            if result.slurm_conf:
                work.slurm_conf = result.slurm_conf
            if result.login:
                status.login = result.login
            self._event(step, "done", result.detail)
            index += 1
        status.outcome = ClusterOutcome.READY
        status.step = None
        return self._finish()

    @workflow.query
    def status(self) -> ClusterStatus | None:
        return self._status

    @workflow.signal(name=RESUME_SIGNAL)
    def resume(self) -> None:
        self._answer = "resume"

    @workflow.signal(name=ROLL_BACK_SIGNAL)
    def roll_back(self) -> None:
        self._answer = "roll_back"

    async def _step(self, step: ClusterStep, work: ClusterRequest) -> StepResult:
        assert self._status is not None
        self._status.step = step
        self._event(step, "started")
        result: StepResult = await _activity(
            DO[step], work, StepResult, timeout=TIMEOUTS.get(step, CLUSTER_STEP), summary=f"{step} {work.spec.name}"
        )
        return result

    async def _kept(self) -> bool:
        """Wait, keeping everything, for ``resume`` (True) or ``roll_back`` (False)."""
        assert self._status is not None
        self._status.outcome = ClusterOutcome.FAILED_KEPT
        self._answer = None
        await workflow.wait_condition(lambda: self._answer is not None)
        self._status.outcome = ClusterOutcome.CREATING
        return self._answer == "resume"

    async def _undo(self, work: ClusterRequest) -> None:
        """Undo, in reverse, exactly the steps that were done (and the failed one, in part:
        a reservation that failed midway gave back its nodes itself; objects or daemons
        half-made are found and removed by their undo)."""
        status = self._status
        assert status is not None
        attempted = [*status.done, *([status.failed_step] if status.failed_step else [])]
        failed_undo = False
        for step in reversed(attempted):
            if step not in UNDOABLE:
                continue
            status.step = step
            try:
                result: StepResult = await _activity(
                    UNDO[step],
                    work,
                    StepResult,
                    timeout=TIMEOUTS.get(step, CLUSTER_STEP),
                    summary=f"undo {step} {work.spec.name}",
                )
            except ActivityError as exc:
                failed_undo = True
                self._event(step, "undo_failed", _cause(exc))
                continue
            if step in status.done:
                status.done.remove(step)
            self._event(step, "undone", result.detail)
        status.outcome = ClusterOutcome.ROLLBACK_INCOMPLETE if failed_undo else ClusterOutcome.ROLLED_BACK
        status.step = None

    def _event(self, step: ClusterStep, event: str, detail: str = "") -> None:
        assert self._status is not None
        self._status.timeline.append(StepEvent(step=step, event=event, at=workflow.now(), detail=detail))

    def _finish(self) -> ClusterStatus:
        assert self._status is not None
        self._status.finished_at = workflow.now()
        return self._status


DELETE_POLL = timedelta(seconds=10)


@workflow.defn(name=CLUSTER_DELETION_WORKFLOW)
class ClusterDeletionWorkflow:
    """Delete a cluster: drain, wait for its running jobs up to a deadline (or, forced, cancel
    them), stop its remediation, remove its accounts, tear Slurm down, give its nodes back to the free pool, delete
    its objects, notify. Jobs still running at the deadline fail the deletion with the cluster
    drained and otherwise whole: nothing is torn down under a running job unless forced."""

    def __init__(self) -> None:
        self._status: DeletionStatus | None = None

    @workflow.run
    async def run(self, request: ClusterDeleteInput) -> DeletionStatus:
        # Whoever may start workflows could skip the CLI's checks: refuse before anything changes.
        problem = deletion_problem(force=request.force, requested_by=request.requested_by, reason=request.reason)
        if problem and workflow.patched(INPUTS_CHECKED):
            workflow.logger.warning("deletion of %s refused: %s", request.spec.name, problem)
            raise ApplicationError(
                f"deletion of {request.spec.name} refused, nothing changed: {problem}",
                type="InvalidInput",
                non_retryable=True,
            )
        status = self._status = DeletionStatus(
            name=request.spec.name, backend=request.backend, started_at=workflow.now()
        )
        work = ClusterRequest(spec=request.spec, backend=request.backend, creation=request.creation)
        try:
            if workflow.patched(DELETE_STOPS_INCIDENTS):
                await self._step(DeleteStep.STOP_INCIDENTS, "cluster_stop_incidents", work)
            await self._step(DeleteStep.DRAIN, "cluster_drain", work)
            await self._wait_for_jobs(request, work)
            if workflow.patched(DELETE_STOPS_INCIDENTS):
                # Again: an Xid while the jobs drained may have opened an incident (and restarted
                # the guard); none must outlive the cluster's worker.
                await self._step(DeleteStep.STOP_INCIDENTS, "cluster_stop_incidents", work)
            await self._step(DeleteStep.UNMAKE_REMEDIABLE, "cluster_unmake_remediable", work)
            # Its associations leave the accounting database, which may outlive the cluster.
            await self._accounts(request, work)
            await self._step(DeleteStep.TEAR_DOWN, "cluster_tear_down", work)
            await self._step(DeleteStep.RELEASE, "cluster_release", work)
            await self._step(DeleteStep.OBJECTS, "cluster_delete_objects", work)
            await self._step(DeleteStep.NOTIFY, "cluster_notify_deleted", work)
        except (ActivityError, ApplicationError) as exc:
            assert status.step is not None
            status.outcome, status.error = "failed", _cause(exc)
            self._event(status.step, "failed", status.error)
            status.finished_at = workflow.now()
            return status
        status.outcome, status.step = "deleted", None
        status.finished_at = workflow.now()
        return status

    @workflow.query
    def status(self) -> DeletionStatus | None:
        return self._status

    async def _wait_for_jobs(self, request: ClusterDeleteInput, work: ClusterRequest) -> None:
        status = self._status
        assert status is not None
        status.step = DeleteStep.WAIT_JOBS
        self._event(DeleteStep.WAIT_JOBS, "started")
        deadline = workflow.now() + timedelta(seconds=request.deadline_seconds)
        if request.force:
            cancelled: JobsResult = await self._call("cluster_cancel_jobs", work, JobsResult)
            status.cancelled_jobs = cancelled.running
            self._event(DeleteStep.WAIT_JOBS, "done", f"--force: cancelled {cancelled.running} job(s), not requeued")
            return
        while True:
            jobs: JobsResult = await self._call("cluster_running_jobs", work, JobsResult)
            status.running_jobs = jobs.running
            if jobs.running == 0:
                self._event(DeleteStep.WAIT_JOBS, "done", "no job running")
                return
            if workflow.now() >= deadline:
                raise ApplicationError(
                    f"{jobs.running} job(s) still running after {request.deadline_seconds:g}s; the cluster is "
                    f"drained and kept. Wait, or delete with --force --reason WHY to cancel them",
                    type="StepFailed",
                )
            self._event(DeleteStep.WAIT_JOBS, "waiting", jobs.detail)
            await workflow.sleep(min(DELETE_POLL, deadline - workflow.now()))

    async def _accounts(self, request: ClusterDeleteInput, work: ClusterRequest) -> None:
        """Remove the cluster's accounts; forced, a failure is said and the deletion goes on
        (the accounts stay in the database), else it stops the deletion with the cluster whole."""
        try:
            await self._step(DeleteStep.ACCOUNTS, "cluster_remove_users", work)
        except (ActivityError, ApplicationError) as exc:
            if not request.force:
                raise ApplicationError(
                    f"{_cause(exc)}; fix it and delete again, "
                    "or delete with --force --reason WHY to leave the accounts",
                    type="StepFailed",
                ) from None
            self._event(DeleteStep.ACCOUNTS, "left", f"--force: accounts left in the database: {_cause(exc)}")

    async def _step(self, step: DeleteStep, activity: str, work: ClusterRequest) -> None:
        assert self._status is not None
        self._status.step = step
        self._event(step, "started")
        result: StepResult = await self._call(activity, work, StepResult)
        self._event(step, "done", result.detail)

    async def _call(self, activity: str, work: ClusterRequest, result_type: type[Any]) -> Any:
        return await _activity(
            activity, work, result_type, timeout=CLUSTER_DELETE_STEP, summary=f"{activity} {work.spec.name}"
        )

    def _event(self, step: DeleteStep, event: str, detail: str = "") -> None:
        assert self._status is not None
        if event == "waiting" and self._status.timeline and self._status.timeline[-1].event == "waiting":
            self._status.timeline[-1] = DeleteEvent(step=step, event=event, at=workflow.now(), detail=detail)
            return  # one line for a long wait, kept current
        self._status.timeline.append(DeleteEvent(step=step, event=event, at=workflow.now(), detail=detail))
