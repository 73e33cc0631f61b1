"""Logging in to a lab cluster's login node as its users do: a key pair of their own, then ssh."""

from __future__ import annotations

import subprocess
from pathlib import Path

SSH_OPTIONS = [
    "-o", "BatchMode=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "IdentitiesOnly=yes",
    "-o", "ConnectTimeout=10",
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


def ssh(address: str, user: str, key: Path, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` run by ``user`` on the login node at ``address`` (``host:port``), logged in
    with ``key`` only (never a password, nor the agent's keys)."""
    host, port = address.rsplit(":", 1)
    return subprocess.run(
        ["ssh", "-i", str(key), "-p", port, *SSH_OPTIONS, f"{user}@{host}", command],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
