"""Repairs in place: reset a GPU or reboot a node through a Kubernetes Job pinned to it."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from temporalio import activity

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from clients.dryrun import dry_run
from clients.errors import InvalidInput
from clients.kube import KubeClient
from models.constants import INCIDENT_ANNOTATION, REPAIR_LABEL
from models.names import InvalidName, validate_node_name
from models.policy import Action
from models.requests import RepairRequest, RepairResult

# A GPU as the driver names it: a UUID (GPU-8c2f...) or a PCI address (0000:3b:00.0).
_GPU = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,95}$")
_KINDS = {Action.RESET_GPU: "reset", Action.REBOOT_NODE: "reboot"}


def repair_job(request: RepairRequest) -> dict[str, Any]:
    """The Job for one repair attempt: pinned to the node, tolerating its taints, run once.

    Raises:
        InvalidInput: an action that is not a repair in place, or a GPU or node name unfit
            for a command line.
    """
    kind = _KINDS.get(request.action)
    if kind is None:
        raise InvalidInput(f"{request.action} is not a repair in place (RESET_GPU or REBOOT_NODE)")
    try:
        node = validate_node_name(request.node)
    except InvalidName as exc:
        raise InvalidInput(str(exc)) from None
    settings = request.settings
    command = settings.reset_command if kind == "reset" else settings.reboot_command
    if any("{gpu}" in part for part in command) and not _GPU.match(request.gpu or ""):
        raise InvalidInput(f"a GPU reset needs the GPU's UUID or PCI address; the event gave {request.gpu!r}")
    argv = [part.replace("{gpu}", request.gpu).replace("{node}", node) for part in command]
    digest = hashlib.sha256(f"{request.incident_id}/{request.attempt}".encode()).hexdigest()[:8]
    name = f"gpufleet-{kind}-{node}"[:52].rstrip("-.") + f"-{digest}"
    container: dict[str, Any] = {
        "name": kind,
        "image": settings.reset_image if kind == "reset" else settings.reboot_image,
        "command": argv,
        "securityContext": {"privileged": True},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": {REPAIR_LABEL: kind},
            "annotations": {INCIDENT_ANNOTATION: request.incident_id},
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(settings.job_timeout_seconds),
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": {REPAIR_LABEL: kind}},
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "hostPID": kind == "reboot",
                    # The node is drained, cordoned and tainted by now: the repair runs there anyway.
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [container],
                },
            },
        },
    }


class RepairActivities:
    def __init__(self, kube: KubeClient, *, poll_seconds: float = 0.5) -> None:
        self._kube = kube
        self._poll = poll_seconds

    @activity.defn(name="repair_node")
    @heartbeating
    def repair(self, request: RepairRequest) -> RepairResult:
        """Run the attempt's Job (created once, found again on a retry) and wait for it to end,
        up to its timeout. A dry run answers with the Job it would create."""
        with client_errors(), dry_run(request.dry_run):
            job = repair_job(request)
            name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
            if request.dry_run:
                command = " ".join(job["spec"]["template"]["spec"]["containers"][0]["command"])
                return RepairResult(succeeded=True, job=name, detail=f"dry run: would run Job {name}: {command}")
            self._kube.create_job(namespace, job)
            deadline = time.monotonic() + request.settings.job_timeout_seconds
            while True:
                state = self._kube.job_state(namespace, name)
                if state.finished:
                    return RepairResult(succeeded=state.succeeded, job=name, detail=state.message)
                if time.monotonic() > deadline:
                    return RepairResult(
                        succeeded=False,
                        job=name,
                        detail=f"Job {name} did not finish within {request.settings.job_timeout_seconds:g}s",
                    )
                activity.heartbeat(f"Job {name}: {state.message}")
                time.sleep(self._poll)
