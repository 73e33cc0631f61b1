"""The pure policy that turns the GPU events seen on a node into one action.

Events are looked up by (kind, code). The Xid catalog gives each Xid an immediate-action
bucket; the policy maps buckets to an action on the node, with per-Xid overrides for the
codes we treat as hardware faults that a reset will not cure. NVSwitch SXids have their own
catalog (fatal or not) and their own overrides (``sxids:``); failures the driver reports
without a code have one entry per kind (``kinds:``). A bus loss without an Xid line acts as
Xid 79. Operators override any of it with a YAML file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from models.degradation import DegradationSettings
from models.numbers import Finite, Whole
from models.sxid import sxid_catalog
from models.topology import DomainSettings
from models.validation import ValidationSettings
from models.xid import GpuEventKind, RecoveryAction, XidEvent, xid_catalog


class Action(StrEnum):
    """What happens to a node, from least to most disruptive."""

    OBSERVE = "OBSERVE"
    # Drain with gpufleet's reason, signal nothing, let the node's jobs finish (up to
    # ``drain_after_jobs.max_wait_seconds``, then as REPLACE_NODE), then ``drain_after_jobs.then``.
    DRAIN_AFTER_JOBS = "DRAIN_AFTER_JOBS"
    RESET_GPU = "RESET_GPU"
    REBOOT_NODE = "REBOOT_NODE"
    REPLACE_NODE = "REPLACE_NODE"

    @property
    def severity(self) -> int:
        return list(Action).index(self)

    def escalated(self) -> Action:
        """One level more disruptive (REPLACE_NODE stays REPLACE_NODE)."""
        order = list(Action)
        return order[min(order.index(self) + 1, len(order) - 1)]


DEFAULT_BUCKET_ACTIONS: dict[str, Action] = {
    "RESTART_APP": Action.OBSERVE,
    "IGNORE": Action.OBSERVE,
    "RESET_GPU": Action.RESET_GPU,
    "RESTART_BM": Action.REBOOT_NODE,
    "RESTART_VM": Action.REBOOT_NODE,
    "CONTACT_SUPPORT": Action.REPLACE_NODE,
    "CHECK_MECHANICALS": Action.REPLACE_NODE,
    "WORKFLOW_XID_45": Action.OBSERVE,
    "WORKFLOW_XID_48": Action.RESET_GPU,
    "WORKFLOW_NVLINK_ERR": Action.RESET_GPU,
    "WORKFLOW_NVLINK5_ERR": Action.RESET_GPU,
}

# Hardware faults where the node leaves the fleet: a bus drop does not come back with a reboot
# often enough to hold a multi-node job hostage to it.
#
# Soft failures, drained after the jobs (DRAIN_AFTER_JOBS): NVIDIA's Xid catalog says the work
# on the GPU goes on, correct, and asks for a reset or a look "when convenient". No new job is
# put on the node; the jobs on it finish; then ``drain_after_jobs.then`` (or a reset, where
# DrainAfterJobsSettings.reset_xids names the Xid).
DEFAULT_XID_ACTIONS: dict[int, Action] = {
    79: Action.REPLACE_NODE,
    # Row remapping event (catalog: IGNORE, "reset GPU at a convenient time to activate the
    # remap"): the row is marked and the pending remap does not affect running work (error
    # containment and page blacklisting cover it); only a reset puts the spare row in use.
    63: Action.DRAIN_AFTER_JOBS,
    # High single-bit ECC error rate (catalog: IGNORE): ECC corrects every one, so the jobs'
    # results stand, but memory that corrects at a high rate is failing: no new job until the
    # node is checked.
    92: Action.DRAIN_AFTER_JOBS,
    # Contained memory error (catalog: RESTART_APP, "reset GPU when convenient"): the process
    # that touched the poisoned memory ends (its job is requeued as one the failure ended); every
    # other process on the GPU goes on unaffected; the reset retires the memory for good.
    94: Action.DRAIN_AFTER_JOBS,
    # Not 64 (row remapping failure; catalog: RESET_GPU): the row could not be remapped, so the
    # bad memory stays in use by what runs now; it keeps the catalog's immediate reset.
}

# A fatal SXid takes the switch's NVLink fabric down with it: the node leaves the fleet.
DEFAULT_SXID_SEVERITY_ACTIONS: dict[Literal["fatal", "non-fatal"], Action] = {
    "fatal": Action.REPLACE_NODE,
    "non-fatal": Action.OBSERVE,
}

# Failures without a code: the GPU never came up (or has no power), so no job can use it.
DEFAULT_KIND_ACTIONS: dict[GpuEventKind, Action] = {
    GpuEventKind.INIT_FAILED: Action.REPLACE_NODE,
    GpuEventKind.POWER_CABLE: Action.REPLACE_NODE,
    # A quick check failed: no new job is put on the node; once its jobs end it is validated.
    GpuEventKind.HEALTH_CHECK: Action.DRAIN_AFTER_JOBS,
    # Silent degradation (the detector's NVML polling, docs/detector.md): what is known to slow a
    # synchronous job, or to need a reset before the GPU is whole again, is drained after the
    # jobs (which kills none); the rest is observed and reported.
    # A link narrower than its maximum (or slower under load) slows every host transfer.
    GpuEventKind.PCIE_LINK: Action.DRAIN_AFTER_JOBS,
    # Only the hardware reasons (HW slowdown, HW thermal, HW power brake): NVML documents each as
    # cutting the core clocks by a factor of 2 or more, and a synchronous job waits for its
    # slowest GPU. The software power cap and thermal slowdown are normal operation.
    GpuEventKind.CLOCKS_THROTTLED: Action.DRAIN_AFTER_JOBS,
    # NVIDIA: a pending remapping harms no job (error containment and page offlining cover the
    # row) but takes effect only at the next GPU reset; a remapping failure is its RMA
    # criterion, for the field diagnostic to confirm. Both want the node out once its jobs end.
    GpuEventKind.ROW_REMAP: Action.DRAIN_AFTER_JOBS,
    # Before Ampere a retirement pending takes effect only when the driver reloads or the GPU
    # resets; until then the page can still be handed out.
    GpuEventKind.RETIRED_PAGES: Action.DRAIN_AFTER_JOBS,
    # Replays, recoveries and CRC errors are corrected by the link itself: a rising count
    # forecasts trouble but slows no job yet.
    GpuEventKind.NVLINK_ERRORS: Action.OBSERVE,
    # A job that asks for every GPU of the node cannot start.
    GpuEventKind.GPU_MISSING: Action.DRAIN_AFTER_JOBS,
    # On an NVSwitch system a GPU not registered with the fabric cannot start CUDA work; jobs
    # already running keep their fabric.
    GpuEventKind.FABRIC_MANAGER: Action.DRAIN_AFTER_JOBS,
}

RECOVERY_ACTIONS: dict[RecoveryAction, Action] = {
    RecoveryAction.NONE: Action.OBSERVE,
    RecoveryAction.GPU_RESET: Action.RESET_GPU,
    RecoveryAction.NODE_REBOOT: Action.REBOOT_NODE,
    RecoveryAction.DRAIN_P2P: Action.RESET_GPU,
    # Xid 154 naming "Drain and Reset": the work may finish, then the GPU is reset
    # (DrainAfterJobsSettings.reset_xids has 154, so the step after the wait is at least a reset).
    # "Drain P2P" stays a reset now: peer-to-peer traffic through the GPU is what is broken.
    RecoveryAction.DRAIN_AND_RESET: Action.DRAIN_AFTER_JOBS,
}


class PolicyError(ValueError):
    """An override file that cannot be used; the message names the file and the field."""


class OwnerDrained(StrEnum):
    """What an incident does on a node that someone else drained in Slurm."""

    ASK = "ask"  # notify the owner and wait for `gpufleet approve|reject`
    PROCEED = "proceed"  # act on it anyway (their drain reason is kept)


class RemediationSettings(BaseModel):
    """How patient an incident is; the worker owns these and each incident records them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grace_seconds: Finite = Field(default=120.0, ge=0, le=86400)
    spare_recheck_seconds: Finite = Field(default=60.0, gt=0, le=86400)
    resume_timeout_seconds: Finite = Field(default=1800.0, gt=0, le=7 * 86400)
    eviction_timeout_seconds: Finite = Field(default=60.0, ge=0, le=86400)
    owner_drained: OwnerDrained = OwnerDrained.ASK
    # The jobs a failure touched: those on the node that still run, and those that ended from
    # this long before the incident's first event (a GPU that fails kills its job within seconds,
    # sometimes before the driver's line reaches the log).
    failure_window_seconds: Finite = Field(default=120.0, ge=0, le=3600)
    # GPUs per node, for the goodput ledger (docs/goodput.md): a job whose GPUs Slurm does not
    # report (no gres/gpu in its TRES) counts this many per node it ran on.
    node_gpus: Whole = Field(default=8, ge=1, le=1024)


# What follows DRAIN_AFTER_JOBS once the node's jobs have ended: the node is validated (and
# returned to service when it passes), or repaired in place, or replaced.
VALIDATE: Literal["validate"] = "validate"
AfterJobs = Literal["validate", Action.RESET_GPU, Action.REBOOT_NODE, Action.REPLACE_NODE]


class DrainAfterJobsSettings(BaseModel):
    """DRAIN_AFTER_JOBS: the node is drained (no new job), its jobs run on to their end, then
    ``then``. Jobs still running after ``max_wait_seconds`` are checkpointed and requeued and the
    node is replaced (REPLACE_NODE); an event during the wait that calls for more than
    DRAIN_AFTER_JOBS does so at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_wait_seconds: Finite = Field(default=86400.0, gt=0, le=30 * 86400)
    then: AfterJobs = VALIDATE
    # The node's jobs are listed this often at first; the gap grows with a long wait (at most
    # about 300 looks whatever ``max_wait_seconds``), and a new event wakes the wait at once.
    poll_seconds: Finite = Field(default=60.0, ge=1, le=86400)
    # Xids whose remedy, once the GPU is free, is a reset (the catalog's "reset when convenient",
    # Xid 154's "Drain and Reset"): the step after the wait is at least RESET_GPU for them.
    reset_xids: list[int] = Field(default_factory=lambda: [63, 94, 154])

    @field_validator("then", mode="before")
    @classmethod
    def _known_step(cls, then: object) -> object:
        allowed = (VALIDATE, Action.RESET_GPU.value, Action.REBOOT_NODE.value, Action.REPLACE_NODE.value)
        if then not in allowed:
            raise ValueError(f"got {then!r}; expected one of {', '.join(allowed)}")
        return then if then == VALIDATE else Action(str(then))

    def after_jobs(self, events: Iterable[XidEvent]) -> Action | None:
        """The step once the jobs have ended: an action (a repair in place, or the replacement),
        or None to validate the node. An event in ``reset_xids`` (Xid 154 only when it names
        "Drain and Reset") asks for at least RESET_GPU."""
        step = None if self.then == VALIDATE else Action(self.then)
        if any(_resets(event, self.reset_xids) for event in events) and (
            step is None or step.severity < Action.RESET_GPU.severity
        ):
            step = Action.RESET_GPU
        return step


def _resets(event: XidEvent, reset_xids: list[int]) -> bool:
    if event.gpu_xid is None or event.gpu_xid not in reset_xids:
        return False
    return event.gpu_xid != 154 or event.recovery_action is RecoveryAction.DRAIN_AND_RESET


class InferenceSpare(StrEnum):
    """What replaces a node of the inference pool (gpufleet.io/pool=inference) that an incident retires."""

    # A free spare, brought in for inference (labelled inference; Slurm left as it is). None
    # free: the incident does not wait; the shared pool's rebalancing makes up the capacity.
    SAME_POOL = "same-pool"
    # No spare: the shared pool's rebalancing alone makes up the capacity.
    NONE = "none"


class SpareSettings(BaseModel):
    """Which spare an incident claims. A training node's replacement joins its Slurm partition;
    an inference node's never does (a spare claimed into training would not serve inference)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inference: InferenceSpare = InferenceSpare.SAME_POOL


class GuardSettings(BaseModel):
    """How much of a cluster gpufleet may take down on its own (the fleet guard, per cluster).

    Over a limit the breaker trips: new incidents wait, changing nothing, until a person resets
    it (`gpufleet breaker reset`) or approves one (`gpufleet approve INCIDENT`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Incidents past their first destructive step and not yet closed.
    max_in_flight: Whole = Field(default=2, ge=1, le=100000)
    # Nodes with incidents inside the sliding window, as a share of the partition's nodes now
    # (retired nodes still count, so a rolling failure adds up). 0: no share limit.
    max_share: Finite = Field(default=0.5, ge=0, le=1)
    window_seconds: Finite = Field(default=600.0, gt=0, le=7 * 86400)
    # Actions that wait for `gpufleet approve` once the node is drained and its jobs requeued
    # (a rejection leaves the node drained), and when the owner is reminded meanwhile: first after
    # this long, then each time twice as long after the one before, until the request expires.
    require_approval: list[Action] = Field(default_factory=list)
    approval_reminder_seconds: Finite = Field(default=3600.0, gt=0, le=7 * 86400)
    # A request for approval left unanswered this long is raised again, to the owner and to the
    # operators (`approval_expired`), and again each time as long passes; never approved by default.
    approval_expiry_seconds: Finite = Field(default=4 * 3600.0, gt=0, le=30 * 86400)
    # Lemons: a node that fails again within the cooldown after it was returned to service, or
    # that has this many incidents within the window, is quarantined once its incident has taken
    # it out (label gpufleet.io/quarantine; never a spare, not returned until released). 0: off.
    cooldown_seconds: Finite = Field(default=86400.0, ge=0, le=90 * 86400)
    quarantine_after: Whole = Field(default=3, ge=0, le=1000)
    quarantine_window_seconds: Finite = Field(default=7 * 86400.0, gt=0, le=365 * 86400)
    # A node that reports again within this window after a repair in place escalates one level:
    # RESET_GPU, then REBOOT_NODE, then REPLACE_NODE.
    escalation_window_seconds: Finite = Field(default=86400.0, ge=0, le=90 * 86400)

    @field_validator("require_approval")
    @classmethod
    def _acting(cls, actions: list[Action]) -> list[Action]:
        if Action.OBSERVE in actions:
            raise ValueError("OBSERVE changes nothing, so it needs no approval")
        return actions


class RepairSettings(BaseModel):
    """How RESET_GPU and REBOOT_NODE are done: a Kubernetes Job pinned to the node.

    Commands are argv lists (no shell of ours); ``{gpu}`` (the event's GPU UUID or PCI address),
    ``{node}`` and, in the reboot command, ``{boot_id}`` (the node's boot before the reboot) are
    filled in, each checked first. A repair holds when:

    - a reset: its Job completes;
    - a reboot: the node comes back Ready with a new boot ID (``status.nodeInfo.bootID``), within
      ``reboot_timeout_seconds``. The reboot Job's own outcome does not count: its pod dies with the
      node. A Job that failed while the node stayed up on its old boot ID fails the repair after
      ``reboot_grace_seconds``;
    - then the GPU answers: a check Job (``check_command`` with the event's GPU, or
      ``node_check_command`` when the event named none) completes. An empty command skips it;
    - and no new event arrives for ``settle_seconds``.

    The node then goes back into service.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = "gpufleet"
    reset_image: str = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
    reset_command: list[str] = Field(default_factory=lambda: ["nvidia-smi", "--gpu-reset", "-i", "{gpu}"])
    # Privileged, in the host's PID namespace: the kernel's emergency reboot, only while the node
    # still runs the boot it had when the Job was made ({boot_id}): a pod the kubelet starts again
    # after the reboot (restartPolicy Never is at-least-once across a crash) reboots nothing.
    reboot_image: str = "busybox:1.36"
    reboot_command: list[str] = Field(
        default_factory=lambda: [
            "sh",
            "-c",
            'test "$(cat /proc/sys/kernel/random/boot_id)" = "$0" && echo b > /proc/sysrq-trigger',
            "{boot_id}",
        ]
    )
    # How long a node may take to come back Ready on a new boot (bare-metal POST included).
    reboot_timeout_seconds: Finite = Field(default=1800.0, gt=0, le=86400)
    # A reboot Job that failed with the node still up on its old boot fails the repair after this
    # (at least the time the control plane takes to see a node go: ~40 s).
    reboot_grace_seconds: Finite = Field(default=120.0, ge=0, le=3600)
    # After the repair: does the GPU answer? Same image as the reset. Asked again every 10 s until
    # the Job's deadline: drivers and persistence daemons come up after the kubelet says Ready.
    check_image: str = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
    check_command: list[str] = Field(
        default_factory=lambda: [
            "sh",
            "-c",
            'until nvidia-smi --query-gpu=uuid,pci.bus_id,name --format=csv,noheader -i "$0"; do sleep 10; done',
            "{gpu}",
        ]
    )
    node_check_command: list[str] = Field(
        default_factory=lambda: [
            "sh",
            "-c",
            "until nvidia-smi --query-gpu=uuid,pci.bus_id,name --format=csv,noheader; do sleep 10; done",
        ]
    )
    job_timeout_seconds: Finite = Field(default=600.0, gt=0, le=86400)
    settle_seconds: Finite = Field(default=120.0, ge=0, le=86400)
    # The RuntimeClass that gives a pod the GPUs (e.g. "nvidia") where it is not the default.
    runtime_class: str | None = None

    @field_validator("reset_command", "reboot_command")
    @classmethod
    def _not_empty(cls, command: list[str]) -> list[str]:
        if not command or not all(isinstance(part, str) and part for part in command):
            raise ValueError("a command is a non-empty list of non-empty strings (argv, no shell)")
        return command

    @field_validator("check_command", "node_check_command")
    @classmethod
    def _argv_or_nothing(cls, command: list[str]) -> list[str]:
        if not all(isinstance(part, str) and part for part in command):
            raise ValueError("a command is a list of non-empty strings (argv, no shell); [] skips the check")
        return command

    @field_validator("node_check_command")
    @classmethod
    def _names_no_gpu(cls, command: list[str]) -> list[str]:
        if any("{gpu}" in part for part in command):
            raise ValueError("runs when the event named no GPU, so it cannot use {gpu}; check_command can")
        return command


class Policy(BaseModel):
    """Actions by Xid bucket and code, SXid severity and code, and kind. ``decide`` is pure:
    same events, same action."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    buckets: dict[str, Action] = Field(default_factory=lambda: dict(DEFAULT_BUCKET_ACTIONS))
    xids: dict[int, Action] = Field(default_factory=lambda: dict(DEFAULT_XID_ACTIONS))
    unknown_xid: Action = Action.OBSERVE
    sxid_severities: dict[Literal["fatal", "non-fatal"], Action] = Field(
        default_factory=lambda: dict(DEFAULT_SXID_SEVERITY_ACTIONS)
    )
    sxids: dict[int, Action] = Field(default_factory=dict)
    unknown_sxid: Action = Action.OBSERVE
    kinds: dict[GpuEventKind, Action] = Field(default_factory=lambda: dict(DEFAULT_KIND_ACTIONS))
    # Xid 154 whose recovery action was not reported: assume the GPU needs a reset.
    xid_154_default: Action = Action.RESET_GPU
    # The worker's side of the same file: grace, timeouts, what to do with owners' nodes...
    remediation: RemediationSettings = Field(default_factory=RemediationSettings)
    # ... how much of the cluster it may take down on its own...
    guard: GuardSettings = Field(default_factory=GuardSettings)
    # ... how it resets a GPU or reboots a node...
    repair: RepairSettings = Field(default_factory=RepairSettings)
    # ... which spare replaces a retired node...
    spares: SpareSettings = Field(default_factory=SpareSettings)
    # ... how long a node drained after its jobs waits for them, and what comes next.
    drain_after_jobs: DrainAfterJobsSettings = Field(default_factory=DrainAfterJobsSettings)
    # The detector's side: how often it reads every GPU for silent degradation.
    degradation: DegradationSettings = Field(default_factory=DegradationSettings)
    # The checks a node passes before it goes back into service (models/validation.py).
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    # Failures clustered in a rack, zone, NVLink domain or leaf switch: one domain incident.
    domains: DomainSettings = Field(default_factory=DomainSettings)

    @field_validator("kinds")
    @classmethod
    def _codeless_only(cls, kinds: dict[GpuEventKind, Action]) -> dict[GpuEventKind, Action]:
        for kind in kinds:
            if kind.has_code:
                hint = "set it under 'xids: {79: ...}'" if kind is GpuEventKind.BUS_LOST else "use 'xids' or 'sxids'"
                raise ValueError(f"{kind.value} events have a code: {hint}")
        return kinds

    def action_for(self, event: XidEvent | int) -> Action:
        """The action for one event (an int is a GPU Xid), before combining with others."""
        if isinstance(event, XidEvent):
            if event.kind is GpuEventKind.SXID:
                return self._sxid_action(event.xid, event.message)
            if not event.kind.has_code:
                return self.kinds.get(event.kind, Action.REPLACE_NODE)
        xid = event if isinstance(event, int) else event.gpu_xid
        recovery = None if isinstance(event, int) else event.recovery_action
        if xid is None:  # unreachable: every other kind has a GPU Xid
            return self.unknown_xid
        if xid in self.xids:
            return self.xids[xid]
        entry = xid_catalog().get(xid)
        if entry is None:
            return self.unknown_xid
        if entry.bucket == "XID_154":
            return RECOVERY_ACTIONS[recovery] if recovery is not None else self.xid_154_default
        return self.buckets.get(entry.bucket, self.unknown_xid)

    def _sxid_action(self, sxid: int | None, message: str = "") -> Action:
        if sxid in self.sxids:
            return self.sxids[sxid]
        entry = sxid_catalog().get(sxid) if sxid is not None else None
        if entry is not None:
            return self.sxid_severities.get(entry.severity, self.unknown_sxid)
        # Not in the catalog: the driver's own word on it ("Fatal, ..." / "Non-fatal, ...").
        word = message.split(",", 1)[0].strip().lower()
        if word == "fatal":
            return self.sxid_severities.get("fatal", self.unknown_sxid)
        if word == "non-fatal":
            return self.sxid_severities.get("non-fatal", self.unknown_sxid)
        return self.unknown_sxid

    def decide(self, events: Iterable[XidEvent | int]) -> Action:
        """The one action for everything seen on a node: the most disruptive of each Xid's action."""
        actions = [self.action_for(event) for event in events]
        return max(actions, key=lambda action: action.severity, default=Action.OBSERVE)


def policy_from_mapping(data: Mapping[str, Any], *, origin: str = "policy") -> Policy:
    """Build a policy from overrides; keys left out keep their defaults.

    Raises:
        PolicyError: naming the field that is wrong.
    """
    defaults = Policy()
    sections = ("remediation", "guard", "repair", "degradation", "drain_after_jobs", "validation")
    for key in ("buckets", "xids", "sxids", "sxid_severities", "kinds", *sections):
        if data.get(key) is not None and not isinstance(data[key], Mapping):
            raise PolicyError(f"{origin}: {key}: expected a mapping, got {type(data[key]).__name__}")
    merged: dict[str, Any] = {
        "buckets": {**defaults.buckets, **(data.get("buckets") or {})},
        "xids": {**defaults.xids, **(data.get("xids") or {})},
        "sxids": {**defaults.sxids, **(data.get("sxids") or {})},
        "sxid_severities": {**defaults.sxid_severities, **(data.get("sxid_severities") or {})},
        "kinds": {**defaults.kinds, **(data.get("kinds") or {})},
    }
    merged.update({key: value for key, value in data.items() if key not in merged})
    try:
        return Policy.model_validate(merged)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        raise PolicyError(f"{origin}: {problems}") from None


def load_policy(path: Path | None) -> Policy:
    """The default policy, or the defaults overridden by the YAML file at ``path``.

    Raises:
        PolicyError: the file is missing, is not UTF-8 text, is not YAML, is not a mapping, or names
            an unknown field or action or a value out of its bounds; one line naming the file.
    """
    if path is None:
        return Policy()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the policy file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PolicyError(f"{path}: not valid YAML{where}: {problem}") from None
    except (ValueError, RecursionError) as exc:  # a tagged value that is no such thing (!!int abc, 2001-13-01), nesting
        raise PolicyError(
            f"{path}: not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    if not isinstance(data, dict):
        raise PolicyError(
            f"{path}: expected a mapping with 'xids', 'sxids', 'kinds', 'buckets', 'remediation', 'guard', "
            "'repair' or 'validation'"
        )
    return policy_from_mapping(data, origin=str(path))


class PolicyFile:
    """The policy file as it is now: read again when it changes, the last good one kept if it breaks.

    The detector and the worker read the same file, so an edit applies to both sides without
    a restart (the worker reads it at each incident's start).
    """

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._stamp: tuple[float, int] | None = None
        self._policy = load_policy(path)  # a broken file at start is an error for the caller
        self._stamp = self._current_stamp()
        self.reload_error: str | None = None

    def _current_stamp(self) -> tuple[float, int] | None:
        if self._path is None:
            return None
        try:
            info = self._path.stat()
        except OSError:
            return None
        return (info.st_mtime, info.st_size)

    def current(self) -> Policy:
        stamp = self._current_stamp()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._policy = load_policy(self._path)
                self.reload_error = None
            except PolicyError as exc:
                self.reload_error = str(exc)  # keep deciding with the last good policy
        return self._policy
