"""The activities a change of a running cluster's users calls: a backend that cannot set logins
says so, naming itself, as a step failure (not retried), never an AttributeError; ``only`` reaches
the backend's remove_users, and no ``only`` removes every user as a deletion does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import yaml
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.cluster import ClusterActivities
from clients.clusters import leaving
from clients.notify import WebhookNotifier
from models.cluster import ClusterSpec, load_spec
from models.clusterops import ClusterRequest
from tests.models.test_cluster_spec import EXAMPLE


class NoLogins:
    """A backend of before set_logins: users into and out of accounting only."""

    name = "older"

    def __init__(self) -> None:
        self.removed: list[tuple[list[str], set[str]]] = []

    def remove_users(self, spec: ClusterSpec, only: Sequence[str] | None = None) -> str:
        self.removed.append(leaving(spec, only))
        return "removed"


def spec() -> ClusterSpec:
    return load_spec(yaml.safe_load(EXAMPLE.read_text()))  # alice (vision) and bob (language)


def activities(backend: object) -> ClusterActivities:
    return ClusterActivities(None, {"older": backend}, WebhookNotifier(url=""))  # type: ignore[arg-type, dict-item]


def test_a_backend_without_set_logins_fails_the_step_naming_itself() -> None:
    with pytest.raises(ApplicationError) as failed:
        ActivityEnvironment().run(activities(NoLogins()).set_logins, ClusterRequest(spec=spec(), backend="older"))
    assert failed.value.type == "Unsupported" and failed.value.non_retryable
    assert "the older backend cannot change the logins of a running cluster" in failed.value.message


def test_only_the_users_named_are_removed_and_the_accounts_no_one_left_uses() -> None:
    backend = NoLogins()
    acts = activities(backend)
    raw = spec().model_dump(mode="json")
    raw["users"][1]["account"] = "vision"  # bob shares alice's account
    shared = load_spec(raw)
    ActivityEnvironment().run(acts.remove_users, ClusterRequest(spec=shared, backend="older", only=["bob"]))
    ActivityEnvironment().run(acts.remove_users, ClusterRequest(spec=spec(), backend="older", only=["bob"]))
    ActivityEnvironment().run(acts.remove_users, ClusterRequest(spec=spec(), backend="older"))
    # bob leaves vision to alice, but takes language, his alone; no only: every user and account.
    assert backend.removed == [
        (["bob"], set()),
        (["bob"], {"language"}),
        (["alice", "bob"], {"vision", "language"}),
    ]
