"""Repairs in place: reset a GPU or reboot a node through a Kubernetes Job pinned to it, then
check that the GPU answers through another.

What counts as done differs. A reset is done when its Job completes. A reboot is done when the
node comes back Ready with a new boot ID: the reboot Job's pod dies with the node, so its own
outcome says nothing. Either way the check Job must then complete (the GPU answers). A
validation (DRAIN_AFTER_JOBS once the node's jobs have ended) runs the check Job alone.

A Job is its attempt's record and is never deleted by gpufleet: one that overruns is stopped
(suspended) and annotated with why, so that a retry of the attempt reads the verdict instead
of starting the reset or reboot again. Deadlines count from the Job's creation, not from the
activity's try.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from temporalio import activity

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.dryrun import dry_run
from clients.errors import ClientError, InvalidInput, NotFound
from clients.kube import KubeClient
from models.constants import BOOT_ID_ANNOTATION, INCIDENT_ANNOTATION, REPAIR_LABEL, VERDICT_ANNOTATION
from models.names import InvalidName, dns_name, validate_node_name
from models.policy import Action
from models.requests import RepairRequest, RepairResult, StopRepairsRequest

# A GPU as the driver names it: a UUID (GPU-8c2f...) or a PCI address (0000:3b:00.0).
_GPU = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,95}$")
# DRAIN_AFTER_JOBS: the node's jobs have ended and ``drain_after_jobs.then`` is validate: the
# check alone (the GPU answers), nothing reset or rebooted.
_KINDS = {Action.RESET_GPU: "reset", Action.REBOOT_NODE: "reboot", Action.DRAIN_AFTER_JOBS: "check"}


def _kind(request: RepairRequest) -> str:
    kind = _KINDS.get(request.action)
    if kind is None:
        raise InvalidInput(
            f"{request.action} is not a repair in place (RESET_GPU or REBOOT_NODE) or a validation (DRAIN_AFTER_JOBS)"
        )
    return kind


def _command(request: RepairRequest, kind: str) -> tuple[str, list[str]]:
    """The image and the configured command for a Job of this kind (``[]``: no check)."""
    settings = request.settings
    if kind == "reset":
        return settings.reset_image, settings.reset_command
    if kind == "reboot":
        return settings.reboot_image, settings.reboot_command
    # A GPU name unfit for a command line cannot be checked by name: check the node's GPUs.
    named = bool(request.gpu) and bool(_GPU.match(request.gpu))
    return settings.check_image, (settings.check_command if named else settings.node_check_command)


def repair_job(request: RepairRequest, kind: str | None = None, *, boot_id: str = "") -> dict[str, Any]:
    """The Job for one attempt (``kind``: reset or reboot, from the action; or check): pinned to
    the node, tolerating its taints, run once. A reboot Job carries the node's boot ID from
    before it.

    Raises:
        InvalidInput: an action that is not a repair in place, or a GPU or node name unfit
            for a command line.
    """
    kind = kind or _kind(request)
    try:
        node = validate_node_name(request.node)
    except InvalidName as exc:
        raise InvalidInput(str(exc)) from None
    settings = request.settings
    image, command = _command(request, kind)
    if any("{gpu}" in part for part in command) and not _GPU.match(request.gpu or ""):
        raise InvalidInput(f"a GPU {kind} needs the GPU's UUID or PCI address; the event gave {request.gpu!r}")
    argv = [
        part.replace("{gpu}", request.gpu).replace("{node}", node).replace("{boot_id}", boot_id) for part in command
    ]
    annotations = {INCIDENT_ANNOTATION: request.incident_id}
    if kind == "reboot":
        annotations[BOOT_ID_ANNOTATION] = boot_id
    return pinned_job(
        name=job_name(kind, node, f"{request.incident_id}/{request.attempt}"),
        namespace=settings.namespace,
        node=node,
        container=kind,
        label=kind,
        image=image,
        argv=argv,
        annotations=annotations,
        timeout_seconds=settings.job_timeout_seconds,
        runtime_class=settings.runtime_class,
        host_pid=kind == "reboot",
    )


def job_name(kind: str, node: str, key: str) -> str:
    """A Job's name for one attempt: its kind, its node and a digest of ``key`` (the same key, the
    same name: a retry finds its own Job). A Job's name is its pods' job-name label too: a
    DNS-1123 name of at most 63 characters."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return dns_name(f"gpufleet-{kind}-{node}"[:52].rstrip("-.") + f"-{digest}")


def pinned_job(
    *,
    name: str,
    namespace: str,
    node: str,
    container: str,
    label: str,
    image: str,
    argv: list[str],
    annotations: dict[str, str],
    timeout_seconds: float,
    runtime_class: str | None = None,
    host_pid: bool = False,
    logs_on_error: bool = False,
) -> dict[str, Any]:
    """A privileged Job pinned to ``node``, tolerating its taints, run once within
    ``timeout_seconds``, labelled ``gpufleet.io/repair=<label>``. With ``logs_on_error``, its
    container's termination message is its last output when it fails (else what it writes to
    /dev/termination-log)."""
    pod: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "hostPID": host_pid,
        # The node is drained, cordoned and tainted by now: the Job runs there anyway.
        "tolerations": [{"operator": "Exists"}],
    }
    if runtime_class:
        pod["runtimeClassName"] = runtime_class
    spec: dict[str, Any] = {
        "name": container,
        "image": image,
        "command": argv,
        "securityContext": {"privileged": True},
    }
    if logs_on_error:
        spec["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {REPAIR_LABEL: label},
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(timeout_seconds),
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": {REPAIR_LABEL: label}},
                "spec": {**pod, "containers": [spec]},
            },
        },
    }


def _argv(job: dict[str, Any]) -> str:
    return " ".join(job["spec"]["template"]["spec"]["containers"][0]["command"])


def _short(boot_id: str) -> str:
    return boot_id[:8] or "(none)"


def stop_incident_repairs(kube: KubeClient, namespace: str, incident_id: str, why: str) -> list[str]:
    """Stop the repair Jobs of ``incident_id`` in ``namespace`` that still run (a retry finds them
    stopped already); returns the names of those stopped."""
    stopped = []
    for job in kube.list_jobs(namespace, label_selector=REPAIR_LABEL):
        if job.active and job.annotations.get(INCIDENT_ANNOTATION) == incident_id:
            kube.stop_job(namespace, job.name, annotations={VERDICT_ANNOTATION: why})
            stopped.append(job.name)
    return stopped


class RepairActivities:
    def __init__(self, kube: KubeClient, *, poll_seconds: float = 0.5) -> None:
        self._kube = kube
        self._poll = poll_seconds

    @activity.defn(name="start_reboot")
    @heartbeating
    def start_reboot(self, request: RepairRequest) -> str:
        """Create the reboot Job, with the node's boot ID of now, once (a retry finds it); returns
        its name. The reboot is then under way: waiting for the node to come back on a new boot
        is ``repair_node``'s, which finds this Job and the boot ID it kept."""
        with client_errors(), dry_run(request.dry_run):
            before = "" if request.dry_run else self._kube.get_node(request.node).boot_id
            job = repair_job(request, "reboot", boot_id=before)
            name, namespace = str(job["metadata"]["name"]), str(job["metadata"]["namespace"])
            if request.dry_run:
                return name
            if not before:
                raise InvalidInput(
                    f"node {request.node} reports no boot ID (status.nodeInfo.bootID), so a reboot could not be "
                    "told from none; map this event to RESET_GPU or REPLACE_NODE in the policy instead"
                )
            self._kube.create_job(namespace, job)  # False: made already by an earlier try
            return name

    @activity.defn(name="stop_repair_jobs")
    @heartbeating
    def stop_repairs(self, request: StopRepairsRequest) -> list[str]:
        """Stop (suspend, with why) the incident's repair Jobs that still run; returns their
        names. Finished Jobs and other incidents' are left as they are. Idempotent."""
        with client_errors():
            return stop_incident_repairs(self._kube, request.namespace, request.incident_id, request.why)

    @activity.defn(name="repair_node")
    @heartbeating
    def repair(self, request: RepairRequest) -> RepairResult:
        """Reset or reboot, then check that the GPU answers, each Job created once (a retry
        finds its own) and waited for up to ``job_timeout_seconds``. A Job still running at its
        deadline is deleted, so that it cannot act after the incident has moved on. A dry run
        answers with the Jobs it would create."""
        with client_errors(), dry_run(request.dry_run):
            kind = _kind(request)
            if kind == "check":
                return self._validate(request)
            job = repair_job(request, kind)  # every name checked before anything is made
            check = repair_job(request, "check") if _command(request, "check")[1] else None
            if request.dry_run:
                then = f"; then Job {check['metadata']['name']}: {_argv(check)}" if check else ""
                return RepairResult(
                    succeeded=True,
                    job=job["metadata"]["name"],
                    detail=f"dry run: would run Job {job['metadata']['name']}: {_argv(job)}{then}",
                )
            timeout = request.settings.job_timeout_seconds
            done = self._reboot(request) if kind == "reboot" else self._run(job, timeout)
            if not done.succeeded:
                return done
            if check is None:
                return done.model_copy(update={"detail": f"{done.detail}; no GPU check is configured"})
            checked = self._run(check, request.settings.job_timeout_seconds)
            if not checked.succeeded:
                return checked.model_copy(
                    update={"detail": f"{done.detail}; but the GPU does not answer: {checked.detail}"}
                )
            return done.model_copy(update={"detail": f"{done.detail}; the GPU answers: {checked.detail}"})

    def _validate(self, request: RepairRequest) -> RepairResult:
        """DRAIN_AFTER_JOBS, validate: only the check's Job (the GPU answers); with no check
        configured, nothing to run. The Job is the attempt's, found again by a retry."""
        if not _command(request, "check")[1]:
            return RepairResult(succeeded=True, detail="nothing checked: no GPU check is configured")
        check = repair_job(request, "check")
        if request.dry_run:
            return RepairResult(
                succeeded=True,
                job=check["metadata"]["name"],
                detail=f"dry run: would run Job {check['metadata']['name']}: {_argv(check)}",
            )
        checked = self._run(check, request.settings.job_timeout_seconds)
        if not checked.succeeded:
            return checked.model_copy(update={"detail": f"the GPU does not answer: {checked.detail}"})
        return checked.model_copy(update={"detail": f"the GPU answers: {checked.detail}"})

    def _run(self, job: dict[str, Any], timeout: float) -> RepairResult:
        return run_job(self._kube, job, timeout, poll_seconds=self._poll)

    def _reboot(self, request: RepairRequest) -> RepairResult:
        """Create the reboot Job with the node's boot ID of now (a retry reads the one its Job
        kept), then wait for the node to be Ready on a new one."""
        settings = request.settings
        before = self._kube.get_node(request.node).boot_id
        job = repair_job(request, "reboot", boot_id=before)
        name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
        if not before or not self._kube.create_job(namespace, job):
            try:  # a retry: its Job kept the boot ID from before, or the verdict of a stop
                annotations = self._kube.job_annotations(namespace, name)
            except NotFound:
                annotations = {}
            if VERDICT_ANNOTATION in annotations:
                return RepairResult(succeeded=False, job=name, detail=annotations[VERDICT_ANNOTATION])
            before = annotations.get(BOOT_ID_ANNOTATION, "")
        if not before:  # nothing was created
            raise InvalidInput(
                f"node {request.node} reports no boot ID (status.nodeInfo.bootID), so a reboot could not be "
                "told from none; map this event to RESET_GPU or REPLACE_NODE in the policy instead"
            )
        failed_at: float | None = None
        while True:
            node = self._kube.get_node(request.node)
            state = self._kube.job_state(namespace, name)
            if node.boot_id and node.boot_id != before and node.ready:
                return RepairResult(
                    succeeded=True,
                    job=name,
                    detail=(
                        f"{request.node} rebooted: Ready on boot ID {_short(node.boot_id)} (was {_short(before)}); "
                        f"Job {name}: {state.message}"
                    ),
                )
            if state.finished and not state.succeeded and node.boot_id == before:
                failed_at = failed_at if failed_at is not None else time.monotonic()
                if node.ready and time.monotonic() - failed_at > settings.reboot_grace_seconds:
                    return self._overdue(
                        namespace,
                        name,
                        f"Job {name} failed ({state.message}) and {request.node} is still up on boot ID "
                        f"{_short(before)} after {settings.reboot_grace_seconds:g}s: it did not reboot",
                    )
            if state.age_seconds > settings.reboot_timeout_seconds:
                return self._overdue(
                    namespace,
                    name,
                    f"{request.node} did not come back Ready on a new boot ID within "
                    f"{settings.reboot_timeout_seconds:g}s (boot ID {_short(node.boot_id)}, Ready={node.ready}; "
                    f"Job {name}: {state.message})",
                )
            activity.heartbeat(f"waiting for {request.node} to reboot: Ready={node.ready}, Job {state.message}")
            time.sleep(self._poll)

    def _overdue(self, namespace: str, name: str, why: str) -> RepairResult:
        return stop_overdue(self._kube, namespace, name, why)


def run_job(kube: KubeClient, job: dict[str, Any], timeout: float, *, poll_seconds: float) -> RepairResult:
    """Create the Job (or find it again: a retry) and wait for it to complete or fail, heartbeating;
    one past ``timeout`` (counted from its creation) is stopped, with the verdict kept on it."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    if not kube.create_job(namespace, job):
        stopped = job_verdict(kube, namespace, name)
        if stopped is not None:
            return stopped
    while True:
        state = kube.job_state(namespace, name)
        if state.finished:
            verdict = "completed" if state.succeeded else "failed"
            return RepairResult(succeeded=state.succeeded, job=name, detail=f"Job {name} {verdict}: {state.message}")
        if state.age_seconds > timeout:
            return stop_overdue(kube, namespace, name, f"Job {name} did not finish within {timeout:g}s")
        activity.heartbeat(f"Job {name}: {state.message}")
        time.sleep(poll_seconds)


def job_verdict(kube: KubeClient, namespace: str, name: str) -> RepairResult | None:
    """The failure recorded on a Job that an earlier try stopped, if it was."""
    why = kube.job_annotations(namespace, name).get(VERDICT_ANNOTATION)
    return None if why is None else RepairResult(succeeded=False, job=name, detail=why)


def stop_overdue(kube: KubeClient, namespace: str, name: str, why: str) -> RepairResult:
    """The attempt failed: its Job is stopped, so that it cannot act late, and keeps the verdict
    for a retry. Stopping is best effort: the failure stands either way."""
    try:
        kube.stop_job(namespace, name, annotations={VERDICT_ANNOTATION: f"{why}; Job stopped"})
    except ClientError as exc:
        return RepairResult(succeeded=False, job=name, detail=f"{why}; could not stop the Job: {exc}")
    return RepairResult(succeeded=False, job=name, detail=f"{why}; Job stopped")
