"""kubectl, a client nobody here wrote, against the lab's emulated Kubernetes API.

The API is seeded as the lab seeds it: Nodes, an inference Deployment (its ReplicaSet's pods
under a PodDisruptionBudget that allows one down) and a node-exporter DaemonSet on every node.
The last test drains one node with ``kubectl drain`` and its twin with gpufleet's
cordon-and-drain, and compares what matters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.kube import KubeActivities
from clients.kube import KubernetesApi
from lab.kubeapi import lab_workloads, node_object
from models.requests import KubeDrainRequest
from tests.conftest import REPO, KubeApiProcess

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (make test installs it as root)")

TRAINING = ["gpu1", "gpu2", "gpu3"]
SPARES = ["spare1"]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    nodes = [node_object(n, pool="training") for n in TRAINING] + [node_object(n, pool="spare") for n in SPARES]
    process = KubeApiProcess(tmp_path / "kube", {"nodes": nodes, **lab_workloads(TRAINING, TRAINING + SPARES)})
    yield process
    process.stop()


def kubectl(api: KubeApiProcess, *args: str, check: bool = True, timeout: float = 60) -> str:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, *args],
        env={**os.environ, "KUBECONFIG": str(api.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check:
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout + done.stderr


def rows(text: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()[1:]]


def test_get_nodes_as_a_table_with_wide_and_selectors(api: KubeApiProcess) -> None:
    table = kubectl(api, "get", "nodes")
    assert table.splitlines()[0].split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert [row[0] for row in rows(table)] == TRAINING + SPARES
    assert all(row[1] == "Ready" for row in rows(table))
    assert "INTERNAL-IP" in kubectl(api, "get", "nodes", "-o", "wide").splitlines()[0]
    assert kubectl(api, "get", "nodes", "-l", "gpufleet.io/pool=spare", "-o", "name").split() == ["node/spare1"]
    node = json.loads(kubectl(api, "get", "node", "gpu1", "-o", "json"))
    assert node["kind"] == "Node" and node["metadata"]["labels"]["gpufleet.io/pool"] == "training"
    assert "kind: Node" in kubectl(api, "get", "no", "gpu1", "-o", "yaml")  # the short name
    assert "Name:               gpu1" in kubectl(api, "describe", "node", "gpu1")


def test_get_pods_pdbs_deployments_and_daemonsets(api: KubeApiProcess) -> None:
    on_gpu1 = kubectl(api, "get", "pods", "-A", "-o", "wide", "--field-selector", "spec.nodeName=gpu1")
    assert {row[1] for row in rows(on_gpu1)} == {"inference-5c9f7d6b8-gpu1", "node-exporter-gpu1"}
    assert all(row[-1] == "gpu1" for row in rows(on_gpu1))
    [pdb] = rows(kubectl(api, "get", "pdb", "-n", "serving"))
    assert pdb[:4] == ["inference", "2", "N/A", "1"]  # three healthy, two needed: one may go
    assert "inference" in kubectl(api, "get", "deployments", "-n", "serving")
    assert "node-exporter" in kubectl(api, "get", "ds", "-n", "monitoring")


def test_cordon_label_annotate_taint_and_uncordon(api: KubeApiProcess) -> None:
    kubectl(api, "cordon", "gpu2")
    assert rows(kubectl(api, "get", "node", "gpu2"))[0][1] == "Ready,SchedulingDisabled"
    kubectl(api, "label", "node", "gpu2", "gpufleet.io/pool=retired", "--overwrite")
    kubectl(api, "annotate", "node", "gpu2", "gpufleet.io/incident=lab-gpu2-1")
    kubectl(api, "taint", "node", "gpu2", "gpufleet.io/retired=true:NoSchedule")
    node = KubernetesApi(kubeconfig=api.kubeconfig).get_node("gpu2")  # what gpufleet's client sees
    assert node.unschedulable and node.labels["gpufleet.io/pool"] == "retired"
    assert any(t["key"] == "gpufleet.io/retired" and t["effect"] == "NoSchedule" for t in node.taints)
    kubectl(api, "taint", "node", "gpu2", "gpufleet.io/retired-")
    kubectl(api, "uncordon", "gpu2")
    node = KubernetesApi(kubeconfig=api.kubeconfig).get_node("gpu2")
    assert not node.unschedulable and not node.taints


def test_drain_respects_the_budget_then_goes_on(api: KubeApiProcess) -> None:
    drain = ["drain", "--ignore-daemonsets", "--delete-emptydir-data"]
    kubectl(api, *drain, "gpu1", "--timeout=30s")  # the budget allows one inference pod down
    assert rows(kubectl(api, "get", "pdb", "-n", "serving"))[0][3] == "0"
    refused = kubectl(api, *drain, "gpu2", "--timeout=3s", check=False)
    assert "disruption budget" in refused or "global timeout reached" in refused
    left = {row[1] for row in rows(kubectl(api, "get", "pods", "-A", "--field-selector", "spec.nodeName=gpu2"))}
    assert left == {"inference-5c9f7d6b8-gpu2", "node-exporter-gpu2"}  # 429: nothing went
    kubectl(api, *drain, "gpu2", "--disable-eviction", "--timeout=30s")  # deletes, past the budget
    left = {row[1] for row in rows(kubectl(api, "get", "pods", "-A", "--field-selector", "spec.nodeName=gpu2"))}
    assert left == {"node-exporter-gpu2"}  # DaemonSet pods stay


def test_delete_pod_and_apply_the_deploy_manifests(api: KubeApiProcess) -> None:
    kubectl(api, "delete", "pod", "-n", "monitoring", "node-exporter-spare1")
    assert "node-exporter-spare1" not in kubectl(api, "get", "pods", "-n", "monitoring")
    first = kubectl(api, "apply", "--validate=false", "-f", str(REPO / "deploy"))
    assert "daemonset.apps/gpufleet-detector created" in first
    again = kubectl(api, "apply", "--validate=false", "-f", str(REPO / "deploy"))
    assert "daemonset.apps/gpufleet-detector unchanged" in again
    assert "gpufleet-worker" in kubectl(api, "get", "deploy", "-n", "gpufleet")


def drained_state(api: KubeApiProcess, node: str) -> dict[str, Any]:
    pods = json.loads(kubectl(api, "get", "pods", "-A", "-o", "json", "--field-selector", f"spec.nodeName={node}"))
    pdb = json.loads(kubectl(api, "get", "pdb", "-n", "serving", "inference", "-o", "json"))
    return {
        "cordoned": json.loads(kubectl(api, "get", "node", node, "-o", "json"))["spec"].get("unschedulable", False),
        "pods_left": sorted(p["metadata"]["ownerReferences"][0]["kind"] for p in pods["items"]),
        "budget_respected": pdb["status"]["currentHealthy"] >= pdb["spec"]["minAvailable"],
    }


def test_kubectl_drain_and_gpufleet_drain_end_the_same(tmp_path: Path) -> None:
    """One lab, gpu1 drained by kubectl, gpu2 (its twin) by gpufleet: cordoned, the inference
    pod evicted, the budget kept, the DaemonSet pod left. (gpufleet's taint and annotation are
    its own extras, not compared.)"""

    nodes = [node_object(n, pool="training") for n in TRAINING]
    workloads = lab_workloads(TRAINING, TRAINING)
    workloads["pdbs"][0]["spec"]["minAvailable"] = 1  # room for one pod down on each side
    api = KubeApiProcess(tmp_path / "kube", {"nodes": nodes, **workloads})
    try:
        kubectl(api, "drain", "gpu1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=30s")
        by_kubectl = drained_state(api, "gpu1")
        activities = KubeActivities(KubernetesApi(kubeconfig=api.kubeconfig))
        request = KubeDrainRequest(node="gpu2", incident_id="lab-gpu2-1", eviction_timeout_seconds=30)
        result = ActivityEnvironment().run(activities.cordon_and_drain, request)
        by_gpufleet = drained_state(api, "gpu2")
    finally:
        api.stop()
    assert by_kubectl == by_gpufleet == {"cordoned": True, "pods_left": ["DaemonSet"], "budget_respected": True}
    assert result.evicted == ["serving/inference-5c9f7d6b8-gpu2"] and not result.forced
