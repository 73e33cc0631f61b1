"""A real intake between the real emulated Kubernetes API and a real Temporal dev server, for tests.

The emulated API holds namespace gpufleet, the detector's ServiceAccount and one detector pod per
node (gpu1, gpu2); tokens come from its TokenRequest, bound to a pod, as the kubelet projects them.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

from clients.kubeauth import KubeAuth
from lab.certs import ServerCertificate, make_server_certificate
from lab.kubeapi import node_object
from lab.procs import free_port, port_in_use, stop, wait_for
from starters.server import dev_server_argv
from tests.conftest import REPO, KubeApiProcess

NAMESPACE = "gpufleet"
DETECTOR_ACCOUNT = "gpufleet-detector"
NODES = ("gpu1", "gpu2")
# Another ServiceAccount of the detectors' namespace, with a pod on gpu1: not a detector.
OTHER_ACCOUNT = "job-runner"


def detector_pod(node: str, *, account: str = DETECTOR_ACCOUNT, name: str = "detector") -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-{node}", "namespace": NAMESPACE, "uid": f"uid-{name}-{node}"},
        "spec": {"nodeName": node, "serviceAccountName": account, "containers": [{"name": name}]},
    }


def seed() -> dict[str, object]:
    return {
        "nodes": [node_object(n, pool="training") for n in NODES],
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}],
        "serviceaccounts": [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": NAMESPACE}}
            for account in (DETECTOR_ACCOUNT, OTHER_ACCOUNT)
        ],
        "pods": [detector_pod(n) for n in NODES] + [detector_pod("gpu1", account=OTHER_ACCOUNT, name="job")],
    }


def start_temporal(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A Temporal dev server with gpufleet's search attributes; its process and address."""
    port = free_port()
    server = subprocess.Popen(
        dev_server_argv(db_file=root / "temporal.db", port=port, ui_port=free_port()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for(lambda: port_in_use(port), timeout=60, what="the Temporal dev server")
    return server, f"127.0.0.1:{port}"


@dataclass
class Intake:
    """``gpufleet intake`` as its own process; start and stop it again on the same port."""

    root: Path
    env: dict[str, str]
    certs: ServerCertificate
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / "intake.log"

    def start(self) -> Intake:
        environment = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "GPUFLEET_INTAKE_PORT": str(self.port),
            "GPUFLEET_INTAKE_BIND": "127.0.0.1",
            "GPUFLEET_INTAKE_METRICS_PORT": str(self.metrics_port),
            "GPUFLEET_INTAKE_TLS_CERT": str(self.certs.cert),
            "GPUFLEET_INTAKE_TLS_KEY": str(self.certs.key),
            **self.env,
        }
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workers.entry", "intake"],
                env=environment,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self._healthy, timeout=60, what=f"the intake to answer (its log: {self.log})")
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the intake exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        return httpx.get(f"{self.url}/healthz", verify=self.tls(), timeout=2).status_code == 200

    def tls(self) -> ssl.SSLContext:
        """A client's TLS context that trusts the intake's CA."""
        return ssl.create_default_context(cafile=str(self.certs.ca))

    def stop(self) -> None:
        if self.proc is not None:
            stop([self.proc.pid])
            self.proc = None

    def metrics(self) -> dict[str, float]:
        """The intake's own samples (gpufleet_intake_*), by name and labels as Prometheus writes them."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        samples = {}
        for line in text.splitlines():
            if line.startswith("gpufleet_intake_"):
                name, _, value = line.rpartition(" ")
                # The Temporal runtime that serves them tags every sample with its service name.
                samples[name.replace(',service_name="temporal-core-sdk"', "")] = float(value)
        return samples


@dataclass
class World:
    root: Path
    kube: KubeApiProcess
    temporal: subprocess.Popen[bytes]
    temporal_address: str
    intake: Intake

    @property
    def auth(self) -> KubeAuth:
        return KubeAuth(kubeconfig=self.kube.kubeconfig)

    def token(self, node: str, *, audience: str = "gpufleet", seconds: int = 3600, pod: str = "detector") -> str:
        """The projected token of the detector pod on ``node`` (``pod="job"``: of the job pod on gpu1,
        whose account is OTHER_ACCOUNT)."""
        account = DETECTOR_ACCOUNT if pod == "detector" else OTHER_ACCOUNT
        return self.auth.request_token(
            NAMESPACE,
            account,
            audiences=[audience],
            expiration_seconds=seconds,
            pod=(f"{pod}-{node}", f"uid-{pod}-{node}"),
        )

    def workflows(self) -> list[str]:
        async def listing() -> list[str]:
            client = await Client.connect(self.temporal_address, data_converter=pydantic_data_converter)
            return [w.id async for w in client.list_workflows()]

        return asyncio.run(listing())

    def stop(self) -> None:
        self.intake.stop()
        stop([self.temporal.pid])
        self.kube.stop()


def start_world(root: Path, *, rate: float = 30, burst: int = 60) -> World:
    """The emulated API, Temporal and an intake for cluster ``lab`` between them."""
    certs = make_server_certificate(root / "certs")
    kube = KubeApiProcess(root / "kube", seed())
    temporal, address = start_temporal(root)
    env = {
        "GPUFLEET_CLUSTER": "lab",
        "GPUFLEET_KUBECONFIG": str(kube.kubeconfig),
        "TEMPORAL_ADDRESS": address,
        "GPUFLEET_INTAKE_RATE": str(rate),
        "GPUFLEET_INTAKE_BURST": str(burst),
    }
    try:
        intake = Intake(root, env, certs).start()
    except BaseException:
        stop([temporal.pid])
        kube.stop()
        raise
    return World(root, kube, temporal, address, intake)


def workflow_exists(temporal_address: str, workflow_id: str) -> bool:
    """Whether Temporal at ``temporal_address`` (directly, never through the API) has that workflow."""

    async def describe() -> bool:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        try:
            await client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    return asyncio.run(describe())
