"""Who may do what, as deploy/ renders it (docs/threat-model.md): the users' roles grant exactly
the gpufleet.io verbs of the table; the intake and the API have their certificates, their
Services and no more RBAC than their reviews; the detector holds only a token for the intake;
Temporal's credentials go to the worker, the intake and the API alone; and the overlays' network
policies let only those reach Temporal's frontend (the Web UI only through its own component), and
the detectors only the intake; and the values for Temporal's chart make its frontend require a
client certificate and its UI read-only."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from models.auth import RESOURCES
from models.intake import IntakeSettings
from tests.test_deploy import DEPLOY, DEPLOYED, Objects, of_kind, render_with, rendered, the

# The gpufleet.io resources and verbs the API authorises (models/auth.py's RESOURCES).
TABLE = {
    "incidents": {"get", "list", "create", "approve", "cancel", "update"},
    "breaker": {"get", "list", "reset", "pause"},
    "nodes": {"get", "list", "return", "release"},
    "clusters": {"get", "list", "create", "delete", "update"},
    "pool": {"get", "list", "rebalance"},
    "workflows": {"list"},
}
OVERLAYS = ["overlays/example", "overlays/slinky"]
TEMPORAL_SECRET = "gpufleet-temporal-client"
TEMPORAL_TLS_ENV = {"TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_KEY_PATH", "TEMPORAL_TLS_SERVER_CA_CERT_PATH"}


def granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(API group, resource): the verbs a role grants."""
    verbs: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                verbs.setdefault((group, resource), set()).update(rule["verbs"])
    return verbs


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = workload["spec"]["template"]["spec"]
    return pod


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    [container] = pod_of(workload)["containers"]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def bound_to(objects: Objects, account: str) -> list[dict[str, Any]]:
    """The roles bound to a ServiceAccount."""
    roles = []
    for binding in of_kind(objects, "RoleBinding") + of_kind(objects, "ClusterRoleBinding"):
        if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            ref = binding["roleRef"]
            [role] = [r for r in of_kind(objects, ref["kind"]) if r["metadata"]["name"] == ref["name"]]
            roles.append(role)
    return roles


def test_the_table_here_is_the_one_the_api_authorises() -> None:
    # The roles are checked against this copy: it must not drift from models/auth.py's.
    assert {resource: set(verbs) for resource, verbs in RESOURCES.items()} == TABLE


@pytest.mark.parametrize("name", DEPLOYED)
def test_the_users_roles_grant_exactly_the_tables_verbs(name: str) -> None:
    objects = rendered(name)
    everything = {("gpufleet.io", resource): verbs for resource, verbs in TABLE.items()}
    reads = {key: verbs & {"get", "list"} for key, verbs in everything.items()}
    answers = {**reads, ("gpufleet.io", "incidents"): {"get", "list", "approve", "cancel", "update"}}
    assert granted(the(objects, "ClusterRole", "gpufleet-viewer")) == reads
    assert granted(the(objects, "ClusterRole", "gpufleet-approver")) == answers
    assert granted(the(objects, "ClusterRole", "gpufleet-operator")) == everything


def test_the_example_binds_groups_to_the_roles_and_no_service_account() -> None:
    objects = rendered("overlays/example")
    bindings = {
        b["roleRef"]["name"]: b["subjects"]
        for b in of_kind(objects, "ClusterRoleBinding")
        if b["roleRef"]["name"].endswith(("viewer", "approver", "operator"))
    }
    assert set(bindings) == {"prod-gpufleet-viewer", "prod-gpufleet-approver", "prod-gpufleet-operator"}
    assert all(s["kind"] == "Group" for subjects in bindings.values() for s in subjects)


@pytest.mark.parametrize("name", DEPLOYED)
@pytest.mark.parametrize(
    ("service", "port", "container_port", "metrics", "rules"),
    [
        (
            "gpufleet-intake",
            443,
            8443,
            9465,
            {("authentication.k8s.io", "tokenreviews"): {"create"}, ("", "pods"): {"get"}},
        ),
        (
            "gpufleet-api",
            7243,
            7243,
            9466,
            {
                ("authentication.k8s.io", "tokenreviews"): {"create"},
                ("authorization.k8s.io", "subjectaccessreviews"): {"create"},
            },
        ),
    ],
)
def test_the_intake_and_the_api_serve_tls_and_may_only_review(
    name: str, service: str, port: int, container_port: int, metrics: int, rules: dict[tuple[str, str], set[str]]
) -> None:
    objects = rendered(name)
    deployment = the(objects, "Deployment", service)
    pod = pod_of(deployment)
    [container] = pod["containers"]
    command = service.removeprefix("gpufleet-")
    assert container["args"] == [command]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # Scraped as the worker is: the annotations name the metrics port.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(metrics)
    assert ports["metrics"] == metrics
    # The Service's port reaches the TLS port.
    svc = the(objects, "Service", service)
    [svc_port] = svc["spec"]["ports"]
    assert svc_port["port"] == port and ports[svc_port["targetPort"]] == container_port
    assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # Its certificate from a Secret, at the paths its settings name.
    env = env_of(deployment)
    prefix = "GPUFLEET_INTAKE" if command == "intake" else "GPUFLEET_API"
    assert env[f"{prefix}_PORT"] == str(container_port) and env[f"{prefix}_METRICS_PORT"] == str(metrics)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["tls"]["secret"]["secretName"] == f"{service}-tls"
    assert (
        env[f"{prefix}_TLS_CERT"] == f"{mounts['tls']}/tls.crt"
        and env[f"{prefix}_TLS_KEY"] == f"{mounts['tls']}/tls.key"
    )
    # Its RBAC: the reviews it makes (and the intake's pods), nothing more.
    account = pod["serviceAccountName"]
    roles = bound_to(objects, account)
    union: dict[tuple[str, str], set[str]] = {}
    for role in roles:
        for key, verbs in granted(role).items():
            union.setdefault(key, set()).update(verbs)
    assert union == rules
    for role in roles:
        if ("", "pods") in granted(role):
            assert role["kind"] == "Role" and role["metadata"]["namespace"] == "gpufleet"  # its namespace only
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("name", DEPLOYED)
def test_the_detector_holds_only_a_token_for_the_intake(name: str) -> None:
    objects = rendered(name)
    daemonset = the(objects, "DaemonSet")
    pod = pod_of(daemonset)
    [container] = pod["containers"]
    env = env_of(daemonset)
    assert not [key for key in env if key.startswith("TEMPORAL_")], "the detector talks to the intake, not Temporal"
    # Its token: projected, for audience gpufleet, an hour, where GPUFLEET_INTAKE_TOKEN_FILE says.
    [volume] = [v for v in pod["volumes"] if "projected" in v]
    sources = volume["projected"]["sources"]
    [token] = [s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s]
    assert token == {"audience": "gpufleet", "expirationSeconds": 3600, "path": "token"}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == "/var/run/secrets/gpufleet" and mount["readOnly"] is True
    assert env["GPUFLEET_INTAKE_TOKEN_FILE"] == "/var/run/secrets/gpufleet/token"
    # The intake's CA from a ConfigMap (never the intake's Secret: a node could read its key).
    [ca] = [s["configMap"] for s in sources if "configMap" in s]
    assert env["GPUFLEET_INTAKE_CA_FILE"] == f"{mount['mountPath']}/{ca['items'][0]['path']}"
    assert not [s for s in sources if "secret" in s]
    # The URL is this rendering's intake Service, at its port.
    url = urlsplit(env["GPUFLEET_INTAKE_URL"])
    svc = the(objects, "Service", "gpufleet-intake")
    assert url.scheme == "https"
    assert url.hostname == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert url.port == svc["spec"]["ports"][0]["port"]
    # Its own account, with no role bound and no token mounted for the Kubernetes API.
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert bound_to(objects, account) == []
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", DEPLOYED)
def test_the_intake_serves_the_workers_cluster_and_believes_its_detectors_alone(name: str) -> None:
    objects = rendered(name)
    intake = env_of(the(objects, "Deployment", "gpufleet-intake"))
    detector = the(objects, "DaemonSet")
    # The intake refuses to start without its cluster; it is the worker's, and the detectors'.
    cluster = env_of(the(objects, "Deployment"))["GPUFLEET_CLUSTER"]
    assert intake["GPUFLEET_CLUSTER"] == cluster == env_of(detector)["GPUFLEET_CLUSTER"]
    # The ServiceAccount it believes is this rendering's detectors' (with the overlay's prefix).
    account = pod_of(detector)["serviceAccountName"]
    namespace = detector["metadata"]["namespace"]
    assert ("ServiceAccount", account, namespace) in {
        (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects
    }
    settings = IntakeSettings(service_accounts=intake["GPUFLEET_INTAKE_SERVICE_ACCOUNTS"])
    assert settings.reporters == {f"system:serviceaccount:{namespace}:{account}"}


@pytest.mark.parametrize("name", DEPLOYED)
def test_only_the_worker_the_intake_and_the_api_hold_temporal_credentials(name: str) -> None:
    objects = rendered(name)
    holders = set()
    for workload in of_kind(objects, "Deployment") + of_kind(objects, "DaemonSet"):
        pod = pod_of(workload)
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        env = env_of(workload)
        if TEMPORAL_SECRET in secrets.values():
            holders.add(workload["metadata"]["name"].removeprefix("prod-").removeprefix("slurm-"))
            [volume] = [v for v, s in secrets.items() if s == TEMPORAL_SECRET]
            [container] = pod["containers"]
            [mount] = [m for m in container["volumeMounts"] if m["name"] == volume]
            assert mount["readOnly"] is True
            assert env.keys() >= TEMPORAL_TLS_ENV
            for key in TEMPORAL_TLS_ENV:
                assert env[key].startswith(mount["mountPath"] + "/"), key
        else:
            assert not TEMPORAL_TLS_ENV & env.keys() and "TEMPORAL_API_KEY" not in env
    assert holders == {"gpufleet-worker", "gpufleet-intake", "gpufleet-api"}


def _labels(objects: Objects, kind: str, name: str) -> dict[str, str]:
    labels: dict[str, str] = the(objects, kind, name)["spec"]["template"]["metadata"]["labels"]
    return labels


FRONTEND = {"app.kubernetes.io/name": "temporal", "app.kubernetes.io/component": "frontend"}
UI = {"app.kubernetes.io/name": "temporal", "app.kubernetes.io/component": "web"}  # the chart's labels


def _temporal_policy(objects: Objects, name: str) -> dict[str, Any]:
    [policy] = [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith(name)]
    assert policy["metadata"]["namespace"] == "temporal"
    spec: dict[str, Any] = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and spec["podSelector"]["matchLabels"] == FRONTEND
    return spec


@pytest.mark.parametrize("name", OVERLAYS)
def test_temporals_frontend_is_reachable_from_gpufleets_services_only(name: str) -> None:
    objects = rendered(name)
    spec = _temporal_policy(objects, "temporal-frontend-gpufleet-only")
    from_gpufleet, from_temporal = spec["ingress"]
    assert from_gpufleet["ports"] == [{"port": 7233, "protocol": "TCP"}]
    [peer] = from_gpufleet["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "gpufleet"}
    [expression] = peer["podSelector"]["matchExpressions"]
    allowed = set(expression["values"])
    assert expression["key"] == "app.kubernetes.io/name" and expression["operator"] == "In"
    # Exactly the pods of the three that hold Temporal's credentials; not the detector's.
    names = {
        _labels(objects, "Deployment", d)["app.kubernetes.io/name"]
        for d in ("gpufleet-worker", "gpufleet-intake", "gpufleet-api")
    }
    assert allowed == names
    assert _labels(objects, "DaemonSet", "gpufleet-detector")["app.kubernetes.io/name"] not in allowed
    # Temporal's own pods, its namespace only, the Web UI excepted.
    assert from_temporal == {
        "from": [
            {
                "podSelector": {
                    "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["web"]}]
                }
            }
        ]
    }


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_temporal_ui_reaches_the_frontend_only_through_its_own_component(tmp_path: Path, name: str) -> None:
    """The overlays admit the UI on 7233 with components/temporal-ui alone: without it, the
    network policy keeps the UI off the frontend (its rule for Temporal's pods excludes it)."""
    spec = _temporal_policy(rendered(name), "temporal-frontend-from-ui")
    assert spec["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": UI}}], "ports": [{"port": 7233, "protocol": "TCP"}]}
    ]
    without = render_with(tmp_path, [DEPLOY / "base"], [DEPLOY / "components" / "network-policy"])
    [policy] = [p for p in of_kind(without, "NetworkPolicy") if p["metadata"]["namespace"] == "temporal"]
    assert policy["metadata"]["name"] == "temporal-frontend-gpufleet-only"


def test_the_values_for_temporals_chart_require_client_certificates_and_a_read_only_ui() -> None:
    """deploy/temporal/values.yaml, for the temporalio/temporal chart: the frontend and the
    services between them take only clients with a certificate of the CA, and the UI presents its
    own certificate, shows no write buttons and has no Service or Ingress outside the cluster."""
    values = yaml.safe_load((DEPLOY / "temporal" / "values.yaml").read_text())
    tls = values["server"]["tls"]
    for section in ("frontend", "internode"):
        assert tls[section]["enabled"] is True and tls[section]["requireClientAuth"] is True, section
        assert tls[section]["secretName"] and tls[section]["serverName"], section
    web = values["web"]
    assert web["tls"]["enabled"] is True and web["tls"]["enableHostVerification"] is True
    assert web["tls"]["serverName"] == tls["frontend"]["serverName"]
    assert web["tls"]["secretName"] not in {tls["frontend"]["secretName"], tls["internode"]["secretName"]}
    env = {e["name"]: e["value"] for e in web["additionalEnv"]}
    assert env["TEMPORAL_DISABLE_WRITE_ACTIONS"] == "true"
    assert web["service"]["type"] == "ClusterIP" and web["ingress"]["enabled"] is False


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_detectors_reach_only_the_intake_and_dns(name: str) -> None:
    objects = rendered(name)
    [policy] = [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["namespace"] == "gpufleet"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == _labels(objects, "DaemonSet", "gpufleet-detector")
    assert spec["policyTypes"] == ["Egress"]
    to_intake, to_dns = spec["egress"]
    [peer] = to_intake["to"]
    assert peer == {"podSelector": {"matchLabels": _labels(objects, "Deployment", "gpufleet-intake")}}
    intake = the(objects, "Deployment", "gpufleet-intake")
    [container] = pod_of(intake)["containers"]
    https = next(p["containerPort"] for p in container["ports"] if p["name"] == "https")
    assert to_intake["ports"] == [{"port": https, "protocol": "TCP"}]
    assert {p["port"] for p in to_dns["ports"]} == {53}
    [dns] = to_dns["to"]
    assert dns["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}


@pytest.mark.parametrize("name", DEPLOYED)
def test_the_holders_of_temporal_credentials_never_run_on_a_gpu_node(name: str) -> None:
    objects = rendered(name)
    detector = pod_of(the(objects, "DaemonSet"))
    [(gpu_label, gpu_value)] = detector["nodeSelector"].items()
    for deployment in ("gpufleet-worker", "gpufleet-intake", "gpufleet-api"):
        affinity = pod_of(the(objects, "Deployment", deployment))["affinity"]["nodeAffinity"]
        [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": gpu_label, "operator": "NotIn", "values": [gpu_value]}]
