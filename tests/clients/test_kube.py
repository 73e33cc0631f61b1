"""KubernetesApi (the official client) over HTTP against the emulated API server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.errors import Conflict, InvalidInput, NotFound, TooManyRequests, Unavailable
from clients.kube import KubernetesApi, PodRef, checked_lease_name, checked_namespace, lease_name
from lab.kubeapi import node_object
from lab.procs import free_port
from tests.conftest import KubeApiProcess


def pod(name: str, node: str, labels: dict[str, str], *, owner: str | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "namespace": "default", "labels": labels}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner, "name": "x", "uid": "u"}]
    return {
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    seed: dict[str, object] = {
        "nodes": [
            node_object("gpu1", pool="training"),
            node_object("gpu2", pool="training"),
            node_object("spare1", pool="spare"),
        ],
        "pods": [
            pod("web-a", "gpu1", {"app": "web"}),
            pod("web-b", "gpu2", {"app": "web"}),
            pod("batch", "gpu1", {"app": "batch"}),
            pod("agent", "gpu1", {"app": "agent"}, owner="DaemonSet"),
        ],
        "pdbs": [
            {
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
            }
        ],
    }
    process = KubeApiProcess(tmp_path / "kube", seed)
    yield process
    process.stop()


@pytest.fixture
def kube(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig, poll_seconds=0.05)


def test_label_selectors(kube: KubernetesApi) -> None:
    assert [n.name for n in kube.list_nodes(label_selector="gpufleet.io/pool=spare")] == ["spare1"]
    assert [n.name for n in kube.list_nodes(label_selector="gpufleet.io/pool!=spare")] == ["gpu1", "gpu2"]
    assert [n.name for n in kube.list_nodes(label_selector="gpufleet.io/pool in (spare,retired)")] == ["spare1"]
    assert len(kube.list_nodes(label_selector="gpufleet.io/pool")) == 3
    assert kube.list_nodes(label_selector="!gpufleet.io/pool") == []


def test_a_listed_node_is_the_node_read_alone(kube: KubernetesApi) -> None:
    """Lists are read as JSON (no client models), single reads through the models: the same Node."""
    kube.set_unschedulable("gpu1", True)
    kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    kube.update_metadata("gpu2", labels={"team": "a"}, annotations={"gpufleet.io/claimed-by": "i2"})
    listed = kube.list_nodes()
    assert [n.name for n in listed] == ["gpu1", "gpu2", "spare1"]
    assert listed == [kube.get_node(n.name) for n in listed]
    assert listed[0].unschedulable and listed[0].taints and listed[0].ready
    assert listed[1].labels["team"] == "a" and listed[1].annotations["gpufleet.io/claimed-by"] == "i2"
    assert all(n.resource_version for n in listed)


def test_field_selector_lists_the_pods_of_one_node(kube: KubernetesApi) -> None:
    assert sorted(p.name for p in kube.pods_on_node("gpu1")) == ["agent", "batch", "web-a"]
    assert [p.name for p in kube.pods_on_node("gpu2")] == ["web-b"]
    assert kube.pods_on_node("spare1") == []


def test_cordon_and_taint_are_idempotent(kube: KubernetesApi) -> None:
    assert kube.set_unschedulable("gpu1", True).unschedulable
    assert kube.set_unschedulable("gpu1", True).unschedulable
    kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    node = kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    assert node.taints == [{"key": "gpufleet.io/unhealthy", "value": "i1", "effect": "NoSchedule"}]


def test_stale_resource_version_is_a_conflict(kube: KubernetesApi) -> None:
    before = kube.get_node("spare1")
    kube.update_metadata(
        "spare1", annotations={"gpufleet.io/claimed-by": "a"}, resource_version=before.resource_version
    )
    with pytest.raises(Conflict):
        kube.update_metadata(
            "spare1", annotations={"gpufleet.io/claimed-by": "b"}, resource_version=before.resource_version
        )
    assert kube.get_node("spare1").annotations["gpufleet.io/claimed-by"] == "a"


def test_eviction_refused_by_a_budget_then_allowed(kube: KubernetesApi) -> None:
    web_a = PodRef(namespace="default", name="web-a")
    web_b = PodRef(namespace="default", name="web-b")
    progress: list[str] = []
    # Two web pods, minAvailable 1: the first eviction goes through...
    assert kube.evict(web_a, timeout_seconds=1, progress=progress.append) == "evicted"
    # ...the second would break the budget: 429 until the deadline; then, not forced, the
    # budget is kept and the pod stays...
    with pytest.raises(TooManyRequests, match="would break its PodDisruptionBudget"):
        kube.evict(web_b, timeout_seconds=0.3, force=False)
    assert [p.name for p in kube.pods_on_node("gpu2")] == ["web-b"]
    # ...and forced, it is deleted.
    assert kube.evict(web_b, timeout_seconds=0.5, progress=progress.append) == "deleted"
    assert any("PodDisruptionBudget" in line for line in progress)
    assert kube.pods_on_node("gpu2") == []
    assert kube.evict(web_b, timeout_seconds=0.5) == "gone"


def test_missing_node_and_bad_names(kube: KubernetesApi) -> None:
    with pytest.raises(NotFound):
        kube.get_node("nosuch")
    with pytest.raises(InvalidInput):
        kube.get_node("gpu1/../../namespaces")
    kube.delete_node("gpu2")
    kube.delete_node("gpu2")  # already gone: a no-op
    with pytest.raises(NotFound):
        kube.get_node("gpu2")


def test_a_refused_write_says_what_the_api_server_refused(kube: KubernetesApi) -> None:
    with pytest.raises(InvalidInput) as refused:
        kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="lab-" + "n" * 70)
    assert str(refused.value).startswith("patch node gpu1: HTTP 422 Unprocessable Entity: ")
    assert 'Node "gpu1" is invalid: metadata.taints[0].value: Invalid value: "lab-' in str(refused.value)
    assert "must be no more than 63 characters" in str(refused.value)
    assert kube.get_node("gpu1").taints == []  # nothing changed


def test_unreachable_api_server_is_unavailable(tmp_path: Path) -> None:
    from lab.kubeapi import write_kubeconfig

    config = write_kubeconfig(tmp_path / "kubeconfig", server=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Unavailable):
        KubernetesApi(kubeconfig=config).list_nodes()


def test_a_silent_api_server_is_unavailable_after_the_request_timeout(tmp_path: Path) -> None:
    """GPUFLEET_KUBE_TIMEOUT_SECONDS: a server that takes the connection and never answers (a
    stopped process) fails the request after that long, not the default 15 s."""
    from lab.kubeapi import write_kubeconfig

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
        config = write_kubeconfig(tmp_path / "kubeconfig", server=f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(Unavailable):
            KubernetesApi(kubeconfig=config, request_timeout_seconds=0.5).list_nodes()
        assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="a request timeout is a positive number of seconds, not 0"):
        KubernetesApi(kubeconfig=config, request_timeout_seconds=0)


def test_remove_taint_is_idempotent_and_keeps_the_others(kube: KubernetesApi) -> None:
    kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="i1")
    kube.add_taint("gpu1", key="gpufleet.io/retired", value="i1")
    kube.add_taint("gpu1", key="gpufleet.io/retired", value="i1", effect="NoExecute")
    node = kube.remove_taint("gpu1", key="gpufleet.io/retired", effect="NoExecute")
    assert [(t["key"], t["effect"]) for t in node.taints] == [
        ("gpufleet.io/unhealthy", "NoSchedule"),
        ("gpufleet.io/retired", "NoSchedule"),
    ]
    kube.remove_taint("gpu1", key="gpufleet.io/retired")
    node = kube.remove_taint("gpu1", key="gpufleet.io/retired")
    assert node.taints == [{"key": "gpufleet.io/unhealthy", "value": "i1", "effect": "NoSchedule"}]
    assert kube.remove_taint("gpu1", key="gpufleet.io/unhealthy").taints == []
    assert kube.get_node("gpu1").taints == []
    with pytest.raises(NotFound):
        kube.remove_taint("nosuch", key="gpufleet.io/retired")


# -- Leases: one mutex per name across processes (coordination.k8s.io/v1, client-go's rules) ------------------------


def raw_lease(kube: KubernetesApi, name: str, namespace: str = "gpufleet") -> Any:
    return kube._coordination.read_namespaced_lease(name, namespace)


def test_lease_names_are_dns_1123_and_distinct() -> None:
    assert lease_name("gpufleet-partition-train") == "gpufleet-partition-train"
    odd = lease_name("gpufleet-partition-GPU_a100")
    assert checked_lease_name(odd) == odd and odd.startswith("gpufleet-partition-gpu-a100-")
    assert odd != lease_name("gpufleet-partition-gpu-a100") != lease_name("gpufleet-partition-gpu_A100")
    assert len(lease_name("x" * 400)) <= 253
    for bad in ("", "Train", "a_b", "-a", "a-", "a/b", "x" * 254):
        with pytest.raises(InvalidInput):
            checked_lease_name(bad)
    with pytest.raises(InvalidInput):
        checked_namespace("gpu.fleet")


def test_lease_acquire_and_release(kube: KubernetesApi) -> None:
    with kube.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-a") as lease:
        assert lease.held
        held = raw_lease(kube, "gpufleet-partition-train")
        assert held.spec.holder_identity == "worker-a"
        assert held.spec.lease_duration_seconds == 15
    assert not lease.held
    assert raw_lease(kube, "gpufleet-partition-train").spec.holder_identity is None
    # Free again: the next holder takes it at once, and the transition is counted.
    with kube.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-b", wait_seconds=1):
        taken = raw_lease(kube, "gpufleet-partition-train")
        assert taken.spec.holder_identity == "worker-b"
        assert taken.spec.lease_transitions == 1
    assert kube._coordination.list_namespaced_lease("other").items == []


def test_a_second_holder_waits_until_the_first_releases(kube: KubernetesApi, api: KubeApiProcess) -> None:
    other = KubernetesApi(kubeconfig=api.kubeconfig)  # its own connection, as another worker has
    entered = threading.Event()
    waited: list[float] = []

    def second() -> None:
        start = time.monotonic()
        with other.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-b", wait_seconds=10):
            waited.append(time.monotonic() - start)
            entered.set()

    first = kube.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-a")
    first.acquire()
    thread = threading.Thread(target=second)
    thread.start()
    try:
        assert not entered.wait(0.8), "the second holder got a Lease the first still holds"
    finally:
        first.release()
    assert entered.wait(5)
    thread.join(5)
    assert 0.8 <= waited[0] < 3


def test_a_live_holder_keeps_the_lease_past_its_duration(kube: KubernetesApi, api: KubeApiProcess) -> None:
    other = KubernetesApi(kubeconfig=api.kubeconfig)
    with kube.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-a", duration_seconds=1) as lease:
        start = time.monotonic()
        with (
            pytest.raises(Unavailable, match="held by worker-a"),
            other.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-b", wait_seconds=2.5),
        ):
            pass
        assert time.monotonic() - start >= 2.5
        assert lease.held  # renewed every third of a second, so never expired


def test_an_abandoned_lease_is_taken_over_after_its_duration_by_our_own_clock(kube: KubernetesApi) -> None:
    from kubernetes import client as k8s

    # A holder that died holding it: never renewed, and its renewTime from a machine whose clock
    # is far behind. Only the time WE see it unchanged counts, so the takeover waits the duration.
    kube._coordination.create_namespaced_lease(
        "gpufleet",
        k8s.V1Lease(
            metadata=k8s.V1ObjectMeta(name="gpufleet-partition-train", namespace="gpufleet"),
            spec=k8s.V1LeaseSpec(
                holder_identity="dead-worker",
                lease_duration_seconds=2,
                acquire_time="2001-01-01T00:00:00.000000Z",
                renew_time="2001-01-01T00:00:00.000000Z",
                lease_transitions=4,
            ),
        ),
    )
    start = time.monotonic()
    with kube.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-b", wait_seconds=10):
        elapsed = time.monotonic() - start
        taken = raw_lease(kube, "gpufleet-partition-train")
        assert taken.spec.holder_identity == "worker-b"
        assert taken.spec.lease_transitions == 5
    assert 2 <= elapsed < 4


def test_a_lease_taken_away_while_held_fails_the_block(kube: KubernetesApi) -> None:
    with (
        pytest.raises(Conflict, match="taken over"),
        kube.lease("gpufleet-partition-train", namespace="gpufleet", holder="worker-a", duration_seconds=1) as lease,
    ):
        stolen = raw_lease(kube, "gpufleet-partition-train")
        stolen.spec.holder_identity = "thief"
        kube._coordination.replace_namespaced_lease("gpufleet-partition-train", "gpufleet", stolen)
        deadline = time.monotonic() + 3
        while lease.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lease.held
    assert raw_lease(kube, "gpufleet-partition-train").spec.holder_identity == "thief"  # not cleared by us


def test_a_stale_replace_loses_with_conflict_and_a_second_create_with_already_exists(kube: KubernetesApi) -> None:
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException

    body = k8s.V1Lease(
        metadata=k8s.V1ObjectMeta(name="race", namespace="gpufleet"),
        spec=k8s.V1LeaseSpec(holder_identity="worker-a", lease_duration_seconds=15),
    )
    coordination: Any = kube._coordination
    coordination.create_namespaced_lease("gpufleet", body)
    with pytest.raises(ApiException) as exists:
        coordination.create_namespaced_lease("gpufleet", body)
    assert exists.value.status == 409 and '"AlreadyExists"' in str(exists.value.body)
    with pytest.raises(Conflict):
        kube._call("create lease", coordination.create_namespaced_lease, "gpufleet", body)

    seen_by_a = coordination.read_namespaced_lease("race", "gpufleet")
    seen_by_b = coordination.read_namespaced_lease("race", "gpufleet")
    seen_by_a.spec.holder_identity = "worker-a2"
    coordination.replace_namespaced_lease("race", "gpufleet", seen_by_a)
    seen_by_b.spec.holder_identity = "worker-b"
    with pytest.raises(Conflict):
        kube._call("replace lease", coordination.replace_namespaced_lease, "race", "gpufleet", seen_by_b)
    assert coordination.read_namespaced_lease("race", "gpufleet").spec.holder_identity == "worker-a2"
    with pytest.raises(NotFound):
        kube._call("read lease", coordination.read_namespaced_lease, "nosuch", "gpufleet")
