"""A lab cluster's login node: its users, their homes and storage, and a real sshd.

Researchers reach a cluster as they reach any Slurm cluster: ``ssh alice@login``, then ``sinfo``
and ``sbatch``. For a cluster under ``folder`` (beside its slurm.conf):

- ``ClusterUsers`` writes the spec's users and nothing of the host's: ``etc/passwd`` and
  ``etc/group`` (the Slurm install's own system accounts, sshd's, then each user with their uid, a
  group of the same number, ``/home/<user>`` and ``/bin/bash``), a home per user in ``home/``
  (owned by them), the cluster's storage in ``storage/`` (everyone writes, as ``/tmp``), each
  user's public keys in ``login/keys/<user>`` (their ``ssh_keys`` only: no password is ever
  set), and ``mounts.json`` (homes at ``/home``, storage at the spec's ``storage.mount_path``).
  lab/inroot.py shows those, in a private mount namespace, to the cluster's slurmctld, slurmd and
  jobs and to the login node: the host's users and ``/home`` are untouched, and two clusters'
  users never meet. A removed user's home is kept, owned by root.
- ``LoginNode`` runs Debian's ``/usr/sbin/sshd`` in that view on a port of 127.0.0.1: public keys
  only, no root login, only the spec's users allowed, ``SLURM_CONF`` set in every session, and, on
  a Slurm release in a root (24.11, 26.05), each session changed into that root, so its client
  commands are the cluster's release. A change of users is seen at once (keys are read at each
  login; a new list of users reloads sshd). ``stop`` ends the sessions too.

sshd must run as root to log anyone in: ``login_unavailable`` says why a machine cannot.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab.procs import alive, free_port, mount_namespace, pids_in_namespace, port_in_use, real_uid, spawn, stop, wait_for
from lab.slurmroots import SlurmInstall
from models.cluster import ClusterSpec

SSHD = Path("/usr/sbin/sshd")
SHELL = "/bin/bash"
# Accounts of the install every cluster keeps (daemons, nobody), and the one sshd's
# privilege separation runs as.
SYSTEM_UID_LIMIT = 1000
KEPT_ACCOUNTS = ("nobody", "sshd")
LOGIN_HOST = "127.0.0.1"


DEFAULT_MOUNT_PATH = "/shared"


@dataclass(frozen=True)
class Account:
    """One user of a cluster as its login node and compute nodes know them."""

    name: str
    uid: int
    keys: tuple[str, ...]


def accounts_of(spec: ClusterSpec) -> list[Account]:
    return [Account(user.name, user.uid, tuple(user.ssh_keys)) for user in spec.users]


def mount_path_of(spec: ClusterSpec) -> str:
    return spec.storage.mount_path if spec.storage else DEFAULT_MOUNT_PATH


def login_unavailable() -> str:
    """Why this machine cannot run a login node ('' when it can)."""
    if os.geteuid() != 0:
        return "a login node's sshd must run as root to log users in; run the lab as root"
    if not SSHD.is_file():
        return f"{SSHD} is missing: apt-get install openssh-server (make test installs it as root)"
    for tool in ("ssh-keygen", "unshare", "mount"):
        if not shutil.which(tool):
            return f"{tool} is missing: apt-get install openssh-client util-linux mount"
    return ""


def closed_to_users(folder: Path) -> str:
    """The first folder above ``folder`` that other users cannot pass through ('' when none):
    there the cluster's users could not read its slurm.conf."""
    for parent in [*reversed(folder.resolve().parents), folder.resolve()]:
        if not parent.stat().st_mode & 0o001:
            return f"{parent} (mode {parent.stat().st_mode & 0o777:o})"
    return ""


def _write_if_changed(path: Path, text: str, mode: int) -> bool:
    """Write ``text`` into ``path`` in place (a bind mount of it sees the change) when it differs."""
    if path.is_file() and path.read_text() == text:
        path.chmod(mode)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:  # the same inode: never a rename over a bound file
        handle.seek(0)
        handle.truncate()
        handle.write(text)
    path.chmod(mode)
    return True


def _system_lines(text: str, *, uid_field: int) -> list[str]:
    """The system accounts (or groups) of an install's passwd (or group) file."""
    kept = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) <= uid_field or not fields[uid_field].isdigit():
            continue
        if int(fields[uid_field]) < SYSTEM_UID_LIMIT or fields[0] in KEPT_ACCOUNTS:
            kept.append(line)
    return kept


class ClusterUsers:
    """The spec's users, homes, keys and storage for the cluster under ``folder``."""

    def __init__(self, folder: Path, install: SlurmInstall | None) -> None:
        """``install``: the cluster's Slurm, whose system accounts its users go beside (needed
        to write them, not to read them)."""
        self.folder = folder.resolve()
        self._install = install

    @property
    def install(self) -> SlurmInstall:
        if self._install is None:
            raise RuntimeError("the cluster's Slurm install is needed to write its users")
        return self._install

    @property
    def keys(self) -> Path:
        return self.folder / "login" / "keys"

    @property
    def storage(self) -> Path:
        return self.folder / "storage"

    def _check_place(self, mount_path: str) -> None:
        """The cluster's own folder must stay visible where its homes and storage are bound."""
        if self.folder in Path(mount_path).parents:
            raise ValueError(f"the storage's mount path {mount_path} is inside the cluster's own folder {self.folder}")
        for target in (Path("/home"), Path(mount_path)):
            if self.folder == target or target in self.folder.parents:
                raise ValueError(
                    f"the cluster's folder {self.folder} is below {target}, where its users' "
                    f"{'homes' if target == Path('/home') else 'storage'} are mounted: "
                    "set GPUFLEET_HOME to a folder outside it (e.g. /srv/gpufleet)"
                )

    def _system(self, name: str) -> list[str]:
        """The install's system accounts or groups, and the host's sshd (the login node's)."""
        root = self.install.root or Path("/")
        lines = _system_lines((root / "etc" / name).read_text(), uid_field=2)
        have = {line.split(":")[0] for line in lines}
        if root != Path("/"):
            host = _system_lines(Path("/etc", name).read_text(), uid_field=2)
            lines += [line for line in host if line.split(":")[0] == "sshd" and "sshd" not in have]
        return lines

    def uids(self) -> dict[str, int]:
        """The cluster's users now (name -> uid), as its ``etc/passwd`` holds them."""
        found: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.folder / "etc" / "passwd").read_text().splitlines():
                fields = line.split(":")
                user = len(fields) > 2 and fields[2].isdigit() and int(fields[2]) >= SYSTEM_UID_LIMIT
                if user and fields[0] not in KEPT_ACCOUNTS:
                    found[fields[0]] = int(fields[2])
        return found

    def differs(self, users: Sequence[Account]) -> str:
        """'' when the cluster's users and their keys are ``users``, else what differs."""
        found = self.uids()
        wanted = {user.name: user.uid for user in users}
        if found != wanted:
            return f"its users are {', '.join(sorted(found)) or 'none'} (uids {sorted(found.values())})"
        for user in users:
            key_file = self.keys / user.name
            held = key_file.read_text() if key_file.exists() else ""
            if held != "\n".join(user.keys) + "\n":
                return f"{user.name}'s keys are not those read"
        return ""

    def write(
        self,
        users: Sequence[Account],
        mount_path: str = DEFAULT_MOUNT_PATH,
        *,
        groups: Sequence[str] = (),
        accounts_only: bool = False,
    ) -> list[str]:
        """Make the cluster's users ``users``, its storage seen at ``mount_path``; returns what
        changed (empty: nothing). ``groups``: group lines beyond each user's own (``name:x:gid:
        members``; one whose name or ID is taken is left out). ``accounts_only``: passwd and group
        only (no homes, keys, storage or mounts: a lab not run as root cannot give homes away).
        Raises ValueError for a user that clashes with a system account, or a cluster folder its
        own mounts would hide."""
        if not accounts_only:
            self._check_place(mount_path)
        changed: list[str] = []
        etc = self.folder / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        system_users = self._system("passwd")
        system_groups = self._system("group")
        taken = {line.split(":")[2]: line.split(":")[0] for line in system_users}
        for user in users:
            if str(user.uid) in taken or user.name in taken.values():
                clash = taken.get(str(user.uid), user.name)
                raise ValueError(f"user {user.name} (uid {user.uid}) clashes with the system account {clash}")
        passwd = [*system_users, *(f"{u.name}:x:{u.uid}:{u.uid}:{u.name}:/home/{u.name}:{SHELL}" for u in users)]
        group = [*system_groups, *(f"{u.name}:x:{u.uid}:" for u in users)]
        names = {line.split(":")[0] for line in group}
        ids = {line.split(":")[2] for line in group if line.count(":") >= 2}
        for line in groups:
            fields = line.split(":")
            if len(fields) == 4 and fields[2].isdigit() and fields[0] not in names and fields[2] not in ids:
                group.append(line)
                names.add(fields[0])
                ids.add(fields[2])
        if _write_if_changed(etc / "passwd", "\n".join(passwd) + "\n", 0o644):
            changed.append("passwd")
        if _write_if_changed(etc / "group", "\n".join(group) + "\n", 0o644):
            changed.append("group")
        if accounts_only:
            return changed
        self.folder.chmod(0o755)  # its users' jobs reach their scripts in its spool
        homes = self.folder / "home"
        homes.mkdir(mode=0o755, exist_ok=True)
        wanted = {user.name for user in users}
        for user in users:
            home = homes / user.name
            if not home.is_dir():
                home.mkdir()
                changed.append(f"home of {user.name}")
            if (home.stat().st_uid, home.stat().st_gid) != (user.uid, user.uid):
                os.chown(home, user.uid, user.uid)
            home.chmod(0o700)
        for home in homes.iterdir():
            if home.name not in wanted and home.stat().st_uid != 0:
                os.chown(home, 0, 0)  # kept for whoever takes its data, out of anyone's reach
                home.chmod(0o700)
                changed.append(f"home of {home.name} kept for root")
        self.storage.mkdir(exist_ok=True)
        self.storage.chmod(0o1777)
        self.keys.mkdir(parents=True, exist_ok=True)
        for user in users:
            if _write_if_changed(self.keys / user.name, "\n".join(user.keys) + "\n", 0o644):
                changed.append(f"keys of {user.name}")
        for key_file in self.keys.iterdir():
            if key_file.name not in wanted:
                key_file.unlink()
                changed.append(f"keys of {key_file.name} removed")
        mounts = [[str(homes), "/home"], [str(self.storage), mount_path.rstrip("/") or "/"]]
        if _write_if_changed(self.folder / "mounts.json", json.dumps(mounts) + "\n", 0o644):
            changed.append("mounts")
        return changed


class LoginNode:
    """sshd for the cluster under ``folder``, in its users' view (``ClusterUsers``)."""

    def __init__(self, folder: Path, install: SlurmInstall | None = None, binds: list[Path] | None = None) -> None:
        """``install``: the cluster's Slurm, needed to start sshd (not to find or stop it)."""
        self.folder = folder.resolve()
        self._install = install
        self.binds = [self.folder, *(binds or [])]
        self.dir = self.folder / "login"
        self._record = self.dir / "login.json"

    @property
    def config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def install(self) -> SlurmInstall:
        if self._install is None:
            raise RuntimeError("the cluster's Slurm install is needed to start its login node")
        return self._install

    def _recorded(self) -> dict[str, int]:
        try:
            data = json.loads(self._record.read_text())
            return {"pid": int(data["pid"]), "port": int(data["port"])}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is this cluster's sshd (a recycled PID is not)."""
        try:  # sshd rewrites its title ("sshd: /usr/sbin/sshd -D -e -f CONFIG [listener] ...")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        # Root's own process only: a user may name the configuration on a command line of theirs.
        return alive(pid) and real_uid(pid) == 0 and f"-f {self.config}".encode() in cmdline.replace(b"\0", b" ")

    def running(self) -> int:
        """The PID of the cluster's sshd (0: none runs); one started by a run cut short before
        it was recorded is found by its configuration on its command line."""
        pid = self._recorded().get("pid", 0)
        if pid and self._ours(pid):
            return pid
        if not self.config.exists():  # never started here: nothing to look for
            return 0
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and self._ours(int(entry.name)):
                return int(entry.name)
        return 0

    def address(self) -> str:
        """``host:port`` where the login node answers ('' when it does not run)."""
        return f"{LOGIN_HOST}:{self._recorded()['port']}" if self.running() else ""

    def _config_text(self, users: Sequence[str], port: int) -> str:
        allowed = " ".join(users)
        lines = [
            "# The login node of a gpufleet lab cluster (lab/login.py); rewritten when its users change.",
            f"Port {port}",
            f"ListenAddress {LOGIN_HOST}",
            f"HostKey {self.dir / 'ssh_host_ed25519_key'}",
            "PidFile none",
            # Read by sshd as root before the session starts: each user's keys of the spec, no others.
            f"AuthorizedKeysFile {self.dir / 'keys'}/%u",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin no",
            "UsePAM no",
            # The keys are root's files in the cluster's folder, not the user's ~/.ssh.
            "StrictModes no",
            f"AllowUsers {allowed}" if allowed else "DenyUsers *",
            f"SetEnv SLURM_CONF={self.folder / 'slurm.conf'}",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            # No tunnels through the login node (a shell still shares the machine's network).
            "AllowTcpForwarding no",
            "AllowStreamLocalForwarding no",
            "AllowAgentForwarding no",
            "PermitTunnel no",
            "GatewayPorts no",
            "Subsystem sftp internal-sftp",
        ]
        if self.install.root is not None:
            # Each session in the cluster's Slurm root: its release's sinfo, sbatch, python3.
            lines.append(f"ChrootDirectory {self.install.root}")
        return "\n".join(lines) + "\n"

    def start(self, users: Sequence[str], *, reload: bool = False, timeout: float = 30.0) -> str:
        """sshd letting in ``users`` (by their keys in ``ClusterUsers.keys``), started, or
        reloaded when its configuration changed (``reload``: in any case, so that a change
        written by a run cut short before the reload is read too); returns its ``host:port``."""
        if problem := login_unavailable():
            raise RuntimeError(problem)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o755)
        host_key = self.dir / "ssh_host_ed25519_key"
        if not host_key.exists():
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"login-{self.folder.name}", "-f", str(host_key)],
                check=True,
                capture_output=True,
                timeout=30,
            )
        pid = self.running()
        recorded = self._recorded().get("port", 0)
        port = recorded if pid or (recorded and not port_in_use(recorded)) else free_port()
        changed = _write_if_changed(self.config, self._config_text(users, port), 0o644)
        if pid and not (changed or reload):
            return f"{LOGIN_HOST}:{port}"
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
        check = subprocess.run(
            [str(SSHD), "-t", "-f", str(self.config)], capture_output=True, text=True, timeout=30, check=False
        )
        if check.returncode != 0:
            raise RuntimeError(f"sshd refuses {self.config}: {check.stderr.strip()}")
        if pid:
            os.kill(pid, signal.SIGHUP)  # sshd reads its configuration again (checked above), sessions kept
            return f"{LOGIN_HOST}:{port}"
        env = {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}
        argv = self.install.argv(
            [str(SSHD), "-D", "-e", "-f", str(self.config)], self.binds, own_view=True, outside=True
        )
        pid = spawn(argv, log=self.folder / "log" / "sshd.log", env=env)
        self._record.write_text(json.dumps({"pid": pid, "port": port}))
        wait_for(lambda: port_in_use(port) or not alive(pid), timeout=timeout, what=f"sshd to listen on {port}")
        if not alive(pid):
            log = self.folder / "log" / "sshd.log"
            raise RuntimeError(f"sshd stopped at once: {log.read_text()[-500:] if log.exists() else '(no log)'}")
        return f"{LOGIN_HOST}:{port}"

    def stop(self) -> str:
        """Stop sshd and end every session it opened."""
        pid = self.running()
        if not pid:
            return "no login node was running"
        namespace = self._namespace(pid)
        stop([pid])
        if namespace:
            stop([other for other in pids_in_namespace(namespace) if other != os.getpid()], timeout=3)
        return "login node stopped, its sessions ended"

    @staticmethod
    def _namespace(pid: int) -> str:
        """The mount namespace sshd runs in, '' when it is the host's or this process's (its
        sessions are then never told apart from anything else)."""
        namespace = mount_namespace(pid)
        return "" if namespace in (mount_namespace(1), mount_namespace(os.getpid())) else namespace

    def end_sessions(self, uids: Sequence[int]) -> int:
        """End every process of these users in the login node's view (their sessions, once
        their account is gone); returns how many."""
        pid = self.running()
        namespace = self._namespace(pid) if pid else ""
        if not namespace or not uids:
            return 0
        ended = [other for other in pids_in_namespace(namespace) if real_uid(other) in set(uids)]
        for other in ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGKILL)
        return len(ended)
