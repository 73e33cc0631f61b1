"""Run one command inside a cached Slurm root (lab/slurmroots.py), in a private mount namespace.

Started as ``unshare --mount --propagation private -- python -I -S lab/inroot.py ROOT [--bind DIR]...
-- COMMAND [ARG]...`` (``inroot_argv`` builds that): it binds the host's ``/proc``, ``/dev``, ``/sys``
and each ``--bind`` folder into the root at the same path, changes root, keeps the working folder
when the root has it, and becomes the command. The binds exist only in that namespace and vanish
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


def _bind(source: str, root: Path) -> None:
    target = root / source.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--rbind", source, str(target)], check=True)


def main(argv: list[str]) -> int:
    if "--" not in argv or len(argv) < 3:
        print("usage: inroot.py ROOT [--bind DIR]... -- COMMAND [ARG]...", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    root = Path(options[0]).resolve()
    binds = [options[i + 1] for i, word in enumerate(options) if word == "--bind" and i + 1 < len(options)]
    if not command:
        print("inroot.py: no command after --", file=sys.stderr)
        return 2
    cwd = os.getcwd()
    for source in (*SYSTEM_BINDS, *binds):
        if os.path.isdir(source):
            _bind(source, root)
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
