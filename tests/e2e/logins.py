"""Logging in to a cluster's login node as its users do: a key pair of the test's own, and ssh."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_key(folder: Path) -> tuple[Path, str]:
    """A new ed25519 key pair in ``folder``: the private key's path and the public key's line."""
    folder.mkdir(parents=True, exist_ok=True)
    private = folder / f"id_{len(list(folder.glob('id_*.pub')))}"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-test", "-f", str(private)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return private, private.with_suffix(".pub").read_text().strip()


def ssh(address: str, user: str, key: Path, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``command`` run by ``user`` on the login node at ``host:port``, with ``key`` only."""
    host, _, port = address.rpartition(":")
    argv = [
        "ssh",
        "-i",
        str(key),
        "-p",
        port,
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=20",
        f"{user}@{host}",
        command,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
