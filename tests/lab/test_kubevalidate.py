"""The emulated API refuses the names and values a real kube-apiserver refuses: 422 Invalid, a
Status with details.causes, and the apiserver's own words; over HTTP with the official client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from lab.kubeapi import node_object
from tests.conftest import KubeApiProcess

apis: Any = kubernetes.client  # the client's typed models are not needed: plain dicts are sent

LONG_LABEL = "a" * 64
LABEL_RULES = (
    "(e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?"
    "[A-Za-z0-9])?')"
)
QNAME_REGEX = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
SUBDOMAIN_REGEX = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiProcess]:
    seed: dict[str, object] = {
        "nodes": [node_object("gpu1", pool="training")],
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpufleet"}}],
    }
    process = KubeApiProcess(tmp_path_factory.mktemp("kube"), seed)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(api: KubeApiProcess) -> Any:
    return kubernetes.config.new_client_from_config(config_file=str(api.kubeconfig))


def refusal(call: Any) -> dict[str, Any]:
    """The Status of a write the server refuses: it must be 422 Invalid."""
    with pytest.raises(ApiException) as raised:
        call()
    assert raised.value.status == 422, raised.value.body
    status: dict[str, Any] = json.loads(str(raised.value.body))
    assert status["kind"] == "Status" and status["reason"] == "Invalid" and status["code"] == 422
    return status


def node(name: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, **meta}}


def test_a_label_value_longer_than_63_characters(client: Any) -> None:
    core = apis.CoreV1Api(client)
    status = refusal(lambda: core.create_node(node("n-long-value", labels={"pool": LONG_LABEL})))
    assert status["message"] == (
        f'Node "n-long-value" is invalid: metadata.labels: Invalid value: "{LONG_LABEL}": '
        "must be no more than 63 characters"
    )
    assert status["details"] == {
        "name": "n-long-value",
        "kind": "Node",
        "causes": [
            {
                "reason": "FieldValueInvalid",
                "message": f'Invalid value: "{LONG_LABEL}": must be no more than 63 characters',
                "field": "metadata.labels",
            }
        ],
    }
    with pytest.raises(ApiException) as gone:
        core.read_node("n-long-value")
    assert gone.value.status == 404  # nothing was stored


def test_bad_label_values_and_keys_on_patch_merge_strategic_and_json(client: Any) -> None:
    core = apis.CoreV1Api(client)
    # The official client sends a dict as a strategic-merge patch and a list as a JSON patch.
    status = refusal(lambda: core.patch_node("gpu1", {"metadata": {"labels": {"zone": "a:b"}}}))
    assert status["message"] == (
        'Node "gpu1" is invalid: metadata.labels: Invalid value: "a:b": a valid label must be an empty string '
        "or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
        "character " + LABEL_RULES
    )
    status = refusal(
        lambda: core.patch_node("gpu1", [{"op": "add", "path": "/metadata/labels/bad~1key~1x", "value": "v"}])
    )
    assert status["details"]["causes"][0]["field"] == "metadata.labels"
    assert 'Invalid value: "bad/key/x": a qualified name must consist of' in status["message"]
    merge = "application/merge-patch+json"
    body = {"metadata": {"labels": {"example.com/" + "k" * 64: "v"}}}
    status = refusal(lambda: core.patch_node("gpu1", body, _content_type=merge))
    assert status["message"] == (
        'Node "gpu1" is invalid: metadata.labels: Invalid value: "example.com/'
        + "k" * 64
        + '": name part must be no more than 63 characters'
    )
    assert core.read_node("gpu1").metadata.labels.get("zone") is None  # nothing changed


def test_a_replace_is_checked_as_a_patch_is(client: Any) -> None:
    core = apis.CoreV1Api(client)
    current = core.read_node("gpu1").to_dict()
    meta = {"name": "gpu1", "resourceVersion": current["metadata"]["resource_version"]}
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {**meta, "labels": {"gpufleet.io/claim": "x" * 64}}}
    status = refusal(lambda: core.replace_node("gpu1", body))
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": f'Invalid value: "{"x" * 64}": must be no more than 63 characters',
            "field": "metadata.labels",
        }
    ]
    apps = apis.AppsV1Api(client)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web", "bad key": "v"}},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    }
    status = refusal(lambda: apps.create_namespaced_deployment("gpufleet", deployment))
    assert status["message"].startswith(
        'Deployment.apps "web" is invalid: spec.template.labels: Invalid value: "bad key"'
    )


def test_an_empty_label_value_and_a_prefixed_key_are_fine(client: Any) -> None:
    core = apis.CoreV1Api(client)
    patched = core.patch_node("gpu1", {"metadata": {"labels": {"example.com/empty": "", "v": "a" * 63}}})
    assert patched.metadata.labels["example.com/empty"] == ""


def test_a_bad_prefix_lists_every_cause(client: Any) -> None:
    core = apis.CoreV1Api(client)
    status = refusal(lambda: core.create_node(node("n-prefix", labels={"Bad_Prefix/name": "v"})))
    causes = status["details"]["causes"]
    assert [c["message"] for c in causes] == [f'Invalid value: "Bad_Prefix/name": prefix part {SUBDOMAIN_REGEX}']


def test_annotation_keys_and_their_total_size(client: Any) -> None:
    core = apis.CoreV1Api(client)
    status = refusal(lambda: core.patch_node("gpu1", {"metadata": {"annotations": {"a b": "x"}}}))
    assert status["message"] == f'Node "gpu1" is invalid: metadata.annotations: Invalid value: "a b": {QNAME_REGEX}'
    # Case does not matter in an annotation key (it does in a label key: neither is refused here).
    core.patch_node("gpu1", {"metadata": {"annotations": {"Example.COM/Key": "x"}}})
    big = {"big": "x" * (256 * 1024)}
    status = refusal(lambda: core.patch_node("gpu1", {"metadata": {"annotations": big}}))
    assert status["message"] == (
        'Node "gpu1" is invalid: metadata.annotations: Too long: may not be more than 262144 bytes'
    )
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueTooLong",
            "message": "Too long: may not be more than 262144 bytes",
            "field": "metadata.annotations",
        }
    ]


def test_taints(client: Any) -> None:
    core = apis.CoreV1Api(client)
    current = core.read_node("gpu1")

    def taint(*taints: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": current.metadata.resource_version}, "spec": {"taints": list(taints)}}

    status = refusal(lambda: core.patch_node("gpu1", taint({"key": "k", "value": "v" * 64, "effect": "NoSchedule"})))
    assert status["message"] == (
        f'Node "gpu1" is invalid: metadata.taints[0].value: Invalid value: "{"v" * 64}": '
        "must be no more than 63 characters"
    )
    status = refusal(lambda: core.patch_node("gpu1", taint({"key": "k", "value": "v", "effect": "Sometimes"})))
    assert status["message"] == (
        'Node "gpu1" is invalid: metadata.taints[0].effect: Unsupported value: "Sometimes": '
        'supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"'
    )
    status = refusal(lambda: core.patch_node("gpu1", taint({"key": "a/b/c", "value": "v", "effect": "NoExecute"})))
    assert status["details"]["causes"][0]["field"] == "metadata.taints[0].key"
    status = refusal(
        lambda: core.patch_node(
            "gpu1",
            taint(
                {"key": "k", "value": "1", "effect": "NoSchedule"}, {"key": "k", "value": "2", "effect": "NoSchedule"}
            ),
        )
    )
    assert status["message"] == (
        'Node "gpu1" is invalid: metadata.taints[1]: Duplicate value: core.Taint{Key:"k", Value:"2", '
        'Effect:"NoSchedule", TimeAdded:(*v1.Time)(nil)}: taints must be unique by key and effect pair'
    )
    assert status["details"]["causes"][0]["reason"] == "FieldValueDuplicate"
    # The same key with another effect is a different taint.
    core.patch_node(
        "gpu1",
        taint({"key": "k", "value": "1", "effect": "NoSchedule"}, {"key": "k", "value": "1", "effect": "NoExecute"}),
    )


def test_object_names_by_kind(client: Any) -> None:
    core = apis.CoreV1Api(client)
    status = refusal(lambda: core.create_node(node("Gpu_1")))
    assert status["message"] == f'Node "Gpu_1" is invalid: metadata.name: Invalid value: "Gpu_1": {SUBDOMAIN_REGEX}'
    too_long = ".".join(["a" * 63] * 4)  # 255 characters
    status = refusal(lambda: core.create_node(node(too_long)))
    assert status["details"]["causes"][0]["message"] == (
        f'Invalid value: "{too_long}": must be no more than 253 characters'
    )
    status = refusal(lambda: core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"labels": {}}}))
    assert status["message"] == 'Node "" is invalid: metadata.name: Required value: name or generateName is required'
    assert status["details"]["causes"][0]["reason"] == "FieldValueRequired"
    # A fully qualified name, and a single label of 63 characters, are fine for a Node.
    core.create_node(node("ip-10-0-12-34.us-west-2.compute.internal"))
    core.create_node(node("n" * 63))
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team.a"}}
    status = refusal(lambda: core.create_namespace(namespace))
    assert (
        status["message"]
        == 'Namespace "team.a" is invalid: metadata.name: Invalid value: "team.a": must not contain dots'
    )
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Settings"}}
    status = refusal(lambda: core.create_namespaced_config_map("gpufleet", config))
    assert status["details"]["causes"][0]["field"] == "metadata.name"
    leases = apis.CoordinationV1Api(client)
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "gpu_1"}, "spec": {}}
    status = refusal(lambda: leases.create_namespaced_lease("gpufleet", lease))
    assert status["message"].startswith('Lease.coordination.k8s.io "gpu_1" is invalid: metadata.name: Invalid value')
    assert status["details"]["group"] == "coordination.k8s.io" and status["details"]["kind"] == "Lease"


def job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}},
    }


def test_a_job_name_longer_than_63_characters_is_refused_for_its_pods_label(
    client: Any,
) -> None:
    batch = apis.BatchV1Api(client)
    name = "j" * 64  # a valid subdomain, but not a valid label value
    status = refusal(lambda: batch.create_namespaced_job("gpufleet", job(name)))
    assert status["message"] == (
        f'Job.batch "{name}" is invalid: spec.template.labels: Invalid value: "{name}": '
        "must be no more than 63 characters"
    )
    # Both labels the server adds (job-name and batch.kubernetes.io/job-name) are causes; the message names it once.
    assert [c["field"] for c in status["details"]["causes"]] == ["spec.template.labels", "spec.template.labels"]
    batch.create_namespaced_job("gpufleet", job("j" * 63))
    pods = apis.CoreV1Api(client)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"app": "x" * 64}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    status = refusal(lambda: pods.create_namespaced_pod("gpufleet", pod))
    assert status["details"]["causes"][0]["field"] == "metadata.labels"
