"""Slurm accounting on one machine: a private MariaDB server and a ``slurmdbd`` on it.

Both belong to one lab cluster and live in its folder (``db/``): MariaDB (always the host's
``mariadb-server``) listens on 127.0.0.1 on a free port with its own data directory and socket,
and takes a ``slurm`` user with a password made for this cluster; ``slurmdbd`` reads
``slurmdbd.conf`` next to the cluster's ``slurm.conf`` (Slurm finds it there through
``SLURM_CONF``). On the host's Slurm (22.05) slurmdbd is the host's and talks to the cluster's
own munged (``AccountingStoragePass`` names the munge socket for the controller's and
sacctmgr's connection); on a release in a root (26.05, lab/slurmroots.py) it is the root's,
run through lab/inroot.py like the cluster's other daemons, and authenticates with
``auth/slurm`` and the cluster's ``slurm.key`` beside slurm.conf. Either way slurmdbd also
takes the cluster's JWT key, so that slurmrestd's accounting API (``openapi/dbv0.0.38``,
``openapi/slurmdbd``) reaches it with each request's token. Accounts and users go in with
``sacctmgr`` or through slurmrestd.
"""

from __future__ import annotations

import getpass
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lab.procs import alive, free_port, port_in_use, spawn, wait_for
from lab.procs import stop as stop_pids
from lab.slurmroots import SlurmInstall

DATABASE = "slurm_acct_db"
# The host's MariaDB commands (a root's Slurm too keeps its records in the host's MariaDB).
MARIADB_TOOLS = ("mariadbd", "mariadb-install-db", "mariadb")
# What a root must hold for slurmdbd: the daemon, sacctmgr and the plugin that speaks MySQL.
IN_ROOT = ("usr/sbin/slurmdbd", "usr/bin/sacctmgr", "usr/lib/x86_64-linux-gnu/slurm-wlm/accounting_storage_mysql.so")
Which = Callable[[str], str | None]


def accounting_installed() -> str:
    """'' when MariaDB and slurmdbd are installed on the host, else what to install."""
    tools = (*MARIADB_TOOLS, "slurmdbd", "sacctmgr")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if not missing:
        return ""
    return f"missing {', '.join(missing)}: apt-get install mariadb-server slurmdbd (or run make test as root)"


def accounting_unavailable(install: SlurmInstall, *, which: Which | None = None) -> str:
    """'' when accounting can run for a cluster on ``install``, else what is missing and what to
    do. On the host's Slurm that is MariaDB and the host's slurmdbd (``accounting_installed``);
    on a root's, MariaDB from the host and slurmdbd from the root. ``which``: how a command is
    found on the host (``shutil.which``)."""
    if install.root is None:
        missing = accounting_installed()
        return f"accounting needs MariaDB and slurmdbd: {missing}" if missing else ""
    which = which or shutil.which
    absent = [tool for tool in MARIADB_TOOLS if not which(tool)]
    if absent:
        return (
            f"accounting on Slurm {install.version} keeps its records in this machine's MariaDB, which is not "
            f"installed (no {', '.join(absent)}): apt-get install mariadb-server (or run make test as root)"
        )
    absent = [path for path in IN_ROOT if not (install.root / path).exists()]
    if absent:
        return (
            f"slurmdbd is missing from the Slurm {install.version} root {install.root} (no /{', /'.join(absent)}): "
            "make slurm-roots makes it again"
        )
    return ""


def conf_value(conf: str, key: str) -> str:
    """The value of ``key`` in a slurm.conf text ('' when absent; keys in any case, last wins)."""
    value = ""
    for line in conf.splitlines():
        name, sep, rest = line.strip().partition("=")
        if sep and name.lower() == key.lower():
            value = rest.split()[0] if rest.split() else ""
    return value


def accounting_lines(munge_socket: Path | None) -> list[str]:
    """The slurm.conf lines that make a cluster keep its accounting in this slurmdbd (on a free
    port): ``munge_socket`` on the host's Slurm, None on a root's (auth/slurm)."""
    return ["AccountingStorageType=accounting_storage/slurmdbd", *Accounting.site_lines(munge_socket)]


def with_accounting(conf: str, munge_socket: Path | None) -> str:
    """A slurm.conf text that asks for slurmdbd (as it is when it does already)."""
    if conf_value(conf, "AccountingStorageType") == "accounting_storage/slurmdbd":
        return conf
    kept = [line for line in conf.splitlines() if not _accounting_line(line)]
    return "\n".join([*kept, *accounting_lines(munge_socket)]) + "\n"


def without_accounting(conf: str) -> str:
    """A slurm.conf text with no accounting (as it is when it has none)."""
    if conf_value(conf, "AccountingStorageType") in ("", "accounting_storage/none"):
        return conf
    kept = [line for line in conf.splitlines() if not _accounting_line(line)]
    return "\n".join([*kept, "AccountingStorageType=accounting_storage/none"]) + "\n"


def _accounting_line(line: str) -> bool:
    name = line.strip().partition("=")[0].lower()
    return name in {"accountingstoragetype", "accountingstoragehost", "accountingstorageport", "accountingstoragepass"}


@dataclass
class Accounting:
    """The accounting daemons of the cluster whose folder is ``root``: ``munge_socket`` on the
    host's Slurm, None where the cluster authenticates with auth/slurm (a root's release), and
    ``argv`` how a Slurm daemon or command runs for it (``SlurmLab.argv``)."""

    root: Path
    munge_socket: Path | None
    argv: Callable[[list[str]], list[str]] = list

    @property
    def folder(self) -> Path:
        return self.root / "db"

    @property
    def socket(self) -> Path:
        return self.folder / "mariadb.sock"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def pid_file(self) -> Path:
        return self.folder / "mariadb.pid"

    @property
    def dbd_conf(self) -> Path:
        return self.root / "slurmdbd.conf"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @staticmethod
    def site_lines(munge_socket: Path | None) -> list[str]:
        """The slurm.conf lines that point the controller and sacctmgr at this slurmdbd."""
        lines = ["AccountingStorageHost=localhost", f"AccountingStoragePort={free_port()}"]
        if munge_socket is not None:
            # For the slurmdbd connection, Slurm takes the munge socket from here, not AuthInfo.
            lines.append(f"AccountingStoragePass={munge_socket}")
        return lines

    # -- finding the daemons again ----------------------------------------------------------------

    def database_pid(self) -> int:
        """The PID of this cluster's MariaDB when it runs (found by its own pid file), else 0."""
        try:
            pid = int(self.pid_file.read_text())
            # Only the MariaDB of this cluster: a reused PID is someone else's process.
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return 0
        return pid if f"--pid-file={self.pid_file}".encode() in words and alive(pid) else 0

    def _database_port(self, pid: int) -> int:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        return next(int(word.split("=", 1)[1]) for word in words if word.startswith("--port="))

    def dbd_pid(self) -> int:
        """The PID of this cluster's slurmdbd when it runs, else 0: a ``slurmdbd`` whose
        environment names this cluster's slurm.conf (the root's slurmdbd runs under its own
        name once lab/inroot.py has become it)."""
        wanted = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "comm").read_text().strip() != "slurmdbd":
                    continue
                if wanted in (entry / "environ").read_bytes().split(b"\0") and alive(int(entry.name)):
                    return int(entry.name)
            except OSError:
                continue
        return 0

    # -- starting ---------------------------------------------------------------------------------

    def start(self, record: Callable[[str, int], None], env: dict[str, str], *, cluster: str, timeout: float) -> str:
        """MariaDB, slurmdbd, and ``cluster`` registered with it: each started unless it runs
        already (found again after a crash), each PID given to ``record``. Says what it did."""
        did = []
        # slurmdbd.conf as slurm.conf wants it (a port moved while they were off is followed).
        current = self.dbd_conf.exists() and conf_value(self.dbd_conf.read_text(), "DbdPort") == conf_value(
            self.conf.read_text(), "AccountingStoragePort"
        )
        database = self.database_pid()
        if database and current:
            record("mariadbd", database)
        else:
            self.start_database(record, env, timeout=timeout)
            did.append("slurmdbd.conf written" if database else "MariaDB started")
        dbd = self.dbd_pid()
        if dbd and current:
            record("slurmdbd", dbd)
        else:
            stop_pids([dbd] if dbd else [])  # one on the old port and password
            self.start_dbd(record, env, timeout=timeout)
            did.append("slurmdbd started")
        if self.add_cluster(env, cluster):
            did.append(f"cluster {cluster} registered")
            # A new registration gives the cluster a new ClusterID; a slurmctld that ran before
            # (accounting turned on later, or a database made again) keeps its old one in its
            # state and would refuse to start with the database's ("CLUSTER ID MISMATCH").
            (self.root / "state" / "clustername").unlink(missing_ok=True)
        return ", ".join(did) or "MariaDB and slurmdbd were running"

    def start_database(self, record: Callable[[str, int], None], env: dict[str, str], *, timeout: float) -> None:
        """MariaDB with the ``slurm`` user and its database, and slurmdbd.conf. Its PID goes to
        ``record`` as soon as it runs, so that a failure after that still stops it; one that
        runs already is kept (given a new password)."""
        data = self.folder / "data"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        self.logs.mkdir(parents=True, exist_ok=True)
        as_user = ["--user=root"] if os.geteuid() == 0 else []
        running = self.database_pid()
        if running:
            record("mariadbd", running)
            port = self._database_port(running)
        else:
            self._install_database(data, as_user)
            port = free_port()
            argv = [
                "mariadbd",
                "--no-defaults",
                f"--datadir={data}",
                f"--socket={self.socket}",
                f"--port={port}",
                "--bind-address=127.0.0.1",
                f"--pid-file={self.pid_file}",
                f"--log-error={self.logs / 'mariadb.log'}",
                "--skip-name-resolve",
                # What slurmdbd asks of its database (it warns otherwise).
                "--innodb-buffer-pool-size=1024M",
                "--innodb-lock-wait-timeout=900",
                *as_user,
            ]
            record("mariadbd", spawn(argv, log=self.logs / "mariadb.out", env=env))
        wait_for(lambda: port_in_use(port) and self.socket.exists(), timeout=timeout, what="MariaDB to listen")
        password = secrets.token_hex(16)
        self._sql(
            f"CREATE DATABASE IF NOT EXISTS {DATABASE};"
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
            f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
            f"GRANT ALL ON {DATABASE}.* TO 'slurm'@'127.0.0.1';",
            secret=password,
        )
        self._write_dbd_conf(port, password)

    def _install_database(self, data: Path, as_user: list[str]) -> None:
        installed = self.folder / "installed"
        if installed.exists():
            return
        shutil.rmtree(data, ignore_errors=True)  # an install cut short starts over
        done = subprocess.run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={data}",
                # root only on the socket, as this user: no root account over TCP, ever.
                "--auth-root-authentication-method=socket",
                f"--auth-root-socket-user={getpass.getuser()}",
                "--skip-test-db",
                *as_user,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {done.stderr.strip()[-500:]}")
        installed.touch()

    def _sql(self, statements: str, *, secret: str = "") -> None:
        """Run SQL as root over the socket. The statements go on standard input (never on a
        command line, where a password would show), and a failure says only MariaDB's words."""
        done = subprocess.run(
            ["mariadb", "--no-defaults", f"--socket={self.socket}", "-uroot"],
            input=statements,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            said = done.stderr.strip()[-300:]
            if secret:  # a syntax error quotes the SQL near it
                said = said.replace(secret, "***")
            raise RuntimeError(f"MariaDB refused the set-up: {said}")

    def _write_dbd_conf(self, db_port: int, password: str) -> None:
        conf = self.conf.read_text()
        if self.munge_socket is not None:
            auth = ["AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}"]
        else:  # slurmdbd reads slurm.key beside slurm.conf, as the cluster's other daemons do
            auth = ["AuthType=auth/slurm"]
        lines = [
            "# slurmdbd.conf for this lab cluster, written by gpufleet (mode 600: it holds a password).",
            *auth,
            "DbdHost=localhost",
            f"DbdPort={conf_value(conf, 'AccountingStoragePort')}",
            f"SlurmUser={getpass.getuser()}",
            f"PidFile={self.folder / 'slurmdbd.pid'}",
            f"LogFile={self.logs / 'slurmdbd.log'}",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={db_port}",
            "StorageUser=slurm",
            f"StoragePass={password}",
            f"StorageLoc={DATABASE}",
        ]
        # Tokens (slurmrestd's accounting calls) are checked by slurmdbd too, with the same key.
        lines += [
            f"{key}={conf_value(conf, key)}" for key in ("AuthAltTypes", "AuthAltParameters") if conf_value(conf, key)
        ]
        path = self.dbd_conf
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text("\n".join(lines) + "\n")

    def start_dbd(self, record: Callable[[str, int], None], env: dict[str, str], *, timeout: float) -> None:
        """slurmdbd, waited for until sacctmgr gets an answer from it."""
        pid = spawn(self.argv(["slurmdbd", "-D"]), log=self.logs / "slurmdbd.out", env=env)
        record("slurmdbd", pid)
        wait_for(
            lambda: alive(pid) and self._answers(env),
            timeout=timeout,
            what=f"slurmdbd to answer sacctmgr (log: {self.logs / 'slurmdbd.log'})",
        )

    def _clusters(self, env: dict[str, str]) -> list[str] | None:
        """The clusters slurmdbd knows (None: it does not answer sacctmgr)."""
        done = subprocess.run(
            self.argv(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"]),
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        return done.stdout.split() if done.returncode == 0 else None

    def _answers(self, env: dict[str, str]) -> bool:
        return self._clusters(env) is not None

    def add_cluster(self, env: dict[str, str], name: str) -> bool:
        """Register the cluster with slurmdbd (once: its controller needs it there); whether it
        was added now."""
        shown = self._clusters(env)
        if shown is None:
            raise RuntimeError("slurmdbd stopped answering sacctmgr")
        if name.lower() in shown:
            return False
        done = subprocess.run(
            self.argv(["sacctmgr", "-i", "add", "cluster", name]),
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sacctmgr add cluster {name}: {(done.stderr or done.stdout).strip()[-300:]}")
        return True

    # -- stopping ---------------------------------------------------------------------------------

    def stop(self, recorded: dict[str, int]) -> str:
        """Stop slurmdbd, then MariaDB (``recorded``: the PIDs the cluster recorded, by name),
        however they were started; their data stays for a later start. Says what it stopped."""
        dbd = {pid for pid in (recorded.get("slurmdbd", 0), self.dbd_pid()) if pid and alive(pid)}
        database = {pid for pid in (recorded.get("mariadbd", 0), self.database_pid()) if pid and alive(pid)}
        stop_pids(sorted(dbd))
        stop_pids(sorted(database), timeout=30)
        said = [what for what, pids in (("slurmdbd", dbd), ("MariaDB", database)) if pids]
        return f"{' and '.join(said)} stopped" if said else "neither MariaDB nor slurmdbd was running"
