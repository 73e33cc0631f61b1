"""A cluster's own remediation defaults (its ConfigMap, written by `gpufleet cluster create`) are
what its worker's incidents start from, over the policy file; a GPUFLEET_* variable set
explicitly still wins; a broken ConfigMap leaves the policy file's value, saying so."""

from __future__ import annotations

import pytest

from clients.kube import KubernetesApi
from models.settings import Settings
from models.slinky import REMEDIATION_CONFIGMAP, cluster_namespace
from tests.conftest import KubeApiProcess
from workers.main import LastGoodConfig


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


def reader(kube: KubernetesApi) -> LastGoodConfig:
    return LastGoodConfig(
        Settings(cluster="research"),
        lambda: kube.config_map_data(cluster_namespace("research"), REMEDIATION_CONFIGMAP),
    )


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
    assert "ConfigMap was not read" in caplog.text
    monkeypatch.setenv("GPUFLEET_GRACE_SECONDS", "7")
    assert reader(kube)().settings.grace_seconds == 7
