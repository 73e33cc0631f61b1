"""Slinky's CRDs (slurm-operator v1.2.1, vendored in lab/crds) served by the emulated API, and
custom resources checked against them as a real API server checks them: through the official
client over HTTP, and through kubectl where it is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from lab import crds
from models.cluster import load_spec
from models.slinky import API, slinky_objects
from tests.conftest import KubeApiProcess
from tests.models.test_cluster_spec import EXAMPLE

GROUP, VERSION = API.split("/")
NAMESPACE = "slurm-research"
PLACEMENT = {"train": ["free1", "free2"], "debug": ["free3"]}
KUBECTL = shutil.which("kubectl")
KINDS = {"Accounting", "Controller", "LoginSet", "NodeSet", "RestApi", "Token"}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    process = KubeApiProcess(tmp_path / "kube", {"namespaces": [namespace]})
    yield process
    process.stop()


@pytest.fixture
def custom(api: KubeApiProcess) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(k8s_config.new_client_from_config(str(api.kubeconfig)))


def get_json(api: KubeApiProcess, path: str) -> Any:
    with urllib.request.urlopen(api.url + path, timeout=10) as response:
        return json.loads(response.read())


def nodeset(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "NodeSet",
        "metadata": {"name": name},
        "spec": {"controllerRef": {"name": "research"}, **spec},
    }


def create(custom: k8s.CustomObjectsApi, plural: str, obj: dict[str, Any], **options: Any) -> dict[str, Any]:
    created: dict[str, Any] = custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, obj, **options)
    return created


def refused(call: Any) -> tuple[int, dict[str, Any]]:
    """The status code and Status body of a call the server refuses."""
    with pytest.raises(k8s.ApiException) as caught:
        call()
    return caught.value.status, json.loads(caught.value.body)


def causes(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {cause["field"]: (cause["reason"], cause["message"]) for cause in status["details"]["causes"]}


def test_the_crds_are_served_and_discovered(api: KubeApiProcess) -> None:
    extensions = k8s.ApiextensionsV1Api(k8s_config.new_client_from_config(str(api.kubeconfig)))
    listed = extensions.list_custom_resource_definition().items
    assert {crd.metadata.name for crd in listed} == {
        f"{crd['spec']['names']['plural']}.{GROUP}" for crd in crds.definitions()
    }
    assert {crd.spec.names.kind for crd in listed} == KINDS
    one = extensions.read_custom_resource_definition(f"nodesets.{GROUP}")
    assert one.spec.names.short_names == ["nodesets", "nss", "slurmd"] and one.spec.scope == "Namespaced"
    assert {c.type: c.status for c in one.status.conditions} == {"NamesAccepted": "True", "Established": "True"}
    # Served as vendored: a CRD cannot be changed here.
    status, body = refused(lambda: extensions.delete_custom_resource_definition(f"nodesets.{GROUP}"))
    assert status == 405 and body["reason"] == "MethodNotAllowed"

    group = get_json(api, f"/apis/{GROUP}")
    assert group["kind"] == "APIGroup" and group["preferredVersion"]["groupVersion"] == API
    resources = {entry["name"]: entry for entry in get_json(api, f"/apis/{API}")["resources"]}
    assert {name for name in resources if "/" not in name} == {
        "accountings",
        "controllers",
        "loginsets",
        "nodesets",
        "restapis",
        "tokens",
    }
    nodesets = resources["nodesets"]
    assert nodesets["kind"] == "NodeSet" and nodesets["namespaced"] is True
    assert set(nodesets["shortNames"]) == {"nodesets", "nss", "slurmd"}
    assert {"create", "get", "list", "watch", "patch", "update", "delete"} <= set(nodesets["verbs"])
    assert resources["nodesets/status"]["kind"] == "NodeSet" and resources["nodesets/status"]["verbs"] == [
        "get",
        "patch",
        "update",
    ]
    assert resources["nodesets/scale"]["kind"] == "Scale" and resources["nodesets/scale"]["group"] == "autoscaling"
    assert "controllers/status" in resources and "controllers/scale" not in resources
    assert set(resources["tokens"]["shortNames"]) == {"tokens", "jwt"}


def test_every_object_gpufleet_renders_is_accepted_as_it_is(custom: k8s.CustomObjectsApi) -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["accounting"] = True
    raw["accounting_storage"] = {
        "host": "mariadb.db.svc",
        "password_secret": {"namespace": "db", "name": "slurm-db", "key": "password"},
    }
    rendered = [obj for obj in slinky_objects(load_spec(raw), PLACEMENT) if obj["apiVersion"] == API]
    assert {obj["kind"] for obj in rendered} == KINDS - {"Token"}
    plurals = {cr.kind: cr.plural for cr in crds.served()}
    for obj in rendered:
        # Strict: a field the CRD does not declare would be refused, not silently dropped.
        stored = create(custom, plurals[obj["kind"]], obj, field_validation="Strict")
        assert stored["metadata"]["generation"] == 1
        # Everything rendered is kept (defaults only add to it).
        assert _contains(stored["spec"], obj["spec"]), obj["kind"]
    train = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "nodesets", "research-train")
    assert train["spec"]["replicas"] == 2 and train["spec"]["scalingMode"] == "StatefulSet"


def _contains(stored: Any, sent: Any) -> bool:
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(k in stored and _contains(stored[k], v) for k, v in sent.items())
    return bool(stored == sent)


def test_a_nodeset_that_breaks_the_schema_is_refused_naming_each_field(custom: k8s.CustomObjectsApi) -> None:
    bad = nodeset("bad", replicas="two", scalingMode="Sideways", partition={"enabled": True, "config": "a\nb"})
    del bad["spec"]["controllerRef"]
    status, body = refused(lambda: create(custom, "nodesets", bad))
    assert status == 422 and body["reason"] == "Invalid"
    assert body["details"]["kind"] == "NodeSet" and body["details"]["group"] == GROUP
    assert body["message"].startswith(f'NodeSet.{GROUP} "bad" is invalid: [')
    found = causes(body)
    assert found["spec.controllerRef"] == ("FieldValueRequired", "Required value")
    assert found["spec.replicas"] == (
        "FieldValueTypeInvalid",
        'Invalid value: "string": spec.replicas in body must be of type integer: "string"',
    )
    assert found["spec.scalingMode"] == (
        "FieldValueNotSupported",
        'Unsupported value: "Sideways": supported values: "DaemonSet", "StatefulSet"',
    )
    assert found["spec.partition.config"] == (
        "FieldValueInvalid",
        "Invalid value: \"a\\nb\": spec.partition.config in body should match '^[^\\n]+$'",
    )
    # With a type wrong, the CEL rules are not evaluated, and the server says so.
    assert "some validation rules were not checked" in found["<nil>"][1]
    with pytest.raises(k8s.ApiException):
        custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "nodesets", "bad")


def test_the_cel_rules_are_enforced(custom: k8s.CustomObjectsApi) -> None:
    controller = {
        "apiVersion": API,
        "kind": "Controller",
        "metadata": {"name": "keyless"},
        "spec": {"slurmctld": {"image": "slurmctld"}},
    }
    status, body = refused(lambda: create(custom, "controllers", controller))
    assert status == 422
    messages = [cause["message"] for cause in body["details"]["causes"] if cause["field"] == "spec"]
    assert messages == [
        'Invalid value: "object": slurmKeyRef must be set when external is false',
        'Invalid value: "object": jwtKeyRef or jwtHs256KeyRef must be set when external is false',
    ]
    controller["spec"] |= {"external": True}
    status, body = refused(lambda: create(custom, "controllers", controller))
    assert causes(body)["spec"][1] == 'Invalid value: "object": externalConfig must be set when external is true'

    scheduled = nodeset("scheduled", updateStrategy={"type": "ScheduledUpdate", "scheduledUpdate": {}})
    status, body = refused(lambda: create(custom, "nodesets", scheduled))
    assert causes(body)["spec.updateStrategy"] == (
        "FieldValueInvalid",
        'Invalid value: "object": scheduledUpdate.startTime and scheduledUpdate.duration are required when type '
        "is ScheduledUpdate",
    )
    scheduled["spec"]["updateStrategy"]["scheduledUpdate"] = {"startTime": "2026-01-01T02:00:00Z"}
    stored = create(custom, "nodesets", scheduled)  # the duration is defaulted (30m)
    assert stored["spec"]["updateStrategy"]["scheduledUpdate"]["duration"] == "30m"

    token = {"apiVersion": API, "kind": "Token", "metadata": {"name": "t"}, "spec": {"username": "alice"}}
    status, body = refused(lambda: create(custom, "tokens", token))
    assert causes(body)["spec"][1] == 'Invalid value: "object": jwtKeyRef or jwtHs256KeyRef must be set'
    token["spec"]["jwtKeyRef"] = {"name": "research-jwt-key", "key": "jwt_hs256.key"}
    assert create(custom, "tokens", token)["spec"]["username"] == "alice"


def test_unknown_fields_are_pruned_and_refused_when_strict(custom: k8s.CustomObjectsApi) -> None:
    loose = nodeset("loose", bogus=1, template={"metadata": {"name": "dropped"}, "spec": {"anything": "kept"}})
    loose["metadata"]["bogus"] = "dropped"
    stored = create(custom, "nodesets", loose)
    assert "bogus" not in stored["spec"] and "bogus" not in stored["metadata"]
    # template.metadata declares only labels and annotations; template.spec keeps unknown fields.
    assert stored["spec"]["template"] == {"metadata": {}, "spec": {"anything": "kept"}}
    status, body = refused(lambda: create(custom, "nodesets", nodeset("strict", bogus=1), field_validation="Strict"))
    assert status == 400 and body["reason"] == "BadRequest"
    assert body["message"] == (
        'NodeSet in version "v1beta1" cannot be handled as a NodeSet: strict decoding error: unknown field "spec.bogus"'
    )


def test_defaults_are_applied(custom: k8s.CustomObjectsApi) -> None:
    stored = create(custom, "nodesets", nodeset("plain", partition={"config": "MaxTime=1:00:00"}))
    spec = stored["spec"]
    assert spec["replicas"] == 1 and spec["scalingMode"] == "StatefulSet"
    assert spec["workloadDisruptionProtection"] is True and spec["pruneSlurmNodeRecords"] == "Never"
    assert spec["partition"] == {"config": "MaxTime=1:00:00", "enabled": False}  # required, so defaulted first
    assert "updateStrategy" not in spec and "ssh" not in spec  # no defaults inside what is not there


def test_the_status_and_scale_subresources(custom: k8s.CustomObjectsApi) -> None:
    created = create(custom, "nodesets", {**nodeset("workers", replicas=2), "status": {"replicas": 9}})
    assert "status" not in created  # a create sets no status
    status = {"replicas": 2, "readyReplicas": 1, "nodeSetHash": "abc", "selector": "app=slurmd"}
    # A status update sets the status only: the spec in it is ignored, and the generation stays.
    updated = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NAMESPACE, "nodesets", "workers", {"status": status, "spec": {"replicas": 7}}
    )
    assert updated["status"] == status and updated["spec"]["replicas"] == 2
    assert updated["metadata"]["generation"] == 1
    # An update of the object keeps the status; a changed spec is a new generation.
    replaced = custom.replace_namespaced_custom_object(
        GROUP,
        VERSION,
        NAMESPACE,
        "nodesets",
        "workers",
        {**updated, "spec": {**updated["spec"], "replicas": 3}, "status": {}},
    )
    assert replaced["status"] == status and replaced["metadata"]["generation"] == 2
    # The status is validated too (nodeSetHash and selector are required in it).
    code, body = refused(
        lambda: custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, "nodesets", "workers", {**replaced, "status": {"replicas": 1}}
        )
    )
    assert code == 422 and set(causes(body)) == {"status.nodeSetHash", "status.selector"}
    got = custom.get_namespaced_custom_object_status(GROUP, VERSION, NAMESPACE, "nodesets", "workers")
    assert got["status"] == status

    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, "nodesets", "workers")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 3}
    assert scale["status"] == {"replicas": 2, "selector": "app=slurmd"}
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, NAMESPACE, "nodesets", "workers", {"spec": {"replicas": 5}}
    )
    assert (
        custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "nodesets", "workers")["spec"]["replicas"] == 5
    )


def test_patches_are_validated(custom: k8s.CustomObjectsApi, api: KubeApiProcess) -> None:
    create(custom, "nodesets", nodeset("patched"))
    patched = custom.patch_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, "nodesets", "patched", {"spec": {"replicas": 4}}
    )  # a merge patch
    assert patched["spec"]["replicas"] == 4 and patched["metadata"]["generation"] == 2
    code, body = refused(
        lambda: custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            "nodesets",
            "patched",
            [{"op": "replace", "path": "/spec/replicas", "value": "x"}],
            _content_type="application/json-patch+json",
        )
    )
    assert code == 422, body
    assert causes(body)["spec.replicas"][0] == "FieldValueTypeInvalid"
    # A custom resource takes no strategic-merge patch, as on a real server.
    request = urllib.request.Request(
        f"{api.url}/apis/{API}/namespaces/{NAMESPACE}/nodesets/patched",
        method="PATCH",
        data=json.dumps({"spec": {"replicas": 1}}).encode(),
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 415
    assert (
        custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "nodesets", "patched")["spec"]["replicas"] == 4
    )


def test_the_readme_accounts_for_every_cel_rule() -> None:
    readme = (Path(crds.__file__).parent / "crds" / crds.FOLDER / "README.md").read_text()
    rules = crds.validation_rules()
    assert len(rules) == 8 and all(rule.enforced for rule in rules)
    for rule in rules:
        assert f"`{rule.rule}`" in readme, rule.rule


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (make test installs it as root)")
def test_kubectl_lists_explains_and_shows_the_servers_errors(api: KubeApiProcess, tmp_path: Path) -> None:
    def kubectl(*args: str) -> subprocess.CompletedProcess[str]:
        assert KUBECTL is not None
        env = {**os.environ, "KUBECONFIG": str(api.kubeconfig)}
        return subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=60, check=False)

    assert kubectl("get", "crds", "-o", "name").stdout.split() == [
        f"customresourcedefinition.apiextensions.k8s.io/{crd['metadata']['name']}" for crd in crds.definitions()
    ]
    resources = kubectl("api-resources", "--api-group", GROUP, "-o", "name").stdout.split()
    assert f"nodesets.{GROUP}" in resources and f"tokens.{GROUP}" in resources
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({**nodeset("bad", scalingMode="Sideways"), "metadata": {"name": "bad", "namespace": NAMESPACE}})
    )
    done = kubectl("apply", "-f", str(bad))
    assert done.returncode != 0
    assert (
        'spec.scalingMode: Unsupported value: "Sideways": supported values: "DaemonSet", "StatefulSet"' in done.stderr
    )
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({**nodeset("good", bogus=1), "metadata": {"name": "good", "namespace": NAMESPACE}}))
    done = kubectl("apply", "-f", str(good))  # kubectl asks for strict field validation
    assert done.returncode != 0 and 'unknown field "spec.bogus"' in done.stderr
    assert kubectl("apply", "--validate=false", "-f", str(good)).returncode == 0
    table = kubectl("get", "nss", "-n", NAMESPACE).stdout
    assert table.splitlines()[0].split() == ["NAME", "DESIRED", "REPLICAS", "UPDATED", "READY", "AGE"]
    assert kubectl("scale", "nodeset", "good", "-n", NAMESPACE, "--replicas=3").returncode == 0
    assert kubectl("get", "nodeset", "good", "-n", NAMESPACE, "-o", "jsonpath={.spec.replicas}").stdout == "3"
    explained = kubectl("explain", "nodeset.spec.scalingMode")
    assert explained.returncode == 0 and "DaemonSet" in explained.stdout
