"""Which remediation a worker runs (GPUFLEET_REMEDIATION_MODE) and the clients it builds for it,
against the emulated Kubernetes API (with Slinky's CRDs) and slurmrestd's API versions as the
worker checks them at start; and `gpufleet worker` itself, which refuses before contacting
anything a Slurm backend that cannot serve the mode."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.errors import ClientError
from clients.kube import KubernetesApi
from clients.onslinky import SlinkyDrain, SlinkyPool, SlinkySlurm
from clients.slurm import SlurmCli
from clients.slurmrest_protocol import MissingSlurmMethods, SlurmRest
from clients.spares import SparePool
from models.settings import Settings
from models.slinky import API
from tests.conftest import KubeApiProcess, gpufleet_cli
from workers.main import build_clients, remediation_mode, slurm_from_settings


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    """NodeSets in slurm-research (a Slinky cluster); none in slurm-plain."""
    namespaces = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in ("slurm-research", "slurm-plain")
    ]
    process = KubeApiProcess(tmp_path / "kube", {"namespaces": namespaces})
    body = {
        "apiVersion": API,
        "kind": "NodeSet",
        "metadata": {"name": "research-train", "namespace": "slurm-research"},
        "spec": {
            "controllerRef": {"name": "research"},
            "replicas": 1,
            "template": {"spec": {"nodeSelector": {"a": "b"}}},
        },
    }
    with httpx.Client(base_url=process.url, timeout=10) as http:
        http.post(f"/apis/{API}/namespaces/slurm-research/nodesets", json=body).raise_for_status()
    yield process
    process.stop()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "slurmrestd.token"
    path.write_text("a-token\n")
    path.chmod(0o600)
    return path


def settings(api: KubeApiProcess, token: Path, **options: Any) -> Settings:
    """A worker's settings over slurmrestd v0.0.44 (Slinky's Slurm 25.11: no requeue); nothing
    listens at its URL, and the version is named, so building the client asks it nothing."""
    values: dict[str, Any] = {
        "cluster": "research",
        "kubeconfig": api.kubeconfig,
        "slurm_backend": "rest",
        "slurmrestd_url": "http://127.0.0.1:1",
        "slurmrestd_version": "v0.0.44",
        "slurmrestd_token_file": token,
        "poll_seconds": 0.05,
        **options,
    }
    return Settings(**values)


def kube_of(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)


# -- which mode ------------------------------------------------------------------------------------


def test_auto_finds_nodesets_in_the_clusters_namespace(api: KubeApiProcess, token: Path) -> None:
    kube = kube_of(api)
    assert remediation_mode(settings(api, token), kube) == "slinky"  # slurm-research
    assert remediation_mode(settings(api, token, cluster="plain"), kube) == "slurm"  # slurm-plain: none
    assert remediation_mode(settings(api, token, cluster="absent"), kube) == "slurm"  # no such namespace
    # GPUFLEET_SLINKY_NAMESPACE names where to look.
    assert remediation_mode(settings(api, token, cluster="plain", slinky_namespace="slurm-research"), kube) == "slinky"
    assert remediation_mode(settings(api, token, slinky_namespace="slurm-plain"), kube) == "slurm"


def test_auto_without_slinkys_crds_is_plain_slurm(api: KubeApiProcess, token: Path) -> None:
    # What an API server without slurm-operator's CRDs answers for the NodeSet list: 404.
    httpx.put(f"{api.url}/_faults", json={"status": 404, "count": 1}, timeout=5).raise_for_status()
    assert remediation_mode(settings(api, token), kube_of(api)) == "slurm"
    assert httpx.get(f"{api.url}/_faults", timeout=5).json() == {"pending": 0, "served": 1}


def test_auto_stops_rather_than_guess_when_the_api_does_not_answer(api: KubeApiProcess, token: Path) -> None:
    """A 500 for the NodeSet list (or no answer): guessing plain Slurm would edit a Slinky
    cluster's partitions, so the worker says what to set instead of starting."""
    httpx.put(f"{api.url}/_faults", json={"status": 500, "count": 10}, timeout=5).raise_for_status()
    with pytest.raises(ClientError, match="set GPUFLEET_REMEDIATION_MODE to slurm or slinky"):
        remediation_mode(settings(api, token), kube_of(api))
    # Set explicitly, the mode is not asked of the API at all.
    assert remediation_mode(settings(api, token, remediation_mode="slinky"), kube_of(api)) == "slinky"


def test_the_mode_set_explicitly_wins(api: KubeApiProcess, token: Path) -> None:
    kube = kube_of(api)
    assert remediation_mode(settings(api, token, remediation_mode="slurm"), kube) == "slurm"
    assert remediation_mode(settings(api, token, cluster="plain", remediation_mode="slinky"), kube) == "slinky"


# -- which clients ---------------------------------------------------------------------------------


def test_on_slinky_the_worker_builds_the_slinky_pool_slurm_and_drain(api: KubeApiProcess, token: Path) -> None:
    for mode, cluster in (("slinky", "plain"), ("auto", "research")):
        clients = build_clients(settings(api, token, cluster=cluster, remediation_mode=mode))
        assert clients.mode == "slinky", mode
        assert isinstance(clients.slurm, SlinkySlurm) and isinstance(clients.slurm.inner, SlurmRest)
        assert clients.slurm.version == "v0.0.44"
        assert isinstance(clients.pool, SlinkyPool) and isinstance(clients.slinky, SlinkyDrain)


def test_without_nodesets_the_worker_builds_plain_slurm_clients(api: KubeApiProcess, token: Path) -> None:
    clients = build_clients(settings(api, token, cluster="plain", slurm_backend="cli"))
    assert clients.mode == "slurm" and clients.slinky is None
    assert isinstance(clients.slurm, SlurmCli) and type(clients.pool) is SparePool
    # The same v0.0.44 slurmrestd that serves Slinky cannot serve plain Slurm: no requeue.
    with pytest.raises(MissingSlurmMethods, match="requeue"):
        build_clients(settings(api, token, cluster="plain"))


# -- which Slurm backends --------------------------------------------------------------------------


def test_slinky_mode_takes_a_v0_0_44_slurmrestd_that_slurm_mode_refuses(api: KubeApiProcess, token: Path) -> None:
    slurm = slurm_from_settings(settings(api, token, remediation_mode="slinky"))
    assert isinstance(slurm, SlurmRest) and slurm.version == "v0.0.44"
    assert "requeue" in slurm.unsupported()  # served through DOWN there, not by the API
    assert isinstance(slurm_from_settings(settings(api, token)), SlurmRest)  # auto: enough for Slinky, for now

    with pytest.raises(MissingSlurmMethods) as refused:
        slurm_from_settings(settings(api, token, remediation_mode="slurm"))
    said = str(refused.value)
    assert "requeue: slurmrestd has no requeue before API v0.0.45" in said
    assert "add_to_partition" in said

    # v0.0.38 sets no node DOWN (no node update): nothing serves a requeue, even on Slinky.
    with pytest.raises(MissingSlurmMethods, match="requeue") as old:
        slurm_from_settings(settings(api, token, remediation_mode="slinky", slurmrestd_version="v0.0.38"))
    assert "drain" in str(old.value) and "add_to_partition" not in str(old.value)


def worker_env(tmp_path: Path, token: Path, mode: str) -> dict[str, str]:
    return {
        **os.environ,
        "GPUFLEET_HOME": str(tmp_path / "home"),
        "GPUFLEET_METRICS_PORT": "0",
        "GPUFLEET_CLUSTER": "research",
        "GPUFLEET_SLURM_BACKEND": "rest",
        "GPUFLEET_SLURMRESTD_URL": "http://127.0.0.1:1",
        "GPUFLEET_SLURMRESTD_VERSION": "v0.0.44",
        "GPUFLEET_SLURMRESTD_TOKEN_FILE": str(token),
        "GPUFLEET_REMEDIATION_MODE": mode,
        "TEMPORAL_ADDRESS": "127.0.0.1:1",  # nothing there: how far the worker got is what it says
    }


def test_gpufleet_worker_starts_on_slinkys_v0_0_44_and_refuses_it_for_plain_slurm(tmp_path: Path, token: Path) -> None:
    refused = gpufleet_cli("worker", env=worker_env(tmp_path, token, "slurm"), timeout=60)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2, said
    assert "requeue" in said and "v0.0.45" in said
    assert "cannot reach the Temporal server" not in said  # refused before it tried

    started = gpufleet_cli("worker", env=worker_env(tmp_path, token, "slinky"), timeout=60)
    said = started.stdout + started.stderr
    assert "Slurm backend rest (http://127.0.0.1:1, API v0.0.44)" in said
    assert "cannot reach the Temporal server" in said and started.returncode == 1, said  # past the backend check
