"""The kustomize manifests render, every object they render is valid against Kubernetes' own
schemas (offline, strict: an unknown or mistyped field fails), and they say what the design
needs, with no more privilege than that."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lab import kustomize
from models.policy import policy_from_mapping

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# The Kubernetes release whose schemas the objects are checked against: the kubectl the machine
# image ships (and the emulated API serves).
SCHEMA_VERSION = "1.32"
# kubectl has had kustomize v4+ built in (`kubectl kustomize`, components) since 1.21.
KUSTOMIZE_SINCE = (1, 21)

Objects = list[dict[str, Any]]


def _kubectl_version(kubectl: str) -> tuple[int, int] | None:
    done = subprocess.run(
        [kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30, check=False
    )
    try:
        client = json.loads(done.stdout)["clientVersion"]
        return int(client["major"]), int(re.sub(r"\D", "", client["minor"]))
    except (ValueError, KeyError, TypeError):
        return None


@functools.cache
def _kustomize_missing() -> str:
    """Why this machine cannot render the kustomizations ('' when it can)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl is not on PATH: deploy/ is rendered with `kubectl kustomize` (kubectl 1.21 or newer)"
    version = _kubectl_version(kubectl)
    if version is None:
        return f"{kubectl} does not say its version: deploy/ is rendered with `kubectl kustomize` (kubectl 1.21+)"
    if version < KUSTOMIZE_SINCE:
        return (
            f"kubectl {version[0]}.{version[1]} is older than 1.21 and has no built-in kustomize v4+ "
            "(components, `kubectl kustomize`): install a recent kubectl to render deploy/"
        )
    return ""


def render(directory: Path) -> Objects:
    """``kubectl kustomize DIRECTORY``: the objects, in order. Where kubectl is missing or too old
    for it, lab/kustomize.py renders them instead (it renders deploy/ as kubectl does: below)."""
    if _kustomize_missing():
        return kustomize.render(directory)
    done = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def _rendered(name: str) -> str:
    return json.dumps(render(DEPLOY / name))


def rendered(name: str) -> Objects:
    """A kustomization under deploy/ (``base``, ``overlays/example``), rendered once per run."""
    objects: Objects = json.loads(_rendered(name))
    return objects


def render_with(tmp_path: Path, resources: list[Path], components: list[Path], **extra: Any) -> Objects:
    """A kustomization in ``tmp_path`` of ``resources`` and ``components`` (and whatever else is
    given: its files go beside it, in ``tmp_path``), rendered."""
    return render(kustomization_in(tmp_path, resources, components, **extra))


def kustomization_in(tmp_path: Path, resources: list[Path], components: list[Path], **extra: Any) -> Path:
    """``tmp_path``, holding a kustomization of ``resources``, ``components`` and ``extra``."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes other kustomizations by relative path only.
        "resources": [os.path.relpath(path, tmp_path) for path in resources],
        "components": [os.path.relpath(path, tmp_path) for path in components],
        **extra,
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tmp_path


def of_kind(objects: Objects, kind: str) -> Objects:
    return [obj for obj in objects if obj["kind"] == kind]


# Of the kinds several objects share (the worker's, the intake's, the API's, the users' roles),
# the worker's, where a test names no other.
WORKERS = {"Deployment": "gpufleet-worker", "ClusterRole": "gpufleet-worker", "Role": "gpufleet-worker-leases"}


def the(objects: Objects, kind: str, name: str = "") -> dict[str, Any]:
    """The one object of ``kind`` named ``name`` (with or without the overlays' prefixes); the
    worker's where several share the kind and no name is given."""
    found = of_kind(objects, kind)
    wanted = name or (WORKERS.get(kind, "") if len(found) > 1 else "")
    if wanted:
        found = [obj for obj in found if obj["metadata"]["name"] in (wanted, f"prod-{wanted}", f"slurm-{wanted}")]
    [obj] = found
    return obj


def invalid(objects: Objects) -> list[str]:
    """Each object that fails strict validation against the Kubernetes schemas, with why."""
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    return problems


# What gets deployed: the example overlay (Slurm's commands), the Slinky overlay (slurmrestd,
# tests/test_deploy_slinky.py); and the base they are made of.
DEPLOYED = ["base", "overlays/example", "overlays/slinky"]
COMPONENTS = sorted(path.name for path in (DEPLOY / "components").iterdir() if path.is_dir())


# -- rendering and schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEPLOYED)
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(name: str) -> None:
    objects = rendered(name)
    assert {obj["kind"] for obj in objects} >= {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "DaemonSet",
    }
    assert invalid(objects) == []


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_renders_valid_objects_over_the_base(tmp_path: Path, component: str) -> None:
    objects = render_with(tmp_path, [DEPLOY / "base"], [DEPLOY / "components" / component])
    assert invalid(objects) == []
    assert objects != rendered("base")  # it changes something


@pytest.mark.parametrize("name", [*DEPLOYED, *(f"components/{component}" for component in COMPONENTS)])
def test_the_python_renderer_renders_as_kubectl_does(tmp_path: Path, name: str) -> None:
    """lab/kustomize.py, used where kubectl is missing or older than 1.21, makes the same objects
    in the same order as `kubectl kustomize`, for each kustomization and component of deploy/."""
    missing = _kustomize_missing()
    if missing:
        pytest.skip(f"nothing to compare the Python renderer with: {missing}")
    if name.startswith("components/"):
        directory = kustomization_in(tmp_path, [DEPLOY / "base"], [DEPLOY / name])
    else:
        directory = DEPLOY / name
    assert kustomize.render(directory) == render(directory)


def test_the_python_renderer_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    def refused(**extra: Any) -> str:
        with pytest.raises(kustomize.KustomizeError) as refusal:
            kustomize.render(kustomization_in(tmp_path, [DEPLOY / "base"], [], **extra))
        return str(refusal.value)

    assert "namespace not supported here; render it with `kubectl" in refused(namespace="elsewhere")
    nobody = "kind: Deployment\nmetadata: {name: nobody}\nspec: {replicas: 2}\n"
    assert "the patch of Deployment nobody matches no resource" in refused(patches=[{"patch": nobody}])
    # A directive it does not apply is refused, not written into the object.
    deletion = "kind: Deployment\nmetadata: {name: gpufleet-worker}\nspec: {template: {spec: {$patch: replace}}}\n"
    assert "patch directives ($patch" in refused(patches=[{"patch": deletion}])


def test_a_wrong_field_in_a_manifest_fails(tmp_path: Path) -> None:
    # A typo patched in through kustomize, as an overlay could: the schemas refuse it by name.
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpufleet-worker", "namespace": "gpufleet"},
        "spec": {"template": {"spec": {"containers": [{"name": "worker", "readinessProbe": {"tcpSockett": {}}}]}}},
    }
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(patch))
    objects = render_with(tmp_path, [DEPLOY / "base"], [], patches=[{"path": "typo.yaml"}])
    [problem] = invalid(objects)
    assert problem.startswith("Deployment/gpufleet-worker: spec.template.spec.containers.0.readinessProbe")
    assert "'tcpSockett' was unexpected" in problem
    # A wrong type, and an unknown field anywhere, fail the same way.
    deployment = the(rendered("overlays/example"), "Deployment")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "3"
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["securityContext"]["runAsNonroot"] = True
    assert len(invalid([wrong_type, unknown])) == 2


# -- what the overlay changes ---------------------------------------------------------------------


def test_the_example_overlay_names_its_cluster_tag_and_prefix() -> None:
    objects = rendered("overlays/example")
    deployment, daemonset = the(objects, "Deployment"), the(objects, "DaemonSet")
    assert deployment["spec"]["replicas"] == 3
    for workload in (deployment, daemonset):
        [container] = workload["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "ghcr.io/gpufleet/gpufleet:0.1.0"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["GPUFLEET_CLUSTER"] == "prod"
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["name"].startswith("prod-"), obj["metadata"]["name"]
    # Every reference follows the prefix: the pods' ServiceAccount and ConfigMap, the bindings'.
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    pod = deployment["spec"]["template"]["spec"]
    assert ("ServiceAccount", pod["serviceAccountName"]) in names
    for volume in pod["volumes"] + daemonset["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "policy":
            assert ("ConfigMap", volume["configMap"]["name"]) in names
    for binding in of_kind(objects, "RoleBinding") + of_kind(objects, "ClusterRoleBinding"):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in names
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount":  # people are Users and Groups: not rendered here
                assert ("ServiceAccount", subject["name"]) in names
                assert subject["namespace"] == deployment["metadata"]["namespace"]


@pytest.mark.parametrize("name", DEPLOYED)
def test_everything_namespaced_lives_in_one_namespace(name: str) -> None:
    objects = rendered(name)
    namespace = the(objects, "Namespace")["metadata"]["name"]
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for obj in objects:
        if obj["kind"] == "NetworkPolicy" and obj["metadata"]["name"].endswith(
            ("temporal-frontend-gpufleet-only", "temporal-frontend-from-ui")
        ):
            assert obj["metadata"]["namespace"] == "temporal"  # they guard Temporal's pods, in Temporal's namespace
            continue
        assert obj["metadata"].get("namespace") == (None if obj["kind"] in cluster_scoped else namespace), obj
    # Repair Jobs run where the Role lets the workers create them.
    policy = yaml.safe_load(the(objects, "ConfigMap")["data"]["policy.yaml"])
    assert policy["repair"]["namespace"] == the(objects, "Role")["metadata"]["namespace"] == namespace


# -- the worker -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEPLOYED)
def test_the_worker_runs_unprivileged_as_the_images_user(name: str) -> None:
    deployment = the(rendered(name), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    security = dict(pod["securityContext"])
    # A Secret's files are root's: an overlay mounting one makes them the worker's group's.
    assert security.pop("fsGroup", 10001) == 10001
    assert security == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    [container] = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "memory" in container["resources"]["limits"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container["ports"]
    assert deployment["spec"]["replicas"] >= 2
    env = {e["name"]: e for e in container["env"]}
    assert env["GPUFLEET_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_the_example_worker_runs_slurms_commands_with_the_nodes_munge() -> None:
    """components/slurm-cli, in the example overlay: slurm.conf from its ConfigMap, read-only, and
    the node's /run/munge, where the commands find munged's socket; the base alone has neither."""
    pod = the(rendered("overlays/example"), "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    conf = mounts[str(Path(env["GPUFLEET_SLURM_CONF"]).parent)]
    assert conf["readOnly"] is True and volumes[conf["name"]]["configMap"] == {"name": "slurm-conf"}
    assert volumes[mounts["/run/munge"]["name"]]["hostPath"] == {"path": "/run/munge", "type": "Directory"}
    base = the(rendered("base"), "Deployment")["spec"]["template"]["spec"]
    assert not [v for v in base["volumes"] if "hostPath" in v or v["name"] == "slurm-conf"]


@pytest.mark.parametrize("name", DEPLOYED)
def test_a_disruption_budget_keeps_a_worker_up(name: str) -> None:
    objects = rendered(name)
    budget, deployment = the(objects, "PodDisruptionBudget"), the(objects, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def _probe(container: dict[str, Any], which: str, env: dict[str, str]) -> int:
    """Run a probe's command here, as the kubelet would in the container (its ``python`` is this one)."""
    command = container[which]["exec"]["command"]
    assert command[0] == "python"
    done = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False)
    return done.returncode


def test_the_worker_probes_work_with_what_the_image_has_today() -> None:
    [container] = the(rendered("overlays/example"), "Deployment")["spec"]["template"]["spec"]["containers"]
    # Alive: the container's first process runs (here: this machine's).
    assert _probe(container, "livenessProbe", {}) == 0
    # Ready: the Temporal frontend takes a connection; refused, not ready.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert _probe(container, "readinessProbe", {"TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}) == 0
    assert _probe(container, "readinessProbe", {"TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}) != 0


# -- the detector ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEPLOYED)
def test_detector_daemonset_reads_kmsg_only_and_knows_its_node(name: str) -> None:
    daemonset = the(rendered(name), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kmsg"]["hostPath"]["path"] == "/dev/kmsg"
    assert mounts["kmsg"]["readOnly"] is True
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    security = container["securityContext"]
    assert not security.get("privileged", False)
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "detect" in container["args"] and "--nvml" in container["args"]
    assert pod["automountServiceAccountToken"] is False  # it calls no Kubernetes API


def test_the_example_detector_gets_kmsg_from_a_device_plugin_not_privilege() -> None:
    [container] = the(rendered("overlays/example"), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["squat.ai/kmsg"] == "1"
    assert not container["securityContext"].get("privileged", False)


def test_the_privileged_detector_is_one_the_api_server_admits(tmp_path: Path) -> None:
    objects = render_with(tmp_path, [DEPLOY / "base"], [DEPLOY / "components" / "kmsg-privileged"])
    [container] = the(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    # The API server refuses privileged with allowPrivilegeEscalation false.
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is True


# -- RBAC and policy (tests/test_rbac.py proves the rules against the client's real requests) -----


@pytest.mark.parametrize("name", DEPLOYED)
def test_worker_may_evict_but_not_create_pods(name: str) -> None:
    role = the(rendered(name), "ClusterRole")
    rules = {resource: set(rule["verbs"]) for rule in role["rules"] for resource in rule["resources"]}
    assert rules["pods/eviction"] == {"create"}
    assert "create" not in rules["pods"] and "create" not in rules["nodes"]


@pytest.mark.parametrize("name", DEPLOYED)
def test_worker_may_run_repair_jobs_in_its_namespace_only(name: str) -> None:
    objects = rendered(name)
    role = the(objects, "Role")
    assert role["metadata"]["namespace"] == "gpufleet"
    rules = {resource: set(rule["verbs"]) for rule in role["rules"] for resource in rule["resources"]}
    assert rules["jobs"] == {"get", "list", "create", "patch"}  # never delete: a Job is its attempt's record
    cluster_role = the(objects, "ClusterRole")
    assert all("jobs" not in rule["resources"] for rule in cluster_role["rules"])


@pytest.mark.parametrize("name", DEPLOYED)
def test_the_detector_and_the_worker_mount_one_policy(name: str) -> None:
    objects = rendered(name)
    configmap = the(objects, "ConfigMap")
    detector = the(objects, "DaemonSet")["spec"]["template"]["spec"]
    worker = the(objects, "Deployment")
    for pod in (detector, worker["spec"]["template"]["spec"]):
        [container] = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert volumes["policy"]["configMap"]["name"] == configmap["metadata"]["name"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "policy")
        assert env["GPUFLEET_POLICY_FILE"] == f"{mount['mountPath']}/policy.yaml"
    policy = policy_from_mapping(yaml.safe_load(configmap["data"]["policy.yaml"]), origin="the ConfigMap")
    assert policy.remediation.owner_drained == "ask"
