"""Dynamic Slurm nodes on Slurm 26.05, the way Slinky's slurm-operator runs a NodeSet.

On Slinky each NodeSet pod runs ``slurmd -Z --conf "Features=<nodeset> ..."``: a dynamic node that
registers with slurmctld under the pod's hostname and disappears with the pod. slurm.conf has no
``NodeName`` line for them; the operator writes, per NodeSet, ``NodeSet=<nodeset>
Feature=<nodeset>`` and ``PartitionName=<nodeset> Nodes=<nodeset> <config>`` (so a node joins its
NodeSet's partition by its feature), and ``MaxNodeCount`` (dynamic nodes need it, and
``select/cons_tres``). Before a pod stops, its preStop hook runs ``scontrol update
nodename=$(hostname) state=down reason='slurm-operator: Pod is terminating'``; a pod recreated
under the same name (StatefulSet mode) registers again under the same node name.

``DynamicSlurmLab`` runs that on one machine: its controller is a ``SlurmLab`` with no static node
and the operator's NodeSet and partition lines, and each "pod" is one ``slurmd -Z -N <pod>``.

What Slurm 26.05 requires, as found here:

- Two dynamic slurmd on one host each need their own port: ``--conf "Port=N"`` gives it (slurmd
  listens there and slurmctld records it from the registration; slurmd's man page still says Port
  is refused in ``--conf``, but only ``NodeName`` is).
- slurmctld takes a re-registering dynamic node's address from the connection but keeps the port
  it first registered with, so a pod started again while its node is still known keeps its port
  (a real pod keeps ``SlurmdPort`` and changes address).
- ``scontrol delete nodename=`` refuses a node with a job on it, completing or in a reservation
  ("Requested nodes are busy"); it need not be idle or drained. The preStop hook's DOWN ends and
  requeues its jobs, after which it can be deleted at once.
- The preStop hook's DOWN keeps a drain but replaces its reason with the operator's; without it a
  drain and its reason survive the node registering again. ``ReturnToService=2`` (the lab's)
  brings a node set DOWN back when it registers again.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from clients.errors import checked_node_name
from lab.accounting import accounting_lines
from lab.procs import alive, free_port, spawn, stop, wait_for
from lab.slurm import SlurmLab, SlurmLabSpec
from models.names import validate_cluster_name

RELEASE = "26.05"
# What Slinky's preStop hook sets on a pod's node before the pod stops.
PRESTOP_REASON = "slurm-operator: Pod is terminating"
# The partition options of each NodeSet's partition (the operator adds the NodeSet's own config).
PARTITION_CONFIG = "MaxTime=UNLIMITED State=UP"
# How many nodes slurmctld may hold (the operator's default).
MAX_NODE_COUNT = 1024
# Slurm's ClusterName unless told otherwise.
CLUSTER_NAME = "gpufleetdyn"
_KEY = re.compile(r"^\s*([A-Za-z]+)\s*=")


def conf_key(line: str) -> str:
    """The slurm.conf key a line sets (lowercased: Slurm's keys are case-insensitive); '' for none."""
    match = _KEY.match(line)
    return match.group(1).lower() if match else ""


def overridden(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` without the lines whose key one of ``extra`` sets (the NodeSet and partition
    lines are never dropped: each names its own)."""
    keys = {conf_key(line) for line in extra} - {"", "nodeset", "partitionname", "nodename"}
    return [line for line in base if conf_key(line) not in keys]


def partition_line(nodeset: str, config: str, *, default: bool) -> str:
    """The operator's partition of a NodeSet: named after it, its nodes the NodeSet's feature, and
    the NodeSet's ``partition.config`` (without one, the lab's options; ``Default`` and ``State=UP``
    added when the config leaves them out)."""
    options = config.split() if config.strip() else PARTITION_CONFIG.split()
    keys = {conf_key(option) for option in options}
    head = [f"PartitionName={nodeset}", f"Nodes={nodeset}"]
    if "default" not in keys:
        head.append(f"Default={'YES' if default else 'NO'}")
    tail = [] if "state" in keys else ["State=UP"]
    return " ".join([*head, *options, *tail])


_FIELDS = re.compile(r"(?:^| )(NodeName|State|Port|SlurmdStartTime)=(\S*)")


@dataclass(frozen=True)
class Pod:
    """One NodeSet pod: its slurmd's node name, NodeSet, CPUs and port."""

    name: str
    nodeset: str
    cpus: int
    port: int

    def slurmd_conf(self) -> str:
        """slurmd's ``--conf``: the operator's ``Features=<nodeset>``, and this host's resources."""
        return f"Features={self.nodeset} CPUs={self.cpus} RealMemory=256 Port={self.port}"


class DynamicSlurmLab(SlurmLab):
    """slurmctld on Slurm 26.05 with NodeSet partitions and no static node, and one
    ``slurmd -Z`` per pod, started and stopped as pods come and go."""

    def __init__(
        self,
        root: Path,
        nodesets: Sequence[str] = ("slinky",),
        *,
        release: str = RELEASE,
        binds: list[Path] | None = None,
        extra_lines: Sequence[str] = (),
        partitions: Mapping[str, str] | None = None,
        cluster_name: str = CLUSTER_NAME,
        accounting: bool = False,
        health_checks: bool = False,
    ) -> None:
        """``nodesets``: one partition each, named after it (the first is the default one);
        ``extra_lines``: more slurm.conf lines (the JWT key's, for slurmrestd; the Controller's
        ``extraConf``), each replacing a line of the lab's that sets the same key;
        ``partitions``: a NodeSet's ``partition.config`` (its partition line's options);
        ``cluster_name``: Slurm's ``ClusterName`` (a Slinky Controller's ``clusterName``: the cluster
        that accounting records jobs and associations under); ``accounting``: ``start`` starts the
        cluster's own MariaDB and slurmdbd too, and registers it there (lab/accounting.py);
        ``health_checks``: Slurm's hooks run ``gpufleet health-check`` (``SlurmLab.hook_lines``)."""
        if not nodesets:
            raise ValueError("a dynamic cluster needs at least one NodeSet")
        super().__init__(
            root,
            SlurmLabSpec(nodes=[], spares=[], partition=nodesets[0]),
            nodes=[],
            release=release,
            binds=binds,
            health_checks=health_checks,
        )
        self.nodesets = [checked_node_name(name) for name in nodesets]
        self._pods_file = self.root / "pods.json"
        self.extra_lines = list(extra_lines)
        self.partitions = dict(partitions or {})
        self.cluster_name = validate_cluster_name(cluster_name)
        self.with_accounting = accounting

    def _write_conf(self) -> None:
        storage = accounting_lines(None) if self.with_accounting else ["AccountingStorageType=accounting_storage/none"]
        base = [
            f"ClusterName={self.cluster_name}",
            *self.site_lines(),
            *storage,
            f"MaxNodeCount={MAX_NODE_COUNT}",
            "KillWait=5",
        ]
        lines = [*overridden(base, self.extra_lines), *self.extra_lines]
        for index, nodeset in enumerate(self.nodesets):
            lines.append(f"NodeSet={nodeset} Feature={nodeset}")
            lines.append(partition_line(nodeset, self.partitions.get(nodeset, ""), default=index == 0))
        self.conf.write_text("\n".join(lines) + "\n")

    # -- pods -------------------------------------------------------------------------------------

    def pods(self) -> dict[str, Pod]:
        """The pods started here (running or not) by name; a removed pod is forgotten."""
        if not self._pods_file.exists():
            return {}
        return {name: Pod(**fields) for name, fields in json.loads(self._pods_file.read_text()).items()}

    def _save(self, pods: dict[str, Pod]) -> None:
        self._pods_file.write_text(json.dumps({name: asdict(pod) for name, pod in pods.items()}))

    def running(self, name: str) -> bool:
        """Whether the pod's slurmd runs."""
        return alive(self.pids().get(f"slurmd-{name}", 0))

    def add_node(self, name: str, nodeset: str, cpus: int = 1, *, timeout: float = 30.0) -> Pod:
        """Start a pod of ``nodeset``: its slurmd registers as node ``name``; returns once the
        node is registered (and idle, when Slurm did not know it)."""
        name = checked_node_name(name)
        if nodeset not in self.nodesets:
            raise ValueError(f"no NodeSet {nodeset!r} here; choose one of {', '.join(self.nodesets)}")
        if self.running(name):
            raise RuntimeError(f"pod {name} already runs")
        known = self._record_of(name)
        # A node Slurm still knows keeps the port it registered with (see the module's notes).
        port = int(known.get("Port", "0")) if known else 0
        pod = Pod(name=name, nodeset=nodeset, cpus=cpus, port=port or free_port())
        self._start_pod(pod, known, timeout=timeout)
        return pod

    def remove_node(self, name: str, *, timeout: float = 30.0) -> None:
        """Delete the pod: its preStop hook sets the node DOWN (its jobs are requeued), its slurmd
        stops, and the node is deleted from Slurm (what the operator does to a node whose pod is
        gone); returns once Slurm no longer knows it."""
        name = checked_node_name(name)
        if self._record_of(name) is not None:
            self._prestop(name, timeout=timeout)
        self._stop_pod(name)

        def deleted() -> bool:
            if self._record_of(name) is None:
                return True
            # Refused while a job still holds the node (it is then retried).
            self._scontrol_ok("delete", f"nodename={name}")
            return self._record_of(name) is None

        wait_for(deleted, timeout=timeout, what=f"node {name} to be deleted from Slurm", interval=0.2)
        pods = self.pods()
        pods.pop(name, None)
        self._save(pods)

    def stop_node(self, name: str, *, timeout: float = 30.0) -> None:
        """The pod gone and not (yet) back: its preStop hook sets the node DOWN (its jobs are
        requeued) and its slurmd stops; Slurm keeps the node, and a pod of the same name started
        later (``add_node``) registers again under it, on its port."""
        name = checked_node_name(name)
        if self._record_of(name) is not None:
            self._prestop(name, timeout=timeout)
        self._stop_pod(name)

    def move_node(self, name: str, *, prestop: bool = True, timeout: float = 30.0) -> Pod:
        """The pod recreated under the same name (on another Kubernetes node, StatefulSet mode):
        its preStop hook sets the node DOWN (its jobs are requeued), its slurmd stops and starts
        again on the same port, and the node registers again under the same name. ``prestop=False``: the slurmd
        restarts without the hook (a container that crashed), its node and jobs as they were."""
        name = checked_node_name(name)
        pod = self.pods().get(name)
        if pod is None:
            raise KeyError(f"no pod {name} here")
        if prestop:
            self._prestop(name, timeout=timeout)
        self._stop_pod(name)
        self._start_pod(pod, self._record_of(name), timeout=timeout)
        return pod

    def nodes(self) -> list[str]:
        """The names of the nodes Slurm knows, sorted."""
        return sorted(record["NodeName"] for record in self._records())

    # -- internals --------------------------------------------------------------------------------

    def _records(self, name: str | None = None) -> list[dict[str, str]]:
        argv = ["show", "-o", "node", *([name] if name else [])]
        done = subprocess.run(
            self.argv(["scontrol", *argv]), env=self.env, capture_output=True, text=True, timeout=15, check=False
        )
        if done.returncode != 0:
            if "not found" in (done.stdout + done.stderr):
                return []
            raise RuntimeError(f"scontrol {' '.join(argv)}: {(done.stderr or done.stdout).strip()}")
        return [dict(_FIELDS.findall(line)) for line in done.stdout.splitlines() if line.startswith("NodeName=")]

    def _record_of(self, name: str) -> dict[str, str] | None:
        return next((record for record in self._records(name) if record.get("NodeName") == name), None)

    def _scontrol_ok(self, *args: str) -> bool:
        done = subprocess.run(
            self.argv(["scontrol", *args]), env=self.env, capture_output=True, text=True, timeout=15, check=False
        )
        return done.returncode == 0

    def _start_pod(self, pod: Pod, known: dict[str, str] | None, *, timeout: float) -> None:
        before = known.get("SlurmdStartTime", "") if known else ""
        before = before if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", before) else ""
        # Told apart by its start time (whole seconds): the new slurmd starts in a later second.
        if before:
            wait_for(lambda: time.strftime("%Y-%m-%dT%H:%M:%S") > before, timeout=3, what="the next second")
        (self.root / "spool" / pod.name).mkdir(parents=True, exist_ok=True)
        argv = ["slurmd", "-D", "-Z", "-N", pod.name, "-f", str(self.conf), "--conf", pod.slurmd_conf()]
        self._record(
            f"slurmd-{pod.name}", spawn(self.argv(argv), log=self.logs / f"slurmd-{pod.name}.out", env=self.env)
        )
        pods = self.pods()
        pods[pod.name] = pod
        self._save(pods)

        def registered() -> bool:
            record = self._record_of(pod.name)
            if record is None or record.get("SlurmdStartTime", "") <= before:
                return False
            base, *flags = record.get("State", "").split("+")
            if known is None:  # a new node: registered and idle
                return base == "IDLE" and set(flags) <= {"DYNAMIC_NORM"}
            return base.rstrip("*") not in {"DOWN", "UNKNOWN"} and "NOT_RESPONDING" not in flags

        wait_for(registered, timeout=timeout, what=f"pod {pod.name}'s slurmd to register")

    def _prestop(self, name: str, *, timeout: float) -> None:
        """Slinky's preStop hook: the node DOWN with the operator's reason, then the node's job
        steps gone (slurmd kills them)."""
        self.scontrol("update", f"nodename={name}", "state=down", f"reason={PRESTOP_REASON}")
        if self.running(name):
            spool = self.root / "spool" / name
            steps = re.compile(rf"^{re.escape(name)}_\d+\.\d+")
            wait_for(
                lambda: not any(steps.match(entry.name) for entry in spool.iterdir()),
                timeout=timeout,
                what=f"pod {name}'s job steps to end",
            )

    def _stop_pod(self, name: str) -> None:
        pid = self.pids().pop(f"slurmd-{name}", 0)
        if pid:
            stop([pid])
        pids = self.pids()
        pids.pop(f"slurmd-{name}", None)
        self._pids_file.write_text(json.dumps(pids))

    def stop(self) -> None:
        super().stop()
        if self._pods_file.exists():
            self._pods_file.unlink()
