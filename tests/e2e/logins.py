"""Logging in to a cluster's login node as its users do: a key pair of their own, then ssh."""

from __future__ import annotations

import subprocess
from pathlib import Path

SSH_OPTIONS = [
    "-o", "BatchMode=yes",
    "-o", "IdentitiesOnly=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "ConnectTimeout=20",
]  # fmt: skip


def make_key(folder: Path) -> tuple[Path, str]:
    """A new ed25519 key pair in ``folder``: the private key's path and the public key's line."""
    folder.mkdir(parents=True, exist_ok=True)
    private = folder / "id_ed25519"
    n = 0
    while private.exists():  # another key of the same folder
        n += 1
        private = folder / f"id_ed25519_{n}"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpufleet-test-{private.name}", "-f", str(private)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return private, private.with_name(private.name + ".pub").read_text().strip()


def ssh_argv(address: str, user: str, key: Path) -> list[str]:
    """``ssh`` as ``user`` to the login node at ``host:port`` with ``key`` only (a command follows)."""
    host, _, port = address.rpartition(":")
    return ["ssh", "-i", str(key), "-p", port, *SSH_OPTIONS, f"{user}@{host}"]


def ssh(address: str, user: str, key: Path, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``command`` run by ``user`` on the login node at ``host:port``, with ``key`` only."""
    return subprocess.run([*ssh_argv(address, user, key), command], capture_output=True, text=True, timeout=timeout)
