"""Least privilege, proven: what the worker's RBAC grants is exactly what its Kubernetes client asks for.

The emulated API records every request it serves (``lab.kubeapi --audit-log``: verb as RBAC names
it, API group, resource, subresource, namespace, name). Each test drives the client as the worker
does, with the arguments the worker passes (every method of ``KubernetesApi`` the worker's code
calls, the partition lock through ``SparePool``, cluster creation through ``SlinkyBackend`` and the
free pool), and compares the requests with the rendered deploy/ rules, both ways: no request a
rule does not allow (nothing missing), no rule no request needs (nothing extra). Another test
reads the worker's code and checks that every method it calls is driven here, so a new call
fails this file until it is driven and granted.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from activities.repair import repair_job
from clients import pool
from clients.clusters import StepFailed
from clients.kube import KubernetesApi, PodRef
from clients.slinky import SlinkyBackend
from clients.spares import SparePool, partition_lease_name
from lab.kubeapi import node_object
from models.cluster import ClusterSpec, load_spec
from models.policy import Action, policy_from_mapping
from models.requests import RepairRequest
from models.slinky import REMEDIATION_CONFIGMAP, cluster_namespace
from tests.conftest import REPO
from tests.models.test_cluster_spec import EXAMPLE
from tests.test_deploy import DEPLOY, Objects, render_with, rendered, the

# Every public method of KubernetesApi, by who calls it. The remediation worker (every worker):
REMEDIATION = {
    "get_node",
    "list_nodes",
    "set_unschedulable",
    "add_taint",
    "remove_taint",
    "update_metadata",
    "pods_on_node",
    "find_pod",
    "pods_in",
    "get_nodeset",
    "list_nodesets",
    "update_pod_metadata",
    "patch_nodeset",
    "evict",
    "create_job",
    "job_state",
    "job_annotations",
    "stop_job",
    "list_jobs",
    "job_exit",
    "update_config_map",
    "lease",
    "config_map_data",
}
# A worker that creates clusters (deploy/components/cluster-creation), besides the above:
CLUSTER_CREATION = {
    "create_object",
    "delete_object",
    "object_exists",
    "object_annotations",
    "secret",
    "secret_data",
    "replace_secret_data",
    "service_address",
}
# Called by no worker code, so granted to none (the static test below keeps this true):
NEVER_CALLED = {
    "delete_node": "retired nodes are kept (tainted and labelled), never deleted from Kubernetes",
}
# The worker's code that serves cluster creation only (the rest serves every worker).
CLUSTER_CREATION_CODE = {"activities/cluster.py", "clients/slinky.py", "clients/clusters.py", "clients/pool.py"}

# Granted although no request of these tests needs it, each with why it cannot be exercised on the
# emulated API: none. Every rule of deploy/ is exercised.
UNEXERCISED: dict[tuple[str, str, str], str] = {}


class Request(NamedTuple):
    verb: str
    group: str
    resource: str  # with its subresource: pods/eviction
    namespace: str | None
    name: str | None


class Grant(NamedTuple):
    namespace: str | None  # None: every namespace, and cluster-scoped resources (a ClusterRoleBinding)
    group: str
    resource: str
    verb: str
    names: frozenset[str]  # resourceNames; empty: any

    def allows(self, request: Request) -> bool:
        return (
            (self.group, self.resource, self.verb) == (request.group, request.resource, request.verb)
            and (self.namespace is None or self.namespace == request.namespace)
            and (not self.names or request.name in self.names)
        )

    def said(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        named = f" named {','.join(sorted(self.names))}" if self.names else ""
        return f"{self.verb} {self.group or 'core'}/{self.resource}{named}{where}"


def grants(objects: Objects, account: str, namespace: str) -> list[Grant]:
    """Every (verb, resource) the ServiceAccount ``namespace/account`` is granted by these objects."""
    roles = {(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]): obj for obj in objects}
    granted = []
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        if subject not in binding["subjects"]:
            continue
        scope = binding["metadata"].get("namespace")  # None for a ClusterRoleBinding
        ref = binding["roleRef"]
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), f"a wildcard in {role['metadata']['name']}"
                        names = frozenset(rule.get("resourceNames", []))
                        granted.append(Grant(scope, group, resource, verb, names))
    return granted


def compare(requests: list[Request], granted: list[Grant]) -> tuple[list[str], list[str]]:
    """(requests no grant allows, grants no request needs): both empty is least privilege. A grant
    is needed when it allows a request that no other grant allows."""

    def said(request: Request) -> str:
        return f"{request.verb} {request.group or 'core'}/{request.resource} in {request.namespace or '(cluster)'}"

    missing = sorted({said(r) for r in requests if not any(g.allows(r) for g in granted)})
    extra = sorted(
        g.said()
        for i, g in enumerate(granted)
        if (g.group, g.resource, g.verb) not in UNEXERCISED
        and not any(g.allows(r) and not any(h.allows(r) for j, h in enumerate(granted) if j != i) for r in requests)
    )
    return missing, extra


# -- the emulated API, recording ------------------------------------------------------------------


class AuditedKubeApi:
    """The emulated API server in a process of its own, each request it serves appended to ``audit``."""

    def __init__(self, root: Path, seed: dict[str, list[dict[str, Any]]]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "seed.json").write_text(json.dumps(seed))
        self.kubeconfig, self.audit, ready = root / "kubeconfig", root / "audit.jsonl", root / "ready"
        self.stderr = root / "kubeapi.log"
        with self.stderr.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lab.kubeapi",
                    "--seed",
                    str(root / "seed.json"),
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--ready-file",
                    str(ready),
                    "--audit-log",
                    str(self.audit),
                ],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        deadline = time.monotonic() + 20
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"emulated API server did not start: {self.stderr.read_text()}")
            time.sleep(0.05)

    def requests(self) -> list[Request]:
        found = []
        for line in self.audit.read_text().splitlines():
            entry = json.loads(line)
            resource = entry["resource"] + (f"/{entry['subresource']}" if entry["subresource"] else "")
            found.append(Request(entry["verb"], entry["apiGroup"], resource, entry["namespace"], entry["name"]))
        return found

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _pod(name: str, node: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "serving", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm/vllm-openai"}]},
        "status": {"phase": "Running"},
    }


def seed(cluster: str) -> dict[str, list[dict[str, Any]]]:
    """A fleet as a worker finds it: nodes (training, spare, free), pods under a budget that
    refuses, the remediation ConfigMap of a cluster gpufleet made, and a database password
    labelled for copying. Seeded objects are not requests: the log holds only the client's."""
    return {
        "nodes": [node_object(n, pool="training") for n in ("gpu1", "gpu2")]
        + [node_object("spare1", pool="spare")]
        + [node_object(n, pool="free") for n in ("free1", "free2", "free3")],
        "namespaces": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
            for n in ("serving", "db", cluster_namespace(cluster))
        ],
        "pods": [_pod("inference-a", "gpu1", {"app": "inference"}), _pod("batch-a", "gpu1", {"app": "batch"})],
        "nodesets": [
            {
                "apiVersion": "slinky.slurm.net/v1beta1",
                "kind": "NodeSet",
                "metadata": {"name": f"{cluster}-train", "namespace": cluster_namespace(cluster)},
                "spec": {
                    "controllerRef": {"name": cluster},
                    "template": {"spec": {"nodeSelector": {"gpufleet.io/cluster": cluster}}},
                },
            }
        ],
        "pdbs": [
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "inference", "namespace": "serving"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "inference"}}},
            }
        ],
        "configmaps": [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": REMEDIATION_CONFIGMAP, "namespace": cluster_namespace(cluster)},
                "data": {"grace_seconds": "90"},
            },
        ],
        "secrets": [
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": "slurm-db",
                    "namespace": "db",
                    "labels": {"gpufleet.io/copy-to-clusters": "true"},
                },
                "data": {"password": "czNjcmV0LWRi"},
            }
        ],
    }


@pytest.fixture
def audited(tmp_path: Path) -> Iterator[AuditedKubeApi]:
    api = AuditedKubeApi(tmp_path / "kube", seed("prod"))
    yield api
    api.stop()


# -- what the worker does, as it does it ----------------------------------------------------------


class Deployed(NamedTuple):
    """What the rendered manifests tell the worker: its account, namespace, cluster and policy."""

    account: str
    namespace: str
    cluster: str
    repair_namespace: str


def deployed(objects: Objects) -> Deployed:
    deployment = the(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    policy_map = yaml.safe_load(the(objects, "ConfigMap")["data"]["policy.yaml"])
    policy = policy_from_mapping(policy_map, origin="the ConfigMap")
    return Deployed(
        account=deployment["spec"]["template"]["spec"]["serviceAccountName"],
        namespace=deployment["metadata"]["namespace"],  # GPUFLEET_NAMESPACE: the pod's own
        cluster=env["GPUFLEET_CLUSTER"],
        repair_namespace=policy.repair.namespace,
    )


class PartitionOnly:
    """Slurm's partition edits, for the partition lock around them (no Kubernetes here)."""

    def __init__(self) -> None:
        self.members: set[str] = set()

    def add_to_partition(self, partition: str, node: str) -> None:
        self.members.add(node)

    def remove_from_partition(self, partition: str, node: str) -> None:
        self.members.discard(node)

    def partition_nodes(self, partition: str) -> list[str]:
        return sorted(self.members)


def drive_remediation(kube: KubernetesApi, worker: Deployed) -> set[str]:
    """Every Kubernetes call of a remediation, as the worker's activities make them; the
    methods driven."""
    # Its configuration at an incident's start: the cluster's remediation defaults.
    assert kube.config_map_data(cluster_namespace(worker.cluster), REMEDIATION_CONFIGMAP) == {"grace_seconds": "90"}
    # The node, cordoned, tainted and annotated; the spares looked for and one claimed.
    assert kube.get_node("gpu1").labels["gpufleet.io/pool"] == "training"
    [spare] = kube.list_nodes(label_selector="gpufleet.io/pool=spare")
    kube.set_unschedulable("gpu1", True)
    kube.add_taint("gpu1", key="gpufleet.io/unhealthy", value="remediate-prod-gpu1")
    kube.update_metadata("gpu1", annotations={"gpufleet.io/incident": "remediate-prod-gpu1"})
    kube.update_metadata(
        spare.name,
        annotations={"gpufleet.io/claimed-by": "remediate-prod-gpu1"},
        resource_version=spare.resource_version,
    )
    # A pool move on Slinky puts the node's NodeSet pod first in the scale-in order (its deletion cost).
    kube.update_pod_metadata(
        "serving", "batch-a", annotations={"nodeset.slinky.slurm.net/pod-deletion-cost": "-2147483648"}
    )
    # Its pods drained: one evicted, one a budget protects deleted past the deadline, one gone.
    pods = {p.name: p for p in kube.pods_on_node("gpu1")}
    assert kube.evict(pods["batch-a"], timeout_seconds=5) == "evicted"
    assert kube.evict(pods["inference-a"], timeout_seconds=0.2) == "deleted"
    assert kube.evict(PodRef(namespace="serving", name="batch-a"), timeout_seconds=5) == "gone"
    # On Slinky: a Slurm node's pod found again by name after its eviction (on the spare, under the
    # same name), and the NodeSet read for the labels that make a spare eligible.
    assert kube.find_pod("serving", "batch-a") is None
    assert kube.find_pod("serving", "inference-a") is None
    # A move to training on Slinky rolled back: the NodeSet's pods waiting for a node counted.
    assert not {"batch-a", "inference-a"} & {p.name for p in kube.pods_in("serving")}
    nodeset = kube.get_nodeset(cluster_namespace(worker.cluster), f"{worker.cluster}-train")
    assert nodeset["spec"]["template"]["spec"]["nodeSelector"] == {"gpufleet.io/cluster": worker.cluster}
    # At the worker's start (GPUFLEET_REMEDIATION_MODE auto): NodeSets in its cluster's namespace mean Slinky.
    listed = kube.list_nodesets(cluster_namespace(worker.cluster))
    assert [n["metadata"]["name"] for n in listed] == [f"{worker.cluster}-train"]
    # A pool move on Slinky: the NodeSet scaled in with the pod named in the same write.
    version = nodeset["metadata"]["resourceVersion"]
    body = {"metadata": {"annotations": {"gpufleet.io/scaled-in-for": "x/y"}, "resourceVersion": version}}
    scaled = kube.patch_nodeset(
        cluster_namespace(worker.cluster), f"{worker.cluster}-train", {**body, "spec": {"replicas": 0}}
    )
    assert scaled["spec"]["replicas"] == 0
    # The partition edited under its Lease; then another worker takes it and holds it long enough to renew it.
    spares = SparePool(
        kube=kube,
        slurm=PartitionOnly(),  # type: ignore[arg-type]
        partition="train",
        cluster=worker.cluster,
        namespace=worker.namespace,
        holder="worker-a",
    )
    spares.add_to_partition(spare.name)
    with kube.lease(partition_lease_name("train"), namespace=worker.namespace, holder="worker-b", duration_seconds=3):
        time.sleep(1.3)  # renewed every third of its duration
    # A repair in place: its Job made (again, on a retry), watched, and stopped past its deadline.
    request = RepairRequest(node="gpu1", action=Action.RESET_GPU, incident_id="remediate-prod-gpu1", gpu="0")
    request = request.model_copy(
        update={"settings": request.settings.model_copy(update={"namespace": worker.repair_namespace})}
    )
    job = repair_job(request)
    assert kube.create_job(worker.repair_namespace, job) is True
    assert kube.create_job(worker.repair_namespace, job) is False
    name = job["metadata"]["name"]
    assert not kube.job_state(worker.repair_namespace, name).finished
    kube.stop_job(worker.repair_namespace, name, annotations={"gpufleet.io/verdict": "did not finish; Job stopped"})
    assert kube.job_annotations(worker.repair_namespace, name)["gpufleet.io/verdict"].endswith("Job stopped")
    # A cancelled incident (or the reaper) lists the repair Jobs to stop those still running.
    listed = kube.list_jobs(worker.repair_namespace, label_selector="gpufleet.io/repair")
    assert [(j.name, j.active) for j in listed] == [(name, False)]
    # A validation rung: how its pod ended (none has here); NCCL passes kept (the first makes the ConfigMap).
    assert kube.job_exit(worker.repair_namespace, name) is None
    for gbps in ("180", "181"):
        kept = kube.update_config_map(
            worker.repair_namespace, "gpufleet-validation-baselines", lambda d, gbps=gbps: {**d, "t": gbps}
        )
        assert kept == {"t": gbps}
    # The node put back: taint off, uncordoned.
    kube.remove_taint("gpu1", key="gpufleet.io/unhealthy")
    kube.set_unschedulable("gpu1", False)
    return {
        "config_map_data",
        "get_node",
        "list_nodes",
        "set_unschedulable",
        "add_taint",
        "update_metadata",
        "pods_on_node",
        "find_pod",
        "pods_in",
        "get_nodeset",
        "list_nodesets",
        "update_pod_metadata",
        "patch_nodeset",
        "evict",
        "lease",
        "create_job",
        "job_state",
        "stop_job",
        "job_annotations",
        "list_jobs",
        "job_exit",
        "update_config_map",
        "remove_taint",
    }


def accounting_spec() -> ClusterSpec:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["accounting"] = True
    raw["accounting_storage"] = {
        "host": "mariadb.db.svc",
        "password_secret": {"namespace": "db", "name": "slurm-db", "key": "password"},
    }
    return load_spec(raw)


def drive_cluster_creation(kube: KubernetesApi, worker: Deployed) -> set[str]:
    """A Slinky cluster created (nodes reserved, objects made, slurmrestd asked) and deleted, as
    the cluster workflows' activities do it; the methods driven."""
    spec = accounting_spec()
    backend = SlinkyBackend(kube, restapi="http://127.0.0.1:9/{name}", wait_seconds=0.1, poll_seconds=0.05)
    assert backend.unsupported(spec) == ""  # the database password's Secret is there, labelled
    assert backend.exists(spec) == ""
    assert pool.free_nodes(kube) == 3 and pool.holdings(kube, spec.name) == {}
    placement = pool.reserve(kube, spec.name, {"train": 2, "debug": 1}, namespace=worker.namespace)
    assert sorted(n for nodes in placement.values() for n in nodes) == ["free1", "free2", "free3"]
    assert backend.create_objects(spec, placement, "", "run-1").startswith("created 14 object(s)")
    assert backend.create_objects(spec, placement, "", "run-1").endswith("(all there already)")  # a retry
    with pytest.raises(StepFailed):  # slurmrestd does not answer here: its JWT key is read first
        backend.bring_up(spec, placement, "")
    with pytest.raises(StepFailed):
        backend.remove_users(spec)
    # Its users changed: the user database Secret rewritten (its users' logins and keys).
    fewer = spec.model_copy(update={"users": spec.users[:1]})
    assert backend.set_logins(fewer).startswith("Secret research-users: 1 user(s)")
    # GPUFLEET_SLINKY_RESTAPI_URL=service: slurmrestd where the RestApi's Service says (none here).
    by_service = SlinkyBackend(kube, restapi="service", wait_seconds=0.1, poll_seconds=0.05)
    with pytest.raises(StepFailed, match="no Service slurm-research/research-restapi"):
        by_service.bring_up(spec, placement, "")
    assert backend.delete_objects(spec, "run-1").startswith("deleted 14 object(s)")
    assert pool.release(kube, spec.name) == (["free1", "free2", "free3"], {})
    return {
        "secret",
        "object_exists",
        "object_annotations",
        "create_object",
        "secret_data",
        "delete_object",
        "service_address",
        "replace_secret_data",
    }


# -- the tests ------------------------------------------------------------------------------------


def test_the_audit_log_names_each_request_as_rbac_does(audited: AuditedKubeApi) -> None:
    kube = KubernetesApi(kubeconfig=audited.kubeconfig)
    kube._api.read_node("gpu1")
    kube._api.list_node(label_selector="gpufleet.io/pool=spare")
    kube._api.list_node(watch=True, timeout_seconds=1, _preload_content=False).read()
    kube._api.patch_node("gpu1", {"metadata": {"labels": {"a": "b"}}})
    lease = {"metadata": {"name": "l", "namespace": "gpufleet"}, "spec": {"holderIdentity": "w"}}
    kube._coordination.create_namespaced_lease("gpufleet", lease)
    kube._coordination.replace_namespaced_lease("l", "gpufleet", lease)
    kube._coordination.delete_namespaced_lease("l", "gpufleet")
    kube._api.create_namespaced_pod_eviction("batch-a", "serving", {"metadata": {"name": "batch-a"}})
    assert audited.requests() == [
        Request("get", "", "nodes", None, "gpu1"),
        Request("list", "", "nodes", None, None),
        Request("watch", "", "nodes", None, None),
        Request("patch", "", "nodes", None, "gpu1"),
        Request("create", "coordination.k8s.io", "leases", "gpufleet", None),
        Request("update", "coordination.k8s.io", "leases", "gpufleet", "l"),
        Request("delete", "coordination.k8s.io", "leases", "gpufleet", "l"),
        Request("create", "", "pods/eviction", "serving", "batch-a"),
    ]


def test_the_worker_is_granted_what_remediation_asks_for_and_nothing_more(audited: AuditedKubeApi) -> None:
    objects = rendered("overlays/example")
    worker = deployed(objects)
    driven = drive_remediation(KubernetesApi(kubeconfig=audited.kubeconfig, poll_seconds=0.05), worker)
    assert driven == REMEDIATION
    missing, extra = compare(audited.requests(), grants(objects, worker.account, worker.namespace))
    assert missing == [], f"requests the worker makes that deploy/ does not grant: {missing}"
    assert extra == [], f"rules in deploy/ that no request of the worker needs: {extra}"


def test_cluster_creation_adds_what_creating_a_cluster_asks_for_and_nothing_more(
    audited: AuditedKubeApi, tmp_path: Path
) -> None:
    objects = render_with(tmp_path, [DEPLOY / "base"], [DEPLOY / "components" / "cluster-creation"])
    worker = deployed(objects)
    [container] = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "GPUFLEET_CLUSTER_BACKENDS", "value": "slinky"} in container["env"]
    kube = KubernetesApi(kubeconfig=audited.kubeconfig, poll_seconds=0.05)
    driven = drive_remediation(kube, worker) | drive_cluster_creation(kube, worker)
    assert driven == REMEDIATION | CLUSTER_CREATION
    missing, extra = compare(audited.requests(), grants(objects, worker.account, worker.namespace))
    assert missing == [], f"requests a cluster-creating worker makes that deploy/ does not grant: {missing}"
    # The base's create of the validation baselines' ConfigMap, in its namespace, is covered by the
    # component's create of ConfigMaps anywhere too: needed without the component, not beside it.
    redundant = ["create core/configmaps in gpufleet"]
    assert extra == redundant, f"rules in deploy/ that no request of a cluster-creating worker needs: {extra}"
    # Without the component, a worker may make no Namespace, nor read a Secret.
    base = grants(rendered("base"), worker.account, worker.namespace)
    assert not any(g.allows(Request("create", "", "namespaces", None, None)) for g in base)
    assert not any(g.allows(Request("get", "", "secrets", "db", "slurm-db")) for g in base)


def _kube_calls(path: Path, methods: set[str]) -> set[str]:
    """The KubernetesApi methods this file calls (``x.method(...)``, by name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods
    }


def test_every_kubernetes_call_of_the_worker_is_driven_above() -> None:
    public = {name for name, _ in inspect.getmembers(KubernetesApi, inspect.isfunction) if not name.startswith("_")}
    assert public == REMEDIATION | CLUSTER_CREATION | set(NEVER_CALLED), "a method of KubernetesApi nobody sorted"
    everywhere: dict[str, set[str]] = {}
    for room in ("activities", "clients", "workers"):
        for path in sorted((REPO / room).rglob("*.py")):
            where = path.relative_to(REPO).as_posix()
            if where != "clients/kube.py":  # its own calls are those of the methods driven
                for method in _kube_calls(path, public):
                    everywhere.setdefault(method, set()).add(where)
    called = set(everywhere)
    assert not called & set(NEVER_CALLED), {m: everywhere[m] for m in called & set(NEVER_CALLED)}
    remediation = {m for m, files in everywhere.items() if files - CLUSTER_CREATION_CODE}
    assert remediation <= REMEDIATION, {m: everywhere[m] for m in remediation - REMEDIATION}
    assert called <= REMEDIATION | CLUSTER_CREATION
