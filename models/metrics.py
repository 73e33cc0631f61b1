"""The names of gpufleet's own Prometheus metrics, in one place.

The worker serves them beside the Temporal SDK's own (``temporal_*``) on one endpoint
(``GPUFLEET_METRICS_PORT``, workers/metrics.py). Workflows record theirs through
``workflow.metric_meter()``, which records nothing while a history is replayed; the worker
records the process-level ones through its runtime's meter. The detector serves its own
``gpufleet_detector_*`` metrics on its ``--health-port`` (detector/health.py).
"""

from __future__ import annotations

# Incidents closed, by cluster, the Xid that decided (its kind for events without a GPU Xid:
# sxid, init_failed, power_cable; "none" when no event arrived), the action and the outcome.
INCIDENTS = "gpufleet_incidents_total"
INCIDENTS_HELP = "Incidents closed, by cluster, deciding Xid, action and outcome (dry runs not counted)."
# Of those, the ones with outcome "failed", by cluster, the step they stopped at and the error's
# type (Unavailable, NotFound, PolicyInvalid, ...; "cancelled" for a person's cancellation).
INCIDENTS_FAILED = "gpufleet_incidents_failed_total"
INCIDENTS_FAILED_HELP = (
    "Incidents that failed, by cluster, the step they stopped at and the error's type (dry runs not counted)."
)

# What incidents cost in GPU time (models/goodput.py, docs/goodput.md): GPU-seconds lost, by
# cluster, the ledger's phase (detection, drain, grace, requeue, spare_wait, restart, lost_work)
# and its cause (the deciding event, "Xid 79"); counted once as each incident closes, whole seconds
# (Temporal's counters count integers), lost work only where the jobs reported checkpoints.
GPU_SECONDS_LOST = "gpufleet_gpu_seconds_lost_total"
GPU_SECONDS_LOST_HELP = (
    "GPU-seconds lost to failures, by cluster, recovery phase and cause, counted as each incident closes "
    "(dry runs not counted; lost work only where jobs reported checkpoints)."
)

# How long each remediation step took, recorded when the step finishes.
STEP_DURATION = "gpufleet_step_duration_seconds"
STEP_DURATION_HELP = "Time from a remediation step's start to its end, by cluster and step."
# From a classify (well under a second) to a wait for a spare or an approval (hours, days).
STEP_DURATION_BUCKETS: tuple[float, ...] = (
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
    4 * 3600,
    24 * 3600,
)

# Per node and step: the Unix time the node's open incident entered the step, 0 once it finished
# or the incident closed (by node, not by incident: the series stay as many as the nodes). A step
# stuck for too long is ``time() - this`` (alerts in deploy/base).
STEP_STARTED = "gpufleet_incident_step_started_timestamp_seconds"
STEP_STARTED_HELP = "Unix time an open incident entered a step; 0 once the step finished or the incident closed."

# Spares a claim would take now (the claim's own test), counted by the worker every minute.
SPARES_FREE = "gpufleet_spares_free"
SPARES_FREE_HELP = "Warm spares of this cluster free to claim now (checked every minute by each worker)."

# The worker's configuration as it reads it again (at each incident, and every minute): per source
# ("policy_file", "configmap": the cluster's remediation ConfigMap), 1 while the source is good, 0
# while the worker refuses it and goes on with its last good configuration (its log says why).
CONFIG_OK = "gpufleet_config_ok"
CONFIG_OK_HELP = (
    "1 while this worker's configuration source is good; 0 while it refuses it and keeps its last good configuration."
)
# Each time a source is refused anew (a bad edit, or another problem than the one before).
CONFIG_REJECTED = "gpufleet_config_rejected_total"
CONFIG_REJECTED_HELP = "Edits of a configuration source that this worker refused (keeping its last good configuration)."
CONFIG_POLICY_FILE = "policy_file"
CONFIG_CONFIGMAP = "configmap"

# The cluster's fleet guard, set by the guard workflow each time it handles a message.
GUARD_BREAKER = "gpufleet_guard_breaker_state"
GUARD_BREAKER_HELP = "The fleet guard's breaker: 0 closed, 1 tripped, 2 paused."
GUARD_IN_FLIGHT = "gpufleet_guard_in_flight"
GUARD_IN_FLIGHT_HELP = "Incidents holding one of the fleet guard's slots."
GUARD_WAITING = "gpufleet_guard_waiting"
GUARD_WAITING_HELP = "Incidents waiting at the fleet guard (breaker tripped, paused, or no slot free)."
# Workflow time of the guard's last report: of several workers' values, the newest is the guard's.
GUARD_UPDATED = "gpufleet_guard_updated_timestamp_seconds"
GUARD_UPDATED_HELP = "Unix time (workflow time) the fleet guard last reported its state from this worker."

BREAKER_CLOSED = 0
BREAKER_TRIPPED = 1
BREAKER_PAUSED = 2
