"""Processes the lab starts: free ports, spawning with logs, waiting, stopping."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port nothing listens on right now (on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def spawn(argv: list[str], *, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    """Start a daemon in its own session, output appended to ``log``; returns its PID."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    return proc.pid


def wait_for(check: Callable[[], T | Literal[False] | None], *, timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy, and return that.

    An exception from ``check`` counts as "not yet". Raises TimeoutError naming ``what``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            value = check()
            if value:
                return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def reap() -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def stop(pids: list[int], *, timeout: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after ``timeout``, and wait
    (a few seconds at most) until the killed ones are gone."""
    for pid in pids:
        for send in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        reap()
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            for send in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    send(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILLED_GONE_SECONDS
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        reap()
        time.sleep(0.05)
    reap()


# How long a SIGKILLed process may take to be gone (its exit is the kernel's, but not instant).
KILLED_GONE_SECONDS = 5.0


def pids_with_env(name: str, value: str) -> list[int]:
    """Processes whose environment has ``name=value`` (job steps the daemons left behind)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def pids_holding(folder: Path, roots: Iterable[Path]) -> list[int]:
    """Processes running in one of ``roots`` (a cached Slurm root) with a file open under
    ``folder`` as bound there: the job steps a newer Slurm's slurmd left behind, which clear their
    environment but keep the node's log open. Nothing outside those roots is ever picked."""
    inside = {str(root) for root in roots}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            root = os.readlink(entry / "root")
            if root not in inside:
                continue
            targets = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(target.startswith(f"{root}{folder}/") for target in targets) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def mount_namespace(pid: int) -> str:
    """The mount namespace a process runs in ('' when it is gone)."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/mnt")
    return ""


def real_uid(pid: int) -> int:
    """The real uid of a process (-1 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def pids_in_namespace(namespace: str) -> list[int]:
    """The processes of a mount namespace (a login node's sessions)."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and mount_namespace(int(entry.name)) == namespace
    ]
