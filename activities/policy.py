"""Classification: the worker's policy (with its operator overrides) decides the action."""

from __future__ import annotations

from temporalio import activity

from models.policy import Action, Policy
from models.requests import ClassifyRequest


class PolicyActivities:
    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    @activity.defn(name="classify_xids")
    def classify(self, request: ClassifyRequest) -> Action:
        return self._policy.decide(request.events)
