"""Names shared by every room: task queue, workflow names and IDs, labels, search attributes."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

TASK_QUEUE = "gpufleet"
REMEDIATION_WORKFLOW = "NodeRemediationWorkflow"

# Slurm drain reasons we write start with this; anything else belongs to someone else.
DRAIN_REASON_PREFIX = "gpufleet:"

POOL_LABEL = "gpufleet.io/pool"
POOL_SPARE = "spare"
POOL_TRAINING = "training"
POOL_RETIRED = "retired"
CLAIMED_BY_ANNOTATION = "gpufleet.io/claimed-by"
INCIDENT_ANNOTATION = "gpufleet.io/incident"
UNHEALTHY_TAINT = "gpufleet.io/unhealthy"

SA_GPU_NODE = SearchAttributeKey.for_keyword("GpuNode")
SA_CLUSTER = SearchAttributeKey.for_keyword("Cluster")
SA_XID = SearchAttributeKey.for_int("Xid")
SA_STEP = SearchAttributeKey.for_keyword("RemediationStep")
SEARCH_ATTRIBUTES = (SA_GPU_NODE, SA_CLUSTER, SA_XID, SA_STEP)


def remediation_workflow_id(cluster: str, node: str) -> str:
    """The one open incident per node: repeated Xids on a node join it through this ID."""
    return f"remediate-{cluster}-{node}"


def drain_reason(*, xid: int, incident_id: str) -> str:
    """The Slurm drain reason that marks a node as drained by this incident."""
    return f"{DRAIN_REASON_PREFIX} xid {xid} incident {incident_id}"
