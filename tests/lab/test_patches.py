"""The emulated API's patches and field checks, against the behaviour Kubernetes documents
(the strategic-merge examples of "Update API Objects in Place Using kubectl patch", RFC 7386's
and RFC 6902's own examples) with Kubernetes' own schemas."""

from __future__ import annotations

from typing import Any

import pytest

from lab import openapi
from lab.patches import PatchError, json_patch, merge_patch, strategic_merge_patch

DEPLOYMENT = openapi.definitions()["io.k8s.api.apps.v1.Deployment"]
NODE = openapi.definitions()["io.k8s.api.core.v1.Node"]
POD = openapi.definitions()["io.k8s.api.core.v1.Pod"]


def deployment(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"replicas": 2, "template": {"spec": {"containers": list(containers)}}}}


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]  # type: ignore[no-any-return]


def test_containers_merge_by_name_and_the_rest_of_each_is_kept() -> None:
    original = deployment({"name": "server", "image": "vllm:1", "args": ["--port=8000"]})
    patch = deployment({"name": "server", "image": "vllm:2"}, {"name": "sidecar", "image": "envoy"})
    patched = strategic_merge_patch(original, patch, DEPLOYMENT)
    assert containers(patched) == [
        {"name": "server", "image": "vllm:2", "args": ["--port=8000"]},
        {"name": "sidecar", "image": "envoy"},
    ]
    assert containers(original) == [{"name": "server", "image": "vllm:1", "args": ["--port=8000"]}]  # untouched
    # The same patch as a JSON merge patch replaces the list: the args are gone.
    assert containers(merge_patch(original, patch))[0] == {"name": "server", "image": "vllm:2"}


def test_the_directives_kubectl_writes() -> None:
    original = deployment({"name": "a", "image": "x"}, {"name": "b", "image": "y"}, {"name": "c", "image": "z"})
    deleted = strategic_merge_patch(original, deployment({"name": "b", "$patch": "delete"}), DEPLOYMENT)
    assert [c["name"] for c in containers(deleted)] == ["a", "c"]
    ordered_patch: dict[str, Any] = {
        "spec": {"template": {"spec": {"$setElementOrder/containers": [{"name": "c"}, {"name": "a"}, {"name": "b"}]}}}
    }
    assert [c["name"] for c in containers(strategic_merge_patch(original, ordered_patch, DEPLOYMENT))] == [
        "c",
        "a",
        "b",
    ]
    replaced = strategic_merge_patch(
        original, deployment({"$patch": "replace"}, {"name": "d", "image": "w"}), DEPLOYMENT
    )
    assert containers(replaced) == [{"name": "d", "image": "w"}]
    retained = strategic_merge_patch(
        {"spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}}},
        {"spec": {"strategy": {"$retainKeys": ["type"], "type": "Recreate"}}},
        DEPLOYMENT,
    )
    assert retained == {"spec": {"strategy": {"type": "Recreate"}}}
    finalizers = strategic_merge_patch(
        {"metadata": {"finalizers": ["a", "b", "c"]}}, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["b"]}}, POD
    )
    assert finalizers == {"metadata": {"finalizers": ["a", "c"]}}
    with pytest.raises(PatchError, match="unknown patch directive"):
        strategic_merge_patch(original, {"$patch": "explode"}, DEPLOYMENT)


def test_a_nodes_taints_are_replaced_whole_its_conditions_merged_by_type_and_null_removes() -> None:
    node = {
        "metadata": {"labels": {"pool": "training", "zone": "a"}},
        "spec": {"taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "DiskPressure", "status": "False"}]},
    }
    patch = {
        "metadata": {"labels": {"zone": None, "pool": "spare"}},
        "spec": {"taints": [{"key": "c", "effect": "NoExecute"}], "unschedulable": True},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    patched = strategic_merge_patch(node, patch, NODE)
    assert patched["metadata"]["labels"] == {"pool": "spare"}
    assert patched["spec"] == {"taints": [{"key": "c", "effect": "NoExecute"}], "unschedulable": True}
    assert patched["status"]["conditions"] == [
        {"type": "Ready", "status": "False"},
        {"type": "DiskPressure", "status": "False"},
    ]
    with pytest.raises(PatchError, match="has no 'type'"):
        strategic_merge_patch(node, {"status": {"conditions": [{"status": "False"}]}}, NODE)


def test_a_set_of_scalars_merges_as_a_set() -> None:
    patched = strategic_merge_patch({"metadata": {"finalizers": ["a", "c"]}}, {"metadata": {"finalizers": ["b"]}}, POD)
    assert patched["metadata"]["finalizers"] == ["a", "c", "b"]
    missing = strategic_merge_patch({"metadata": {}}, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}}, POD)
    assert missing == {"metadata": {}}  # nothing to delete from: no list made up


def test_the_merged_order_is_apimachinerys() -> None:
    """The patch's order wins; what only the server has keeps its place (kubectl apply relies on it)."""
    swapped = strategic_merge_patch(
        deployment({"name": "a"}, {"name": "b"}), deployment({"name": "b"}, {"name": "a"}), DEPLOYMENT
    )
    assert [c["name"] for c in containers(swapped)] == ["b", "a"]
    order: dict[str, Any] = {
        "spec": {"template": {"spec": {"$setElementOrder/containers": [{"name": "c"}, {"name": "a"}]}}}
    }
    three = deployment({"name": "a"}, {"name": "b"}, {"name": "c"})
    assert [c["name"] for c in containers(strategic_merge_patch(three, order, DEPLOYMENT))] == ["b", "c", "a"]
    # Deletions first: a delete and a change of the same key in one patch leave the change.
    both = deployment({"name": "a", "image": "a2"}, {"name": "a", "$patch": "delete"})
    assert containers(strategic_merge_patch(deployment({"name": "a", "image": "a1"}), both, DEPLOYMENT)) == [
        {"name": "a", "image": "a2"}
    ]


def test_json_merge_patch_rfc_7386_example() -> None:
    target = {"title": "Goodbye!", "author": {"givenName": "John", "familyName": "Doe"}, "tags": ["example", "sample"]}
    patch = {"title": "Hello!", "phoneNumber": "+01-123-456-7890", "author": {"familyName": None}, "tags": ["example"]}
    assert merge_patch(target, patch) == {
        "title": "Hello!",
        "author": {"givenName": "John"},
        "tags": ["example"],
        "phoneNumber": "+01-123-456-7890",
    }


def test_json_patch_rfc_6902_operations_and_errors() -> None:
    doc = {"metadata": {"labels": {"a": "1"}}, "spec": {"taints": [{"key": "x"}]}}
    patched = json_patch(
        doc,
        [
            {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
            {"op": "replace", "path": "/metadata/labels/a", "value": "3"},
            {"op": "add", "path": "/spec/taints/-", "value": {"key": "y"}},
            {"op": "copy", "from": "/spec/taints/0", "path": "/spec/taints/0"},
            {"op": "remove", "path": "/spec/taints/1"},
            {"op": "move", "from": "/metadata/labels/b~1c", "path": "/metadata/moved"},
            {"op": "test", "path": "/metadata/moved", "value": "2"},
        ],
    )
    assert patched == {
        "metadata": {"labels": {"a": "3"}, "moved": "2"},
        "spec": {"taints": [{"key": "x"}, {"key": "y"}]},
    }
    assert doc["metadata"] == {"labels": {"a": "1"}}  # untouched
    with pytest.raises(PatchError, match="the value differs"):
        json_patch(doc, [{"op": "test", "path": "/metadata/labels/a", "value": "2"}])
    with pytest.raises(PatchError, match="no path /spec/missing/x"):
        json_patch(doc, [{"op": "replace", "path": "/spec/missing/x", "value": 1}])
    with pytest.raises(PatchError, match="a list of operations"):
        json_patch(doc, {"spec": {}})
    with pytest.raises(PatchError, match="a JSON pointer is a string"):
        json_patch(doc, [{"op": "remove", "path": 3}])
    with pytest.raises(PatchError, match="no path"):
        json_patch(doc, [{"op": "remove", "path": "/spec/taints/\u00b2"}])  # a digit, but not an index
    with pytest.raises(PatchError, match="no from"):
        json_patch(doc, [{"op": "copy", "path": "/x"}])
    with pytest.raises(PatchError, match="into itself"):
        json_patch(doc, [{"op": "move", "from": "/metadata", "path": "/metadata/labels/m"}])
    with pytest.raises(PatchError, match="the value differs"):
        json_patch({"a": 1}, [{"op": "test", "path": "/a", "value": True}])  # JSON: true is not 1


def test_unknown_fields_are_named_by_path_and_maps_take_any_key() -> None:
    obj = {
        "metadata": {"name": "web", "labels": {"any/key": "v"}, "annotations": {"x": "y"}},
        "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "imagee": "y"}]}}},
        "specc": {},
    }
    assert openapi.unknown_fields(DEPLOYMENT, obj) == ["spec.template.spec.containers[1].imagee", "specc"]
    assert openapi.unknown_fields(DEPLOYMENT, {"spec": {"template": {"$patch": "replace"}}}) == []


def test_the_openapi_document_names_each_kind_and_the_field_validation_it_serves() -> None:
    document = openapi.document("apps", "v1", [("Deployment", "deployments", True)])
    patch = document["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "apps", "version": "v1", "kind": "Deployment"}
    assert [p["name"] for p in patch["parameters"]] == ["fieldValidation"]
    schemas = document["components"]["schemas"]
    assert "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta" in schemas  # what Deployment refers to
    assert "io.k8s.api.core.v1.Node" not in schemas  # nor more
    index = openapi.index({"apis/apps/v1": document})
    assert index["paths"]["apis/apps/v1"]["serverRelativeURL"].startswith("/openapi/v3/apis/apps/v1?hash=")
