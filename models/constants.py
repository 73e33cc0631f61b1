"""Names shared by every room: task queue, workflow names and IDs, labels, search attributes."""

from __future__ import annotations

import hashlib
from datetime import datetime
from itertools import pairwise

from temporalio.common import SearchAttributeKey

REMEDIATION_WORKFLOW = "NodeRemediationWorkflow"
RETURN_NODE_WORKFLOW = "ReturnNodeWorkflow"
# The end of a node's probation, a durable timer: probation-<cluster>-<node>-<end, epoch seconds>.
PROBATION_WORKFLOW = "ProbationWorkflow"
GUARD_WORKFLOW = "FleetGuardWorkflow"
QUARANTINED_NODES_WORKFLOW = "QuarantinedNodesWorkflow"
RELEASE_NODE_WORKFLOW = "ReleaseNodeWorkflow"
REAPER_WORKFLOW = "ReaperWorkflow"
# The guard's signals: an incident asks for a slot, gives it back, is let past the breaker by a
# person; a person resets the breaker, pauses or resumes. The guard answers an incident with
# GUARD_DECISION_SIGNAL.
GUARD_REQUEST_SIGNAL = "request"
GUARD_RELEASE_SIGNAL = "release"
GUARD_ADMIT_SIGNAL = "admit"
GUARD_RESET_SIGNAL = "reset"
GUARD_PAUSE_SIGNAL = "pause"
GUARD_RESUME_SIGNAL = "resume"
GUARD_DECISION_SIGNAL = "guard_decision"
# A node came back to service (`gpufleet nodes return`), or was released from quarantine.
GUARD_RETURNED_SIGNAL = "returned"
GUARD_FORGIVE_SIGNAL = "forgive"
# A node failed its validation (models/validation.py): counted toward its quarantine.
GUARD_VALIDATION_FAILED_SIGNAL = "validation_failed"
# An incident drained its node: counted in the guard's window (storms), answered by nothing.
GUARD_DRAINED_SIGNAL = "drained"
# Nodes labelled so get a notification and a recorded incident, nothing more.
REMEDIATION_LABEL = "gpufleet.io/remediation"
REMEDIATION_DISABLED = "disabled"

# Slurm drain reasons we write start with this; anything else belongs to someone else.
DRAIN_REASON_PREFIX = "gpufleet:"

POOL_LABEL = "gpufleet.io/pool"
POOL_SPARE = "spare"
POOL_TRAINING = "training"
# A node of the shared pool serving inference (Kubernetes, outside every Slurm partition).
POOL_INFERENCE = "inference"
POOL_RETIRED = "retired"
# When a node of a shared pool took its pool label (RFC 3339, UTC): the last to go to inference
# is the first to come back.
POOL_SINCE_ANNOTATION = "gpufleet.io/pool-since"
CLAIMED_BY_ANNOTATION = "gpufleet.io/claimed-by"
# Beside the claim annotation, a label a list can select by (claim_label_value): an incident finds
# its own claim among ten thousand nodes without reading them all. The annotation stays the word.
CLAIM_LABEL = "gpufleet.io/claim"
INCIDENT_ANNOTATION = "gpufleet.io/incident"
UNHEALTHY_TAINT = "gpufleet.io/unhealthy"

SA_GPU_NODE = SearchAttributeKey.for_keyword("GpuNode")
SA_CLUSTER = SearchAttributeKey.for_keyword("Cluster")
SA_XID = SearchAttributeKey.for_int("Xid")
SA_STEP = SearchAttributeKey.for_keyword("RemediationStep")
# The first event's kind: xid, sxid, bus_lost, init_failed, power_cable (Xid is set for GPU Xids only).
SA_EVENT_KIND = SearchAttributeKey.for_keyword("GpuEventKind")
SEARCH_ATTRIBUTES = (SA_GPU_NODE, SA_CLUSTER, SA_XID, SA_STEP, SA_EVENT_KIND)


def task_queue(cluster: str) -> str:
    """One task queue per cluster: a worker serves one cluster (its Slurm, its spares)."""
    return f"gpufleet-{cluster}"


def guard_task_queue(cluster: str) -> str:
    """The cluster's fleet guard has a task queue of its own, served beside the cluster's, so that
    its tasks never wait behind those of the incidents it answers (a cluster name has no '.')."""
    return f"gpufleet-{cluster}.guard"


# The start time that ends an incident ID (CLUSTER-NODE-20261205T054018Z), as a pattern.
INCIDENT_STAMP = r"\d{8}T\d{6}Z"


def remediation_workflow_id(cluster: str, node: str) -> str:
    """The one open incident per node: repeated Xids on a node join it through this ID."""
    return f"remediate-{cluster}-{node}"


def dry_run_workflow_id(cluster: str, node: str) -> str:
    """A dry run's own ID: it never joins, blocks or is joined by the node's real incident."""
    return f"dryrun-{cluster}-{node}"


def guard_workflow_id(cluster: str) -> str:
    """The one fleet guard per cluster: every incident of the cluster asks it for a slot."""
    return f"guard-{cluster}"


def reaper_workflow_id(cluster: str) -> str:
    """The one reaper per cluster: it gives back what incidents that stopped running still hold."""
    return f"reaper-{cluster}"


def return_workflow_id(cluster: str, node: str) -> str:
    return f"return-{cluster}-{node}"


def probation_workflow_id(cluster: str, node: str, until: datetime) -> str:
    return f"probation-{cluster}-{node}-{int(until.timestamp())}"


def release_workflow_id(cluster: str, node: str) -> str:
    return f"release-{cluster}-{node}"


def drain_reason(*, event: str, action: str, incident_id: str) -> str:
    """The Slurm drain reason that marks a node as drained by this incident, for this action.

    ``event`` names the event that decided the action: "xid 79", "sxid 22013", "init_failed".
    """
    return f"{DRAIN_REASON_PREFIX} {event} {action} incident {incident_id}"


def owned_reason(reason: str) -> bool:
    """Whether a Slurm drain reason was written by gpufleet."""
    return reason.strip().startswith(DRAIN_REASON_PREFIX)


def drained_for(reason: str) -> str | None:
    """The action an earlier gpufleet drain was for (``REPLACE_NODE``...), or None."""
    if not owned_reason(reason):
        return None
    words = reason.split()
    return next((word for word in words if word.isupper() and "_" in word), None)


def drained_by(reason: str) -> str | None:
    """The incident a gpufleet drain reason names (``... incident <id>``), or None."""
    if not owned_reason(reason):
        return None
    words = reason.split()
    return words[-1] if len(words) >= 2 and words[-2] == "incident" else None


# Reasons Slurm writes itself when a node fails: they are the failure, not an owner's hold.
SLURM_FAILURE_REASONS = ("not responding", "kill task failed", "node unexpectedly rebooted")


def held_by_someone_else(reason: str) -> bool:
    """A drain/down reason that a person or another controller wrote (not us, not Slurm itself)."""
    text = reason.strip().lower()
    return bool(text) and not owned_reason(reason) and not any(text.startswith(r) for r in SLURM_FAILURE_REASONS)


# What Slurm (22.05 to 26.05) writes when a node's Prolog or Epilog fails: it drains the node.
SLURM_HOOK_REASONS = ("prolog error", "epilog error")
# How gpufleet's drain reason names an incident decided by a failed `gpufleet health-check`.
HEALTH_CHECK_WORD = "health_check"


def hook_drain(reason: str) -> bool:
    """Whether ``reason`` is Slurm's own drain after a failed Prolog or Epilog."""
    return reason.strip().lower() in SLURM_HOOK_REASONS


def drained_by_hook(reason: str, event_message: str) -> bool:
    """Whether Slurm's drain ``reason`` follows the failed check a health_check event's message
    tells of: "Prolog error" a check in the prolog ("prolog: ..."), "Epilog error" one in the
    epilog. A check in the HealthCheckProgram makes no hook fail (it drains with gpufleet's reason),
    and a drained node runs no prolog, so a prolog drain found by such an incident is another's."""
    if not hook_drain(reason):
        return False
    hook = reason.strip().lower().split()[0]
    return event_message.startswith(f"{hook}:")


def takes_over(current: str, reason: str) -> bool:
    """Whether gpufleet's drain ``reason`` replaces the node's ``current`` one: Slurm's drain after a
    failed Prolog or Epilog, by an incident decided by gpufleet's own health check in that same
    hook (its reason names ``health_check prolog`` or ``health_check epilog``), which is what made
    the hook fail. See ``drained_by_hook`` for why another hook's check does not count."""
    if not (hook_drain(current) and owned_reason(reason)):
        return False
    hook = current.strip().lower().split()[0]
    words = reason.split()
    return any(word == HEALTH_CHECK_WORD and after == hook for word, after in pairwise(words))


# The spare pool: which cluster a Node serves, nodes kept out of every pool, retired nodes.
CLUSTER_LABEL = "gpufleet.io/cluster"
QUARANTINE_LABEL = "gpufleet.io/quarantine"
# A node back from validation, until the time in its annotation (or a number of jobs) passes:
# an Xid meanwhile quarantines it at once.
PROBATION_LABEL = "gpufleet.io/probation"
PROBATION_UNTIL_ANNOTATION = "gpufleet.io/probation-until"
# On a node returned with `gpufleet nodes return --skip-validation`: who skipped it, when and why.
VALIDATION_SKIPPED_ANNOTATION = "gpufleet.io/validation-skipped"
# On the Jobs that reset a GPU, reboot a node or check its GPUs afterwards (reset | reboot | check),
# and on a validation rung's Job (validate).
REPAIR_LABEL = "gpufleet.io/repair"
# On a reboot Job: the node's boot ID when the Job was made (a retry compares with this one).
BOOT_ID_ANNOTATION = "gpufleet.io/boot-id-before"
# On a repair Job stopped at its deadline: why the attempt failed (a retry reads it, runs nothing).
VERDICT_ANNOTATION = "gpufleet.io/verdict"
QUARANTINE_REASON_ANNOTATION = "gpufleet.io/quarantine-reason"
# Label values (short, label-safe) for why a node was quarantined.
QUARANTINE_REPEAT = "repeat-failures"
QUARANTINE_COOLDOWN = "failed-in-cooldown"
# An event on a node on probation (it passed validation not long ago): quarantined at once.
QUARANTINE_PROBATION = "failed-in-probation"
RETIRED_TAINT = "gpufleet.io/retired"
# Set on a claimed spare when the claim itself put it into this Slurm partition (release takes it out).
CLAIM_PARTITION_ANNOTATION = "gpufleet.io/claim-partition"
# The per-node lease: who holds the node for a multi-step change (an incident's workflow ID, a
# pool move's). An incident takes it from a move (an Xid wins); a move never takes it from anyone.
NODE_LEASE_ANNOTATION = "gpufleet.io/lease"
# The Slurm partitions a retired node was taken out of (comma-separated): it returns to them.
RETIRED_FROM_ANNOTATION = "gpufleet.io/retired-from"


def claim_label_value(incident_id: str) -> str:
    """The claim label's value for an incident: a digest, since an incident ID need not fit a
    label value (63 characters of a narrower alphabet)."""
    return hashlib.sha256(incident_id.encode()).hexdigest()[:40]
