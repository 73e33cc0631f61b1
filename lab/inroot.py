"""Run one command inside a cached Slurm root (lab/slurmroots.py), in a private mount namespace.

Started as ``unshare --mount --propagation private -- python -I -S lab/inroot.py ROOT [--bind DIR]...
[--outside] -- COMMAND [ARG]...`` (``SlurmInstall.argv`` builds that): it binds the host's ``/proc``,
``/dev``, ``/sys`` and each ``--bind`` folder into the root at the same path, changes root, keeps the
working folder when the root has it, and becomes the command.

ROOT ``/`` is the host's own Slurm (22.05) seen with a cluster's users (below): nothing is bound
but the cluster's own files, and the root is not changed. ``--outside`` prepares the root as
usual but runs the command outside it, with the cluster's users over the host's too: the login
node's sshd (lab/login.py), which puts each session into the root itself (``ChrootDirectory``).

Slurm 23.11 and later keep, under ``/run/slurm``, ``/run/slurmctld`` and ``/run/slurmdbd``, the
sockets through which commands have their credentials signed with the cluster's key: two clusters
on one root must not share them. So, where ``$SLURM_CONF`` names a cluster's slurm.conf, the
folders ``run/slurm``, ``run/slurmctld`` and ``run/slurmdbd`` beside it are bound there: the
daemons and the commands of one cluster, and only they, meet at the same sockets, whichever
wrapper started them. Where ``etc/passwd`` and ``etc/group`` are beside that slurm.conf (the
cluster's users: lab/login.py writes them from its spec, or, for a Slinky cluster of the lab, from
its user database Secret, as sssd gives them to the pods), they are bound over the root's
``/etc/passwd`` and ``/etc/group``, so that the cluster's daemons, its jobs, its commands and its
login node know its users; the root's own files are never changed. Where ``mounts.json`` is beside
it (``[[SOURCE, TARGET], ...]``: the users' homes at ``/home``, the cluster's storage at its mount
path), each folder is bound at its target, so a file a job writes is the file its owner reads on
the login node. The binds exist only in that namespace and vanish with its last process, so the
cached root never holds a mount of the host's devices: removing it touches nothing of the host.

Standard library only, and no import of gpufleet: it runs before and outside any virtualenv setup.
"""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
from pathlib import Path

# Inside the root, its own commands: never a wrapper of the host's bin folders.
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_BINDS = ("/proc", "/dev", "/sys")
# Where a cluster's own folders are never bound (models/cluster.py SYSTEM_FOLDERS; this file
# cannot import gpufleet): only its homes go at /home itself.
SYSTEM_FOLDERS = (
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/root",
    "/run", "/sbin", "/sys", "/tmp", "/usr", "/var",
)  # fmt: skip


def _bind(source: str, root: Path, at: str | None = None) -> None:
    target = root / (at or source).lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--rbind", source, str(target)], check=True)


def _bind_file(source: str, root: Path, at: str) -> None:
    target = root / at.lstrip("/")
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    subprocess.run(["mount", "--bind", source, str(target)], check=True)


def _options(options: list[str]) -> tuple[list[str], bool] | None:
    """The folders of the ``--bind DIR`` options and whether ``--outside`` is there (None: malformed)."""
    binds: list[str] = []
    outside = False
    words = iter(options)
    for word in words:
        if word == "--outside":
            outside = True
            continue
        if word != "--bind":
            return None
        binds.append(next(words, ""))
    return None if "" in binds else (binds, outside)


def _cluster_run(conf: str | None) -> list[tuple[str, str]]:
    """The cluster's own run folders (beside its slurm.conf) and where they go in the root."""
    if not conf or not os.path.isabs(conf):
        return []
    folder = Path(conf).parent / "run"
    return [(str(folder / name), f"/run/{name}") for name in ("slurm", "slurmctld", "slurmdbd")]


def _cluster_etc(conf: str | None) -> list[tuple[str, str]]:
    """The cluster's own user database (``etc/passwd``, ``etc/group`` beside its slurm.conf),
    where it has one, and where each goes in the root."""
    if not conf or not os.path.isabs(conf):
        return []
    folder = Path(conf).parent / "etc"
    return [(str(folder / name), f"/etc/{name}") for name in ("passwd", "group") if (folder / name).is_file()]


def _cluster_mounts(conf: str | None, root: Path) -> list[tuple[str, str]]:
    """The cluster's own folders (``mounts.json`` beside its slurm.conf) and where each goes.

    Raises ValueError for an entry that is not an existing folder bound at an absolute path
    without ``..``, or whose target a symbolic link in the root would take elsewhere."""
    if not conf or not os.path.isabs(conf):
        return []
    listed = Path(conf).parent / "mounts.json"
    if not listed.is_file():
        return []
    mounts: list[tuple[str, str]] = []
    for entry in json.loads(listed.read_text()):
        source, target = str(entry[0]), str(entry[1])
        if not (os.path.isabs(source) and os.path.isdir(source)):
            raise ValueError(f"{listed}: {source!r} is not a folder")
        if (
            not os.path.isabs(target)
            or target.startswith("//")
            or posixpath.normpath(target) != target
            or target == "/"
        ):
            raise ValueError(f"{listed}: {target!r} is not a plain absolute path below /")
        if target != "/home" and any(target == f or target.startswith(f + "/") for f in SYSTEM_FOLDERS):
            raise ValueError(f"{listed}: refusing to bind {source} over the system folder {target}")
        inside = root
        for part in Path(target).parts[1:]:
            inside = inside / part
            if inside.is_symlink():
                raise ValueError(f"{listed}: {inside} is a symbolic link; refusing to bind {target} there")
        mounts.append((source, target))
    return mounts


def _hide_other_clusters(conf: str | None, root: Path) -> None:
    """Where the cluster's folder is one of ``clusters/`` (the lab's), the others are hidden
    behind an empty folder and only its own is bound back: its users see no other cluster's
    homes, storage or sockets."""
    if not conf or not os.path.isabs(conf):
        return
    folder = Path(conf).parent
    clusters = folder.parent
    target = root / str(clusters).lstrip("/")
    if clusters.name != "clusters" or not target.is_dir():
        return
    inside = root
    for part in clusters.parts[1:]:  # a link would take the empty folder somewhere else
        inside = inside / part
        if inside.is_symlink():
            print(f"inroot.py: {inside} is a symbolic link; other clusters are not hidden", file=sys.stderr)
            return
    own = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # still reachable once its parent is hidden
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=64k", "tmpfs", str(target)], check=True)
        (target / folder.name).mkdir()
        subprocess.run(
            ["mount", "--no-canonicalize", "--rbind", f"/proc/self/fd/{own}", str(target / folder.name)],
            check=True,
            pass_fds=(own,),
        )
    finally:
        os.close(own)


def _cluster_mounts_first(mounts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The mounts with a shallower target first, so that none hides one bound before it."""
    return sorted(mounts, key=lambda mount: mount[1].rstrip("/").count("/"))


def main(argv: list[str]) -> int:
    usage = "usage: inroot.py ROOT [--bind DIR]... [--outside] -- COMMAND [ARG]..."
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
    binds, outside = parsed
    host = root == Path("/")
    conf = os.environ.get("SLURM_CONF")
    try:
        mounts = _cluster_mounts(conf, root)
    except (ValueError, OSError, IndexError, TypeError) as exc:
        print(f"inroot.py: {exc}", file=sys.stderr)
        return 2
    cwd = os.getcwd()
    if not host:
        for source in (*SYSTEM_BINDS, *binds):
            if os.path.isdir(source):
                _bind(source, root)
        for source, at in _cluster_run(conf):
            os.makedirs(source, exist_ok=True)
            _bind(source, root, at)
    if mounts or _cluster_etc(conf):  # a cluster of its own users
        _hide_other_clusters(conf, root)
    for source, at in _cluster_mounts_first(mounts):
        _bind(source, root, at)
    for source, at in _cluster_etc(conf):
        _bind_file(source, root, at)
        if outside and not host:
            _bind_file(source, Path("/"), at)
    if host or outside:
        env = dict(os.environ)
    else:
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
