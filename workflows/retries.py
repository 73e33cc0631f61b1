"""How long every workflow's activities may take, and how they are retried: one place for all.

A value changed here changes what the workflows ask Temporal for (the activity options in their
histories); workflows in flight replay either way, but what they do next follows the new value.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities.errors import NON_RETRYABLE

# -- incidents and the fleet guard ---------------------------------------------------------------

# Every activity has a budget: a schedule-to-close timeout (all its attempts and the waits
# between them) or a maximum of attempts, so that no failure is retried for ever. A step that
# runs out of budget fails its incident at that step, visibly (docs/remediation.md).
#
#   incident step (_activity, workflows/remediation/state.py)   its start-to-close + STEP_RETRY_WINDOW
#     lookups, drain, signal, requeue, lease (SHORT_STEP 60 s)   16 min
#     spare claim, retire, quarantine (SPARE_STEP 3 min)         18 min
#     cordon and drain in Kubernetes (KUBE_DRAIN_STEP 30 min)    45 min
#     watching jobs, a repair Job: their own timeout             that + 15 min
#   after the incident failed: give back its lease, slot, claim  its start-to-close + RELEASE_RETRY_WINDOW
#   guard reads: running incidents, limits (GUARD_READ 30 s)     GUARD_READ_BUDGET 2 min
#   guard count of the partition (GUARD_COUNT 60 s)              GUARD_COUNT_BUDGET 3 min
#   guard answers, one batch (ANSWER_BATCH 2 min)                ANSWER_BUDGET 5 min, 25 attempts
#   notifications and the guard's page                           NOTIFY_BUDGET 5 min, 8 attempts

# Slurm, Kubernetes or Temporal being away is retried every 5 s at most, so an incident goes on
# within seconds of their return; wrong input (NON_RETRYABLE, or any error raised as
# non-retryable) is not retried. How long it is retried is the call's schedule-to-close.
STEP_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    non_retryable_error_types=list(NON_RETRYABLE),
)
# How long a step of an incident goes on retrying after one whole attempt: a Slurm controller's
# restart or a Kubernetes API server's upgrade takes minutes; a service away for longer needs a
# person, and the incident fails (the node drained, its jobs requeued) and says so.
STEP_RETRY_WINDOW = timedelta(minutes=15)
# Once an incident has failed, giving back what it holds (its node's lease, its guard slot, an
# unused spare claim) is retried for this long after one attempt: each is worth a try, but the
# operators' page should not wait a quarter of an hour for each.
RELEASE_RETRY_WINDOW = timedelta(minutes=2)
# Every activity heartbeats (activities/heartbeat.py): a worker that dies costs this, plus a retry.
HEARTBEAT = timedelta(seconds=5)
# One step of Slurm or Kubernetes calls: longer than the calls' own timeouts (Slurm 30 s,
# Kubernetes 15 s), so a slow attempt in a live worker ends before its retry could start.
SHORT_STEP = timedelta(seconds=60)
# Spare steps: several calls, and the partition lease may be waited for.
SPARE_STEP = timedelta(minutes=3)
# Cordoning and draining a node in Kubernetes: its pods' evictions are waited for.
KUBE_DRAIN_STEP = timedelta(minutes=30)


def step_budget(step: timedelta, window: timedelta = STEP_RETRY_WINDOW) -> timedelta:
    """The schedule-to-close of a call whose attempts may take ``step`` each: one whole attempt,
    then retries for ``window``."""
    return step + window


# Notifications (and the guard's page): each attempt bounded, the whole message bounded, a
# refusal not retried.
NOTIFY_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=8,
    non_retryable_error_types=["InvalidInput"],
)
NOTIFY_ATTEMPT = timedelta(seconds=10)
NOTIFY_BUDGET = timedelta(minutes=5)

# The guard's own reads: which incidents still run, the worker's policy. The guard handles one
# message at a time, so a read it cannot make is given up after GUARD_READ_BUDGET and the guard
# goes on with what it last read (every slot kept held, the last limits).
GUARD_READ = timedelta(seconds=30)
GUARD_READ_BUDGET = timedelta(minutes=2)
# Counting the partition's nodes (it heartbeats); the last count is kept when it gives up.
GUARD_COUNT = timedelta(seconds=60)
GUARD_COUNT_BUDGET = timedelta(minutes=3)
# One batch of the guard's answers (it heartbeats).
ANSWER_BATCH = timedelta(seconds=120)
# A batch the server keeps refusing is given up after a few minutes, not retried for ever (the
# answers after it wait for it; workflows/guard_answers.py sends it again a few times).
ANSWER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    maximum_attempts=25,
)
ANSWER_BUDGET = timedelta(minutes=5)

# -- operator workflows on nodes (return, list and release quarantined ones) -------------------------

NODES_RETRY = RetryPolicy(
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=10,
    non_retryable_error_types=list(NON_RETRYABLE),
)
NODES_STEP = timedelta(seconds=30)
# The end of a node's probation (ProbationWorkflow), the timer's one step: tried until done (the
# Kubernetes API may be away for longer than NODES_RETRY's minute or so), else the node would
# keep gpufleet.io/probation for good.
PROBATION_END_RETRY = RetryPolicy(
    maximum_interval=timedelta(minutes=5),
    non_retryable_error_types=list(NON_RETRYABLE),
)

# -- pool rebalancing ------------------------------------------------------------------------------

POOL_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=["InvalidInput", "NotFound", "Forbidden", "NotOwned"],
)
# Looking at the pool: a few API reads.
POOL_LOOK = timedelta(seconds=60)
# Moving one node: its jobs or pods are waited for (it heartbeats).
POOL_MOVE = timedelta(hours=2)
POOL_MOVE_HEARTBEAT = timedelta(seconds=30)

# -- cluster creation and deletion -----------------------------------------------------------------

# A step's activity retries only what may pass on its own (a lost connection) and only briefly,
# so the real cause shows in the status within a minute; a wrong spec or an empty pool fails at once.
CLUSTER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=4,
    non_retryable_error_types=["InvalidInput", "NotFound", "Forbidden", "PoolExhausted", "SpecInvalid", "StepFailed"],
)
CLUSTER_HEARTBEAT = timedelta(seconds=30)
# Most steps are API calls; daemons starting and smoke jobs running take longest.
CLUSTER_STEP = timedelta(minutes=2)
CLUSTER_SLOW_STEP = timedelta(minutes=10)
# A deletion's steps (draining, tearing down) may wait on the cluster.
CLUSTER_DELETE_STEP = timedelta(minutes=5)
