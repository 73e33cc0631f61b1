"""The validation ladder's rungs, each a Kubernetes Job pinned to the node (models/validation.py).

A rung's Job is made and waited for as a repair's is (activities/repair.py): named from the
request's ID, attempt and rung, so that a retry finds its own Job; never deleted, stopped at its
deadline with the verdict kept on it. How its container ended (its exit status and termination
message, read from its pod) says whether its tool was missing (the rung is skipped) and, for
NCCL, the bus bandwidth it measured.

The NCCL threshold is the policy's floor until gpufleet has passes of its own for the node's
type; then a fraction of their median. Those passes are kept in a ConfigMap in the repair
namespace (``gpufleet-validation-baselines``), one key per node type, written under its
resourceVersion so that two validations never lose each other's pass.
"""

from __future__ import annotations

import json
import re
import statistics
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity

from activities.errors import client_errors
from activities.heartbeat import heartbeating
from activities.repair import job_name, pinned_job, run_job
from clients.errors import InvalidInput
from clients.kube import KubeClient, KubeNode
from models.constants import (
    INCIDENT_ANNOTATION,
    PROBATION_LABEL,
    PROBATION_UNTIL_ANNOTATION,
    VALIDATION_SKIPPED_ANNOTATION,
)
from models.names import InvalidName, validate_node_name
from models.validation import (
    BASELINE_KEPT,
    DEFAULT_NODE_TYPE,
    ProbationRequest,
    RungKind,
    RungOutcome,
    RungRequest,
    RungResult,
    ValidationSettings,
    node_type_key,
)

BASELINES_CONFIG_MAP = "gpufleet-validation-baselines"
# nccl-tests' summary: "# Avg bus bandwidth    : 181.342", printed with %g (so "5e-05" too).
_BUS_BANDWIDTH = re.compile(r"Avg bus bandwidth\s*:\s*([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)")
_GPU_COUNT = re.compile(r"^[0-9]{1,4}$")


def bus_bandwidth(text: str) -> float | None:
    """The average bus bandwidth (GB/s) nccl-tests reported in ``text``; None when it did not."""
    found = _BUS_BANDWIDTH.findall(text)
    return float(found[-1]) if found else None


def node_type(node: KubeNode, settings: ValidationSettings) -> str:
    return node.labels.get(settings.node_type_label, "").strip() or DEFAULT_NODE_TYPE


def gpu_count(node: KubeNode, settings: ValidationSettings) -> int:
    value = node.labels.get(settings.gpu_count_label, "").strip()
    return int(value) if _GPU_COUNT.match(value) and int(value) > 0 else settings.default_gpus


def rung_job(request: RungRequest, *, gpus: int) -> dict[str, Any]:
    """The rung's Job, its placeholders filled in.

    Raises:
        InvalidInput: a node name unfit for a command line.
    """
    try:
        node = validate_node_name(request.node)
    except InvalidName as exc:
        raise InvalidInput(str(exc)) from None
    rung = request.rung
    fill = {"{node}": node, "{gpus}": str(gpus), "{level}": str(request.settings.dcgm_level)}
    argv = []
    for part in rung.command:
        for placeholder, value in fill.items():
            part = part.replace(placeholder, value)
        argv.append(part)
    return pinned_job(
        name=job_name(f"v-{rung.name}", node, f"{request.request_id}/{request.attempt}/{rung.name}"),
        namespace=request.namespace,
        node=node,
        container=rung.name,
        label="validate",
        image=rung.image,
        argv=argv,
        annotations={INCIDENT_ANNOTATION: request.request_id},
        timeout_seconds=rung.timeout_seconds,
        runtime_class=request.runtime_class,
        logs_on_error=True,
    )


def _passes(data: dict[str, str], key: str) -> list[dict[str, Any]]:
    try:
        passes = json.loads(data.get(key) or "[]")
    except ValueError:
        return []  # unreadable (edited by hand): started again
    return [p for p in passes if isinstance(p, dict) and isinstance(p.get("gbps"), int | float)]


class ValidationActivities:
    def __init__(self, kube: KubeClient, *, poll_seconds: float = 0.5) -> None:
        self._kube = kube
        self._poll = poll_seconds

    @activity.defn(name="validation_rung")
    @heartbeating
    def run_rung(self, request: RungRequest) -> RungResult:
        """Run one rung on the node as a Job (a retry finds its own) and read how it went: passed,
        failed (with the figure, for NCCL), or skipped where its tool is missing."""
        with client_errors():
            rung = request.rung
            node = self._kube.get_node(request.node)
            job = rung_job(request, gpus=gpu_count(node, request.settings))
            name = str(job["metadata"]["name"])
            ran = run_job(self._kube, job, rung.timeout_seconds, poll_seconds=self._poll)
            ended = self._kube.job_exit(request.namespace, name)
            result = RungResult(name=rung.name, kind=rung.kind, outcome=RungOutcome.PASSED, job=name)
            if not ran.succeeded:
                if ended is not None and rung.skip_exit_code is not None and ended.exit_code == rung.skip_exit_code:
                    why = f"its tool is not on {request.node} (exit status {ended.exit_code}); Job {name}"
                    return result.model_copy(update={"outcome": RungOutcome.SKIPPED, "detail": why})
                said = f" ({ended.message.strip().splitlines()[-1]})" if ended and ended.message.strip() else ""
                return result.model_copy(update={"outcome": RungOutcome.FAILED, "detail": f"{ran.detail}{said}"})
            if rung.kind is not RungKind.NCCL:
                return result.model_copy(update={"detail": ran.detail})
            return self._nccl(request, node, result, ended.message if ended else "")

    def _nccl(self, request: RungRequest, node: KubeNode, result: RungResult, message: str) -> RungResult:
        """Hold the bus bandwidth measured to the node type's threshold; a pass joins its baseline."""
        figure = bus_bandwidth(message)
        if figure is None:
            return result.model_copy(
                update={
                    "outcome": RungOutcome.FAILED,
                    "detail": f"Job {result.job} completed but reported no bus bandwidth (no 'Avg bus bandwidth' line "
                    "in its termination message); its command must write nccl-tests' summary to /dev/termination-log",
                }
            )
        settings, kind = request.settings, node_type(node, request.settings)
        key = node_type_key(kind)
        data = self._kube.update_config_map(request.namespace, BASELINES_CONFIG_MAP, lambda data: data)
        # A retry of an attempt that passed already: its own pass is not compared with itself.
        own = [p for p in _passes(data, key) if p.get("id") != result.job]
        if len(own) >= settings.nccl_own_passes:
            median = statistics.median(float(p["gbps"]) for p in own)
            threshold = round(median * settings.nccl_median_fraction, 3)
            source = f"{settings.nccl_median_fraction:g} of the median {median:g} GB/s of {len(own)} passes on {kind}"
        else:
            threshold = settings.nccl_floor_gbps
            source = f"the policy's floor ({len(own)} of {settings.nccl_own_passes} own passes on {kind} so far)"
        update: dict[str, Any] = {"figure": figure, "threshold": threshold}
        if figure < threshold:
            update.update(outcome=RungOutcome.FAILED, detail=f"bus bandwidth {figure:g} GB/s is under {source}")
            return result.model_copy(update=update)

        def add(data: dict[str, str]) -> dict[str, str]:
            passes = _passes(data, key)
            if not any(p.get("id") == result.job for p in passes):
                at = datetime.now(UTC).isoformat(timespec="seconds")
                passes.append({"id": result.job, "node": request.node, "gbps": figure, "at": at})
            return {**data, key: json.dumps(passes[-BASELINE_KEPT:])}

        self._kube.update_config_map(request.namespace, BASELINES_CONFIG_MAP, add)
        update["detail"] = f"bus bandwidth {figure:g} GB/s, threshold {threshold:g} from {source}"
        return result.model_copy(update=update)

    @activity.defn(name="set_probation")
    @heartbeating
    def set_probation(self, request: ProbationRequest) -> bool:
        """Put the node on probation until ``until`` (label and annotation), or take it off when
        ``until`` is None, only if its probation still ends at ``ending`` (a later probation is
        left alone). True when the node was changed. Idempotent."""
        with client_errors():
            node = self._kube.get_node(request.node)
            if request.until is not None:
                until = request.until.isoformat()
                if node.labels.get(PROBATION_LABEL) and node.annotations.get(PROBATION_UNTIL_ANNOTATION) == until:
                    return False
                self._kube.update_metadata(
                    request.node, labels={PROBATION_LABEL: "true"}, annotations={PROBATION_UNTIL_ANNOTATION: until}
                )
                return True
            ending = request.ending.isoformat() if request.ending is not None else None
            if PROBATION_LABEL not in node.labels and PROBATION_UNTIL_ANNOTATION not in node.annotations:
                return False
            if ending is not None and node.annotations.get(PROBATION_UNTIL_ANNOTATION, ending) != ending:
                return False
            self._kube.update_metadata(
                request.node,
                labels={PROBATION_LABEL: None},
                annotations={PROBATION_UNTIL_ANNOTATION: None},
                resource_version=node.resource_version,
            )
            return True

    @activity.defn(name="record_skipped_validation")
    @heartbeating
    def record_skipped(self, request: ProbationRequest) -> None:
        """Write on the node who skipped its validation and why (``why``)."""
        with client_errors():
            self._kube.update_metadata(request.node, annotations={VALIDATION_SKIPPED_ANNOTATION: request.why})


def probation_end(node: KubeNode, now: datetime) -> datetime | None:
    """When the node's probation ends (None: it carries no probation label). An end that cannot
    be read is taken as ``now`` plus a day, so a mangled annotation does not end a probation; the
    workflow compares the end with its own clock."""
    if not node.labels.get(PROBATION_LABEL):
        return None
    text = node.annotations.get(PROBATION_UNTIL_ANNOTATION, "")
    try:
        until = datetime.fromisoformat(text)
    except ValueError:
        return now + timedelta(days=1)
    return until if until.tzinfo is not None else until.replace(tzinfo=UTC)
