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

# Slurm, Kubernetes or Temporal being away is retried until they come back (every 5 s at most, so
# an incident goes on within seconds of their return); wrong input is not retried.
RETRY_UNTIL_BACK = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    non_retryable_error_types=list(NON_RETRYABLE),
)
# Every activity heartbeats (activities/heartbeat.py): a worker that dies costs this, plus a retry.
HEARTBEAT = timedelta(seconds=5)
# One step of Slurm or Kubernetes calls: longer than the calls' own timeouts (Slurm 30 s,
# Kubernetes 15 s), so a slow attempt in a live worker ends before its retry could start.
SHORT_STEP = timedelta(seconds=60)
# Spare steps: several calls, and the partition lease may be waited for.
SPARE_STEP = timedelta(minutes=3)
# Cordoning and draining a node in Kubernetes: its pods' evictions are waited for.
KUBE_DRAIN_STEP = timedelta(minutes=30)

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

# The guard's own reads: which incidents still run, the worker's policy.
GUARD_READ = timedelta(seconds=30)
# Counting the partition's nodes (it heartbeats).
GUARD_COUNT = timedelta(seconds=60)
# One batch of the guard's answers (it heartbeats).
ANSWER_BATCH = timedelta(seconds=120)
# A batch the server keeps refusing is given up after a couple of minutes, not retried for ever
# (the answers after it wait for it).
ANSWER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    maximum_attempts=25,
)

# -- operator workflows on nodes (return, list and release quarantined ones) -------------------------

NODES_RETRY = RetryPolicy(
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=10,
    non_retryable_error_types=list(NON_RETRYABLE),
)
NODES_STEP = timedelta(seconds=30)

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
