"""Where a new Slurm cluster runs: one Protocol, a backend per place (Slinky on Kubernetes, the
lab's local daemons). Each method is idempotent: called again after a crash it finds what it
made and finishes, and each undo removes whatever part of its step exists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from models.cluster import ClusterSpec


class StepFailed(Exception):
    """A step that ran and found the cluster wrong (a smoke job that failed, a daemon that
    exited): not retried, its message is the cause."""


def leaving(spec: ClusterSpec, only: Sequence[str] | None) -> tuple[list[str], set[str]]:
    """What ``remove_users(spec, only)`` removes: the users (all the spec's when ``only`` is None)
    and the accounts that no user staying in the spec still uses."""
    gone = [u.name for u in spec.users] if only is None else [u.name for u in spec.users if u.name in set(only)]
    staying = {u.account for u in spec.users if u.name not in set(gone)}
    accounts = {u.account for u in spec.users if u.name in set(gone)} - staying
    return gone, accounts


class ClusterBackend(Protocol):
    name: str

    def unsupported(self, spec: ClusterSpec) -> str:
        """What of the spec this backend cannot do ('' when it can do it all)."""
        ...

    def exists(self, spec: ClusterSpec) -> str:
        """What of a cluster by this name exists already ('' when nothing)."""
        ...

    def render_conf(self, spec: ClusterSpec, placement: dict[str, list[str]]) -> str: ...
    def create_objects(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str, creation: str) -> str:
        """Make the cluster's objects, each marked as made by ``creation``."""
        ...

    def delete_objects(self, spec: ClusterSpec, creation: str) -> str:
        """Delete the objects ``creation`` made (never others of the same names)."""
        ...

    def bring_up(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str) -> str: ...
    def tear_down(self, spec: ClusterSpec) -> str: ...
    def add_users(self, spec: ClusterSpec) -> str:
        """The spec's accounts and users into accounting; only those missing are added."""
        ...

    def remove_users(self, spec: ClusterSpec, only: Sequence[str] | None = None) -> str:
        """The spec's users' associations out of accounting, and their accounts'. ``only``: just
        those users' associations, and just the accounts that no user of ``spec`` but them uses."""
        ...

    def set_logins(self, spec: ClusterSpec) -> str:
        """The login node's users and their keys become the spec's: accounts made for added users,
        removed users can no longer log in. Idempotent."""
        ...

    def smoke_test(self, spec: ClusterSpec) -> str: ...
    def make_remediable(self, spec: ClusterSpec) -> str: ...
    def drain(self, spec: ClusterSpec) -> str:
        """Every node drained: no new job starts."""
        ...

    def running_jobs(self, spec: ClusterSpec) -> int:
        """Jobs still running or about to (pending jobs cannot start on drained nodes)."""
        ...

    def cancel_jobs(self, spec: ClusterSpec) -> int:
        """Cancel every job; returns how many there were."""
        ...

    def unmake_remediable(self, spec: ClusterSpec) -> str: ...


@runtime_checkable
class HasLogin(Protocol):
    """A backend whose clusters have a login node."""

    def login_address(self, spec: ClusterSpec) -> str:
        """``host:port`` where the cluster's users log in with ssh ('' when it has no login node)."""
        ...
