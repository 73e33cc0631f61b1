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

    def _read(self) -> WorkerConfig:
        """The configuration; one that cannot be used (a policy file that is not UTF-8 text, not
        YAML, or names an unknown field) fails at once: reading it again gives the same error.
        The worker's own reader keeps the last good one instead (workers/main.py LastGoodConfig):
        this is for a worker that has none."""
        try:
            return self._config()
        except ValueError as exc:  # PolicyError, UnicodeDecodeError, a pydantic ValidationError
            raise ApplicationError(
                f"the worker's policy cannot be used: {exc}", type="PolicyInvalid", non_retryable=True
            ) from exc

    @activity.defn(name="worker_config")
    @heartbeating
    def worker_config(self, cluster: str) -> WorkerConfig:
        """Grace, timeouts and policy as this worker has them; the incident records them once."""
        config = self._read()
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
        policy: Policy = request.policy or self._read().policy
        return policy.decide(request.events)
