"""Slurm accounting on one machine: a private MariaDB server and a ``slurmdbd`` on it.

Both belong to one lab cluster and live in its folder (``db/``): MariaDB listens on
127.0.0.1 on a free port with its own data directory and socket, and takes a ``slurm`` user
with a password made for this cluster; ``slurmdbd`` reads ``slurmdbd.conf`` next to the
cluster's ``slurm.conf`` (Slurm finds it there through ``SLURM_CONF``) and talks to the
cluster's own munged. Accounts and users go in with ``sacctmgr``, through the controller's
``slurm.conf`` (``AccountingStoragePass`` names the munge socket for that connection).
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

from lab.procs import free_port, port_in_use, spawn, wait_for

DATABASE = "slurm_acct_db"


def accounting_installed() -> str:
    """'' when MariaDB and slurmdbd are installed, else what to install."""
    tools = ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if not missing:
        return ""
    return f"missing {', '.join(missing)}: apt-get install mariadb-server slurmdbd (or run make test as root)"


def conf_value(conf: str, key: str) -> str:
    """The value of ``key`` in a slurm.conf text ('' when absent; keys in any case, last wins)."""
    value = ""
    for line in conf.splitlines():
        name, sep, rest = line.strip().partition("=")
        if sep and name.lower() == key.lower():
            value = rest.split()[0] if rest.split() else ""
    return value


@dataclass
class Accounting:
    """The accounting daemons of the cluster whose folder is ``root``."""

    root: Path
    munge_socket: Path

    @property
    def folder(self) -> Path:
        return self.root / "db"

    @property
    def socket(self) -> Path:
        return self.folder / "mariadb.sock"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @staticmethod
    def site_lines(munge_socket: Path) -> list[str]:
        """The slurm.conf lines that point the controller and sacctmgr at this slurmdbd."""
        return [
            "AccountingStorageHost=localhost",
            f"AccountingStoragePort={free_port()}",
            # For the slurmdbd connection, Slurm takes the munge socket from here, not AuthInfo.
            f"AccountingStoragePass={munge_socket}",
        ]

    def start_database(self, record: Callable[[str, int], None], env: dict[str, str], *, timeout: float) -> None:
        """MariaDB with the ``slurm`` user and its database, and slurmdbd.conf. Its PID goes to
        ``record`` as soon as it runs, so that a failure after that still stops it."""
        data = self.folder / "data"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        as_user = ["--user=root"] if os.geteuid() == 0 else []
        installed = self.folder / "installed"
        if not installed.exists():  # an install cut short starts over
            shutil.rmtree(data, ignore_errors=True)
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

    @property
    def pid_file(self) -> Path:
        return self.folder / "mariadb.pid"

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
        conf = (self.root / "slurm.conf").read_text()
        lines = [
            "# slurmdbd.conf for this lab cluster, written by gpufleet (mode 600: it holds a password).",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
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
        path = self.root / "slurmdbd.conf"
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text("\n".join(lines) + "\n")

    def start_dbd(self, record: Callable[[str, int], None], env: dict[str, str], *, timeout: float) -> None:
        """slurmdbd, waited for until sacctmgr gets an answer from it."""
        record("slurmdbd", spawn(["slurmdbd", "-D"], log=self.logs / "slurmdbd.out", env=env))
        wait_for(lambda: self._answers(env), timeout=timeout, what="slurmdbd to answer sacctmgr")

    @staticmethod
    def _clusters(env: dict[str, str]) -> list[str] | None:
        """The clusters slurmdbd knows (None: it does not answer sacctmgr)."""
        done = subprocess.run(
            ["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"],
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        return done.stdout.split() if done.returncode == 0 else None

    @classmethod
    def _answers(cls, env: dict[str, str]) -> bool:
        return cls._clusters(env) is not None

    def add_cluster(self, env: dict[str, str], name: str) -> None:
        """Register the cluster with slurmdbd (once: its controller needs it there)."""
        shown = self._clusters(env)
        if shown is None:
            raise RuntimeError("slurmdbd stopped answering sacctmgr")
        if name.lower() not in shown:
            subprocess.run(
                ["sacctmgr", "-i", "add", "cluster", name],
                env=env,
                capture_output=True,
                text=True,
                timeout=15,
                check=True,
            )
