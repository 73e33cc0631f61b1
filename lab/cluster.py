"""The lab's cluster backend: a new Slurm cluster as real daemons on this machine.

Each cluster lives under ``$GPUFLEET_HOME/clusters/<name>``: its own munged, slurmctld and one
``slurmd -N`` per reserved node, on free ports, sharing nothing with the lab's own cluster. Its
Kubernetes objects (Namespace, Secrets, storage claim, remediation ConfigMap) go to the lab's
emulated API. The lab's nodes have no GPUs, so its slurm.conf leaves Gres out (said in a
comment there). Its users are the spec's, in the cluster's own view of the machine (lab/login.py:
passwd and group, homes, storage at the spec's mount path, never the host's users), and its login
node is a real sshd where they log in with their keys; the smoke jobs run as whoever runs the
worker. As an ordinary user there is no login node (sshd must run as root), said. A file
``smoke-fails`` in ``$GPUFLEET_HOME`` makes smoke tests fail, to watch a
creation kept on failure and resumed. With accounting on, the cluster also gets its own
MariaDB server and slurmdbd (``lab/accounting.py``), and its users go into them with
``sacctmgr`` as accounts and associations.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from clients.clusters import StepFailed, leaving
from clients.kube import KubernetesApi
from clients.pool import SPARES
from clients.slinky import core_objects, create_all, delete_all
from lab.accounting import Accounting, accounting_installed
from lab.login import ClusterUsers, LoginNode, accounts_of, closed_to_users, login_unavailable, mount_path_of
from lab.procs import alive, spawn, stop
from lab.slinkyclusters import SlinkyCluster
from lab.slurm import SlurmLab
from models.cluster import ClusterSpec, render_slurm_conf
from models.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT = 120.0


def cluster_backend(settings: Settings, kube: KubernetesApi) -> LabClusterBackend:
    """The backend of a worker whose GPUFLEET_CLUSTER_BACKENDS names the lab (entry point
    gpufleet.cluster_backends): clusters under its GPUFLEET_HOME, their workers in its environment."""
    return LabClusterBackend(settings.home, kube, worker_env=dict(os.environ))


class LabClusterBackend:
    name = "lab"

    def __init__(self, home: Path, kube: KubernetesApi, *, worker_env: dict[str, str] | None = None) -> None:
        self._home = home.resolve()
        self._kube = kube
        self._worker_env = worker_env or {}

    def root(self, spec: ClusterSpec) -> Path:
        return self._home / "clusters" / spec.name

    def _slurm(self, spec: ClusterSpec, conf: str | None = None, nodes: list[str] | None = None) -> SlurmLab:
        return SlurmLab(self.root(spec), conf=conf, nodes=nodes)

    def unsupported(self, spec: ClusterSpec) -> str:
        if spec.accounting and not self._slurm(spec).install.on_host:
            return f"accounting runs in the lab on the host's Slurm only, not on Slurm {self._slurm(spec).release}"
        missing = accounting_installed() if spec.accounting else ""
        return f"accounting needs MariaDB and slurmdbd on this machine: {missing}" if missing else ""

    def exists(self, spec: ClusterSpec) -> str:
        pids = self._slurm(spec).pids()
        if any(alive(pid) for pid in pids.values()):
            return f"Slurm daemons running under {self.root(spec)}"
        namespace = core_objects(spec, {})[0]
        if self._kube.object_exists(namespace):
            return f"Namespace {namespace['metadata']['name']}"
        return ""

    def render_conf(self, spec: ClusterSpec, placement: dict[str, list[str]]) -> str:
        slurm = self._slurm(spec)
        nodes = sorted(n for names in placement.values() for n in names)
        site = [
            "# The lab: local daemons on free ports. Its nodes have no GPUs, so Gres is left out.",
            *slurm.site_lines(),
            *(Accounting.site_lines(slurm.munge_socket) if spec.accounting else []),
        ]
        return render_slurm_conf(
            spec,
            {p.name: placement.get(p.name, []) for p in spec.partitions},
            site=site,
            node_options={node: slurm.node_options() for node in nodes},
            spares=placement.get(SPARES, []),
            gres=False,
        )

    def create_objects(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str, creation: str) -> str:
        return create_all(self._kube, core_objects(spec, placement), creation)

    def delete_objects(self, spec: ClusterSpec, creation: str) -> str:
        return delete_all(self._kube, core_objects(spec, {}), creation)

    def bring_up(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str) -> str:
        nodes = sorted(n for names in placement.values() for n in names)
        slurm = self._slurm(spec, conf=conf, nodes=nodes)
        no_login = login_unavailable()
        if not slurm.whole():
            if slurm.pids():
                slurm.stop()  # a half-started cluster from a crashed attempt
            try:
                if not no_login:  # its users before its daemons: they run in the users' view
                    ClusterUsers(slurm.root, slurm.install).write(accounts_of(spec), mount_path_of(spec))
                slurm.start(timeout=60)
            except ValueError as exc:
                raise StepFailed(str(exc)) from None
            except (TimeoutError, RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                raise StepFailed(f"Slurm did not come up: {exc}; logs in {slurm.logs}") from None
            up = f"slurmctld and {len(nodes)} slurmd up (SLURM_CONF={slurm.conf})"
        else:
            up = f"already up: slurmctld and {len(nodes)} slurmd (SLURM_CONF={slurm.conf})"
        if no_login:
            return f"{up}; no login node: {no_login}"
        login = f"{up}; login node on {self._start_login(spec, slurm)}"
        if closed := closed_to_users(slurm.root.parent):
            login += (
                f"; its users cannot reach its slurm.conf through {closed}: "
                "set GPUFLEET_HOME to a folder every user may pass through (e.g. /srv/gpufleet)"
            )
        return login

    def _login(self, slurm: SlurmLab) -> LoginNode:
        return LoginNode(slurm.root, slurm.install, slurm.binds[1:])

    def _start_login(self, spec: ClusterSpec, slurm: SlurmLab, *, reload: bool = False) -> str:
        """The login node started for the spec's users (``reload``: reloaded in any case)."""
        try:
            return self._login(slurm).start([user.name for user in spec.users], reload=reload)
        except (TimeoutError, RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            did = "take the change" if reload else "come up"
            raise StepFailed(f"the login node did not {did}: {exc}; log in {slurm.logs / 'sshd.log'}") from None

    def login_address(self, spec: ClusterSpec) -> str:
        return LoginNode(self.root(spec)).address()

    def set_logins(self, spec: ClusterSpec) -> str:
        """The login node's users and keys become ``spec``'s (homes made, removed users' kept
        for root, their sessions ended); its sshd reloaded, sessions of the others kept. As an
        ordinary user there is no login node, and nothing to change: said."""
        slurm = self._up(spec)
        if slurm is None:
            raise StepFailed(f"the controller of {spec.name} is not running: its users cannot change now")
        if problem := login_unavailable():
            return f"no login node: {problem}"
        users = ClusterUsers(slurm.root, slurm.install)
        before = users.uids()
        try:
            changed = users.write(accounts_of(spec), mount_path_of(spec))
        except (ValueError, OSError) as exc:
            raise StepFailed(str(exc)) from None
        address = self._start_login(spec, slurm, reload=True)
        gone = sorted(set(before.values()) - {user.uid for user in spec.users})
        ended = self._login(slurm).end_sessions(gone)
        names = ", ".join(user.name for user in spec.users) or "nobody"
        said = f"login node on {address} for {names}" + (f" ({', '.join(changed)})" if changed else ", nothing changed")
        return said + (f"; {ended} process(es) of removed users ended" if ended else "")

    def logins_differ(self, spec: ClusterSpec) -> str:
        """'' when the login node's users and keys are the spec's (or there is no login node),
        else what differs (a change of users read before another one ended)."""
        root = self.root(spec)
        if login_unavailable() or not (root / "slurm.conf").exists() or not (root / "etc" / "passwd").exists():
            return ""  # no login node: nothing written to compare with
        return ClusterUsers(root, None).differs(accounts_of(spec))

    def tear_down(self, spec: ClusterSpec) -> str:
        root = self.root(spec)
        if not root.exists():
            return "nothing was running"
        LoginNode(root).stop()
        self._slurm(spec).stop()
        shutil.rmtree(root, ignore_errors=True)
        return f"login node and daemons stopped, {root} removed"

    def add_users(self, spec: ClusterSpec) -> str:
        no_linux = f"their logins are the login node's (its smoke jobs run as {getpass.getuser()})"
        if not spec.accounting:
            return f"accounting is off: {len(spec.users)} user(s) are in the user database Secret; {no_linux}"
        slurm = self._up(spec)
        if slurm is None:
            raise StepFailed(f"the controller of {spec.name} is not running: bring it up first")
        have = self._associations(slurm, spec)
        added = []
        for account in sorted({user.account for user in spec.users}):
            if (account, "") not in have:
                self._slurm_cmd(
                    slurm,
                    "sacctmgr",
                    "-i",
                    "add",
                    "account",
                    account,
                    f"cluster={spec.name}",
                    f"description={account}",
                    f"organization={account}",
                )
                added.append(f"account {account}")
        for user in spec.users:
            if (user.account, user.name) not in have:
                level = "Administrator" if user.admin else "None"
                self._slurm_cmd(
                    slurm,
                    "sacctmgr",
                    "-i",
                    "add",
                    "user",
                    user.name,
                    f"account={user.account}",
                    f"cluster={spec.name}",
                    f"adminlevel={level}",
                )
                added.append(f"user {user.name} in {user.account}")
        done = ", ".join(added) if added else "every account and user was there already"
        return f"sacctmgr: {done}; {no_linux}"

    def _associations(self, slurm: SlurmLab, spec: ClusterSpec) -> set[tuple[str, str]]:
        """(account, user) for each association of the cluster ('' for an account's own)."""
        out = self._slurm_cmd(
            slurm, "sacctmgr", "-n", "-P", "show", "assoc", f"cluster={spec.name}", "format=account,user"
        )
        return {(account, user) for account, _, user in (line.partition("|") for line in out.splitlines()) if account}

    def remove_users(self, spec: ClusterSpec, only: Sequence[str] | None = None) -> str:
        """The spec's users out of the cluster's accounting (``only``: just those users, and the
        accounts no other user of the spec uses)."""
        gone, accounts = leaving(spec, only)
        if not spec.accounting or not gone:
            return "no accounts to remove"
        slurm = self._up(spec)
        if slurm is None:
            return "the controller is not running: its accounts go with its database"
        have = self._associations(slurm, spec)
        removed = []
        for user in spec.users:
            if user.name in gone and (user.account, user.name) in have:
                self._slurm_cmd(
                    slurm,
                    "sacctmgr",
                    "-i",
                    "delete",
                    "user",
                    user.name,
                    f"account={user.account}",
                    f"cluster={spec.name}",
                )
                removed.append(f"user {user.name}")
        for account in sorted(accounts):
            if (account, "") in have:
                self._slurm_cmd(slurm, "sacctmgr", "-i", "delete", "account", account, f"cluster={spec.name}")
                removed.append(f"account {account}")
        return f"sacctmgr: removed {', '.join(removed)}" if removed else "no accounts to remove"

    def smoke_test(self, spec: ClusterSpec) -> str:
        """A hello-world batch job on every partition; each must complete."""
        slurm = self._slurm(spec)
        if not slurm.conf.exists():
            raise StepFailed(f"no slurm.conf at {slurm.conf}: the cluster is not up")
        told = self._home / "smoke-fails"
        if told.exists():  # the lab's knob, to watch a creation kept on failure and resumed
            raise StepFailed(f"the lab was told to fail smoke tests: remove {told}, then resume")
        ran = []
        for partition in spec.partitions:
            output = slurm.root / f"smoke-{partition.name}.out"
            output.unlink(missing_ok=True)
            script = slurm.root / "smoke.sh"
            script.write_text('#!/bin/sh\necho "hello from $SLURMD_NODENAME"\n')
            try:
                job = slurm.sbatch(script, "-p", partition.name, "-N", "1", "-J", "gpufleet-smoke", "-o", str(output))
            except subprocess.CalledProcessError as exc:
                raise StepFailed(f"sbatch on partition {partition.name} refused: {exc.stderr.strip()}") from None
            state = self._wait_job(slurm, job)
            if state != "COMPLETED":
                said = output.read_text().strip() if output.exists() else "(no output)"
                raise StepFailed(f"smoke job {job} on partition {partition.name} ended {state}: {said}")
            ran.append(f"{partition.name}: job {job} {output.read_text().strip()}")
        return "; ".join(ran)

    @staticmethod
    def _wait_job(slurm: SlurmLab, job: int) -> str:
        deadline = time.monotonic() + SMOKE_TIMEOUT
        state = "PENDING"
        while time.monotonic() < deadline:
            fields = dict(
                part.split("=", 1) for part in slurm.scontrol("show", "-o", "job", str(job)).split() if "=" in part
            )
            state = fields.get("JobState", "?")
            if state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
                return state
            time.sleep(0.5)
        return f"{state} after {SMOKE_TIMEOUT:g}s"

    def _up(self, spec: ClusterSpec) -> SlurmLab | None:
        """The cluster's Slurm when its controller answers (None: not running)."""
        slurm = self._slurm(spec)
        if not slurm.conf.exists() or not alive(slurm.pids().get("slurmctld", 0)):
            return None
        return slurm

    def _slurm_cmd(self, slurm: SlurmLab, *argv: str) -> str:
        done = subprocess.run(list(argv), env=slurm.env, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise StepFailed(f"{' '.join(argv[:2])} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def drain(self, spec: ClusterSpec) -> str:
        slurm = self._up(spec)
        if slurm is None:
            return "Slurm is not running: nothing to drain"
        nodes = sorted(set(self._slurm_cmd(slurm, "sinfo", "-h", "-N", "-o", "%N").split()))
        self._slurm_cmd(
            slurm, "scontrol", "update", f"nodename={','.join(nodes)}", "state=drain", "reason=gpufleet: cluster delete"
        )
        return f"drained {', '.join(nodes)}"

    def _jobs(self, slurm: SlurmLab, states: str) -> list[str]:
        return self._slurm_cmd(slurm, "squeue", "-h", "-t", states, "-o", "%i").split()

    def running_jobs(self, spec: ClusterSpec) -> int:
        slurm = self._up(spec)
        return 0 if slurm is None else len(self._jobs(slurm, "RUNNING,COMPLETING,CONFIGURING"))

    def cancel_jobs(self, spec: ClusterSpec) -> int:
        slurm = self._up(spec)
        if slurm is None:
            return 0
        jobs = self._jobs(slurm, "PENDING,RUNNING,SUSPENDED,COMPLETING,CONFIGURING")
        if jobs:
            self._slurm_cmd(slurm, "scancel", *jobs)
        return len(jobs)

    def make_remediable(self, spec: ClusterSpec) -> str:
        """A gpufleet worker for the cluster, on task queue gpufleet-<name>."""
        root = self.root(spec)
        pid_file = root / "worker.pid"
        if pid_file.exists() and alive(int(pid_file.read_text())):
            return f"worker already running (pid {pid_file.read_text()})"
        slurm = self._slurm(spec)
        env = {
            **self._worker_env,
            "GPUFLEET_CLUSTER": spec.name,
            "GPUFLEET_PARTITION": spec.default_partition,
            "GPUFLEET_SLURM_CONF": str(slurm.conf),
            "SLURM_CONF": str(slurm.conf),
            "GPUFLEET_CLUSTER_BACKENDS": "",  # only the lab's own worker creates clusters
            "PYTHONPATH": str(REPO_ROOT),
        }
        pid = spawn(
            [sys.executable, "-m", "workers.entry", "worker"], log=root / "log" / "worker.log", env=env, cwd=REPO_ROOT
        )
        pid_file.write_text(str(pid))
        return f"worker on task queue gpufleet-{spec.name} (pid {pid}); it reads its grace from the cluster's ConfigMap"

    def unmake_remediable(self, spec: ClusterSpec) -> str:
        pid_file = self.root(spec) / "worker.pid"
        if not pid_file.exists():
            return "no worker was running"
        stop([int(pid_file.read_text())])
        pid_file.unlink()
        return "worker stopped"


def stop_all(home: Path) -> list[Path]:
    """Stop every lab-made cluster under ``home`` (for ``lab down``); returns their folders."""
    stopped = []
    for root in sorted((home / "clusters").glob("*")):
        pid_file = root / "worker.pid"
        if pid_file.exists():
            stop([int(pid_file.read_text())])
        LoginNode(root).stop()
        slinky = SlinkyCluster(root)
        if slinky.controller():  # one the operator stand-in brought up: slurmrestd too
            slinky.stop()
        else:
            SlurmLab(root).stop()
        stopped.append(root)
    return stopped
