"""A real Slurm cluster on one machine: slurmctld and one ``slurmd -N`` per node.

On the host's Slurm (Debian 12's 22.05) the cluster authenticates with a private munged; on a
newer release (lab/slurmroots.py: 24.11, 26.05 in a cached Debian root) with ``auth/slurm`` and a
key beside its slurm.conf, every daemon and command running in the root through lab/inroot.py,
and the client commands offered as wrappers in ``root/bin`` (``env`` puts them first on PATH).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from clients.slurm import SlurmCli
from lab.accounting import Accounting, accounting_unavailable, conf_value, with_accounting, without_accounting
from lab.nvmlstub import StubUnavailable, build_stub
from lab.procs import alive, free_port, pids_holding, pids_with_env, spawn, stop, wait_for
from lab.slurmroots import LAB_SLURM_ENV, REPO_ROOT, RootError, Roots, SlurmInstall, host_install, install_for


def slurm_installed() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "scontrol", "sbatch"))


@dataclass
class SlurmLabSpec:
    nodes: list[str] = field(default_factory=lambda: ["gpu1", "gpu2", "gpu3", "gpu4"])
    spares: list[str] = field(default_factory=lambda: ["spare1", "spare2"])
    partition: str = "train"
    cpus_per_node: int = 1
    # How long a requeued job waits before it may start again (Slurm's default is 120 s).
    requeue_delay_seconds: int = 5
    # KillWait: how long a job's steps have after their SIGTERM (a cancel, a requeue, a step a
    # rank's failure ended) before Slurm's SIGKILL. A rank that hangs, deaf to SIGTERM, ends only then.
    kill_wait_seconds: int = 10
    # Slurm's tree topology (TopologyPlugin=topology/tree, topology.conf beside slurm.conf): one
    # leaf switch per rack, named leaf-RACK, over the rack's nodes, and a top switch over the
    # leaves. Empty: no topology. Nodes in no rack hang off no switch.
    racks: dict[str, list[str]] = field(default_factory=dict)


class SlurmLab:
    """Start and stop the daemons under ``root``; every PID is recorded in ``root/pids.json``."""

    def __init__(
        self,
        root: Path,
        spec: SlurmLabSpec | None = None,
        *,
        conf: str | None = None,
        nodes: list[str] | None = None,
        release: str | None = None,
        binds: list[Path] | None = None,
        health_checks: bool = False,
    ) -> None:
        """``conf`` (with ``nodes``, the slurmd to start): run from that slurm.conf instead of
        the lab's own; it must use this lab's munge socket and paths (``site_lines``).
        ``release``: the Slurm release (``22.05``, ``24.11``, ``26.05``; default
        ``$GPUFLEET_LAB_SLURM``, else the host's own). ``binds``: folders beyond ``/tmp``, the
        checkout and ``root`` that the daemons and jobs of a release in a root must see.
        ``health_checks``: Slurm's hooks run ``gpufleet health-check`` (``hook_lines``; the fleet
        lab's, both flavors)."""
        self.root = root.resolve()
        # A cluster started earlier keeps the release it was started on (its file says which).
        started_on = self.root / "release"
        self.release = release or (started_on.read_text().strip() if started_on.exists() else None)
        self.release = self.release or os.environ.get(LAB_SLURM_ENV) or None
        self._install: SlurmInstall | None = None
        self.binds = [self.root, *(binds or [])]
        self.health_checks = health_checks
        self.spec = spec or SlurmLabSpec()
        self._conf_text = conf
        self._nodes = nodes
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.logs = self.root / "log"
        self._pids_file = self.root / "pids.json"

    @property
    def install(self) -> SlurmInstall:
        """Where this cluster's Slurm runs (as it is: ``start`` makes a missing root)."""
        if self._install is None:
            self._install = self._resolve(make=False)
        return self._install

    def _resolve(self, *, make: bool) -> SlurmInstall:
        host = host_install()
        if self.release is None or (host is not None and host.release.version == self.release):
            if host is None:
                raise RuntimeError("Slurm is not installed: apt-get install slurm-wlm munge (or run make test as root)")
            return host
        return install_for(self.release) if make else Roots().existing(self.release)

    @property
    def bin_dir(self) -> Path | None:
        """The folder of this cluster's client commands when they are not the host's."""
        if self.install.on_host:
            return None
        folder = self.root / "bin"
        if not (folder / "scontrol").exists():
            self.install.write_wrappers(folder, self.binds)
        return folder

    def client(self) -> SlurmCli:
        """gpufleet's Slurm client for this cluster, on its release's commands."""
        return SlurmCli(slurm_conf=self.conf, bin_dir=self.bin_dir)

    @property
    def own_view(self) -> bool:
        """Whether the cluster has users of its own (``etc/passwd``) or folders bound for them
        (``mounts.json``) beside its slurm.conf (lab/login.py): its daemons and commands then
        run where those are seen, on the host's Slurm too (lab/inroot.py)."""
        return (self.root / "etc" / "passwd").is_file() or (self.root / "mounts.json").is_file()

    def argv(self, command: list[str]) -> list[str]:
        """``command`` (a Slurm daemon or command) as it runs on this cluster's install."""
        return self.install.argv(command, self.binds, own_view=self.own_view)

    @property
    def env(self) -> dict[str, str]:
        """The environment in which the Slurm commands talk to this cluster."""
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        if self.bin_dir is not None:
            env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        return env

    def slurmd_pid(self, node: str) -> int:
        """The PID of the node's slurmd itself (under a Slurm root, a child of the recorded
        wrapper): what a test stops to keep a node from answering slurmctld."""
        todo = [self.pids()[f"slurmd-{node}"]]
        while todo:
            pid = todo.pop()
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd":
                    return pid
                todo += [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except FileNotFoundError:
                continue
        raise LookupError(f"no slurmd process runs for {node}")

    def pids(self) -> dict[str, int]:
        if not self._pids_file.exists():
            return {}
        data: dict[str, int] = json.loads(self._pids_file.read_text())
        return data

    def _record(self, name: str, pid: int) -> None:
        pids = self.pids()
        pids[name] = pid
        self._pids_file.write_text(json.dumps(pids))

    # -- start ------------------------------------------------------------------------------------

    def start(self, *, timeout: float = 60.0) -> None:
        self._install = self._resolve(make=True)
        if self.install.on_host and not slurm_installed():
            raise RuntimeError("Slurm is not installed: apt-get install slurm-wlm munge (or run make test as root)")
        for folder in ("munge", "state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        # Its own users' commands reach the munge socket too (munged refuses a writable folder).
        os.chmod(self.root / "munge", 0o711 if self.own_view else 0o700)
        (self.root / "release").write_text(self.install.release.version + "\n")
        if self.install.on_host:
            self._start_munge()
        else:
            self._write_slurm_key()
            self.install.write_wrappers(self.root / "bin", self.binds)
        self._write_conf()
        if self.accounting is not None:
            self._start_accounting(self.accounting, timeout=timeout)
        self._spawn_controller(clear=True)
        wait_for(self._controller_up, timeout=timeout, what="slurmctld to answer")
        for node in self.all_nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
            self._spawn_slurmd(node)
        # Slurm 23.11 and later: a cluster's slurmds share its /run/slurm (lab/inroot.py), where
        # each binds the same sack socket at start; two binding at the same instant collide, and
        # the one that lost exits ("Unable to bind UNIX socket"). It is started again (twice at most).
        again: dict[str, int] = {}

        def registered() -> bool:
            if not self.install.on_host:
                pids = self.pids()
                for node in self.all_nodes:
                    pid = pids.get(f"slurmd-{node}")
                    if pid is not None and not alive(pid) and again.get(node, 0) < 2:
                        again[node] = again.get(node, 0) + 1
                        self._spawn_slurmd(node)
            return self._nodes_up()

        try:
            wait_for(registered, timeout=timeout, what="every slurmd to register")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {self._registration_report()}") from None

    def _spawn_slurmd(self, node: str) -> None:
        self._record(
            f"slurmd-{node}",
            spawn(
                self.argv(["slurmd", "-D", "-N", node, "-f", str(self.conf)]),
                log=self.logs / f"slurmd-{node}.out",
                env=self.env,
            ),
        )

    def _registration_report(self) -> str:
        """What Slurm says of the nodes that did not register, and the end of the first one's
        slurmd log: where to look when a slurmd runs but never registers."""
        try:
            out = self.scontrol("show", "-o", "node")
        except (subprocess.SubprocessError, OSError) as exc:
            return f"scontrol show node failed: {exc}"
        states = dict(re.findall(r"NodeName=(\S+).*?State=(\S+)", out))
        missing = [node for node in self.all_nodes if states.get(node) != "IDLE"]
        said = ", ".join(f"{node} {states.get(node, 'unknown')}" for node in missing)
        log = self.logs / f"slurmd-{missing[0]}.log" if missing else None
        tail = " | ".join(log.read_text(errors="replace").splitlines()[-5:]) if log and log.exists() else ""
        alive_ones = [name for name, pid in self.pids().items() if alive(pid)]
        return f"nodes {said}; running: {', '.join(sorted(alive_ones))}; {log}: {tail}"

    def expected(self) -> set[str]:
        """The names under which a whole cluster's daemons are recorded."""
        names = {"slurmctld", *(f"slurmd-{node}" for node in self.all_nodes)}
        if self.install.on_host:
            names.add("munged")
        return names | ({"mariadbd", "slurmdbd"} if self.accounting is not None else set())

    def whole(self) -> bool:
        """Every daemon of the cluster recorded and running, the controller answering and every
        node registered (a start cut short is not)."""
        pids = self.pids()
        if not (self.expected() <= set(pids) and all(alive(pid) for pid in pids.values())):
            return False
        try:
            return self._controller_up() and self._nodes_up()
        except (subprocess.SubprocessError, OSError):
            return False

    @property
    def accounting(self) -> Accounting | None:
        """The cluster's slurmdbd and database when its slurm.conf asks for them."""
        text = self._conf_text if self._conf_text is not None else (self.conf.read_text() if self.conf.exists() else "")
        if conf_value(text, "AccountingStorageType") != "accounting_storage/slurmdbd":
            return None
        return self._accounting()

    def _accounting(self) -> Accounting:
        munge = self.munge_socket if self.install.on_host else None  # a root's release: auth/slurm
        return Accounting(self.root, munge, argv=self.argv)

    def _start_accounting(self, accounting: Accounting, *, timeout: float) -> str:
        missing = accounting_unavailable(self.install)
        if missing:
            raise RuntimeError(missing)
        cluster = conf_value(self.conf.read_text(), "ClusterName")
        return accounting.start(self._record, self.env, cluster=cluster, timeout=timeout)

    def start_accounting(self, *, timeout: float = 60.0) -> str:
        """Accounting for this cluster, started or not: its slurm.conf made to ask for slurmdbd,
        MariaDB and slurmdbd started (those that run already are kept, found by their own
        files), the cluster registered, and a running slurmctld that does not use them yet
        restarted (its jobs and nodes kept). Says what it did; calling it again does nothing more.
        A slurmrestd started before reads an old copy of slurm.conf: start it again for the
        accounting API."""
        if self._conf_text is not None:
            raise RuntimeError("a cluster run from a given slurm.conf has accounting when that slurm.conf asks for it")
        if not self.conf.exists():
            raise RuntimeError(f"no cluster under {self.root}: start it first")
        missing = accounting_unavailable(self.install)
        if missing:
            raise RuntimeError(missing)
        text = self.conf.read_text()
        if with_accounting(text, self._accounting().munge_socket) != text:
            self.conf.write_text(with_accounting(text, self._accounting().munge_socket))
        did = self._start_accounting(self._accounting(), timeout=timeout)
        return did + self._controller_on_conf(timeout=timeout)

    def stop_accounting(self, *, timeout: float = 60.0) -> str:
        """No accounting for this cluster: slurmdbd and MariaDB stopped (their data kept for a
        later start), its slurm.conf without slurmdbd, and a running slurmctld that still uses
        them restarted. Says what it did; calling it again does nothing more."""
        if self._conf_text is not None:
            raise RuntimeError("a cluster run from a given slurm.conf has accounting when that slurm.conf asks for it")
        pids = self.pids()
        did = self._accounting().stop(pids)
        self._pids_file.write_text(json.dumps({k: v for k, v in pids.items() if k not in ("slurmdbd", "mariadbd")}))
        if self.conf.exists():
            text = self.conf.read_text()
            if without_accounting(text) != text:
                self.conf.write_text(without_accounting(text))
            did += self._controller_on_conf(timeout=timeout)
        return did

    def _controller_on_conf(self, *, timeout: float) -> str:
        """Restart a running slurmctld whose accounting is not its slurm.conf's (after a change,
        or a change that a crash cut short); ', slurmctld restarted' when it did."""
        if not alive(self.pids().get("slurmctld", 0)):
            return ""
        wanted = conf_value(self.conf.read_text(), "AccountingStorageType") or "accounting_storage/none"
        found = re.search(r"^AccountingStorageType\s*=\s*(\S+)", self.scontrol("show", "config"), re.M)
        # Slurm 23.11 and later have no accounting_storage/none plugin: no accounting shows as (null).
        running = found.group(1) if found is not None and found.group(1) != "(null)" else "accounting_storage/none"
        if running == wanted:
            return ""
        self._restart_controller(timeout=timeout)
        return ", slurmctld restarted"

    def _restart_controller(self, *, timeout: float) -> None:
        """slurmctld again on the same slurm.conf, from its saved state (jobs and nodes kept)."""
        stop([self.pids().get("slurmctld", 0)])
        self._spawn_controller(clear=False)
        wait_for(self._controller_up, timeout=timeout, what="slurmctld to answer again")

    def _spawn_controller(self, *, clear: bool) -> None:
        argv = ["slurmctld", "-D", *(["-c"] if clear else []), "-i", "-f", str(self.conf)]
        self._record("slurmctld", spawn(self.argv(argv), log=self.logs / "slurmctld.out", env=self.env))

    @property
    def all_nodes(self) -> list[str]:
        if self._nodes is not None:
            return list(self._nodes)
        return [*self.spec.nodes, *self.spec.spares]

    def site_lines(self) -> list[str]:
        """What a slurm.conf needs to run here: this lab's host, users, free ports, munge
        socket and paths, and plugins that need nothing from the machine."""
        user = getpass.getuser()
        if self.install.on_host:
            auth = [
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket},cred_expire={self.spec.requeue_delay_seconds}",
            ]
        else:  # the key is slurm.key beside slurm.conf (_write_slurm_key)
            auth = [
                "AuthType=auth/slurm",
                "CredType=cred/slurm",
                f"AuthInfo=cred_expire={self.spec.requeue_delay_seconds}",
            ]
        return [
            "SlurmctldHost=localhost",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            *auth,
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            # A scheduling pass every second, so a requeued job starts as soon as it may; with the
            # health checks, a job whose prolog failed is requeued to run elsewhere, not held.
            "SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000"
            + (",nohold_on_prolog_fail" if self.health_checks else ""),
            "ReturnToService=2",
            "MpiDefault=none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=10",
            "MessageTimeout=5",
            "SlurmdTimeout=30",
            "MinJobAge=600",
            "PlugStackConfig=/dev/null",
            *(self.hook_lines() if self.health_checks else []),
        ]

    # -- gpufleet health-check in Slurm's hooks (docs/health-check.md) ------------------------------

    # Each lab node has this many GPUs (the NVML stand-in's default); hook_gpus_file changes one's.
    HOOK_GPUS = 2

    @property
    def hooks(self) -> Path:
        """The hooks' folder: the script, the NVML stand-in, each node's GPUs and detector inbox."""
        return self.root / "hooks"

    def hook_inbox(self, node: str) -> Path:
        """Where ``gpufleet health-check`` on ``node`` drops its events (the node's detector's --inbox)."""
        return self.hooks / "inbox" / node

    def hook_gpus_file(self, node: str) -> Path:
        """What the NVML stand-in answers on ``node`` (lab/stub_nvml.c's STUB_NVML_NODE_FILE): write
        ``"1"`` and the node has one GPU of the two it should have; ``"2 1"``: GPU 1 is lost."""
        return self.hooks / "gpus" / node

    def hook_node_file(self, slurm_node: str) -> Path:
        """The Kubernetes node a Slurm node (a Slinky pod) runs on, when it has another name."""
        return self.hooks / "nodes" / slurm_node

    def hook_lines(self) -> list[str]:
        """Prolog, Epilog and HealthCheckProgram running ``gpufleet health-check`` on the NVML
        stand-in, each node its own GPUs; none where the stand-in cannot be built (no gcc)."""
        try:
            build_stub(self.hooks / "nvml")
        except StubUnavailable:
            return []
        import pynvml  # its one file, for a release's own Python in a root (pure Python)

        (self.hooks / "py").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pynvml.__file__, self.hooks / "py" / "pynvml.py")
        for folder in ("gpus", "inbox", "nodes"):
            (self.hooks / folder).mkdir(parents=True, exist_ok=True)
        hooks = self.hooks
        scripts = {}
        # Slurm runs a hook's program without arguments: one script per mode.
        for mode in ("prolog", "epilog", "healthcheck"):
            scripts[mode] = script = hooks / mode
            script.write_text(
                "#!/bin/sh\n"
                f"# gpufleet health-check --mode {mode} in this lab's Slurm, on the NVML stand-in.\n"
                "# Slurm gives a hook SLURMD_NODENAME; a Slinky pod's Kubernetes node is in nodes/POD.\n"
                'slurm_node="${SLURMD_NODENAME:?}"\n'
                'node="$slurm_node"\n'
                f'[ -r "{hooks}/nodes/$slurm_node" ] && read -r node < "{hooks}/nodes/$slurm_node"\n'
                f'export LD_LIBRARY_PATH="{hooks}/nvml" STUB_NVML_NODE_FILE="{hooks}/gpus/$node" '
                f'GPUFLEET_INBOX="{hooks}/inbox/$node" NODE_NAME="$node" SLURM_CONF="{self.conf}" '
                f'PYTHONPATH="{hooks}/py:{REPO_ROOT}" PATH="${{PATH:-/usr/bin:/bin}}:/usr/bin:/bin"\n'
                f"exec {self.install.python()} -m workers.command health-check --mode {mode} --gpus {self.HOOK_GPUS}\n"
            )
            script.chmod(0o755)
        return [
            f"Prolog={scripts['prolog']}",
            f"Epilog={scripts['epilog']}",
            f"HealthCheckProgram={scripts['healthcheck']}",
            "HealthCheckInterval=300",
        ]

    @staticmethod
    def node_options(cpus: int = 1) -> str:
        """A slurmd of this lab on its own port, as one NodeName line's options."""
        return f"NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} RealMemory=256"

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        argv = [
            "munged",
            "-F",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            f"--log-file={self.logs / 'munged.log'}",
        ]
        self._record("munged", spawn(argv, log=self.logs / "munged.out"))
        wait_for(self.munge_socket.exists, timeout=10, what="munged to create its socket")

    def _write_slurm_key(self) -> None:
        """auth/slurm's shared key, read by every daemon and command from beside slurm.conf."""
        key = self.root / "slurm.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)

    def _write_conf(self) -> None:
        if self._conf_text is not None:
            self.conf.write_text(self._conf_text)
            return
        spec = self.spec
        lines = [
            "ClusterName=gpufleetlab",
            *self.site_lines(),
            "AccountingStorageType=accounting_storage/none",
            f"KillWait={spec.kill_wait_seconds}",
        ]
        topology = self.topology_lines()
        if topology:
            lines.append("TopologyPlugin=topology/tree")
        for node in self.all_nodes:
            lines.append(f"NodeName={node} {self.node_options(spec.cpus_per_node)} State=UNKNOWN")
        lines.append(
            f"PartitionName={spec.partition} Nodes={','.join(spec.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        topology_conf = self.conf.with_name("topology.conf")
        if topology:
            topology_conf.write_text("\n".join(topology) + "\n")
        else:
            topology_conf.unlink(missing_ok=True)

    # The top switch of the lab's tree (leaf_switch names the leaves).
    TOP_SWITCH = "top"

    @staticmethod
    def leaf_switch(rack: str) -> str:
        """The leaf switch of a rack in the lab's topology.conf."""
        return f"leaf-{rack}"

    def topology_lines(self) -> list[str]:
        """topology.conf for ``spec.racks``: a leaf switch per rack over its Slurm nodes (a rack's
        Kubernetes-only nodes left out), a top switch over the leaves; none without racks.

        A Slurm node in no rack gets a leaf of its own (``node-NAME``): under topology/tree a node
        no switch reaches cannot share a job with others (22.05: "Requested node configuration is
        not available"), and a domain of one node never makes a domain incident."""
        known = self.all_nodes
        racked: dict[str, list[str]] = {}
        for rack, members in sorted(self.spec.racks.items()):
            nodes = [node for node in members if node in known]
            if nodes:
                racked[self.leaf_switch(rack)] = nodes
        if not racked:
            return []
        placed = {node for nodes in racked.values() for node in nodes}
        leaves = {**racked, **{f"node-{node}": [node] for node in known if node not in placed}}
        lines = [f"SwitchName={name} Nodes={','.join(nodes)}" for name, nodes in leaves.items()]
        return [*lines, f"SwitchName={self.TOP_SWITCH} Switches={','.join(leaves)}"]

    def scontrol(self, *args: str) -> str:
        done = subprocess.run(
            self.argv(["scontrol", *args]), env=self.env, capture_output=True, text=True, timeout=15, check=True
        )
        return done.stdout

    def _controller_up(self) -> bool:
        return "UP" in self.scontrol("ping")

    def _nodes_up(self) -> bool:
        out = self.scontrol("show", "-o", "node")
        states = {
            fields["NodeName"]: fields["State"]
            for fields in (dict(re.findall(r"(NodeName|State)=(\S+)", line)) for line in out.splitlines())
            if "NodeName" in fields
        }
        return all(states.get(node) == "IDLE" for node in self.all_nodes)

    # -- jobs -------------------------------------------------------------------------------------

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit a batch script; returns the job ID."""
        done = subprocess.run(
            self.argv(["sbatch", "--parsable", *args, str(script)]),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return int(done.stdout.strip().split(";")[0])

    # -- stop -------------------------------------------------------------------------------------

    def _started_install(self) -> SlurmInstall | None:
        """The install this cluster was started on (its ``release`` file), never made here."""
        started_on = self.root / "release"
        release = started_on.read_text().strip() if started_on.exists() else self.release
        if release is None or release == self.release:
            try:
                return self.install
            except (RootError, RuntimeError):
                return None
        try:
            return SlurmLab(self.root, release=release).install
        except (RootError, RuntimeError):
            return None

    def stop(self) -> None:
        """Stop every daemon this lab started and every job step they left behind, on the
        release it was started on."""
        pids = self.pids()
        install = self._started_install()
        if install is not None and self.conf.exists() and alive(pids.get("slurmctld", 0)):
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    install.argv(["scancel", "--user", getpass.getuser()], self.binds),
                    env=self.env,
                    capture_output=True,
                    timeout=15,
                    check=False,
                )
        stop([pid for name, pid in pids.items() if name == "slurmrestd"])  # a Slinky cluster's (lab/slinkyclusters.py)
        daemons = [pid for name, pid in pids.items() if name.startswith("slurmd")]
        stop(daemons)
        stop([pid for name, pid in pids.items() if name == "slurmctld"])
        # slurmdbd and MariaDB, also where started but not recorded (found by their own files).
        Accounting(self.root, None).stop(pids)
        # slurmstepd and the job processes carry the lab's SLURM_CONF in their environment; a newer
        # release's slurmstepd clears it but keeps its node's log open.
        roots = [install.root] if install is not None and install.root is not None else []
        stop(sorted({*pids_with_env("SLURM_CONF", str(self.conf)), *pids_holding(self.root, roots)}), timeout=3)
        # A step its slurmd was starting as it stopped opens the node's log only then: once more.
        stop(pids_holding(self.root, roots), timeout=3)
        stop([pid for name, pid in pids.items() if name == "munged"])
        if self._pids_file.exists():
            self._pids_file.unlink()
