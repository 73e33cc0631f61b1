"""ClusterUsersWorkflow: the users of a running cluster changed, one idempotent activity per step.

validate -> add accounts (the new spec's, only those missing) -> set logins (the login node's
users and keys become the new spec's) -> remove accounts (of the users gone). A failed step undoes,
in reverse, what was done: the logins set back to the old spec's, the accounts of added users
removed; the status then says the change was undone, and why. The change is checked here again
(the command checked it first): what crosses from a command into the workflow is never trusted.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.cluster import _activity, _cause
from workflows.retries import CLUSTER_STEP

with workflow.unsafe.imports_passed_through():
    from models.cluster import ClusterSpec
    from models.clusterops import ClusterRequest, StepResult
    from models.clusterusers import (
        CLUSTER_USERS_WORKFLOW,
        USERS_STEPS,
        UsersChangeInput,
        UsersChangeStatus,
        UsersEvent,
        UsersOutcome,
        UsersStep,
        users_change_problems,
    )

# The check of the cluster (its creation, ready), and the activity of each step (those of cluster
# creation and deletion, and set_logins).
CHECK = "cluster_users_check"
DO = {
    UsersStep.ADD_ACCOUNTS: "cluster_add_users",
    UsersStep.SET_LOGINS: "cluster_set_logins",
    UsersStep.REMOVE_ACCOUNTS: "cluster_remove_users",
}
UNDO = {
    UsersStep.REMOVE_ACCOUNTS: "cluster_add_users",
    UsersStep.SET_LOGINS: "cluster_set_logins",
    UsersStep.ADD_ACCOUNTS: "cluster_remove_users",
}
# A step the backend cannot do at all (it has no such method) did nothing: it has nothing to undo.
UNSUPPORTED = "Unsupported"
STEP_TIMEOUT: timedelta = CLUSTER_STEP


def _error_type(exc: BaseException) -> str:
    """The type of the innermost application error (what the activity said went wrong)."""
    while isinstance(exc, ActivityError) and exc.cause is not None:
        exc = exc.cause
    return exc.type or "" if isinstance(exc, ApplicationError) else ""


@workflow.defn(name=CLUSTER_USERS_WORKFLOW)
class ClusterUsersWorkflow:
    def __init__(self) -> None:
        self._status: UsersChangeStatus | None = None

    @workflow.run
    async def run(self, request: UsersChangeInput) -> UsersChangeStatus:
        status = self._status = UsersChangeStatus(
            name=request.name,
            backend=request.backend,
            creation=request.creation,
            action=request.action,
            old=request.old,
            new=request.new,
            based_on=request.based_on,
            started_at=workflow.now(),
        )
        self._event(UsersStep.VALIDATE, "started")
        problems, change = users_change_problems(request)
        if problems:
            status.outcome, status.failed_step, status.error = (
                UsersOutcome.REFUSED,
                UsersStep.VALIDATE,
                "; ".join(problems),
            )
            self._event(UsersStep.VALIDATE, "failed", status.error)
            return self._finish()
        status.added, status.removed, status.rekeyed = change.added, change.removed, change.rekeyed
        try:
            # The cluster itself, asked of Temporal by the worker: the creation named, ready.
            await self._call(CHECK, request.old, request, summary=f"check {request.name}")
        except ActivityError as exc:
            status.outcome, status.failed_step, status.error = UsersOutcome.REFUSED, UsersStep.VALIDATE, _cause(exc)
            self._event(UsersStep.VALIDATE, "failed", status.error)
            return self._finish()
        self._event(UsersStep.VALIDATE, "done", self._says())
        for step in USERS_STEPS:
            try:
                detail = await self._step(step, request)
            except ActivityError as exc:
                status.failed_step, status.error = step, _cause(exc)
                self._event(step, "failed", status.error)
                await self._undo(request, failed_did_nothing=_error_type(exc) == UNSUPPORTED)
                return self._finish()
            status.done.append(step)
            self._event(step, "done", detail)
        status.outcome, status.step = UsersOutcome.DONE, None
        return self._finish()

    @workflow.query
    def status(self) -> UsersChangeStatus | None:
        return self._status

    def _says(self) -> str:
        assert self._status is not None
        parts = [
            f"{what}: {', '.join(names)}"
            for what, names in (
                ("adding", self._status.added),
                ("removing", self._status.removed),
                ("new keys for", self._status.rekeyed),
            )
            if names
        ]
        return "; ".join(parts)

    async def _step(self, step: UsersStep, request: UsersChangeInput) -> str:
        assert self._status is not None
        self._status.step = step
        self._event(step, "started")
        if step == UsersStep.ADD_ACCOUNTS:
            if not self._status.added:
                return "no user added"
            return await self._call(DO[step], request.new, request, summary=f"add accounts {request.name}")
        if step == UsersStep.SET_LOGINS:
            return await self._call(DO[step], request.new, request, summary=f"set logins {request.name}")
        if not self._status.removed:
            return "no user removed"
        return await self._call(
            DO[step], request.old, request, only=self._status.removed, summary=f"remove accounts {request.name}"
        )

    async def _undo(self, request: UsersChangeInput, *, failed_did_nothing: bool = False) -> None:
        """Undo, in reverse, the steps done (and the failed one, unless it could not be done at
        all: its activity may have done part of its work; each undo finds and undoes what is there)."""
        status = self._status
        assert status is not None
        failed = [status.failed_step] if status.failed_step and not failed_did_nothing else []
        attempted = [*status.done, *failed]
        failed_undo = False
        for step in reversed(attempted):
            if step not in UNDO or (step == UsersStep.ADD_ACCOUNTS and not status.added):
                continue
            if step == UsersStep.REMOVE_ACCOUNTS and not status.removed:
                continue
            status.step = step
            try:
                if step == UsersStep.SET_LOGINS:
                    detail = await self._call(UNDO[step], request.old, request, summary=f"undo logins {request.name}")
                elif step == UsersStep.REMOVE_ACCOUNTS:  # the accounts removed put back (only what is missing)
                    detail = await self._call(UNDO[step], request.old, request, summary=f"undo removal {request.name}")
                else:
                    detail = await self._call(
                        UNDO[step], request.new, request, only=status.added, summary=f"undo accounts {request.name}"
                    )
            except ActivityError as exc:
                failed_undo = True
                self._event(step, "undo_failed", _cause(exc))
                continue
            if step in status.done:
                status.done.remove(step)
            self._event(step, "undone", detail)
        status.outcome = UsersOutcome.UNDO_INCOMPLETE if failed_undo else UsersOutcome.UNDONE
        status.step = None

    async def _call(
        self,
        activity: str,
        spec: ClusterSpec,
        request: UsersChangeInput,
        *,
        summary: str,
        only: list[str] | None = None,
    ) -> str:
        work = ClusterRequest(spec=spec, backend=request.backend, creation=request.creation, only=only)
        result: Any = await _activity(activity, work, StepResult, timeout=STEP_TIMEOUT, summary=summary)
        detail: str = result.detail
        return detail

    def _event(self, step: UsersStep, event: str, detail: str = "") -> None:
        assert self._status is not None
        self._status.timeline.append(UsersEvent(step=step, event=event, at=workflow.now(), detail=detail))

    def _finish(self) -> UsersChangeStatus:
        assert self._status is not None
        self._status.finished_at = workflow.now()
        return self._status
