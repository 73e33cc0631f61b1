"""The gpufleet worker: every activity and workflow of one cluster, on task queue ``gpufleet-{cluster}``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.common import MetricMeter, WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.cluster import ClusterActivities
from activities.guard import GuardActivities
from activities.kube import KubeActivities
from activities.notify import NotifyActivities
from activities.policy import PolicyActivities
from activities.pool import PoolActivities
from activities.reaper import ReaperActivities
from activities.repair import RepairActivities
from activities.slurm import SlurmActivities
from activities.spares import SpareActivities
from activities.topology import TopologyActivities
from activities.validation import ValidationActivities
from clients.clusters import ClusterBackend
from clients.errors import ClientError
from clients.kube import CONNECTIONS, KubernetesApi
from clients.notify import WebhookNotifier
from clients.onslinky import PARTITION_EDITS, SlinkyDrain, SlinkyPool, SlinkySlurm, detect_slinky, slinky_unsupported
from clients.poolmoves import PoolMover
from clients.prometheus import PrometheusApi
from clients.slinky import SlinkyBackend
from clients.slinkymoves import SlinkyPoolMover
from clients.slurm import SlurmClient
from clients.slurmrest_protocol import WORKER_METHODS, MissingSlurmMethods, require_methods, slurm_client
from clients.spares import SparePool
from models.clusterops import CLUSTER_TASK_QUEUE
from models.constants import guard_task_queue, reaper_workflow_id, task_queue
from models.metrics import (
    CONFIG_CONFIGMAP,
    CONFIG_OK,
    CONFIG_OK_HELP,
    CONFIG_POLICY_FILE,
    CONFIG_REJECTED,
    CONFIG_REJECTED_HELP,
)
from models.plugins import CLUSTER_BACKENDS, PluginNotInstalled, declared, load
from models.policy import PolicyError, RemediationSettings
from models.requests import ReaperInput, WorkerConfig
from models.settings import Settings
from models.slinky import REMEDIATION_CONFIGMAP, cluster_namespace, configmap_remediation
from workers.metrics import report_spares
from workflows.cluster import ClusterCreationWorkflow, ClusterDeletionWorkflow
from workflows.clusterusers import ClusterUsersWorkflow
from workflows.domain import DomainIncidentWorkflow
from workflows.guard import FleetGuardWorkflow
from workflows.nodes import (
    NodeDomainsWorkflow,
    ProbationWorkflow,
    QuarantinedNodesWorkflow,
    ReleaseNodeWorkflow,
    ReturnNodeWorkflow,
)
from workflows.pool import PoolRebalanceWorkflow
from workflows.reaper import ReaperWorkflow
from workflows.remediation import NodeRemediationWorkflow

log = logging.getLogger("gpufleet.worker")

# Activities are short or heartbeat (workflows/retries.py): a graceful stop waits this long
# for the ones in flight, and a killed worker's are retried elsewhere within seconds.
GRACEFUL_SHUTDOWN = timedelta(seconds=10)
# Activities at once, each on its own thread with its own Kubernetes connection.
ACTIVITY_THREADS = CONNECTIONS
# The guard's own worker: one guard per cluster, its answers a batch per activity.
GUARD_ACTIVITY_SLOTS = 8
GUARD_WORKFLOW_TASK_SLOTS = 4
# How often a running worker reads its configuration again besides each incident's start, so that
# a bad edit shows in its log and its metrics (gpufleet_config_ok) without waiting for an incident.
CONFIG_EVERY_SECONDS = 60.0


class LastGoodConfig:
    """The worker's configuration, read again at each incident; a broken edit keeps the last good one.

    An incident must not wait at classify for ever because someone saved a typo in the policy
    file, or a ``grace_seconds: nan`` in the cluster's ConfigMap: it goes on with what the worker
    had. Each source is kept apart: a policy file that breaks keeps the last good policy (with the
    ConfigMap's grace over it still), a ConfigMap that breaks keeps the last grace it gave. The
    log says once what is wrong with a source (and when it is good again), and ``meter`` counts it
    (``gpufleet_config_ok`` and ``gpufleet_config_rejected_total``, by source).
    """

    def __init__(
        self,
        settings: Settings,
        cluster_defaults: Callable[[], dict[str, str] | None] | None = None,
        *,
        meter: MetricMeter | None = None,
    ) -> None:
        self._settings = settings
        self._defaults = cluster_defaults
        self._configmap = f"ConfigMap {cluster_namespace(settings.cluster)}/{REMEDIATION_CONFIGMAP}"
        self._lock = threading.Lock()  # incidents' activities and the minute's check read at once
        self._policy: WorkerConfig = settings.worker_config()  # broken at start: the worker stops
        self._overrides: dict[str, str] = {}  # the ConfigMap's last good keys over the policy file
        self._problems: dict[str, str] = {}  # per source, the problem last logged
        self._unread: str | None = None  # the last failure to read the ConfigMap, logged once
        meter = meter or MetricMeter.noop
        self._ok = meter.create_gauge(CONFIG_OK, CONFIG_OK_HELP)
        self._rejected = meter.create_counter(CONFIG_REJECTED, CONFIG_REJECTED_HELP)
        self._sources = [CONFIG_POLICY_FILE] + ([CONFIG_CONFIGMAP] if cluster_defaults is not None else [])
        for source in self._sources:
            self._rejected.add(0, self._labels(source))
            self._ok.set(1, self._labels(source))

    def _labels(self, source: str) -> dict[str, str]:
        return {"cluster": self._settings.cluster, "source": source}

    def __call__(self) -> WorkerConfig:
        with self._lock:
            try:
                self._policy = self._settings.worker_config()
            except PolicyError as exc:
                self._refuse(CONFIG_POLICY_FILE, f"policy file not reloaded, incidents use the last good one: {exc}")
            else:
                self._accept(CONFIG_POLICY_FILE, "the policy file is good again")
            return self._with_cluster_defaults(self._policy)

    def _refuse(self, source: str, problem: str) -> None:
        if self._problems.get(source) != problem:
            self._problems[source] = problem
            log.error("%s", problem)
            self._rejected.add(1, self._labels(source))
        self._ok.set(0, self._labels(source))

    def _accept(self, source: str, good_again: str) -> None:
        if self._problems.pop(source, None) is not None:
            log.warning("%s", good_again)
        self._ok.set(1, self._labels(source))

    def _with_cluster_defaults(self, config: WorkerConfig) -> WorkerConfig:
        """The cluster's own defaults (its ConfigMap, written by `gpufleet cluster create`) over
        the policy file's; a GPUFLEET_* variable set explicitly still wins. A ConfigMap that cannot
        be read (Kubernetes away) or holds a wrong value leaves the last good one it gave."""
        if self._defaults is None or "grace_seconds" in self._settings.model_fields_set:
            return config
        try:
            data = self._defaults()
        except ClientError as exc:
            # Not a bad edit: Kubernetes did not answer. Logged once; the metric is for edits.
            problem = f"the cluster's {self._configmap} was not read, its last good grace holds: {exc}"
            if self._unread != problem:
                self._unread = problem
                log.error("%s", problem)
            return self._apply(config, self._overrides)
        self._unread = None
        overrides = {key: value for key, value in (data or {}).items() if key == "grace_seconds"}
        try:
            configmap_remediation(data or {}, config.settings, origin=self._configmap)
        except PolicyError as exc:
            kept = self._overrides.get("grace_seconds")
            keeps = (
                f"the last good grace it gave ({kept} s)"
                if kept is not None
                else f"the policy file's grace ({config.settings.grace_seconds:g} s)"
            )
            self._refuse(CONFIG_CONFIGMAP, f"{exc}; refused: incidents keep {keeps}")
            return self._apply(config, self._overrides)
        self._accept(CONFIG_CONFIGMAP, f"the cluster's {self._configmap} is good again")
        self._overrides = overrides
        return self._apply(config, overrides)

    @staticmethod
    def _apply(config: WorkerConfig, overrides: dict[str, str]) -> WorkerConfig:
        if not overrides:
            return config
        remediation = RemediationSettings.model_validate({**config.settings.model_dump(), **overrides})
        return config.model_copy(
            update={"settings": remediation, "policy": config.policy.model_copy(update={"remediation": remediation})}
        )


async def check_config(
    config: LastGoodConfig, *, stop: asyncio.Event, every_seconds: float = CONFIG_EVERY_SECONDS
) -> None:
    """Read the configuration every ``every_seconds`` until ``stop``, so that a bad edit shows in
    the log and the metric within a minute, not only at the next incident."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_seconds)
        if stop.is_set():
            return
        try:
            await asyncio.to_thread(config)
        except Exception as exc:  # a check must never stop the worker: say it and try again
            log.warning("configuration not checked (%s: %s)", type(exc).__name__, exc)


@dataclass(frozen=True)
class Clients:
    """The worker's Kubernetes, Slurm and spare-pool clients, shared by its activities and its
    metrics; on Slinky, the drain of a node hosting NodeSet pods too."""

    kube: KubernetesApi
    slurm: SlurmClient
    pool: SparePool
    slinky: SlinkyDrain | None = None

    @property
    def mode(self) -> str:
        return "slinky" if self.slinky is not None else "slurm"


def slurm_named_by(settings: Settings) -> SlurmClient:
    """The Slurm client the settings name (GPUFLEET_SLURM_BACKEND), unchecked."""
    return slurm_client(
        settings.slurm_backend,
        slurm_conf=settings.slurm_conf,
        bin_dir=settings.slurm_bin_dir,
        timeout_seconds=settings.slurm_timeout_seconds,
        restd_url=settings.slurmrestd_url,
        restd_version=settings.slurmrestd_version,
        restd_user=settings.slurmrestd_user,
        restd_key_file=settings.slurmrestd_jwt_key_file,
        restd_token_file=settings.slurmrestd_token_file,
    )


def slurm_from_settings(settings: Settings) -> SlurmClient:
    """The Slurm client the settings name (GPUFLEET_SLURM_BACKEND), checked to serve every
    method the worker calls: MissingSlurmMethods names each one it lacks, and why."""
    slurm = slurm_named_by(settings)
    on_slinky = slinky_unsupported_view(slurm)
    if settings.remediation_mode == "slinky":  # some are served otherwise there, or never called
        require_methods(on_slinky, WORKER_METHODS - PARTITION_EDITS)
        return slurm
    try:
        require_methods(slurm)
    except MissingSlurmMethods:
        if settings.remediation_mode == "slurm":
            raise
        try:  # auto: enough for Slinky is enough for now; checked again once the cluster says which
            require_methods(on_slinky, WORKER_METHODS - PARTITION_EDITS)
        except MissingSlurmMethods:
            pass
        else:
            return slurm
        raise
    return slurm


class slinky_unsupported_view:
    """What ``slurm`` lacks on Slinky, in the shape ``require_methods`` reads."""

    def __init__(self, slurm: object) -> None:
        self._slurm = slurm

    def unsupported(self) -> dict[str, str]:
        return slinky_unsupported(self._slurm)


def remediation_mode(settings: Settings, kube: KubernetesApi) -> str:
    """``slurm`` or ``slinky``: the setting, or (``auto``) slinky when the cluster's namespace holds NodeSets."""
    if settings.remediation_mode != "auto":
        return settings.remediation_mode
    if not settings.cluster:
        return "slurm"
    return "slinky" if detect_slinky(kube, slinky_namespace(settings)) else "slurm"


def slinky_namespace(settings: Settings) -> str:
    return settings.slinky_namespace or cluster_namespace(settings.cluster)


def slurm_backend_said(settings: Settings, slurm: object) -> str:
    """The Slurm backend in a few words, for the worker's log: ``cli``, or ``rest`` with
    slurmrestd's URL and the API version in use (never its key or token)."""
    if settings.slurm_backend != "rest":
        return settings.slurm_backend
    return f"rest ({settings.slurmrestd_url}, API {getattr(slurm, 'version', settings.slurmrestd_version or '?')})"


def build_clients(settings: Settings, *, slurm: SlurmClient | None = None) -> Clients:
    """The worker's clients from the settings; ``slurm`` in place of the one they name (the scale
    bench's simulated Slurm, bench/simulated_worker.py)."""
    kube = KubernetesApi(
        kubeconfig=settings.kubeconfig,
        poll_seconds=settings.poll_seconds,
        request_timeout_seconds=settings.kube_timeout_seconds,
    )
    given = slurm is not None
    slurm = slurm if slurm is not None else slurm_from_settings(settings)
    mode = remediation_mode(settings, kube) if not given or settings.remediation_mode == "slinky" else "slurm"
    if mode == "slinky":
        on_slinky = SlinkySlurm(slurm, kube)
        if not given:
            require_methods(on_slinky, WORKER_METHODS - PARTITION_EDITS)
        log.info("remediation on Slinky: NodeSet pods are the Slurm nodes (namespace %s)", slinky_namespace(settings))
        pool: SparePool = SlinkyPool(
            kube=kube,
            slurm=on_slinky,
            partition=settings.partition,
            cluster=settings.cluster,
            namespace=settings.namespace,
            poll_seconds=settings.poll_seconds,
        )
        return Clients(
            kube=kube, slurm=on_slinky, pool=pool, slinky=SlinkyDrain(kube, poll_seconds=settings.poll_seconds)
        )
    if not given and settings.remediation_mode == "auto":
        require_methods(slurm)
    pool = SparePool(
        kube=kube, slurm=slurm, partition=settings.partition, cluster=settings.cluster, namespace=settings.namespace
    )
    return Clients(kube=kube, slurm=slurm, pool=pool)


def worker_config(settings: Settings, kube: KubernetesApi, meter: MetricMeter | None = None) -> LastGoodConfig:
    """The worker's configuration: the settings, the policy file and the cluster's ConfigMap.

    Raises:
        PolicyError: the policy file is broken now (the worker stops, not its first incident).
    """
    return LastGoodConfig(
        settings,
        lambda: kube.config_map_data(cluster_namespace(settings.cluster), REMEDIATION_CONFIGMAP),
        meter=meter,
    )


def build_activities(
    settings: Settings, clients: Clients | None = None, config: LastGoodConfig | None = None
) -> list[Any]:
    """Every activity, bound to clients built from the settings (or to ``clients``), reading the
    configuration through ``config`` (else one of their own, without metrics)."""
    clients = clients or build_clients(settings)
    kube, slurm, pool = clients.kube, clients.slurm, clients.pool
    config = config or worker_config(settings, kube)
    slurm_acts = SlurmActivities(slurm, poll_seconds=settings.poll_seconds)
    kube_acts = KubeActivities(kube, slinky=clients.slinky)
    spare_acts = SpareActivities(pool)
    notify_acts = NotifyActivities(WebhookNotifier(url=settings.webhook_url))
    policy_acts = PolicyActivities(config)
    guard_acts = GuardActivities(slurm, cluster=settings.cluster, partition=settings.partition)
    repair_acts = RepairActivities(kube, poll_seconds=settings.poll_seconds)
    validation_acts = ValidationActivities(kube, poll_seconds=settings.poll_seconds)
    reaper_acts = ReaperActivities(kube, cluster=settings.cluster)
    # The cluster's queue (gpufleet nodes show) and the guard's (a domain's nodes) alike.
    topology_acts = TopologyActivities(kube, slurm)
    mover = (
        SlinkyPoolMover(kube, slurm, pool, namespace=slinky_namespace(settings), poll_seconds=settings.poll_seconds)
        if clients.mode == "slinky"
        else PoolMover(kube, slurm, pool, poll_seconds=settings.poll_seconds)
    )
    prometheus = PrometheusApi(settings.prometheus_url) if settings.prometheus_url else None
    pool_acts = PoolActivities(
        kube,
        slurm,
        mover,
        prometheus,
        grace_seconds=config().settings.grace_seconds,
    )
    return [
        pool_acts.observe,
        pool_acts.move,
        slurm_acts.node_state,
        slurm_acts.drain_node,
        slurm_acts.jobs_on_node,
        slurm_acts.jobs_hit,
        slurm_acts.signal_job,
        slurm_acts.still_running,
        slurm_acts.requeue_job,
        slurm_acts.jobs_resumed,
        slurm_acts.resume_node,
        repair_acts.repair,
        repair_acts.start_reboot,
        repair_acts.stop_repairs,
        validation_acts.run_rung,
        validation_acts.set_probation,
        validation_acts.record_skipped,
        reaper_acts.find_leftovers,
        kube_acts.node_facts,
        kube_acts.cordon_and_drain,
        kube_acts.take_node_lease,
        kube_acts.give_back_node_lease,
        spare_acts.claim_spare,
        spare_acts.release_spare,
        spare_acts.retire_node,
        spare_acts.return_node,
        spare_acts.quarantine_node,
        spare_acts.quarantined_nodes,
        spare_acts.release_quarantine,
        notify_acts.notify,
        policy_acts.worker_config,
        policy_acts.classify,
        guard_acts.request_slot,
        guard_acts.drained,
        guard_acts.answer,
        guard_acts.tell,
        guard_acts.fleet_size,
        guard_acts.running,
        guard_acts.domain_join,
        topology_acts.node_domains,
        topology_acts.domain_nodes,
    ]


# A cluster-creation backend from the worker's settings and Kubernetes client.
BackendFactory = Callable[[Settings, KubernetesApi], ClusterBackend]


def _slinky(settings: Settings, kube: KubernetesApi) -> ClusterBackend:
    return SlinkyBackend(kube, restapi=settings.slinky_restapi_url)


# Every worker has these; others (the lab's) are entry points of installed packages (models/plugins.py).
BUILTIN_BACKEND_FACTORIES: dict[str, BackendFactory] = {"slinky": _slinky}


class BackendNotInstalled(ValueError):
    """GPUFLEET_CLUSTER_BACKENDS names a backend whose package is not installed here."""


def backend_factories(settings: Settings) -> dict[str, BackendFactory]:
    """The factory of each backend the settings name, built in or from an entry point.

    Raises:
        BackendNotInstalled: one is declared but its package is absent (the lab, in the image).
    """
    factories: dict[str, BackendFactory] = {}
    entries = declared(CLUSTER_BACKENDS)
    for name in settings.backends:
        if name in BUILTIN_BACKEND_FACTORIES:
            factories[name] = BUILTIN_BACKEND_FACTORIES[name]
            continue
        entry = entries.get(name)
        if entry is None:
            raise BackendNotInstalled(f"GPUFLEET_CLUSTER_BACKENDS names {name!r}, a backend nothing installed declares")
        try:
            factories[name] = load(entry)
        except PluginNotInstalled as exc:
            raise BackendNotInstalled(
                f"GPUFLEET_CLUSTER_BACKENDS names the cluster backend {name!r}, which is not installed here: "
                f"its package {exc.missing!r} ({entry.value}) is missing; the lab's backend serves only where "
                "the lab is installed (a checkout of gpufleet, not the production image)"
            ) from None
    return factories


def cluster_activities(settings: Settings) -> list[Any]:
    """The cluster-creation activities over the backends the settings name (none: [])."""
    if not settings.backends:
        return []
    factories = backend_factories(settings)
    kube = KubernetesApi(
        kubeconfig=settings.kubeconfig,
        poll_seconds=settings.poll_seconds,
        request_timeout_seconds=settings.kube_timeout_seconds,
    )
    backends = {name: factory(settings, kube) for name, factory in factories.items()}
    acts = ClusterActivities(
        kube,
        backends,
        WebhookNotifier(url=settings.webhook_url),
        namespace=settings.namespace,
        own_cluster=settings.cluster,
    )
    return acts.all()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# gpufleet's workflow modules: the package a "shared" sandbox imports once (Settings.workflow_sandbox).
WORKFLOW_PACKAGE = "workflows"


def workflow_runner(settings: Settings) -> SandboxedWorkflowRunner:
    """The sandbox the worker runs every workflow in, as GPUFLEET_WORKFLOW_SANDBOX says: "shared"
    passes the workflows package through (imported once, for every run), "isolated" is the SDK's
    default (imported again for each run, and checked with the rest)."""
    if settings.workflow_sandbox == "isolated":
        return SandboxedWorkflowRunner()
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(WORKFLOW_PACKAGE))


async def start_reaper(client: Client, settings: Settings) -> None:
    """The cluster's reaper (workflows/reaper.py), started by whichever worker comes up first; one
    already running is left as it is (to apply a new GPUFLEET_REAPER_SECONDS, terminate it: the
    next worker to start begins it again). Temporal away: the worker says so and goes on."""
    try:
        await client.start_workflow(
            ReaperWorkflow.run,
            ReaperInput(cluster=settings.cluster, every_seconds=settings.reaper_seconds),
            id=reaper_workflow_id(settings.cluster),
            task_queue=task_queue(settings.cluster),
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
    except RPCError as exc:
        log.error("the cluster's reaper was not started (%s); the next worker to start tries again", exc.message)


# The workflows each of the worker's task queues runs.
CLUSTER_WORKFLOWS: tuple[type, ...] = (
    NodeRemediationWorkflow,
    ReturnNodeWorkflow,
    ProbationWorkflow,
    QuarantinedNodesWorkflow,
    NodeDomainsWorkflow,
    ReleaseNodeWorkflow,
    PoolRebalanceWorkflow,
    ReaperWorkflow,
)
GUARD_WORKFLOWS: tuple[type, ...] = (FleetGuardWorkflow, DomainIncidentWorkflow)
CREATION_WORKFLOWS: tuple[type, ...] = (ClusterCreationWorkflow, ClusterDeletionWorkflow, ClusterUsersWorkflow)


def cluster_worker(
    client: Client, settings: Settings, activities: list[Callable[..., Any]], executor: ThreadPoolExecutor
) -> Worker:
    """The Temporal worker of one cluster's task queue: its workflows and the activities given."""
    return Worker(
        client,
        task_queue=task_queue(settings.cluster),
        workflows=list(CLUSTER_WORKFLOWS),
        activities=activities,
        activity_executor=executor,
        max_concurrent_activities=ACTIVITY_THREADS,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
        # A dead worker's cached workflows move to another worker after this (3 s, not the
        # SDK's 10 s, unless GPUFLEET_STICKY_TIMEOUT_SECONDS says otherwise).
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_timeout_seconds),
        max_cached_workflows=settings.max_cached_workflows,
        workflow_runner=workflow_runner(settings),
    )


def guard_worker(
    client: Client, settings: Settings, activities: list[Callable[..., Any]], executor: ThreadPoolExecutor
) -> Worker:
    """The worker of the cluster's fleet guard, on the guard's own task queue beside the cluster's:
    in a burst its tasks (and its answers' activities) never queue behind the incidents it answers.
    One guard per cluster, so a few task slots are plenty; the same activities (it calls a few)."""
    return Worker(
        client,
        task_queue=guard_task_queue(settings.cluster),
        workflows=list(GUARD_WORKFLOWS),
        activities=activities,
        activity_executor=executor,
        max_concurrent_activities=GUARD_ACTIVITY_SLOTS,
        max_concurrent_workflow_tasks=GUARD_WORKFLOW_TASK_SLOTS,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_timeout_seconds),
        workflow_runner=workflow_runner(settings),
    )


def creation_worker(
    client: Client, settings: Settings, activities: list[Callable[..., Any]], executor: ThreadPoolExecutor
) -> Worker:
    """The worker of cluster creation and deletion (task queue gpufleet-clusters), for a worker
    whose settings name backends; the cluster activities given."""
    return Worker(
        client,
        task_queue=CLUSTER_TASK_QUEUE,
        workflows=list(CREATION_WORKFLOWS),
        activities=activities,
        activity_executor=executor,
        graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
        workflow_runner=workflow_runner(settings),
    )


async def run_worker(
    client: Client,
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    metrics: MetricMeter | None = None,
    clients: Clients | None = None,
) -> None:
    """Run until ``stop`` is set, or SIGTERM/SIGINT (finishing what is in flight, up to a bound).

    ``metrics``: the meter of the runtime that serves the worker's Prometheus endpoint
    (workers/metrics.py); the free spares are then counted every minute beside the worker.
    ``clients``: the worker's clients, when not those the settings name (the scale bench's
    simulated Slurm, bench/simulated_worker.py).

    Raises:
        ValueError: the settings name no cluster (GPUFLEET_CLUSTER).
    """
    if not settings.cluster:
        raise ValueError("GPUFLEET_CLUSTER is not set: a worker serves one named cluster's task queue")
    clients = clients or build_clients(settings)
    config = worker_config(settings, clients.kube, metrics)
    activities = build_activities(settings, clients, config)
    queue = task_queue(settings.cluster)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    with ThreadPoolExecutor(max_workers=ACTIVITY_THREADS, thread_name_prefix="activity") as executor:
        worker = cluster_worker(client, settings, activities, executor)
        log.info(
            "worker on task queue %s, its fleet guard on %s (cluster %s, partition %s)",
            queue,
            guard_task_queue(settings.cluster),
            settings.cluster,
            settings.partition,
        )
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(worker)
            guards = stack.enter_context(
                ThreadPoolExecutor(max_workers=GUARD_ACTIVITY_SLOTS, thread_name_prefix="guard-activity")
            )
            await stack.enter_async_context(guard_worker(client, settings, activities, guards))
            if metrics is not None:
                counting = asyncio.create_task(
                    report_spares(clients.kube, clients.pool, metrics, cluster=settings.cluster, stop=stop)
                )
                stack.push_async_callback(_cancel, counting)
            await start_reaper(client, settings)
            checking = asyncio.create_task(check_config(config, stop=stop))
            stack.push_async_callback(_cancel, checking)
            creations = cluster_activities(settings)
            if creations:
                await stack.enter_async_context(creation_worker(client, settings, creations, executor))
                log.info("creating clusters on %s (task queue %s)", ", ".join(settings.backends), CLUSTER_TASK_QUEUE)
            await stop.wait()
            log.info("stopping: finishing activities in flight (at most %ss)", GRACEFUL_SHUTDOWN.seconds)
