"""The worker's configuration and classification: one policy file decides for the detector and the worker."""

from __future__ import annotations

from collections.abc import Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import heartbeating
from models.policy import Action, Policy
from models.requests import ClassifyRequest, WorkerConfig


class PolicyActivities:
    def __init__(self, config: Callable[[], WorkerConfig]) -> None:
        # Called on every read, so an edited policy file applies to the next incident.
        self._config = config

    @activity.defn(name="worker_config")
    @heartbeating
    def worker_config(self, cluster: str) -> WorkerConfig:
        """Grace, timeouts and policy as this worker has them; the incident records them once."""
        config = self._config()
        if cluster != config.cluster:
            # Task queues are per cluster, so this is a worker started with the wrong GPUFLEET_CLUSTER.
            raise ApplicationError(
                f"this worker serves cluster {config.cluster!r}, not {cluster!r}: check GPUFLEET_CLUSTER",
                type="InvalidInput",
                non_retryable=True,
            )
        return config

    @activity.defn(name="classify_xids")
    @heartbeating
    def classify(self, request: ClassifyRequest) -> Action:
        policy: Policy = request.policy or self._config().policy
        return policy.decide(request.events)
