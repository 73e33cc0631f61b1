"""The manifests and the compose file say what the design needs, with no more privilege than that."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from models.policy import policy_from_mapping

ROOT = Path(__file__).resolve().parents[1]


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((ROOT / name).read_text()) if doc]


def test_detector_daemonset_reads_kmsg_only_and_knows_its_node() -> None:
    [daemonset] = documents("deploy/detector-daemonset.yaml")
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
    assert "detect" in container["args"] and "--nvml" in container["args"]


def test_worker_may_evict_but_not_create_pods() -> None:
    role = next(d for d in documents("deploy/worker-deployment.yaml") if d["kind"] == "ClusterRole")
    rules = {resource: set(rule["verbs"]) for rule in role["rules"] for resource in rule["resources"]}
    assert rules["pods/eviction"] == {"create"}
    assert "create" not in rules["pods"] and "create" not in rules["nodes"]


def test_worker_may_run_repair_jobs_in_its_namespace_only() -> None:
    role = next(d for d in documents("deploy/worker-deployment.yaml") if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "gpufleet"
    rules = {resource: set(rule["verbs"]) for rule in role["rules"] for resource in rule["resources"]}
    assert rules["jobs"] == {"get", "create", "patch"}  # never delete: a Job is its attempt's record
    cluster_role = next(d for d in documents("deploy/worker-deployment.yaml") if d["kind"] == "ClusterRole")
    assert all("jobs" not in rule["resources"] for rule in cluster_role["rules"])


def test_the_detector_and_the_worker_mount_one_policy() -> None:
    [configmap] = documents("deploy/policy-configmap.yaml")
    detector = documents("deploy/detector-daemonset.yaml")[0]["spec"]["template"]["spec"]
    worker = next(d for d in documents("deploy/worker-deployment.yaml") if d["kind"] == "Deployment")
    for pod in (detector, worker["spec"]["template"]["spec"]):
        [container] = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert volumes["policy"]["configMap"]["name"] == configmap["metadata"]["name"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "policy")
        assert env["GPUFLEET_POLICY_FILE"] == f"{mount['mountPath']}/policy.yaml"
    policy = policy_from_mapping(yaml.safe_load(configmap["data"]["policy.yaml"]), origin="the ConfigMap")
    assert policy.remediation.owner_drained == "ask"
