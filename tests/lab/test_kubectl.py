"""kubectl, a client nobody here wrote, against the lab's emulated Kubernetes API.

The API is seeded as the lab seeds it: Nodes, an inference Deployment (its ReplicaSet's pods
under a PodDisruptionBudget that allows one down) and a node-exporter DaemonSet on every node.
The last test drains one node with ``kubectl drain`` and its twin with gpufleet's
cordon-and-drain, and compares what matters.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from temporalio.testing import ActivityEnvironment

from activities.kube import KubeActivities
from clients.kube import KubernetesApi
from lab.kubeapi import lab_workloads, node_object
from models.requests import KubeDrainRequest
from tests.conftest import REPO, KubeApiProcess

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (make test installs it as root)")


def _kubectl_minor() -> int:
    if KUBECTL is None:
        return 0
    done = subprocess.run([KUBECTL, "version", "--client", "-o", "json"], capture_output=True, text=True, check=False)
    try:
        return int(re.sub(r"\D", "", json.loads(done.stdout)["clientVersion"]["minor"]))
    except (ValueError, KeyError):
        return 0


# kubectl reads the OpenAPI v3 documents (explain, whether the server validates fields) from 1.27;
# older ones read only the v2 document in protobuf, which the emulator does not serve.
OPENAPI_V3 = _kubectl_minor() >= 27
VALIDATE = [] if OPENAPI_V3 else ["--validate=false"]
needs_openapi_v3 = pytest.mark.skipif(
    not OPENAPI_V3, reason="kubectl older than 1.27 reads OpenAPI v2 (protobuf), which the lab does not serve"
)

# kubectl 1.20 describes budgets through policy/v1beta1, which the lab does not serve (it serves policy/v1).
DESCRIBES_PDB_V1 = _kubectl_minor() >= 21

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
    [daemonset] = rows(kubectl(api, "get", "ds", "-n", "monitoring"))
    assert daemonset[:3] == ["node-exporter", "4", "4"]  # DESIRED, CURRENT: one on every node
    listed = kubectl(api, "get", "pods", "-n", "serving", "-o", "yaml")
    assert listed.count("kind: Pod\n") == len(TRAINING) and "nodeName: gpu3" in listed


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


def serving_pod(api: KubeApiProcess, name: str, node: str, *, ready: bool) -> None:
    """An inference pod as the kubelet reports it: Running and Ready, or Pending."""
    status = _running_status() if ready else {"phase": "Pending"}
    body: Any = {
        "metadata": {"name": name, "namespace": "serving", "labels": {"app": "inference"}},
        "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm/vllm-openai"}]},
        "status": status,
    }
    k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(api.kubeconfig))).create_namespaced_pod(
        "serving", body
    )


def _running_status() -> dict[str, Any]:
    return {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}


def budget(api: KubeApiProcess) -> tuple[int, int]:
    """The inference budget's (currentHealthy, disruptionsAllowed), as kubectl reads them."""
    status = json.loads(kubectl(api, "get", "pdb", "-n", "serving", "inference", "-o", "json"))["status"]
    return status["currentHealthy"], status["disruptionsAllowed"]


def test_the_budget_follows_pods_as_they_come_and_go(api: KubeApiProcess) -> None:
    assert budget(api) == (3, 1)
    kubectl(api, "delete", "pod", "-n", "serving", "inference-5c9f7d6b8-gpu3")
    assert budget(api) == (2, 0)
    serving_pod(api, "inference-pending", "spare1", ready=False)  # not serving yet: counts for nothing
    assert budget(api) == (2, 0)
    serving_pod(api, "inference-spare1", "spare1", ready=True)
    assert budget(api) == (3, 1)
    [deployment] = rows(kubectl(api, "get", "deploy", "-n", "serving"))
    assert deployment[1] == "3/3"  # READY: the Ready pods there are, of the replicas wanted


def test_a_refused_drain_goes_on_once_the_budget_allows(api: KubeApiProcess) -> None:
    drain = ["drain", "--ignore-daemonsets", "--delete-emptydir-data"]
    kubectl(api, *drain, "gpu1", "--timeout=30s")  # takes the one disruption the budget allows
    assert KUBECTL is not None
    waiting = subprocess.Popen(
        [KUBECTL, *drain, "gpu2", "--timeout=120s"],
        env={**os.environ, "KUBECONFIG": str(api.kubeconfig)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert waiting.stdout is not None
        seen = []
        for line in waiting.stdout:  # kubectl says why, then retries every 5 s
            seen.append(line)
            if "Cannot evict pod as it would violate the pod's disruption budget" in line:
                break
        else:
            raise AssertionError(f"kubectl drain never said it was refused: {''.join(seen)}")
        assert "inference-5c9f7d6b8-gpu2" in kubectl(api, "get", "pods", "-n", "serving")  # still there
        serving_pod(api, "inference-spare1", "spare1", ready=True)  # a replacement serves: one may go
        rest = waiting.communicate(timeout=120)[0]
    finally:
        waiting.kill()
    assert waiting.returncode == 0, rest
    assert "pod/inference-5c9f7d6b8-gpu2 evicted" in rest and "node/gpu2 drained" in rest


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
    first = kubectl(api, "apply", *VALIDATE, "-k", str(REPO / "deploy" / "base"))
    assert "daemonset.apps/gpufleet-detector created" in first and "Warning" not in first
    again = kubectl(api, "apply", *VALIDATE, "-k", str(REPO / "deploy" / "base"))
    assert "daemonset.apps/gpufleet-detector unchanged" in again
    assert "gpufleet-worker" in kubectl(api, "get", "deploy", "-n", "gpufleet")


WEB = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: serving}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers: [{name: web, %s: nginx:1.27, args: ["--port=80"]}]
"""


@needs_openapi_v3
def test_explain_and_field_validation_from_the_openapi_documents(api: KubeApiProcess, tmp_path: Path) -> None:
    explained = kubectl(api, "explain", "node.spec.taints")
    assert "FIELD: taints <[]Taint>" in explained and "effect\t<string> -required-" in explained
    assert "Node is a worker node in Kubernetes" in kubectl(api, "explain", "node")
    typo = tmp_path / "typo.yaml"
    typo.write_text(WEB % "imagee", encoding="utf-8")
    refused = kubectl(api, "apply", "-f", str(typo), check=False)  # kubectl asks for Strict
    assert 'strict decoding error: unknown field "spec.template.spec.containers[0].imagee"' in refused
    assert "web" not in kubectl(api, "get", "deploy", "-n", "serving", "-o", "name")  # nothing created
    warned = kubectl(api, "apply", "--validate=warn", "-f", str(typo))
    assert 'Warning: unknown field "spec.template.spec.containers[0].imagee"' in warned


def containers_of(api: KubeApiProcess, name: str) -> list[dict[str, Any]]:
    deployment = json.loads(kubectl(api, "get", "deploy", "-n", "serving", name, "-o", "json"))
    return deployment["spec"]["template"]["spec"]["containers"]  # type: ignore[no-any-return]


def test_patches_as_the_api_server_applies_them(api: KubeApiProcess, tmp_path: Path) -> None:
    manifest = tmp_path / "web.yaml"
    manifest.write_text(WEB % "image", encoding="utf-8")
    kubectl(api, "apply", *VALIDATE, "-f", str(manifest))
    pair = [{"name": "web", "image": "nginx:1.28"}, {"name": "envoy", "image": "envoy"}]
    sidecar = json.dumps({"spec": {"template": {"spec": {"containers": pair}}}})
    kubectl(api, "patch", "deploy", "-n", "serving", "web", "-p", sidecar)  # strategic: merged by name
    assert containers_of(api, "web") == [
        {"name": "web", "image": "nginx:1.28", "args": ["--port=80"]},
        {"name": "envoy", "image": "envoy"},
    ]
    ops = '[{"op":"replace","path":"/spec/template/spec/containers/1/image","value":"envoy:2"}]'
    kubectl(api, "patch", "deploy", "-n", "serving", "web", "--type", "json", "-p", ops)
    assert containers_of(api, "web")[1] == {"name": "envoy", "image": "envoy:2"}
    only = '{"spec":{"template":{"spec":{"containers":[{"name":"web","image":"nginx:1.29"}]}}}}'
    kubectl(api, "patch", "deploy", "-n", "serving", "web", "--type", "merge", "-p", only)  # a list replaces
    assert containers_of(api, "web") == [{"name": "web", "image": "nginx:1.29"}]
    manifest.write_text((WEB % "image").replace("nginx:1.27", "nginx:1.30"), encoding="utf-8")
    kubectl(api, "apply", *VALIDATE, "-f", str(manifest))  # three-way
    assert containers_of(api, "web") == [{"name": "web", "image": "nginx:1.30", "args": ["--port=80"]}]
    missing = kubectl(api, "patch", "deploy", "-n", "serving", "web", "--type", "json", "-p", ops, check=False)
    assert "no path /spec/template/spec/containers/1" in missing  # 422, and nothing changed
    server_side = kubectl(api, "apply", "--server-side", "-f", str(manifest), check=False)
    if OPENAPI_V3:  # kubectl 1.20 fails earlier, on the OpenAPI v2 document it fetches first
        assert "server-side apply is not served" in server_side
    assert "error" in server_side.lower()
    assert containers_of(api, "web")[0]["image"] == "nginx:1.30"  # refused: nothing changed


@contextlib.contextmanager
def watching(api: KubeApiProcess, *args: str) -> Iterator[Callable[[], str]]:
    """``kubectl get ARGS --watch`` running; yields a function returning its next line (60 s at most)."""
    assert KUBECTL is not None
    watch = subprocess.Popen(
        [KUBECTL, "get", *args, "--watch"],
        env={**os.environ, "KUBECONFIG": str(api.kubeconfig)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in watch.stdout or []:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def next_line() -> str:
        try:
            return lines.get(timeout=60)
        except queue.Empty:
            raise AssertionError(f"kubectl get {' '.join(args)} --watch printed nothing for 60 s") from None

    try:
        yield next_line
    finally:
        watch.kill()
        watch.wait(timeout=10)


def test_get_watch_prints_each_change(api: KubeApiProcess) -> None:
    with watching(api, "nodes") as next_line:
        listed = [next_line() for _ in range(1 + len(TRAINING + SPARES))]  # the header, then each node once
        assert [line.split()[0] for line in listed[1:]] == TRAINING + SPARES
        kubectl(api, "cordon", "gpu2")
        changed = next_line().split()
        assert changed[:2] == ["gpu2", "Ready,SchedulingDisabled"]  # the change, not the whole list again


@needs_openapi_v3  # kubectl asks the OpenAPI document whether the server supports dry runs
def test_server_dry_runs_change_nothing(api: KubeApiProcess) -> None:
    before = kubectl(api, "get", "nodes,pods", "-A", "-o", "json")
    assert "(server dry run)" in kubectl(api, "cordon", "gpu1", "--dry-run=server")
    kubectl(api, "label", "node", "gpu1", "x=y", "--dry-run=server")
    drained = kubectl(api, "drain", "gpu1", "--ignore-daemonsets", "--dry-run=server")
    assert "evicting pod serving/inference-5c9f7d6b8-gpu1 (server dry run)" in drained
    kubectl(api, "delete", "pod", "-n", "monitoring", "node-exporter-gpu2", "--dry-run=server")
    assert kubectl(api, "get", "nodes,pods", "-A", "-o", "json") == before


def test_namespaces_labels_and_a_namespaced_watch(api: KubeApiProcess, tmp_path: Path) -> None:
    assert [row[0] for row in rows(kubectl(api, "get", "ns"))] == ["serving", "monitoring"]
    namespace = tmp_path / "ns.yaml"
    namespace.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: batch}\n", encoding="utf-8")
    kubectl(api, "create", *VALIDATE, "-f", str(namespace))
    assert rows(kubectl(api, "get", "ns", "batch"))[0][0] == "batch"
    pods = kubectl(api, "get", "pods", "-A", "-l", "app=node-exporter", "-o", "name")
    assert pods.split() == [f"pod/node-exporter-{node}" for node in TRAINING + SPARES]
    pod = tmp_path / "pod.yaml"
    pod.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: probe}\nspec: {containers: [{name: c, image: busybox}]}\n",
        encoding="utf-8",
    )
    with watching(api, "pods", "-n", "batch") as next_line:
        # Created in the namespace the command names (the manifest names none), and watched there.
        kubectl(api, "create", *VALIDATE, "-n", "batch", "-f", str(pod))
        seen = next_line()
        while not seen.startswith("probe"):
            seen = next_line()
        assert seen.split()[2] == "Pending"
    assert rows(kubectl(api, "get", "pods", "-n", "batch"))[0][0] == "probe"


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


def test_describe_pods_budgets_and_deployments(api: KubeApiProcess) -> None:
    pod = kubectl(api, "describe", "pod", "-n", "serving", "inference-5c9f7d6b8-gpu1")
    assert re.search(r"Node:\s+gpu1", pod) and re.search(r"Controlled By:\s+ReplicaSet/inference-5c9f7d6b8", pod)
    if DESCRIBES_PDB_V1:
        budget = kubectl(api, "describe", "pdb", "-n", "serving", "inference")
        assert re.search(r"Min available:\s+2", budget) and re.search(r"Allowed disruptions:\s+1", budget)
    deployment = kubectl(api, "describe", "deploy", "-n", "serving", "inference")
    assert re.search(r"Replicas:\s+3 desired", deployment)
    exporter = kubectl(api, "describe", "pod", "-n", "monitoring", "node-exporter-gpu2")
    assert re.search(r"Controlled By:\s+DaemonSet/node-exporter", exporter)


def test_a_stale_replace_is_refused_with_a_conflict(api: KubeApiProcess, tmp_path: Path) -> None:
    """kubectl replace sends the resourceVersion it read; a write in between makes it stale (409)."""
    stale = tmp_path / "gpu1.json"
    stale.write_text(kubectl(api, "get", "node", "gpu1", "-o", "json"), encoding="utf-8")
    kubectl(api, "label", "node", "gpu1", "gpufleet.io/pool=retired", "--overwrite")  # someone else's write
    refused = kubectl(api, "replace", *VALIDATE, "-f", str(stale), check=False)
    assert "the object has been modified; please apply your changes to the latest version" in refused
    fresh = json.loads(kubectl(api, "get", "node", "gpu1", "-o", "json"))
    assert fresh["metadata"]["labels"]["gpufleet.io/pool"] == "retired"  # the refused write changed nothing
    fresh["metadata"]["labels"]["team"] = "vision"
    stale.write_text(json.dumps(fresh), encoding="utf-8")
    assert "node/gpu1 replaced" in kubectl(api, "replace", *VALIDATE, "-f", str(stale))
