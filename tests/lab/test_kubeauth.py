"""The emulated API's TokenRequest, TokenReview and SubjectAccessReview as a real API server answers
them on the wire, and RBAC objects applied with kubectl deciding."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lab import kubeauth
from lab.kubeapi import node_object
from tests.conftest import REPO, KubeApiProcess

KUBECTL = shutil.which("kubectl")
NS = "gpufleet"
ISSUER = "https://kubernetes.default.svc.cluster.local"


def _seed() -> dict[str, object]:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "detector-gpu1", "namespace": NS},
        "spec": {"nodeName": "gpu1", "containers": [{"name": "d", "image": "gpufleet"}]},
    }
    return {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}],
        "nodes": [node_object("gpu1", pool="training")],
        "serviceaccounts": [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "detector", "namespace": NS}}
        ],
        "pods": [pod],
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiProcess]:
    """One API server for the module: the test that deletes the ServiceAccount puts it back, and
    the roles kubectl applies grant nothing on what the other tests ask."""
    root = tmp_path_factory.mktemp("kubeauth")
    (root / "tokens.csv").write_text('lab-viewer,alice,1001,"gpufleet:viewers"\n')
    args = ("--token-file", str(root / "tokens.csv"), "--signing-key", str(root / "signing.key"))
    process = KubeApiProcess(root / "kube", _seed(), args)
    yield process
    process.stop()


@pytest.fixture
def http(api: KubeApiProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=10) as client:
        yield client


def _claims(token: str) -> dict[str, Any]:
    body = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    return claims


def _token(http: httpx.Client, spec: dict[str, Any], account: str = "detector") -> httpx.Response:
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    return http.post(f"/api/v1/namespaces/{NS}/serviceaccounts/{account}/token", json=body)


def _review(http: httpx.Client, token: str, audiences: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"token": token} | ({"audiences": audiences} if audiences is not None else {})
    answer = http.post(
        "/apis/authentication.k8s.io/v1/tokenreviews",
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec},
    )
    assert answer.status_code == 201, answer.text
    status: dict[str, Any] = answer.json()["status"]
    return status


def test_a_token_request_answers_a_signed_jwt_with_the_claims_a_real_server_writes(http: httpx.Client) -> None:
    pod = http.get(f"/api/v1/namespaces/{NS}/pods/detector-gpu1").json()
    node = http.get("/api/v1/nodes/gpu1").json()
    account = http.get(f"/api/v1/namespaces/{NS}/serviceaccounts/detector").json()
    before = int(time.time())
    answer = _token(
        http,
        {
            "audiences": ["gpufleet"],
            "expirationSeconds": 30,
            "boundObjectRef": {"kind": "Pod", "name": "detector-gpu1"},
        },
    )
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["kind"] == "TokenRequest" and body["apiVersion"] == "authentication.k8s.io/v1"
    assert body["spec"]["boundObjectRef"]["uid"] == pod["metadata"]["uid"]
    claims = _claims(body["status"]["token"])
    assert claims["iss"] == ISSUER and claims["aud"] == ["gpufleet"]
    assert claims["sub"] == f"system:serviceaccount:{NS}:detector"
    assert before <= claims["iat"] == claims["nbf"] and claims["exp"] == claims["iat"] + 30
    assert claims["kubernetes.io"] == {
        "namespace": NS,
        "serviceaccount": {"name": "detector", "uid": account["metadata"]["uid"]},
        "pod": {"name": "detector-gpu1", "uid": pod["metadata"]["uid"]},
        "node": {"name": "gpu1", "uid": node["metadata"]["uid"]},
    }
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims["exp"]))
    assert body["status"]["expirationTimestamp"] == expires
    # No audience asked: the API's own, for an hour.
    plain = _claims(_token(http, {}).json()["status"]["token"])
    assert plain["aud"] == [ISSUER] and plain["exp"] - plain["iat"] == 3600 and "pod" not in plain["kubernetes.io"]


def test_a_token_request_is_refused_for_what_does_not_exist(http: httpx.Client) -> None:
    assert _token(http, {}, account="nobody").status_code == 404
    assert _token(http, {"boundObjectRef": {"kind": "Pod", "name": "gone"}}).status_code == 404
    stale = _token(http, {"boundObjectRef": {"kind": "Pod", "name": "detector-gpu1", "uid": "not-its-uid"}})
    assert stale.status_code == 409 and "does not match the UID in record" in stale.json()["message"]
    assert _token(http, {"boundObjectRef": {"kind": "Secret", "name": "x"}}).status_code == 422
    assert _token(http, {"expirationSeconds": 0}).status_code == 422
    assert http.get(f"/api/v1/namespaces/{NS}/serviceaccounts/detector/token").status_code == 405


def test_a_token_review_answers_as_the_real_api(http: httpx.Client) -> None:
    bound = {"kind": "Pod", "name": "detector-gpu1"}
    token = _token(http, {"audiences": ["gpufleet", "other"], "boundObjectRef": bound}).json()["status"]["token"]
    status = _review(http, token, ["gpufleet"])
    assert status["authenticated"] and status["audiences"] == ["gpufleet"]
    user = status["user"]
    assert user["username"] == f"system:serviceaccount:{NS}:detector"
    assert user["groups"] == ["system:serviceaccounts", f"system:serviceaccounts:{NS}", "system:authenticated"]
    assert set(user["extra"]) == {
        "authentication.kubernetes.io/credential-id",
        "authentication.kubernetes.io/pod-name",
        "authentication.kubernetes.io/pod-uid",
        "authentication.kubernetes.io/node-name",
        "authentication.kubernetes.io/node-uid",
    }
    assert user["extra"]["authentication.kubernetes.io/credential-id"] == [f"JTI={_claims(token)['jti']}"]
    refused = _review(http, token)  # no audience: the API's own, which the token is not for
    assert not refused["authenticated"] and refused["error"].startswith("[invalid bearer token, token audiences")
    assert _review(http, "lab-viewer")["user"] == {
        "username": "alice",
        "uid": "1001",
        "groups": ["gpufleet:viewers", "system:authenticated"],
    }
    # Deleting the ServiceAccount revokes its tokens.
    assert http.delete(f"/api/v1/namespaces/{NS}/serviceaccounts/detector").status_code == 200
    try:
        assert not _review(http, token, ["gpufleet"])["authenticated"]
    finally:  # back (a new uid) for the module's other tests
        account = _seed()["serviceaccounts"][0]  # type: ignore[index]
        http.post(f"/api/v1/namespaces/{NS}/serviceaccounts", json=account).raise_for_status()


def test_tokens_outlive_a_restart_with_the_same_signing_key(tmp_path: Path) -> None:
    key = tmp_path / "signing.key"
    args = ("--signing-key", str(key))
    first = KubeApiProcess(tmp_path / "one", _seed(), args)
    try:
        with httpx.Client(base_url=first.url, timeout=10) as http:
            token = _token(http, {"audiences": ["gpufleet"]}).json()["status"]["token"]
    finally:
        first.stop()
    assert key.stat().st_mode & 0o777 == 0o600
    account = _seed()
    account["serviceaccounts"][0]["metadata"]["uid"] = _claims(token)["kubernetes.io"]["serviceaccount"]["uid"]  # type: ignore[index]
    again = KubeApiProcess(tmp_path / "two", account, args)
    other = KubeApiProcess(tmp_path / "three", account)  # a key of its own
    try:
        with httpx.Client(base_url=again.url, timeout=10) as http:
            assert _review(http, token, ["gpufleet"])["authenticated"]
        with httpx.Client(base_url=other.url, timeout=10) as http:
            assert not _review(http, token, ["gpufleet"])["authenticated"]
    finally:
        again.stop()
        other.stop()


def test_a_bad_token_file_stops_the_server_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "tokens.csv").write_text("lab-viewer,alice\n")
    with pytest.raises(RuntimeError, match=r"tokens.csv:1: token file record must have at least 3 columns"):
        KubeApiProcess(tmp_path / "kube", _seed(), ("--token-file", str(tmp_path / "tokens.csv")))


def _access(http: httpx.Client, spec: dict[str, Any]) -> httpx.Response:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
    return http.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", json=body)


def test_a_subject_access_review_must_say_who_and_what(http: httpx.Client) -> None:
    assert _access(http, {"user": "alice"}).status_code == 422
    assert _access(http, {"resourceAttributes": {"verb": "get", "resource": "pods"}}).status_code == 422
    nothing = _access(http, {"user": "alice", "resourceAttributes": {"verb": "get", "resource": "pods"}})
    assert nothing.status_code == 201 and nothing.json()["status"] == {"allowed": False}
    masters = _access(http, {"groups": ["system:masters"], "nonResourceAttributes": {"verb": "get", "path": "/x"}})
    assert masters.json()["status"]["allowed"]


ROLES = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: gpufleet-viewer
  labels: {gpufleet.io/aggregate-to-approver: "true"}
rules:
- apiGroups: [gpufleet.io]
  resources: [incidents, breaker, nodes, clusters, pool]
  verbs: [get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: gpufleet-answers
  labels: {gpufleet.io/aggregate-to-approver: "true"}
rules:
- apiGroups: [gpufleet.io]
  resources: [incidents]
  verbs: [approve, cancel, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: gpufleet-approver
# Its rules are the union of the roles it selects (a real cluster's controller writes them).
aggregationRule:
  clusterRoleSelectors:
  - matchLabels: {gpufleet.io/aggregate-to-approver: "true"}
rules: []
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: gpufleet-viewers
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: gpufleet-viewer}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: Group, name: "gpufleet:viewers"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: gpufleet-approvers
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: gpufleet-approver}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: Group, name: "gpufleet:approvers"}
"""


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (make test installs it as root)")
def test_the_cluster_roles_of_a_yaml_applied_with_kubectl_decide(
    api: KubeApiProcess, http: httpx.Client, tmp_path: Path
) -> None:
    assert KUBECTL is not None
    (tmp_path / "roles.yaml").write_text(ROLES)
    kubectl = [KUBECTL, "--kubeconfig", str(api.kubeconfig)]
    applied = subprocess.run(
        [*kubectl, "apply", "--validate=false", "-f", str(tmp_path / "roles.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr

    def review(groups: list[str], verb: str, resource: str = "incidents") -> dict[str, Any]:
        attributes = {"group": "gpufleet.io", "resource": resource, "verb": verb, "name": "gpu1"}
        answer = _access(http, {"user": "someone", "groups": groups, "resourceAttributes": attributes})
        status: dict[str, Any] = answer.json()["status"]
        return status

    viewer, approver = ["gpufleet:viewers", "system:authenticated"], ["gpufleet:approvers", "system:authenticated"]
    assert review(viewer, "list")["reason"] == (
        'RBAC: allowed by ClusterRoleBinding "gpufleet-viewers" of ClusterRole "gpufleet-viewer" '
        'to Group "gpufleet:viewers"'
    )
    assert not review(viewer, "approve")["allowed"]
    assert review(approver, "approve")["allowed"]
    assert review(approver, "get", "breaker")["allowed"]  # aggregated from the viewer's role
    assert not review(approver, "reset", "breaker")["allowed"]
    # Taken back with kubectl: the approvers may no longer approve.
    deleted = subprocess.run(
        [*kubectl, "delete", "clusterrolebinding", "gpufleet-approvers"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert deleted.returncode == 0, deleted.stderr
    assert not review(approver, "approve")["allowed"]


def test_rules_match_as_the_rbac_authorizer_matches_them() -> None:
    def asks(**fields: Any) -> kubeauth.Attributes:
        return kubeauth.Attributes(user="u", groups=(), resource_request="path" not in fields, **fields)

    status_rule = {"apiGroups": [""], "resources": ["*/status"], "verbs": ["patch"]}
    assert kubeauth.rule_allows(asks(verb="patch", resource="nodes", subresource="status"), status_rule)
    assert not kubeauth.rule_allows(asks(verb="patch", resource="nodes"), status_rule)
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}
    assert not kubeauth.rule_allows(asks(verb="create", resource="pods", subresource="eviction"), pods)
    metrics = {"nonResourceURLs": ["/metrics", "/healthz/*"], "verbs": ["get"]}
    assert kubeauth.rule_allows(asks(verb="get", path="/healthz/ping"), metrics)
    assert not kubeauth.rule_allows(asks(verb="get", path="/metricsx"), metrics)


def test_an_aggregated_role_has_the_rules_it_selects_and_none_of_its_own() -> None:
    # A real cluster's controller overwrites an aggregated role's rules with what it selects.
    viewer = {"metadata": {"name": "viewer", "labels": {"agg": "yes"}}, "rules": [{"verbs": ["get"]}]}
    wide = {
        "metadata": {"name": "approver"},
        "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"agg": "yes"}}]},
        "rules": [{"verbs": ["*"]}],  # written over on a real cluster: grants nothing
    }
    assert kubeauth.cluster_role_rules(wide, [viewer, wide]) == [{"verbs": ["get"]}]
    # A selector with an operator a real server refuses selects nothing.
    odd = {
        "metadata": {"name": "odd"},
        "aggregationRule": {
            "clusterRoleSelectors": [{"matchExpressions": [{"key": "agg", "operator": "Gt", "values": ["a"]}]}]
        },
    }
    assert kubeauth.cluster_role_rules(odd, [viewer, odd]) == []
    assert kubeauth.cluster_role_rules(viewer, [viewer, wide]) == [{"verbs": ["get"]}]


def _forged(claims: dict[str, Any], header: dict[str, Any], signature: bytes) -> str:
    def part(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    return ".".join((part(json.dumps(header).encode()), part(json.dumps(claims).encode()), part(signature)))


def _macd(claims: dict[str, Any], header: dict[str, Any], key: bytes) -> str:
    """A token under ``header`` with the HS256 MAC of its first two parts under ``key``."""
    head, body, _ = _forged(claims, header, b"").split(".")
    mac = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def test_only_a_token_signed_hs256_with_the_servers_key_verifies() -> None:
    key, now = b"k" * 32, time.time()
    claims = {"iss": ISSUER, "sub": "system:serviceaccount:gpufleet:detector", "exp": now + 60, "iat": now, "nbf": now}
    assert kubeauth.verify(kubeauth.sign(claims, key), key, now=now)["sub"] == claims["sub"]
    refused = [
        kubeauth.sign(claims, b"x" * 32),  # another server's key
        _forged(claims, {"alg": "none", "typ": "JWT"}, b""),  # unsigned
        _forged(claims, {"alg": "none", "typ": "JWT"}, b"\0" * 32),
        _macd(claims, {"alg": "HS512", "typ": "JWT"}, key),  # a right HS256 MAC, another alg named
        kubeauth.sign({**claims, "exp": now}, key),  # expired at now
        kubeauth.sign({**claims, "nbf": now + 5}, key),  # not yet valid
        kubeauth.sign({**claims, "iss": "https://elsewhere"}, key),
        kubeauth.sign({k: v for k, v in claims.items() if k != "exp"}, key),
    ]
    for token in refused:
        with pytest.raises(kubeauth.TokenInvalid):
            kubeauth.verify(token, key, now=now)


def test_the_token_file_reads_as_kube_apiserver_reads_it(tmp_path: Path) -> None:
    (tmp_path / "tokens.csv").write_text('t1,alice,1001,"g1, g2"\n\nt2, bob, 1002\nt1,alice,1001,g3\n')
    users = kubeauth.read_token_file(tmp_path / "tokens.csv")
    assert users == {
        "t1": kubeauth.StaticUser(name="alice", uid="1001", groups=("g3",)),  # the later line wins
        "t2": kubeauth.StaticUser(name="bob", uid="1002", groups=()),
    }
