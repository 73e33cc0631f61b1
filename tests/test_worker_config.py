"""A cluster's own remediation defaults (its ConfigMap, written by `gpufleet cluster create`) are
what its worker's incidents start from, over the policy file; a GPUFLEET_* variable set
explicitly still wins. A broken ConfigMap or policy file is refused: the worker keeps its last
good configuration, says so once in its log, and shows it on its metrics endpoint."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from temporalio.runtime import Runtime

from clients.kube import KubernetesApi
from models.cluster import load_spec
from models.policy import PolicyError, RemediationSettings
from models.settings import Settings
from models.slinky import REMEDIATION_CONFIGMAP, cluster_namespace, configmap_remediation, slinky_objects
from tests.conftest import KubeApiProcess
from tests.models.test_cluster_spec import PLACEMENT, example
from tests.workers.test_metrics import free_port, one, scraped_until
from workers.main import LastGoodConfig, check_config
from workers.metrics import prometheus_runtime

CONFIGMAP = f"ConfigMap {cluster_namespace('research')}/{REMEDIATION_CONFIGMAP}"


def config_map(kube: KubernetesApi, grace: str) -> None:
    namespace = cluster_namespace("research")
    kube.create_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube.create_object(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": REMEDIATION_CONFIGMAP, "namespace": namespace},
            "data": {"grace_seconds": grace, "requeue": "true"},
        }
    )


def edit_config_map(kube_api: KubeApiProcess, **data: str) -> None:
    """`kubectl edit`: the ConfigMap's data replaced, through the official client."""
    api = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(kube_api.kubeconfig)))
    body = api.read_namespaced_config_map(REMEDIATION_CONFIGMAP, cluster_namespace("research"))
    body.data = data
    api.replace_namespaced_config_map(REMEDIATION_CONFIGMAP, cluster_namespace("research"), body)


def reader(kube: KubernetesApi, runtime: Runtime | None = None, policy_file: Path | None = None) -> LastGoodConfig:
    return LastGoodConfig(
        Settings(cluster="research", policy_file=policy_file),
        lambda: kube.config_map_data(cluster_namespace("research"), REMEDIATION_CONFIGMAP),
        meter=runtime.metric_meter if runtime is not None else None,
    )


@pytest.fixture
def served() -> Iterator[tuple[Runtime, str]]:
    """A Temporal runtime serving /metrics, as the worker's does on GPUFLEET_METRICS_PORT."""
    port = free_port()
    yield prometheus_runtime(f"127.0.0.1:{port}"), f"http://127.0.0.1:{port}/metrics"


async def metric(url: str, name: str, source: str, want: float) -> float:
    """The worker's ``name`` for ``source`` once it reads ``want`` (or what it reads after 30 s)."""
    text = await scraped_until(url, lambda t: one(t, name, cluster="research", source=source) == want)
    return one(text, name, cluster="research", source=source)


def test_the_clusters_configmap_sets_the_grace(kube_api: KubeApiProcess) -> None:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    assert reader(kube)().settings.grace_seconds == 120  # no ConfigMap: the policy file's default
    config_map(kube, "45")
    config = reader(kube)()
    assert config.settings.grace_seconds == 45 and config.policy.remediation.grace_seconds == 45


def test_an_explicit_variable_wins_and_a_broken_value_is_ignored(
    kube_api: KubeApiProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    config_map(kube, "forever")
    assert reader(kube)().settings.grace_seconds == 120
    assert f"{CONFIGMAP}: grace_seconds: Input should be a valid number" in caplog.text
    monkeypatch.setenv("GPUFLEET_GRACE_SECONDS", "7")
    assert reader(kube)().settings.grace_seconds == 7


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("nan", "Input should be a finite number"),
        ("inf", "Input should be a finite number"),
        ("-5", "Input should be greater than or equal to 0"),
        ("1e12", "Input should be less than or equal to 86400"),
        ("true", "Input should be a valid number"),
    ],
)
async def test_a_bad_grace_in_the_configmap_keeps_the_last_good_one_logs_it_and_moves_the_metric(
    kube_api: KubeApiProcess,
    served: tuple[Runtime, str],
    caplog: pytest.LogCaptureFixture,
    value: str,
    problem: str,
) -> None:
    runtime, url = served
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    config_map(kube, "45")
    config = reader(kube, runtime)
    assert config().settings.grace_seconds == 45
    assert await metric(url, "gpufleet_config_ok", "configmap", 1) == 1
    assert await metric(url, "gpufleet_config_rejected_total", "configmap", 0) == 0

    edit_config_map(kube_api, grace_seconds=value, requeue="true")
    with caplog.at_level(logging.ERROR, logger="gpufleet.worker"):
        kept = config()
        again = config()  # the next incident: same config, not logged or counted again
    assert kept.settings.grace_seconds == 45 and kept.policy.remediation.grace_seconds == 45
    assert again == kept
    refused = [r.getMessage() for r in caplog.records if CONFIGMAP in r.getMessage()]
    assert len(refused) == 1, refused
    assert f"{CONFIGMAP}: grace_seconds: {problem}" in refused[0]
    assert "last good grace it gave (45 s)" in refused[0]
    assert await metric(url, "gpufleet_config_ok", "configmap", 0) == 0
    assert await metric(url, "gpufleet_config_rejected_total", "configmap", 1) == 1
    assert await metric(url, "gpufleet_config_ok", "policy_file", 1) == 1  # the other source is fine

    edit_config_map(kube_api, grace_seconds="30", requeue="true")
    assert config().settings.grace_seconds == 30
    assert await metric(url, "gpufleet_config_ok", "configmap", 1) == 1


def test_a_configmap_refused_at_start_leaves_the_policy_files_grace(
    kube_api: KubeApiProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("remediation:\n  grace_seconds: 75\n", encoding="utf-8")
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    config_map(kube, "nan")
    with caplog.at_level(logging.ERROR, logger="gpufleet.worker"):
        assert reader(kube, policy_file=policy)().settings.grace_seconds == 75
    assert f"{CONFIGMAP}: grace_seconds: Input should be a finite number" in caplog.text
    assert "the policy file's grace (75 s)" in caplog.text


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"remediation:\n  grace_seconds: .nan\n", "remediation.grace_seconds: Input should be a finite number"),
        (b"guard:\n  max_share: .inf\n", "guard.max_share: Input should be a finite number"),
        (b"repair:\n  settle_seconds: -1\n", "repair.settle_seconds: Input should be greater than or equal to 0"),
        (b"remediation:\n  grace_seconds: yes\n", "remediation.grace_seconds: Value error, a number, not true"),
        ("remediation:\n  grace_seconds: 5  # caf\u00e9\n".encode("latin-1"), "not UTF-8 text"),
        (b"remediation: [grace_seconds\n", "not valid YAML"),
        (b"- grace_seconds\n", "expected a mapping"),
    ],
)
async def test_a_policy_file_edited_to_a_broken_one_keeps_the_last_good_and_moves_the_metric(
    kube_api: KubeApiProcess,
    served: tuple[Runtime, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    content: bytes,
    said: str,
) -> None:
    runtime, url = served
    policy = tmp_path / "policy.yaml"
    policy.write_text("remediation:\n  grace_seconds: 75\nguard:\n  max_share: 0.25\n", encoding="utf-8")
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    config_map(kube, "45")  # the ConfigMap's grace stays over whichever policy the worker keeps
    config = reader(kube, runtime, policy)
    good = config()
    assert good.settings.grace_seconds == 45 and good.policy.guard.max_share == 0.25

    policy.write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="gpufleet.worker"):
        assert config() == good
        assert config() == good
    refused = [r.getMessage() for r in caplog.records if str(policy) in r.getMessage()]
    assert len(refused) == 1 and said in refused[0], refused
    assert "\n" not in refused[0]
    assert await metric(url, "gpufleet_config_ok", "policy_file", 0) == 0
    assert await metric(url, "gpufleet_config_rejected_total", "policy_file", 1) == 1

    policy.write_text("guard:\n  max_share: 0.75\n", encoding="utf-8")  # fixed: in force again
    fixed = config()
    assert fixed.policy.guard.max_share == 0.75 and fixed.settings.grace_seconds == 45
    assert await metric(url, "gpufleet_config_ok", "policy_file", 1) == 1


async def test_a_running_worker_notices_a_bad_edit_without_an_incident(
    kube_api: KubeApiProcess, served: tuple[Runtime, str], tmp_path: Path
) -> None:
    runtime, url = served
    policy = tmp_path / "policy.yaml"
    policy.write_text("remediation:\n  grace_seconds: 75\n", encoding="utf-8")
    kube = KubernetesApi(kubeconfig=kube_api.kubeconfig)
    config = reader(kube, runtime, policy)
    config()
    stop = asyncio.Event()
    checking = asyncio.create_task(check_config(config, stop=stop, every_seconds=0.05))
    policy.write_text("remediation:\n  grace_seconds: .nan\n", encoding="utf-8")
    assert await metric(url, "gpufleet_config_ok", "policy_file", 0) == 0
    stop.set()
    await asyncio.wait_for(checking, timeout=5)


# -- the ConfigMap's keys, checked as the policy file's remediation: is --------------------------------


def test_what_cluster_create_writes_is_accepted() -> None:
    written = next(
        obj
        for obj in slinky_objects(load_spec(example()), PLACEMENT)
        if obj["metadata"]["name"] == REMEDIATION_CONFIGMAP
    )
    settings = configmap_remediation(written["data"], RemediationSettings(), origin=CONFIGMAP)
    assert settings.grace_seconds == load_spec(example()).remediation.grace_seconds


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"grace_seconds": "nan"}, "grace_seconds: Input should be a finite number"),
        ({"grace_seconds": "-inf"}, "grace_seconds: Input should be a finite number"),
        ({"grace_seconds": "-1"}, "grace_seconds: Input should be greater than or equal to 0"),
        ({"grace_seconds": "1e300"}, "grace_seconds: Input should be less than or equal to 86400"),
        ({"grace_seconds": ""}, "grace_seconds: Input should be a valid number"),
        ({"requeue": "maybe"}, "requeue: 'maybe' is not 'true' or 'false'"),
        ({"resume_timeout_seconds": "60"}, "resume_timeout_seconds: not a key of this ConfigMap"),
    ],
)
def test_a_configmap_value_out_of_bounds_is_named_with_its_configmap(data: dict[str, str], problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        configmap_remediation(data, RemediationSettings(), origin=CONFIGMAP)
    assert str(caught.value).startswith(f"{CONFIGMAP}: ") and problem in str(caught.value)
