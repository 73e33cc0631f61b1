"""The worker's Prometheus endpoint: the Temporal SDK's metrics and gpufleet's own, on one port.

The SDK serves the endpoint itself (``PrometheusConfig`` on the process's Temporal runtime):
its ``temporal_*`` metrics (workflows completed and failed, task latencies, activity failures
and retries), gpufleet's workflow metrics (made with ``workflow.metric_meter()``, which records
nothing while a history is replayed) and the process-level gauges made here with the runtime's
meter. The names are in models/metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from temporalio.common import MetricMeter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from clients.kube import KubeClient
from clients.spares import SparePool
from models.constants import POOL_LABEL, POOL_SPARE
from models.metrics import SPARES_FREE, SPARES_FREE_HELP, STEP_DURATION, STEP_DURATION_BUCKETS
from models.settings import Settings

log = logging.getLogger("gpufleet.worker")

# How often each worker counts the free spares: one node list and one `scontrol show node` per
# spare that Kubernetes says is free.
SPARES_EVERY_SECONDS = 60.0


def bind_address(settings: Settings) -> str | None:
    """Where the endpoint listens (``host:port``, an IPv6 host in brackets); None when it is off."""
    if not settings.metrics_port:
        return None
    host = settings.metrics_bind.strip() or "0.0.0.0"  # noqa: S104 (the default: every address of the pod)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{settings.metrics_port}"


def prometheus_runtime(address: str) -> Runtime:
    """A Temporal runtime serving ``GET /metrics`` on ``address``: its own metrics and every one
    made with its meter (workflows' and activities' meters included).

    Raises:
        ValueError: the address cannot be listened on (taken, or not this machine's).
    """
    return Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(
                bind_address=address,
                histogram_bucket_overrides={STEP_DURATION: list(STEP_DURATION_BUCKETS)},
            )
        )
    )


def install_metrics(settings: Settings) -> Runtime | None:
    """Serve the metrics the settings ask for, on the runtime every Temporal client of this process
    then uses (call it before connecting). None when off, or when the address cannot be listened
    on: said loudly, and the worker runs without (remediation never waits on its metrics)."""
    address = bind_address(settings)
    if address is None:
        log.info("no metrics endpoint (GPUFLEET_METRICS_PORT=0)")
        return None
    try:
        runtime = prometheus_runtime(address)
    except ValueError as exc:
        log.error(
            "no metrics endpoint: %s. The worker runs without one; GPUFLEET_METRICS_PORT names another port (0: none)",
            exc,
        )
        return None
    Runtime.set_default(runtime)
    log.info("metrics on http://%s/metrics", address)
    return runtime


def free_spares(kube: KubeClient, pool: SparePool) -> int:
    """The spares a claim would take now, by the claim's own test: in the spare pool, of this
    cluster, Ready, schedulable, unclaimed, with no incident, lease or quarantine on it, and idle
    and undrained in Slurm."""
    return sum(
        1
        for node in kube.list_nodes(label_selector=f"{POOL_LABEL}={POOL_SPARE}")
        if pool._free_in_kube(node) and pool._idle_in_slurm(node.name)
    )


async def report_spares(
    kube: KubeClient,
    pool: SparePool,
    meter: MetricMeter,
    *,
    cluster: str,
    stop: asyncio.Event,
    every_seconds: float = SPARES_EVERY_SECONDS,
) -> None:
    """Set ``gpufleet_spares_free`` every ``every_seconds`` until ``stop``; a count that fails
    (Kubernetes or Slurm away) is logged and leaves the last one."""
    gauge = meter.create_gauge(SPARES_FREE, SPARES_FREE_HELP)
    while not stop.is_set():
        try:
            count = await asyncio.to_thread(free_spares, kube, pool)
        except Exception as exc:  # a metric must never stop the worker: say it and try again
            log.warning("free spares not counted (%s: %s); the gauge keeps its last value", type(exc).__name__, exc)
        else:
            gauge.set(count, {"cluster": cluster})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_seconds)
