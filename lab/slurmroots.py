"""Slurm releases for the lab: the host's own packages, or a Debian root made once and cached.

Clusters run Slurm 23.11 to 26.05 today; Debian 12 carries 22.05. A newer release is a minimal
Debian root (``debootstrap --variant=minbase``) of the suite that carries it, with Slurm, slurmrestd,
its JWT plugin, slurmdbd and python3 (for the lab's jobs), cached outside any checkout
(``$GPUFLEET_SLURM_ROOTS``, default ``~/.cache/gpufleet``: ``slurm-24.11``, ``slurm-26.05``) beside a
manifest saying what it holds. Its commands run through ``lab/inroot.py`` in a private mount
namespace (root only): nothing is ever bound into a cached root on the host's side, so removing
one never touches the host's devices. When the host's own Slurm is the release asked for, the
host's packages serve and no root is made.

``python -m lab.slurmroots [--refresh] [VERSION...]`` (``make slurm-roots``) makes or checks them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
INROOT = REPO_ROOT / "lab" / "inroot.py"
MIRROR = "http://deb.debian.org/debian"
# What every root holds: the daemons and commands, Slurm's REST API and its JWT plugin, the
# accounting daemon, and an interpreter for the lab's jobs (they run on the root's slurmd).
PACKAGES = ("slurm-wlm", "slurmrestd", "slurm-wlm-jwt-plugin", "slurmdbd", "python3")
# The commands the lab and gpufleet run against a cluster, as wrappers in its bin folder.
CLIENT_COMMANDS = ("scontrol", "squeue", "sbatch", "scancel", "sinfo", "sacct", "sacctmgr", "srun", "sreport")
# How often an existing root is checked against its archive (a moved package rebuilds it).
CHECK_EVERY_SECONDS = 24 * 3600
# How long making one root may take (about a minute on a good link).
MAKE_TIMEOUT_SECONDS = 1800
Say = Callable[[str], None]


@dataclass(frozen=True)
class Release:
    """One Slurm release and the Debian suite that carries it."""

    version: str  # "24.11"
    suite: str  # "trixie"
    # debootstrap's script for the suite, where it has none of that name (forky: sid's).
    script: str = ""
    # The REST API versions its slurmrestd serves (its data_parser plugins).
    api_versions: tuple[str, ...] = field(default=())
    # Whether it can run from a root: 23.11 and later authenticate with auth/slurm and a key; 22.05
    # needs MUNGE, which the lab runs only with the host's own Slurm.
    in_root: bool = True


RELEASES: dict[str, Release] = {
    "22.05": Release("22.05", "bookworm", api_versions=("v0.0.38",), in_root=False),
    "24.11": Release("24.11", "trixie", api_versions=("v0.0.40", "v0.0.41", "v0.0.42")),
    "26.05": Release("26.05", "forky", script="sid", api_versions=("v0.0.42", "v0.0.43", "v0.0.44", "v0.0.45")),
}
DEFAULT_RELEASE = "22.05"
# The Slurm release of the lab's clusters, for every process of the lab (its worker creates clusters).
LAB_SLURM_ENV = "GPUFLEET_LAB_SLURM"


class RootError(RuntimeError):
    """A Slurm release cannot be provided here; the message says why and what to do."""


def release(version: str) -> Release:
    try:
        return RELEASES[version]
    except KeyError:
        raise RootError(f"no Slurm release {version!r} in the lab; choose one of {', '.join(RELEASES)}") from None


def host_version() -> str:
    """The host's own Slurm version (``24.11.5``), or '' when the host has none."""
    if not shutil.which("slurmctld"):
        return ""
    try:
        done = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    found = re.search(r"(\d+\.\d+\.\d+)", done.stdout + done.stderr)
    return found.group(1) if found else ""


def cache_dir() -> Path:
    configured = os.environ.get("GPUFLEET_SLURM_ROOTS")
    return (Path(configured).expanduser() if configured else Path.home() / ".cache" / "gpufleet").resolve()


@dataclass(frozen=True)
class SlurmInstall:
    """Where one Slurm release's daemons and commands run: the host (``root`` None) or a root."""

    release: Release
    version: str  # the full version, e.g. 26.05.5
    root: Path | None = None

    @property
    def on_host(self) -> bool:
        return self.root is None

    def argv(
        self, command: list[str], binds: Sequence[Path] = (), *, own_view: bool = False, outside: bool = False
    ) -> list[str]:
        """``command`` as it runs on this install: as is on the host, else in the root, with
        ``binds`` seen at their own paths (and the cluster's run folders beside ``$SLURM_CONF``
        as the root's ``/run/slurm``, ``/run/slurmctld`` and ``/run/slurmdbd``: lab/inroot.py).
        ``own_view``: on the host too, in a private mount namespace where the cluster's users,
        homes and storage beside ``$SLURM_CONF`` are seen (lab/login.py writes them).
        ``outside``: prepared the same way, but run outside the root (the login node's sshd)."""
        if self.root is None and not own_view:
            return list(command)
        root = self.root or Path("/")
        folders = ["/tmp", str(REPO_ROOT), *(str(b) for b in binds)] if self.root is not None else []
        options = [word for folder in dict.fromkeys(folders) for word in ("--bind", folder)]
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            sys.executable,
            "-I",
            "-S",
            str(INROOT),
            str(root),
            *options,
            *(["--outside"] if outside and self.root is not None else []),
            "--",
            *command,
        ]

    def python(self) -> str:
        """The interpreter a job started by this install's slurmd runs under."""
        return sys.executable if self.root is None else "/usr/bin/python3"

    def write_wrappers(self, folder: Path, binds: Sequence[Path] = ()) -> Path | None:
        """A folder of the client commands, each running this install's own (None on the host)."""
        if self.root is None:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        for command in CLIENT_COMMANDS:
            words = " ".join(shlex.quote(word) for word in self.argv([command], binds))
            path = folder / command
            path.write_text(f'#!/bin/sh\n# {command} of Slurm {self.version}, in {self.root}\nexec {words} "$@"\n')
            path.chmod(0o755)
        return folder


def host_install() -> SlurmInstall | None:
    version = host_version()
    for item in RELEASES.values():
        if version.startswith(item.version + "."):
            return SlurmInstall(item, version)
    return None


def _installed_version(root: Path) -> str:
    """The version of slurm-wlm in a root's package database, '' when it lacks any of PACKAGES."""
    status = root / "var" / "lib" / "dpkg" / "status"
    if not status.exists():
        return ""
    versions: dict[str, str] = {}
    for stanza in status.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        name = re.search(r"^Package: (\S+)$", stanza, re.M)
        version = re.search(r"^Version: (\S+)$", stanza, re.M)
        if name and version and "Status: install ok installed" in stanza:
            versions[name.group(1)] = version.group(1)
    if any(package not in versions for package in PACKAGES):
        return ""
    return versions["slurm-wlm"]


def _upstream(version: str) -> str:
    """``24.11.5-4+deb13u1`` -> ``24.11.5``."""
    return re.sub(r"^\d+:", "", version).split("-")[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One maker of a root at a time, across processes (two test sessions, a lab and a test)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _missing_for_roots(*, making: bool = True) -> str:
    """What running (and, with ``making``, making) a root lacks here ('' when nothing)."""
    if os.geteuid() != 0:
        return "making and running a Slurm root needs root (debootstrap, a private mount namespace, chroot)"
    for tool in ("debootstrap", "unshare", "mount") if making else ("unshare", "mount"):
        if not shutil.which(tool):
            return f"{tool} is missing (apt-get install debootstrap util-linux mount)"
    return ""


def root_unavailable(version: str) -> str:
    """'' when ``version`` can run here (host packages or a root that can be made), else why not."""
    item = release(version)
    host = host_install()
    if host is not None and host.release == item:
        return ""
    if not item.in_root:
        return f"Slurm {version} runs in the lab only as the host's own: apt-get install slurm-wlm munge"
    return _missing_for_roots()


def users_of(root: Path) -> list[int]:
    """The processes running in ``root`` (a lab's daemons, its jobs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == str(root):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class Roots:
    """The cached roots under ``folder``."""

    def __init__(self, folder: Path | None = None, *, mirror: str = MIRROR) -> None:
        self.folder = folder or cache_dir()
        self.mirror = mirror

    def path(self, item: Release) -> Path:
        return self.folder / f"slurm-{item.version}"

    def manifest_path(self, item: Release) -> Path:
        return self.folder / f"slurm-{item.version}.json"

    def manifest(self, item: Release) -> dict[str, object]:
        try:
            data: dict[str, object] = json.loads(self.manifest_path(item).read_text())
        except (OSError, ValueError):
            return {}
        return data

    def install(
        self, version: str, *, say: Say = lambda _: None, check: bool = False, refresh: bool = False
    ) -> SlurmInstall:
        """The install of ``version``: the host's when it is that release, else the cached root,
        made when missing or not at its pinned release, and remade when its packages moved in the
        archive (asked with ``check`` once a day, with ``refresh`` now). Raises RootError saying
        what is missing."""
        item = release(version)
        host = host_install()
        if host is not None and host.release == item:
            return host
        unavailable = root_unavailable(version)
        if not item.in_root:
            raise RootError(unavailable)
        root = self.path(item)
        at_pin = _upstream(_installed_version(root)).startswith(item.version + ".")
        missing = _missing_for_roots(making=not at_pin or refresh or check)
        if missing:
            raise RootError(f"Slurm {version} runs here only in a Debian root: {missing}")
        with _locked(self.folder / f".slurm-{item.version}.lock"):
            installed = _installed_version(root)
            if not _upstream(installed).startswith(item.version + "."):
                self._refuse_in_use(item)
                if root.exists():
                    say(f"the cached Slurm {version} root at {root} holds {installed or 'no Slurm'}: making it again")
                self._make(item, say)
            elif refresh or (check and self._check_due(item)):
                moved = self._archive_moved(item, installed, say)
                if moved and users_of(root):
                    say(f"Slurm {version}'s packages moved ({installed} -> {moved}), but the root is in use: kept")
                elif moved:
                    say(f"Slurm {version}'s packages moved ({installed} -> {moved}): making the root again")
                    self._make(item, say)
            installed = _installed_version(root)
            return SlurmInstall(item, _upstream(installed), root)

    def existing(self, version: str) -> SlurmInstall:
        """The install of ``version`` as it is now, never made nor checked (stopping, reading)."""
        item = release(version)
        host = host_install()
        if host is not None and host.release == item:
            return host
        installed = _installed_version(self.path(item))
        if not item.in_root or not _upstream(installed).startswith(item.version + "."):
            raise RootError(f"no Slurm {version} here: make it with `make slurm-roots` (or `gpufleet lab up`)")
        return SlurmInstall(item, _upstream(installed), self.path(item))

    def _refuse_in_use(self, item: Release) -> None:
        """A root is never replaced under the processes running in it."""
        running = users_of(self.path(item))
        if running:
            raise RootError(
                f"the Slurm {item.version} root at {self.path(item)} must be made again, but processes run in it "
                f"(PIDs {', '.join(map(str, running[:8]))}): stop its labs first (gpufleet lab down)"
            )

    def _check_due(self, item: Release) -> bool:
        checked = self.manifest(item).get("checked_at")
        return not isinstance(checked, (int, float)) or time.time() - checked > CHECK_EVERY_SECONDS

    def _archive_moved(self, item: Release, installed: str, say: Say) -> str:
        """The archive's version of slurm-wlm when it differs from ``installed``, else ''. An
        archive out of reach keeps the root as it is (said once)."""
        try:
            candidate = self._candidate(item)
        except (subprocess.SubprocessError, OSError) as exc:
            say(f"could not check Slurm {item.version}'s archive ({exc}); keeping the cached root")
            return ""
        self._write_manifest(item, installed)
        if candidate and not _upstream(candidate).startswith(item.version + "."):
            say(
                f"Debian {item.suite} now carries Slurm {_upstream(candidate)}, not {item.version}: "
                f"keeping the cached {_upstream(installed)} root"
            )
            return ""
        return candidate if candidate and candidate != installed else ""

    def _candidate(self, item: Release) -> str:
        """The version of slurm-wlm the suite's archive offers now ('' when it offers none)."""
        probe = SlurmInstall(item, "", self.path(item))
        update = probe.argv(["apt-get", "update", "-qq"])
        subprocess.run(update, capture_output=True, text=True, timeout=300, check=True)
        done = subprocess.run(
            probe.argv(["apt-cache", "policy", "slurm-wlm"]), capture_output=True, text=True, timeout=60, check=True
        )
        found = re.search(r"Candidate: (\S+)", done.stdout)
        return found.group(1) if found and found.group(1) != "(none)" else ""

    def _make(self, item: Release, say: Say) -> None:
        root = self.path(item)
        building = self.folder / f".slurm-{item.version}.building"
        shutil.rmtree(building, ignore_errors=True)
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            item.suite,
            str(building),
            self.mirror,
        ]
        if item.script:
            argv.append(f"/usr/share/debootstrap/scripts/{item.script}")
        say(f"making a Slurm {item.version} root (Debian {item.suite}) in {root}: about a minute, once")
        log = self.folder / f"slurm-{item.version}.debootstrap.log"
        started = time.monotonic()
        # debootstrap mounts /proc and /sys in the root it makes: in a namespace of its own, so
        # that no mount is left on the host's side however it ends.
        private = ["unshare", "--mount", "--propagation", "private", "--"]
        returncode: int | str
        with open(log, "w") as out:
            proc = subprocess.Popen([*private, *argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = proc.wait(timeout=MAKE_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = f"stopped after {MAKE_TIMEOUT_SECONDS}s"
        installed = _installed_version(building)
        if returncode != 0 or not _upstream(installed).startswith(item.version + "."):
            shutil.rmtree(building, ignore_errors=True)
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RootError(
                f"debootstrap of Debian {item.suite} for Slurm {item.version} "
                + (f"gave Slurm {installed or 'none'}" if returncode == 0 else f"failed ({returncode})")
                + f"; see {log}: {' | '.join(tail)}"
            )
        if root.exists():
            shutil.rmtree(root)
        building.rename(root)
        self._write_manifest(item, installed)
        say(f"Slurm {_upstream(installed)} root ready in {time.monotonic() - started:.0f}s")

    def _write_manifest(self, item: Release, installed: str) -> None:
        manifest = {
            "release": item.version,
            "suite": item.suite,
            "slurm": installed,
            "packages": list(PACKAGES),
            "checked_at": time.time(),
        }
        self.manifest_path(item).write_text(json.dumps(manifest, indent=2) + "\n")


def cached_root(version: str) -> Path | None:
    """Where ``version``'s root is cached, when the host's packages do not serve it (nothing made)."""
    item = RELEASES.get(version)
    host = host_install()
    if item is None or not item.in_root or (host is not None and host.release == item):
        return None
    return Roots().path(item)


def install_for(version: str, *, say: Say = lambda _: None, check: bool = False) -> SlurmInstall:
    """The install of ``version`` (made when needed; ``check``: its archive asked once a day)."""
    return Roots().install(version, say=say, check=check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.slurmroots",
        description="Make (once) and check the cached Debian roots of the lab's newer Slurm releases.",
    )
    parser.add_argument(
        "versions", nargs="*", metavar="VERSION", help=f"releases to provide (default: {', '.join(RELEASES)})"
    )
    parser.add_argument("--refresh", action="store_true", help="check each root against its archive now")
    args = parser.parse_args(argv)
    roots = Roots()

    def provide(version: str) -> bool:
        unavailable = root_unavailable(version)
        if unavailable:  # as an ordinary user: said, and the tests that need it are skipped
            print(f"Slurm {version}: not made here: {unavailable}; what needs it is skipped", flush=True)
            return True
        try:
            install = roots.install(version, say=lambda line: print(line, flush=True), check=True, refresh=args.refresh)
        except RootError as exc:
            print(f"Slurm {version}: {exc}", file=sys.stderr, flush=True)
            return False
        where = "the host's packages" if install.on_host else str(install.root)
        print(f"Slurm {version}: {install.version} ({where})", flush=True)
        return True

    # The roots are made side by side: most of the time goes on downloads.
    with ThreadPoolExecutor(max_workers=len(RELEASES)) as pool:
        results = list(pool.map(provide, args.versions or list(RELEASES)))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
