"""The whole local fleet lab: Temporal dev server, Slurm, emulated Kubernetes, webhook receiver, worker.

Everything runs detached, under ``home`` (``$GPUFLEET_HOME``, default ``./.gpufleet``), and
every PID is recorded in ``home/lab.json`` so that ``down`` stops exactly what ``up`` started.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client

from lab.access import (
    DEFAULT_USER,
    USERS,
    api_answers,
    api_certificate,
    apply_roles,
    connect_as,
    user_tokens,
    write_kubeconfigs,
)
from lab.cluster import stop_all
from lab.dynamic import DynamicSlurmLab
from lab.faults import FAULTS_ENV, Effect, GpuFaults
from lab.intake import REPORTERS, certificate, detector_seed, healthy, write_tokens
from lab.kubeapi import inference_workloads, lab_workloads, merge_seeds, node_object, training_node
from lab.procs import alive, free_port, port_in_use, spawn, stop, wait_for
from lab.prometheus import prometheus_installed, start_prometheus
from lab.slinkylab import (
    DB_SECRET,
    FLAVORS,
    SLINKY_RELEASE,
    cluster_objects,
    create_objects,
    db_secret_objects,
    nodeset_name,
    nodeset_pods,
    slinky_nodes,
    write_jwt_key,
)
from lab.slurm import SlurmLab, SlurmLabSpec
from lab.slurmrest import jwt_lines, slurmrestd_installed, start_slurmrestd
from lab.slurmroots import DEFAULT_RELEASE, LAB_SLURM_ENV, RootError, install_for, release
from models.topology import RACK_LABEL
from models.xid import xid_catalog
from starters.server import dev_server_argv

REPO_ROOT = Path(__file__).resolve().parents[1]
# The lab's worker polls Slurm this often while it waits for a job (GPUFLEET_POLL_SECONDS).
LAB_POLL_SECONDS = "0.25"
# The lab's worker's reaper looks for what stopped incidents still hold this often
# (GPUFLEET_REAPER_SECONDS, 300 s by default): an incident terminated in the UI is cleaned up at once.
LAB_REAPER_SECONDS = "5"
# Where the lab's worker serves its metrics, when the port is free (else a free one, in lab.json).
LAB_METRICS_PORT = 9464
Say = Callable[[str], None]


@dataclass
class LabConfig:
    training: list[str] = field(default_factory=lambda: ["gpu1", "gpu2", "gpu3", "gpu4"])
    spares: list[str] = field(default_factory=lambda: ["spare1", "spare2"])
    # The free pool new clusters are made from (`gpufleet cluster create`): Kubernetes nodes only,
    # until a creation gives them Slurm daemons of their own.
    free: list[str] = field(default_factory=lambda: ["free1", "free2", "free3", "free4"])
    # The shared pool's inference side: Kubernetes nodes serving the vLLM Deployment, and Slurm
    # nodes outside every partition, so that a rebalance can move them to training and back.
    inference: list[str] = field(default_factory=lambda: ["inf1", "inf2"])
    partition: str = "train"
    cluster: str = "lab"
    temporal_port: int = 7233
    ui_port: int = 8233
    grace_seconds: float = 120.0
    requeue_delay_seconds: int = 5
    # The Slurm release the lab runs (lab/slurmroots.py): the host's 22.05, or 24.11 or 26.05 in
    # a cached Debian root; $GPUFLEET_LAB_SLURM sets the default (any test's lab on another release).
    slurm: str = field(default_factory=lambda: os.environ.get(LAB_SLURM_ENV) or DEFAULT_RELEASE)
    # default: static Slurm nodes named after the Kubernetes nodes; slinky: a Slinky cluster's
    # objects in the API, its NodeSet's pods as dynamic Slurm 26.05 nodes, slurmrestd (lab/slinkylab.py).
    flavor: str = "default"
    # Slurm's Prolog, Epilog and HealthCheckProgram run gpufleet health-check (docs/health-check.md).
    health_checks: bool = True
    # Failure domains (docs/configuration.md#failure-domains): each Kubernetes node of a rack carries
    # gpufleet.io/rack=RACK (a node in no rack, none); the default flavor's Slurm has a leaf switch
    # leaf-RACK per rack under a top switch (topology/tree). Two racks of three: the chaos storm's
    # four nodes over two racks trips the fleet breaker, never a domain incident (min_nodes 3).
    # Domain incidents (policy domains.enabled): off by default here, since the lab's tests and
    # chaos strike the same rack's few nodes again and again on purpose, where three failures in
    # ten minutes would make a domain incident; the rack storm (lab/chaos/domains.py) turns them on.
    domain_incidents: bool = False
    racks: dict[str, list[str]] = field(
        default_factory=lambda: {"a": ["gpu1", "gpu2", "spare1"], "b": ["gpu3", "gpu4", "spare2"]}
    )


def _runs(services: dict[str, Any], name: str) -> bool:
    """Whether the lab's service ``name`` was started and still runs."""
    return name in services and alive(services[name]["pid"])


class LabError(RuntimeError):
    """The lab cannot do what was asked; the message says why and what to do."""


class FleetLab:
    def __init__(self, home: Path, config: LabConfig | None = None) -> None:
        self.home = home.resolve()
        self.state_file = self.home / "lab.json"
        saved = self._load()
        self.config = (
            LabConfig(**saved["config"]) if saved.get("config") and config is None else (config or LabConfig())
        )
        if self.config.flavor not in FLAVORS:
            raise LabError(f"no lab flavor {self.config.flavor!r}; choose one of {', '.join(FLAVORS)}")
        if self.slinky and self.config.slurm != SLINKY_RELEASE:
            raise LabError(f"the slinky flavor runs Slurm {SLINKY_RELEASE}, not {self.config.slurm}")
        self.slurm: SlurmLab
        if self.slinky:
            self.slurm = DynamicSlurmLab(
                self.home / "slurm",
                [self.partition],
                release=SLINKY_RELEASE,
                binds=[self.home],
                extra_lines=jwt_lines(self.jwt_key_file),
                health_checks=self.config.health_checks,  # Prolog, Epilog, HealthCheckProgram
            )
            return
        self.slurm = SlurmLab(
            self.home / "slurm",
            SlurmLabSpec(
                nodes=list(self.config.training),
                # Spares and inference nodes alike: Slurm nodes in no partition.
                spares=[*self.config.spares, *self.config.inference],
                partition=self.config.partition,
                requeue_delay_seconds=self.config.requeue_delay_seconds,
                racks={rack: list(nodes) for rack, nodes in self.config.racks.items()},
            ),
            release=self.config.slurm,
            # The jobs' checkpoints and logs, and the nodes' GPU faults, live under the home.
            binds=[self.home],
            health_checks=self.config.health_checks,  # Prolog, Epilog, HealthCheckProgram
        )

    @property
    def slinky(self) -> bool:
        return self.config.flavor == "slinky"

    @property
    def partition(self) -> str:
        """The training partition: the config's, or on the slinky flavor its NodeSet's (named after it)."""
        return nodeset_name(self.config.cluster, self.config.partition) if self.slinky else self.config.partition

    @property
    def jwt_key_file(self) -> Path:
        """The slinky flavor's JWT key, which slurmctld, slurmrestd and the worker share."""
        return self.home / "slurm" / "jwt.key"

    # -- state ------------------------------------------------------------------------------------

    def _load(self) -> dict[str, Any]:
        if not self.state_file.exists():
            return {}
        data: dict[str, Any] = json.loads(self.state_file.read_text())
        return data

    def _save(self, state: dict[str, Any]) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(state, indent=2))

    def state(self) -> dict[str, Any]:
        return self._load()

    def running(self) -> bool:
        state = self._load()
        # After lab down the state keeps only the config: nothing runs.
        return bool(state.get("services")) and all(alive(pid) for pid in self.recorded_pids())

    def slurm_release(self) -> dict[str, Any]:
        """The Slurm the lab runs: its release, full version and where it runs from."""
        state = self._load()
        found: dict[str, Any] = {"release": self.config.slurm, **state.get("slurm", {})}
        return found

    def recorded_pids(self) -> list[int]:
        state = self._load()
        pids = [svc["pid"] for svc in state.get("services", {}).values() if "pid" in svc]
        pids += list(self.slurm.pids().values())
        return pids

    def env(self) -> dict[str, str]:
        """Environment for the gpufleet CLI, the worker and sbatch against this lab."""
        state = self._load()
        services = state.get("services", {})
        env = {
            **os.environ,
            "GPUFLEET_HOME": str(self.home),
            "GPUFLEET_CLUSTER": self.config.cluster,
            "GPUFLEET_PARTITION": self.partition,
            "GPUFLEET_SLURM_CONF": str(self.slurm.conf),
            # One policy file for the detectors and the worker: Xid overrides and the worker's grace.
            "GPUFLEET_POLICY_FILE": str(self.policy_file),
            # A local controller answers in milliseconds; give up on a silent one sooner.
            "GPUFLEET_SLURM_TIMEOUT_SECONDS": "10",
            "GPUFLEET_KUBE_TIMEOUT_SECONDS": "5",
            "GPUFLEET_POLL_SECONDS": LAB_POLL_SECONDS,
            # The lab's worker creates clusters from the free pool, as local Slurm daemons (and, on
            # the slinky flavor, as Slinky clusters the operator stand-in brings up).
            "GPUFLEET_CLUSTER_BACKENDS": "lab,slinky" if self.slinky else "lab",
            "SLURM_CONF": str(self.slurm.conf),
            "PYTHONPATH": str(REPO_ROOT),
            # The nodes' GPU faults: what the lab's jobs read at every step and its repairs clear.
            FAULTS_ENV: str(self.faults.folder),
            # The clusters the worker creates run the same Slurm release.
            LAB_SLURM_ENV: self.config.slurm,
        }
        if self.slinky:  # a created cluster's slurmrestd: where its Service says (lab/slinkyclusters.py)
            env["GPUFLEET_SLINKY_RESTAPI_URL"] = "service"
        bin_dir = self.slurm.bin_dir if state.get("services") else None
        if bin_dir is not None:  # a newer Slurm: its commands, through wrappers, for sbatch and the worker
            env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
            env["GPUFLEET_SLURM_BIN_DIR"] = str(bin_dir)
        if "temporal" in services:
            env["TEMPORAL_ADDRESS"] = services["temporal"]["address"]
        if "kubeapi" in services:
            env["GPUFLEET_KUBECONFIG"] = services["kubeapi"]["kubeconfig"]
        if "webhook" in services:
            env["GPUFLEET_WEBHOOK_URL"] = services["webhook"]["url"]
        if "prometheus" in services:
            env["GPUFLEET_PROMETHEUS_URL"] = services["prometheus"]["url"]
        if "api" in services:  # every `gpufleet` command through the API, as the operator unless told
            env["GPUFLEET_API_ADDRESS"] = services["api"]["address"]
            env["GPUFLEET_API_CA_FILE"] = services["api"]["ca"]
            env["GPUFLEET_API_KUBECONFIG"] = str(self.user_kubeconfig(DEFAULT_USER))
        return env

    # -- up ---------------------------------------------------------------------------------------

    def up(self, say: Say = lambda _: None, *, keep_slurm: bool = False) -> dict[str, Any]:
        """Start what is not running yet; a second call reuses what runs. ``keep_slurm`` (a
        service brought back after a fault on purpose): a Slurm with a daemon down is said, never
        stopped and started afresh, which would cancel its jobs."""
        state = self._load()
        services: dict[str, Any] = state.get("services", {})
        saved = state.get("config", {}).get("slurm", DEFAULT_RELEASE)
        if services and self.running() and saved != self.config.slurm:
            raise LabError(
                f"the lab runs Slurm {saved}; stop it first (gpufleet lab down) to run Slurm {self.config.slurm}"
            )
        flavor = state.get("config", {}).get("flavor", "default")
        if services and self.running() and flavor != self.config.flavor:
            raise LabError(
                f"the lab runs the {flavor} flavor; stop it first (gpufleet lab down) "
                f"to run the {self.config.flavor} one"
            )
        state["config"] = asdict(self.config)
        self.home.mkdir(parents=True, exist_ok=True)
        self._write_policy()
        try:
            release(self.config.slurm)
            # The archive is asked (once a day) only when no Slurm of this lab runs on the root.
            slurm_runs = any(alive(pid) for pid in self.slurm.pids().values())
            install = install_for(self.config.slurm, say=say, check=not slurm_runs)
        except RootError as exc:
            raise LabError(str(exc)) from None
        where = "the host's packages" if install.on_host else f"a Debian {install.release.suite} root, {install.root}"
        say(f"Slurm {install.version} ({where})")
        state["slurm"] = {"version": install.version, "root": str(install.root) if install.root else None}
        logs = self.home / "logs"

        def running(name: str) -> bool:
            return name in services and alive(services[name]["pid"])

        if running("temporal"):
            say(f"Temporal already running at {services['temporal']['address']}")
        else:
            port = self._port(self.config.temporal_port, "Temporal", say)
            ui_port = self._port(self.config.ui_port, "Temporal UI", say)
            argv = dev_server_argv(db_file=self.home / "temporal.db", port=port, ui_port=ui_port)
            pid = spawn(argv, log=logs / "temporal.log")
            services["temporal"] = {"pid": pid, "address": f"127.0.0.1:{port}", "ui": f"http://localhost:{ui_port}"}
            say(f"starting Temporal dev server on 127.0.0.1:{port} (UI http://localhost:{ui_port})")
            self._save({**state, "services": services})
            wait_for(lambda: port_in_use(port), timeout=60, what="the Temporal dev server")

        down = sorted(name for name, pid in self.slurm.pids().items() if not alive(pid))
        if self.slurm.pids() and not down:
            say("Slurm already running")
        elif self.slurm.pids() and keep_slurm:
            say(f"Slurm kept as it is, though down: {', '.join(down)}")
        else:
            if down:
                say(f"Slurm's {', '.join(down)} down: starting it afresh")
            if self.slinky:
                say(f"starting Slurm: NodeSet partition {self.partition}, its nodes the NodeSet's pods (slurmd -Z)")
            else:
                say(
                    f"starting Slurm: partition {self.config.partition} = {', '.join(self.config.training)}; "
                    f"spares {', '.join(self.config.spares)}"
                )
            if self.slurm.pids():
                self.slurm.stop()  # a partial cluster from an earlier run
            self.faults.clear_all()  # fresh nodes: no GPU fault stands
            if self.slinky:
                missing = slurmrestd_installed(install)
                if missing:
                    raise LabError(missing)
                if not self.jwt_key_file.exists():
                    write_jwt_key(self.jwt_key_file)
                # slurmrestd reads a copy of slurm.conf, and the worker its URL: both start again.
                for name in ("worker", "slurmrestd"):
                    if name in services:
                        gone = services.pop(name)
                        stop([gone["pid"]])
                        if "folder" in gone:
                            shutil.rmtree(gone["folder"], ignore_errors=True)
            self.slurm.start()

        if running("kubeapi"):
            say(f"Kubernetes API already running at {services['kubeapi']['url']}")
        else:
            seed = self.home / "kube-seed.json"
            seed.write_text(json.dumps(self._kube_seed()))
            kubeconfig = self.home / "kubeconfig"
            # Its signing key kept in the lab's home: the detectors' tokens outlive its restart.
            args = ["--seed", str(seed), "--kubeconfig", str(kubeconfig), "--signing-key", str(self.kube_signing_key)]
            # The lab's users, by their static tokens (kept in the home: they outlive its restart too).
            user_tokens(self.users_token_file)
            args += ["--token-file", str(self.users_token_file)]
            # Back on the port it had: the intake and the gpufleet API read its address once, at their start.
            before = str(services.get("kubeapi", {}).get("url", ""))
            port = self._port(int(before.rsplit(":", 1)[1]), "the emulated Kubernetes API", say) if before else 0
            args += ["--port", str(port)]
            pid, url = self._start_module("kubeapi", args, what="the emulated Kubernetes API")
            services["kubeapi"] = {"pid": pid, "url": url, "kubeconfig": str(kubeconfig)}
            say(f"emulated Kubernetes API on {services['kubeapi']['url']} (kubeconfig {kubeconfig})")
            self._save({**state, "services": services})
            # Its RBAC objects live in its memory: deploy/'s roles and the users' bindings, at each start.
            apply_roles(kubeconfig)
            said = ", ".join(f"{user.name} ({user.group}: {user.role})" for user in USERS)
            say(f"users of the gpufleet API: {said}")
            if before and url != before:  # on another port: what holds the old address starts again below
                for name in ("intake", "api"):
                    if running(name):
                        stop([services[name]["pid"]])
        write_kubeconfigs(self.users_folder, services["kubeapi"]["url"], user_tokens(self.users_token_file))

        if running("webhook"):
            say(f"webhook receiver already running at {services['webhook']['url']}")
        else:
            pid, url = self._start_module(
                "webhook", ["--record", str(self.notifications_file)], what="the webhook receiver"
            )
            # A secret in the path, as a Slack webhook's: gpufleet must never write it anywhere.
            services["webhook"] = {"pid": pid, "url": f"{url}/hooks/{secrets.token_urlsafe(16)}"}
            say(f"webhook receiver on {url} (records {self.notifications_file})")
            self._save({**state, "services": services})

        if running("jobrunner"):
            say("repair Job runner already running")
        else:
            pid, _ = self._start_module(
                "jobrunner", ["--api", services["kubeapi"]["url"]], what="the lab's repair Job runner"
            )
            services["jobrunner"] = {"pid": pid}
            say("repair Jobs (GPU reset, reboot) run as local processes standing for their node")
            self._save({**state, "services": services})

        self._start_shared_pool(state, services, say)
        if self.slinky:
            self._start_slinky(state, services, say, settle=not keep_slurm)

        self._start_intake(state, services, say)
        self._start_api(state, services, say)

        started: list[Path] = []
        for node in self.all_nodes:
            name = f"detector-{node}"
            if running(name):
                continue
            self.kmsg_file(node).parent.mkdir(parents=True, exist_ok=True)
            self.kmsg_file(node).touch()
            self.detector_ready_file(node).unlink(missing_ok=True)
            argv = self.detector_argv(node)
            services[name] = {"pid": spawn(argv, log=logs / f"{name}.log", env=self.detector_env(node), cwd=REPO_ROOT)}
            self._save({**state, "services": services})
            started.append(self.detector_ready_file(node))
        wait_for(lambda: all(ready.exists() for ready in started), timeout=60, what="the detectors")
        say(f"a detector per node, each following its kernel log in {self.home / 'kmsg'} and posting to the intake")

        if running("worker"):
            say("worker already running")
        else:
            metrics_port = self._port(LAB_METRICS_PORT, "the worker's metrics", say)
            env = {
                **self.env(),
                "GPUFLEET_REAPER_SECONDS": LAB_REAPER_SECONDS,
                "GPUFLEET_METRICS_PORT": str(metrics_port),
                "GPUFLEET_METRICS_BIND": "127.0.0.1",
                **self._worker_slurm_env(services),
            }
            pid = spawn(
                [sys.executable, "-m", "workers.entry", "worker"], log=logs / "worker.log", env=env, cwd=REPO_ROOT
            )
            services["worker"] = {"pid": pid, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
            self._save({**state, "services": services})
            time.sleep(1.0)
            if not alive(pid):
                raise LabError(f"the worker exited at once; see {logs / 'worker.log'}")
            backend = f" (Slurm through slurmrestd {services['slurmrestd']['url']})" if self.slinky else ""
            say(f"worker running on task queue gpufleet-{self.config.cluster}{backend}")
        state = {**state, "services": services}
        self._save(state)
        return state

    def _worker_slurm_env(self, services: dict[str, Any]) -> dict[str, str]:
        """The remediation mode the flavor is (never guessed at the worker's start: a worker
        started while the lab's Kubernetes is away on purpose must still start); on the slinky
        flavor the worker reaches Slurm through slurmrestd (API v0.0.45), with the cluster's JWT key."""
        if not self.slinky:
            return {"GPUFLEET_REMEDIATION_MODE": "slurm"}
        return {
            "GPUFLEET_REMEDIATION_MODE": "slinky",
            "GPUFLEET_SLURM_BACKEND": "rest",
            "GPUFLEET_SLURMRESTD_URL": services["slurmrestd"]["url"],
            "GPUFLEET_SLURMRESTD_VERSION": "v0.0.45",
            "GPUFLEET_SLURMRESTD_USER": getpass.getuser(),
            "GPUFLEET_SLURMRESTD_JWT_KEY_FILE": str(self.jwt_key_file),
        }

    def _start_slinky(self, state: dict[str, Any], services: dict[str, Any], say: Say, *, settle: bool = True) -> None:
        """The Slinky cluster's objects, the operator stand-in running its NodeSet's pods (each a
        slurmd -Z named after it), and slurmrestd; returns once every pod runs and its Slurm node is
        idle. Without ``settle`` (a service brought back mid-incident, whose nodes are drained or
        busy on purpose) it does not wait for that."""
        api = services["kubeapi"]["url"]
        replicas = len(self.config.training)
        objects = cluster_objects(self.config.cluster, self.config.partition, replicas, self.jwt_key_file.read_bytes())
        create_objects(api, objects)
        names = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objects if o["kind"] != "Namespace")
        say(f"Slinky cluster {self.config.cluster} in namespace slurm-{self.config.cluster}: {names}")
        create_objects(api, db_secret_objects())  # what a spec with accounting names (lab/slinkylab.py)
        say("database password Secret for clusters with accounting: {}/{} (key {})".format(*DB_SECRET))
        if not _runs(services, "operator"):
            pid, _ = self._start_module(
                "operator",
                [
                    "--api",
                    api,
                    "--slurm-root",
                    str(self.slurm.root),
                    "--bind",
                    str(self.home),
                    "--faults",
                    str(self.faults.folder),
                    # Clusters `gpufleet cluster create --backend slinky` makes, beside the lab's own.
                    "--clusters",
                    str(self.home / "clusters"),
                    "--own",
                    f"slurm-{self.config.cluster}/{self.config.cluster}",
                ],
                what="the lab's NodeSet controller",
            )
            services["operator"] = {"pid": pid}
            self._save({**state, "services": services})

        def ready() -> bool:
            pods = nodeset_pods(api, self.config.cluster, self.partition)
            running = [p for p in pods.values() if (p.get("status") or {}).get("phase") == "Running"]
            if len(running) < replicas:
                return False
            states = {n.name: n.state for n in self.slurm.client().nodes()}
            return all(states.get(name) == "idle" for name in pods)

        if settle:
            what = f"NodeSet {self.partition}'s pods to run and their Slurm nodes to be idle"
            wait_for(ready, timeout=120, what=what)
            pods = nodeset_pods(api, self.config.cluster, self.partition)
            placed = ", ".join(f"{name} on {pod['spec']['nodeName']}" for name, pod in sorted(pods.items()))
            say(f"NodeSet {self.partition}: {replicas} pods, each a slurmd -Z: {placed}")
        if not _runs(services, "slurmrestd"):
            restd = start_slurmrestd(self.slurm)
            services["slurmrestd"] = {"pid": restd.pid, "url": restd.url, "folder": str(restd.folder)}
            self._save({**state, "services": services})
            secret = f"slurm-{self.config.cluster}/{self.config.cluster}-jwt-key"
            say(f"slurmrestd on {restd.url} (its JWT key in Secret {secret})")

    def _start_shared_pool(self, state: dict[str, Any], services: dict[str, Any], say: Say) -> None:
        """What a shared training/inference pool needs around the API: the ReplicaSet controller
        and scheduler, the inference load (vLLM's metrics) and a Prometheus scraping it."""
        if not _runs(services, "scheduler"):
            pid, _ = self._start_module(
                "scheduler", ["--api", services["kubeapi"]["url"]], what="the lab's ReplicaSet controller"
            )
            services["scheduler"] = {"pid": pid}
            self._save({**state, "services": services})
        if not _runs(services, "loadgen"):
            pid, address = self._start_module(
                "loadgen", ["--load-file", str(self.load_file)], what="the lab's inference load"
            )
            services["loadgen"] = {"pid": pid, "address": address}
            self._save({**state, "services": services})
        if _runs(services, "prometheus"):
            say(f"Prometheus already running at {services['prometheus']['url']}")
        elif prometheus_installed():
            say(f"no Prometheus: {prometheus_installed()}; pool rebalancing works from `gpufleet pool set-demand`")
        else:
            server = start_prometheus(self.home / "prometheus", [services["loadgen"]["address"]])
            services["prometheus"] = {"pid": server.pid, "url": server.url}
            self._save({**state, "services": services})
            say(f"Prometheus on {server.url}, scraping the inference load (`gpufleet lab demand N` sets it)")

    @property
    def load_file(self) -> Path:
        """The inference load the lab's load generator reports (``gpufleet lab demand``)."""
        return self.home / "demand.json"

    def _start_module(self, name: str, args: list[str], *, what: str) -> tuple[int, str]:
        """Start ``python -m lab.NAME ARGS --ready-file F``; returns its PID and the URL it wrote to F."""
        ready = self.home / f"{name}.url"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", f"lab.{name}", *args, "--ready-file", str(ready)]
        pid = spawn(argv, log=self.home / "logs" / f"{name}.log", env=self.env(), cwd=REPO_ROOT)
        wait_for(ready.exists, timeout=30, what=what)
        return pid, ready.read_text()

    @property
    def all_nodes(self) -> list[str]:
        return [*self.config.training, *self.config.spares]

    @property
    def policy_file(self) -> Path:
        return self.home / "policy.yaml"

    def _write_policy(self) -> None:
        """The lab's policy file, written once: edit it, and new incidents (and restarted detectors) follow."""
        if self.policy_file.exists():
            return
        python = json.dumps(sys.executable)
        self.policy_file.write_text(
            "# gpufleet policy for this lab: read by every detector (what to send) and by the worker\n"
            "# (what to do). Overrides of the built-in defaults only; e.g.\n"
            "#   xids: {13: REPLACE_NODE}\n"
            "#   buckets: {RESET_GPU: REBOOT_NODE}\n"
            "remediation:\n"
            f"  grace_seconds: {self.config.grace_seconds:g}\n"
            "  owner_drained: ask   # a node someone else drained waits for gpufleet approve|reject\n"
            "# The fleet guard: the defaults (max_in_flight: 2, max_share: 0.5, ...): docs/fleet-guard.md.\n"
            "# Failure domains (docs/domains.md): the lab's racks a and b hold three nodes each, its\n"
            "# Slurm a leaf switch per rack. Domain incidents are off unless the lab was asked for them\n"
            "# (its tests strike one rack's nodes again and again); with them on, the defaults apply\n"
            "# (min_nodes: 3, half a rack, within 10 minutes).\n"
            f"domains:\n  enabled: {'true' if self.config.domain_incidents else 'false'}\n"
            "# Repairs in place: in the lab a repair Job's command runs as a local process standing\n"
            "# for its node (lab/jobrunner.py); lab/repair.py says what a real node would do.\n"
            "repair:\n"
            f"  reset_command: [{python}, -m, lab.repair, reset, --gpu, '{{gpu}}', --node, '{{node}}']\n"
            f"  reboot_command: [{python}, -m, lab.repair, reboot, --node, '{{node}}', --boot-id, '{{boot_id}}']\n"
            "  # Does the GPU answer afterwards? (nvidia-smi on a real node)\n"
            f"  check_command: [{python}, -m, lab.repair, check, --gpu, '{{gpu}}', --node, '{{node}}']\n"
            f"  node_check_command: [{python}, -m, lab.repair, check, --node, '{{node}}']\n"
            "  reboot_grace_seconds: 10\n"
            "  settle_seconds: 5\n" + validation_policy(python),
            encoding="utf-8",
        )

    def detector_env(self, node: str) -> dict[str, str]:
        """The node's detector's environment: the lab's, and the intake with the node's own token."""
        env = self.env()
        intake = self._load().get("services", {}).get("intake")
        if intake is not None:
            env["GPUFLEET_INTAKE_URL"] = intake["url"]
            env["GPUFLEET_INTAKE_CA_FILE"] = intake["ca"]
            env["GPUFLEET_INTAKE_TOKEN_FILE"] = str(self.token_folder / node)
        return env

    @property
    def kube_signing_key(self) -> Path:
        """The key the emulated API signs ServiceAccount tokens with, made at its first start."""
        return self.home / "kube-signing.key"

    @property
    def token_folder(self) -> Path:
        """Each node's detector token (the kubelet's projected token, in a real cluster)."""
        return self.home / "tokens"

    def _start_intake(self, state: dict[str, Any], services: dict[str, Any], say: Say) -> None:
        """The intake between the detectors and Temporal, and each node's token for it (renewed)."""
        write_tokens(Path(services["kubeapi"]["kubeconfig"]), self.token_folder, self.all_nodes)
        if "intake" in services and alive(services["intake"]["pid"]):
            say(f"intake already running at {services['intake']['url']}")
            return
        certs = certificate(self.home)
        # Back on the port it had (the detectors know that one), unless something else took it.
        before = services.get("intake", {})
        port = self._port(int(before.get("port", 0)), "the intake", say)
        metrics_port = self._port(int(before.get("metrics_port", 0)), "the intake's metrics", say)
        url = f"https://127.0.0.1:{port}"
        env = {
            **self.env(),
            "GPUFLEET_INTAKE_PORT": str(port),
            "GPUFLEET_INTAKE_BIND": "127.0.0.1",
            "GPUFLEET_INTAKE_METRICS_PORT": str(metrics_port),
            "GPUFLEET_INTAKE_TLS_CERT": str(certs.cert),
            "GPUFLEET_INTAKE_TLS_KEY": str(certs.key),
            "GPUFLEET_INTAKE_SERVICE_ACCOUNTS": REPORTERS,
            # The lab's drills fire bursts of Xids at a node: room for them, a limit all the same.
            "GPUFLEET_INTAKE_RATE": "600",
            "GPUFLEET_INTAKE_BURST": "200",
        }
        log = self.home / "logs" / "intake.log"
        pid = spawn([sys.executable, "-m", "workers.entry", "intake"], log=log, env=env, cwd=REPO_ROOT)
        services["intake"] = {
            "pid": pid,
            "port": port,
            "metrics_port": metrics_port,
            "url": url,
            "ca": str(certs.ca),
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
        }
        self._save({**state, "services": services})

        # Done when it answers, or as soon as it has exited (wait_for takes a raise for "not yet").
        wait_for(lambda: not alive(pid) or healthy(url, certs.ca), timeout=60, what=f"the intake (its log: {log})")
        if not alive(pid):
            raise LabError(f"the intake exited at once; see {log}")
        say(f"intake on {url} (CA {certs.ca}): the detectors post there, each with its pod's token")

    @property
    def users_folder(self) -> Path:
        """The lab's users of the gpufleet API: their tokens and a kubeconfig each (lab/access.py)."""
        return self.home / "users"

    @property
    def users_token_file(self) -> Path:
        """The users' static tokens, the emulated API's ``--token-file``."""
        return self.users_folder / "tokens.csv"

    def user_kubeconfig(self, name: str) -> Path:
        """The kubeconfig of lab user ``name`` (``GPUFLEET_API_KUBECONFIG`` to act as them)."""
        return self.users_folder / f"{name}.kubeconfig"

    async def api_client(self, user: str = DEFAULT_USER) -> Client:
        """The lab's gpufleet API as lab user ``user`` (the operator unless told): where what the lab
        does in a person's name goes (a breaker reset, an approval), so that the history names them.

        Raises:
            LabError: the lab runs no gpufleet API.
            starters.temporal.TemporalUnreachable: the API does not answer (ApiRefused: it refused the user).
        """
        api = self._load().get("services", {}).get("api")
        if api is None:
            raise LabError("the lab runs no gpufleet API: start it with `gpufleet lab up`")
        return await connect_as(api["address"], Path(api["ca"]), self.user_kubeconfig(user))

    def _start_api(self, state: dict[str, Any], services: dict[str, Any], say: Say) -> None:
        """gpufleet's API between the `gpufleet` commands and Temporal, answering once the
        operator's token gets through it (its TokenReview answered, Temporal reached)."""
        if "api" in services and alive(services["api"]["pid"]):
            say(f"gpufleet API already running at {services['api']['address']}")
            return
        certs = api_certificate(self.home)
        # Back on the port it had (a shell told GPUFLEET_API_ADDRESS keeps it), unless something else took it.
        before = services.get("api", {})
        port = self._port(int(before.get("port", 0)), "the gpufleet API", say)
        metrics_port = self._port(int(before.get("metrics_port", 0)), "the gpufleet API's metrics", say)
        address = f"127.0.0.1:{port}"
        # Its own settings only, never a client's (it connects to Temporal directly, not to an API).
        env = {name: value for name, value in self.env().items() if not name.startswith("GPUFLEET_API_")}
        env |= {
            "GPUFLEET_API_PORT": str(port),
            "GPUFLEET_API_BIND": "127.0.0.1",
            "GPUFLEET_API_METRICS_PORT": str(metrics_port),
            "GPUFLEET_API_TLS_CERT": str(certs.cert),
            "GPUFLEET_API_TLS_KEY": str(certs.key),
        }
        log = self.home / "logs" / "api.log"
        pid = spawn([sys.executable, "-m", "workers.entry", "api"], log=log, env=env, cwd=REPO_ROOT)
        services["api"] = {
            "pid": pid,
            "port": port,
            "metrics_port": metrics_port,
            "address": address,
            "ca": str(certs.ca),
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "users": {user.name: str(self.user_kubeconfig(user.name)) for user in USERS},
        }
        self._save({**state, "services": services})
        token = user_tokens(self.users_token_file)[DEFAULT_USER]
        deadline = time.monotonic() + 60
        while True:
            if not alive(pid):
                raise LabError(f"the gpufleet API exited at once; see {log}")
            try:
                api_answers(address, certs.ca, token)
                break
            except Exception as exc:  # not listening yet, or what it answered: said if it lasts
                if time.monotonic() > deadline:
                    said = f"the gpufleet API did not let {DEFAULT_USER} in within 60 s ({exc}); see {log}"
                    raise LabError(said) from None
            time.sleep(0.2)
        say(
            f"gpufleet API on {address} (CA {certs.ca}): every `gpufleet` command of the lab goes through it, "
            f"as {DEFAULT_USER} unless GPUFLEET_API_KUBECONFIG names another of {self.users_folder}"
        )

    def detector_argv(self, node: str) -> list[str]:
        """The node's detector, following its kernel log, its cursor in ``$GPUFLEET_HOME/detector/NODE``."""
        return [
            sys.executable,
            "-m",
            "workers.entry",
            "detect",
            "--kmsg",
            str(self.kmsg_file(node)),
            "--node",
            node,
            "--cluster",
            self.config.cluster,
            "--fold-seconds",
            "2",
            "--ready-file",
            str(self.detector_ready_file(node)),
            # Where gpufleet health-check in the node's Slurm hooks drops its events.
            "--inbox",
            str(self.slurm.hook_inbox(node)),
        ]

    def detector_ready_file(self, node: str) -> Path:
        """Written by the node's detector once it follows its kernel log."""
        return self.home / "kmsg" / f"{node}.ready"

    def kmsg_file(self, node: str) -> Path:
        """The node's kernel log, which its detector follows."""
        return self.home / "kmsg" / f"{node}.log"

    @property
    def faults(self) -> GpuFaults:
        """The nodes' GPU faults (lab/faults.py)."""
        return GpuFaults.of_home(self.home)

    def inject_xid(self, node: str, xid: int, effect: Effect | None = None) -> str:
        """Fail the node's GPU as ``xid`` does: its fault (the Xid's default effect on the job's
        processes there, unless ``effect`` says), then a driver-format Xid line appended to the
        node's kernel log; returns the line."""
        if node not in self.all_nodes:
            raise LabError(f"no lab node {node!r}; nodes: {', '.join(self.all_nodes)}")
        self.faults.inject(node, xid, effect)
        entry = xid_catalog().get(xid)
        text = "GPU has fallen off the bus." if xid == 79 else (entry.name if entry else "Unknown Error")
        line = f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid='<unknown>', name=<unknown>, {text}"
        seconds = time.monotonic()
        with open(self.kmsg_file(node), "a", encoding="utf-8") as out:
            out.write(f"[{seconds:12.6f}] {line}\n")
        return line

    @property
    def notifications_file(self) -> Path:
        return self.home / "notifications.jsonl"

    def notifications(self) -> list[dict[str, Any]]:
        if not self.notifications_file.exists():
            return []
        return [json.loads(line) for line in self.notifications_file.read_text().splitlines() if line.strip()]

    def _port(self, wanted: int, what: str, say: Say) -> int:
        if wanted and not port_in_use(wanted):
            return wanted
        port = free_port()
        if wanted:
            say(f"port {wanted} for {what} is in use; using {port} instead")
        return port

    def _kube_seed(self) -> dict[str, Any]:
        if self.slinky:  # training nodes eligible for the NodeSet, spares not
            nodes = slinky_nodes(self.config.cluster, self.config.partition, self.config.training, self.config.spares)
        else:
            nodes = [training_node(n) for n in self.config.training]
            nodes += [node_object(n, pool="spare") for n in self.config.spares]
        nodes += [node_object(n, pool="inference") for n in self.config.inference]
        nodes += [node_object(n, pool="free") for n in self.config.free]
        rack_of = {node: rack for rack, members in self.config.racks.items() for node in members}
        for node in nodes:
            meta = node["metadata"]
            if meta["name"] in rack_of:
                meta.setdefault("labels", {})[RACK_LABEL] = rack_of[meta["name"]]
        every = [*self.config.training, *self.config.spares, *self.config.inference, *self.config.free]
        # The training nodes' own PodDisruptionBudget-protected workload (what remediation's drain
        # evicts), and the inference servers on the inference nodes.
        workloads = lab_workloads(
            self.config.training, every, name="checkpoint-sync", namespace="training", image="busybox"
        )
        merged = merge_seeds(workloads, inference_workloads(len(self.config.inference)), detector_seed(self.all_nodes))
        return {"nodes": nodes, **merged}

    # -- down -------------------------------------------------------------------------------------

    def down(self, say: Say = lambda _: None) -> list[int]:
        """Stop everything ``up`` started; returns the PIDs that were stopped."""
        state = self._load()
        services = state.get("services", {})
        pids = self.recorded_pids()
        detectors = [svc["pid"] for name, svc in services.items() if name.startswith("detector-")]
        if detectors:
            say("stopping the detectors")
            stop(detectors)
        for name in (
            "api",
            "intake",
            "worker",
            "slurmrestd",
            "operator",
            "prometheus",
            "loadgen",
            "scheduler",
            "jobrunner",
            "webhook",
            "kubeapi",
        ):
            if name in services:
                say(f"stopping {name}")
                stop([services[name]["pid"]])
        if "slurmrestd" in services:
            shutil.rmtree(services["slurmrestd"]["folder"], ignore_errors=True)
        for root in stop_all(self.home):
            say(f"stopped cluster {root.name} (its Slurm daemons and worker)")
        say("stopping Slurm")
        self.slurm.stop()
        self.faults.clear_all()
        if "temporal" in services:
            say("stopping Temporal")
            stop([services["temporal"]["pid"]])
        left = [pid for pid in pids if alive(pid)]
        if left:
            raise LabError(f"processes still running after lab down: {left}")
        state.pop("services", None)
        self._save(state)
        return pids


def validation_policy(python: str, *, enabled: bool = False) -> str:
    """The lab policy's ``validation:`` section: its stand-in rungs (lab/validate.py), whose knob
    files in the lab's home make each pass or fail (docs/validation.md#in-the-lab)."""
    placeholders = "--node, '{node}', --gpus, '{gpus}', --level, '{level}'"
    lines = [
        "# Validation before a node goes back (docs/validation.md): the lab's stand-in rungs. Set",
        "# enabled: true to climb them before `gpufleet nodes return` and after each repair in place.",
        "validation:",
        f"  enabled: {'true' if enabled else 'false'}",
        "  nccl_floor_gbps: 100",
        "  nccl_own_passes: 3",
        "  probation_seconds: 3600",
        "  rungs:",
    ]
    for kind in ("quick", "dcgm", "nccl", "site"):
        lines += [
            f"    - name: {kind}",
            f"      kind: {kind}",
            "      image: lab",
            f"      command: [{python}, -m, lab.validate, {kind}, {placeholders}]",
            "      timeout_seconds: 60",
        ]
        if kind == "dcgm":
            lines.append("      skip_exit_code: 127")
    return "\n".join(lines) + "\n"
