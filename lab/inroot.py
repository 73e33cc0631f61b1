"""Run one command inside a cached Slurm root (lab/slurmroots.py), in a private mount namespace.

Started as ``unshare --mount --propagation private -- python -I -S lab/inroot.py ROOT [--bind DIR]...
[--bind-at DIR PATH]... -- COMMAND [ARG]...`` (``SlurmInstall.argv`` builds that): it binds the host's
``/proc``, ``/dev``, ``/sys`` and each ``--bind`` folder into the root at the same path, each
``--bind-at`` folder at PATH in the root (a cluster's own ``/run/slurm``: where Slurm 23.11 and later
keep the socket through which commands have their credentials signed, which two clusters on one
root must not share), changes root, keeps the working folder when the root has it, and becomes the
command. The binds exist only in that namespace and vanish
with its last process, so the cached root never holds a mount of the host's devices: removing it
touches nothing of the host.

Standard library only, and no import of gpufleet: it runs before and outside any virtualenv setup.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Inside the root, its own commands: never a wrapper of the host's bin folders.
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_BINDS = ("/proc", "/dev", "/sys")


def _bind(source: str, root: Path, at: str | None = None) -> None:
    target = root / (at or source).lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--rbind", source, str(target)], check=True)


def _options(options: list[str]) -> tuple[list[str], list[tuple[str, str]]] | None:
    """The ``--bind DIR`` and ``--bind-at DIR PATH`` options (None: malformed)."""
    binds: list[str] = []
    binds_at: list[tuple[str, str]] = []
    words = iter(options)
    for word in words:
        if word == "--bind":
            binds.append(next(words, ""))
        elif word == "--bind-at":
            binds_at.append((next(words, ""), next(words, "")))
        else:
            return None
    if "" in binds or any("" in pair for pair in binds_at):
        return None
    return binds, binds_at


def main(argv: list[str]) -> int:
    usage = "usage: inroot.py ROOT [--bind DIR]... [--bind-at DIR PATH]... -- COMMAND [ARG]..."
    if "--" not in argv or len(argv) < 3:
        print(usage, file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    root = Path(options[0]).resolve()
    parsed = _options(options[1:])
    if not command or parsed is None:
        print(usage, file=sys.stderr)
        return 2
    binds, binds_at = parsed
    cwd = os.getcwd()
    for source in (*SYSTEM_BINDS, *binds):
        if os.path.isdir(source):
            _bind(source, root)
    for source, at in binds_at:
        os.makedirs(source, exist_ok=True)
        _bind(source, root, at)
    os.chroot(root)
    try:
        os.chdir(cwd)
    except OSError:
        os.chdir("/")
    env = {**os.environ, "PATH": ROOT_PATH}
    try:
        os.execvpe(command[0], command, env)  # noqa: S606 (an argv list, no shell)
    except FileNotFoundError:
        print(f"inroot.py: {command[0]} is not in the Slurm root {root}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
