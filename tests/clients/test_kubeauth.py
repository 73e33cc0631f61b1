"""KubeAuth against the emulated API server (its own process, over HTTP): pod-bound tokens reviewed
with their node, each kind of bad token refused, static users with their groups, and
SubjectAccessReviews decided by the RBAC objects stored there."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from clients.errors import InvalidInput, NotFound
from clients.kube import KubernetesApi, api_client
from clients.kubeauth import KubeAuth, Unauthenticated
from lab.kubeapi import node_object
from models.auth import API_GROUP, INTAKE_AUDIENCE, Identity
from tests.conftest import KubeApiProcess

DETECTOR = "gpufleet-detector"
NAMESPACE = "gpufleet"


def _pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "detector"}},
        "spec": {"nodeName": node, "serviceAccountName": DETECTOR, "containers": [{"name": "d", "image": "gpufleet"}]},
    }


def _seed() -> dict[str, object]:
    return {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}],
        "nodes": [node_object("gpu1", pool="training"), node_object("gpu2", pool="training")],
        "serviceaccounts": [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": DETECTOR, "namespace": NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "gpufleet-api", "namespace": NAMESPACE},
            },
        ],
        "pods": [_pod("detector-gpu1", "gpu1"), _pod("detector-gpu2", "gpu2")],
    }


TOKENS = """\
viewer-token,alice,1001,"gpufleet:viewers,oncall"
approver-token,bob,1002,gpufleet:approvers
operator-token,carol,1003
"""


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiProcess]:
    """One API server for the module: each test asks for tokens of its own and binds roles to
    users of its own; the one that deletes the detector pods puts them back."""
    root = tmp_path_factory.mktemp("kubeauth")
    (root / "tokens.csv").write_text(TOKENS)
    process = KubeApiProcess(root / "kube", _seed(), ("--token-file", str(root / "tokens.csv")))
    yield process
    process.stop()


@pytest.fixture
def auth(api: KubeApiProcess) -> KubeAuth:
    return KubeAuth(kubeconfig=api.kubeconfig)


@pytest.fixture
def kube(api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=api.kubeconfig)


def _pod_uid(kube: KubernetesApi, name: str) -> str:
    found = kube.find_pod(NAMESPACE, name)
    assert found is not None
    return found.uid


def _detector_token(
    auth: KubeAuth, kube: KubernetesApi, pod: str, *, audience: str = INTAKE_AUDIENCE, seconds: int = 600
) -> str:
    return auth.request_token(
        NAMESPACE, DETECTOR, audiences=[audience], expiration_seconds=seconds, pod=(pod, _pod_uid(kube, pod))
    )


def test_a_pod_bound_token_is_reviewed_with_its_pod_and_node(auth: KubeAuth, kube: KubernetesApi) -> None:
    token = _detector_token(auth, kube, "detector-gpu1")
    who = auth.review_token(token, audiences=[INTAKE_AUDIENCE])
    assert who.name == f"system:serviceaccount:{NAMESPACE}:{DETECTOR}"
    assert who.uid  # the ServiceAccount's
    assert who.groups == ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}", "system:authenticated"]
    assert who.audiences == [INTAKE_AUDIENCE]
    assert who.node == "gpu1"
    assert who.pod_name == "detector-gpu1" and who.pod_uid == _pod_uid(kube, "detector-gpu1")
    assert who.extra["authentication.kubernetes.io/node-uid"][0]
    assert who.extra["authentication.kubernetes.io/credential-id"][0].startswith("JTI=")
    assert auth.pod_node(NAMESPACE, "detector-gpu1", who.pod_uid or "") == "gpu1"
    # The other detector's token names the other node.
    assert auth.review_token(_detector_token(auth, kube, "detector-gpu2"), audiences=[INTAKE_AUDIENCE]).node == "gpu2"


def test_a_token_for_another_audience_is_refused(auth: KubeAuth, kube: KubernetesApi) -> None:
    token = _detector_token(auth, kube, "detector-gpu1", audience="vault")
    with pytest.raises(Unauthenticated, match="invalid for the target audiences"):
        auth.review_token(token, audiences=[INTAKE_AUDIENCE])
    assert auth.review_token(token, audiences=["vault", INTAKE_AUDIENCE]).audiences == ["vault"]


def test_an_expired_token_is_refused(auth: KubeAuth, kube: KubernetesApi) -> None:
    token = _detector_token(auth, kube, "detector-gpu1", seconds=1)
    assert auth.review_token(token, audiences=[INTAKE_AUDIENCE]).node == "gpu1"
    deadline = time.monotonic() + 5
    while True:  # until the token's second is past (its exp is whole seconds)
        try:
            auth.review_token(token, audiences=[INTAKE_AUDIENCE])
        except Unauthenticated as refused:
            assert "expired" in str(refused)
            break
        assert time.monotonic() < deadline, "the token is still valid 5 s after its 1 s expiry"
        time.sleep(0.2)


def test_a_token_whose_pod_was_deleted_or_recreated_is_refused(
    auth: KubeAuth, kube: KubernetesApi, api: KubeApiProcess
) -> None:
    first = _detector_token(auth, kube, "detector-gpu1")
    second = _detector_token(auth, kube, "detector-gpu2")
    try:
        kube._api.delete_namespaced_pod("detector-gpu1", NAMESPACE)
        with pytest.raises(Unauthenticated, match='pods "detector-gpu1" not found'):
            auth.review_token(first, audiences=[INTAKE_AUDIENCE])
        assert auth.pod_node(NAMESPACE, "detector-gpu1") is None
        old_uid = _pod_uid(kube, "detector-gpu2")
        kube._api.delete_namespaced_pod("detector-gpu2", NAMESPACE)
        kube._api.create_namespaced_pod(NAMESPACE, _pod("detector-gpu2", "gpu2"))  # type: ignore[arg-type]  # the same name, a new uid
        with pytest.raises(Unauthenticated, match="does not match claim"):
            auth.review_token(second, audiences=[INTAKE_AUDIENCE])
        assert auth.pod_node(NAMESPACE, "detector-gpu2", old_uid) is None
        assert auth.pod_node(NAMESPACE, "detector-gpu2") == "gpu2"
    finally:  # both detectors there again (new uids) for the module's other tests
        for name, node in (("detector-gpu1", "gpu1"), ("detector-gpu2", "gpu2")):
            if kube.find_pod(NAMESPACE, name) is None:
                kube._api.create_namespaced_pod(NAMESPACE, _pod(name, node))  # type: ignore[arg-type]


def _tampered(token: str, **claims: Any) -> str:
    header, body, signature = token.split(".")
    decoded = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    decoded["kubernetes.io"]["node"]["name"] = claims.get("node", decoded["kubernetes.io"]["node"]["name"])
    forged = base64.urlsafe_b64encode(json.dumps(decoded).encode()).rstrip(b"=").decode()
    return f"{header}.{forged}.{signature}"


def test_a_forged_or_tampered_token_is_refused(auth: KubeAuth, kube: KubernetesApi) -> None:
    token = _detector_token(auth, kube, "detector-gpu1")
    with pytest.raises(Unauthenticated, match="cryptographic"):  # the signature no longer matches
        auth.review_token(_tampered(token, node="gpu2"), audiences=[INTAKE_AUDIENCE])
    header, body, _signature = token.split(".")
    with pytest.raises(Unauthenticated, match="cryptographic"):
        auth.review_token(f"{header}.{body}.{'A' * 43}", audiences=[INTAKE_AUDIENCE])
    for junk in ("not-a-token", "a.b.c", ""):
        with pytest.raises(Unauthenticated):
            auth.review_token(junk, audiences=[INTAKE_AUDIENCE])


def test_a_refusal_never_quotes_the_token(auth: KubeAuth, kube: KubernetesApi) -> None:
    token = _detector_token(auth, kube, "detector-gpu1", audience="vault")
    with pytest.raises(Unauthenticated) as refused:
        auth.review_token(token, audiences=[INTAKE_AUDIENCE])
    assert token not in str(refused.value) and token.split(".")[2] not in str(refused.value)


def test_a_static_user_is_reviewed_with_their_groups(auth: KubeAuth) -> None:
    alice = auth.review_token("viewer-token", audiences=[])
    assert (alice.name, alice.uid) == ("alice", "1001")
    assert alice.groups == ["gpufleet:viewers", "oncall", "system:authenticated"]
    assert alice.node is None and alice.pod_name is None
    assert auth.review_token("operator-token", audiences=[]).groups == ["system:authenticated"]
    # Audience-agnostic, as kube-apiserver's token file: valid for the API's audience only.
    with pytest.raises(Unauthenticated):
        auth.review_token("viewer-token", audiences=[INTAKE_AUDIENCE])
    with pytest.raises(Unauthenticated):
        auth.review_token("no-such-token", audiences=[])


def test_request_token_refuses_what_the_api_refuses(auth: KubeAuth, kube: KubernetesApi) -> None:
    with pytest.raises(NotFound):
        auth.request_token(NAMESPACE, "nobody", audiences=[INTAKE_AUDIENCE], expiration_seconds=600)
    with pytest.raises(NotFound):
        auth.request_token(NAMESPACE, DETECTOR, audiences=["x"], expiration_seconds=600, pod=("gone", ""))
    with pytest.raises(InvalidInput):
        auth.request_token(NAMESPACE, "../x", audiences=["x"], expiration_seconds=600)


# -- SubjectAccessReview from the RBAC objects stored in the API -----------------------------------


def _apply(api: KubeApiProcess, *objects: dict[str, Any]) -> None:
    """Create RBAC objects through the API, as kubectl create would."""
    rbac = k8s.RbacAuthorizationV1Api(api_client(api.kubeconfig))
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        kind = re.sub(r"(?<!^)([A-Z])", r"_\1", obj["kind"]).lower()
        if namespace:
            getattr(rbac, f"create_namespaced_{kind}")(namespace, obj)
        else:
            getattr(rbac, f"create_{kind}")(obj)


def _cluster_role(name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": list(rules),
    }


def _binding(
    kind: str, name: str, role: tuple[str, str], *subjects: dict[str, str], namespace: str = ""
) -> dict[str, Any]:
    meta = {"name": name} | ({"namespace": namespace} if namespace else {})
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role[0], "name": role[1]},
        "subjects": list(subjects),
    }


def _user(name: str, *groups: str) -> Identity:
    return Identity(name=name, groups=[*groups, "system:authenticated"])


def test_access_is_allowed_through_a_cluster_role_binding_to_a_user_a_group_or_a_service_account(
    auth: KubeAuth, api: KubeApiProcess
) -> None:
    viewer = _cluster_role("viewer", {"apiGroups": [API_GROUP], "resources": ["*"], "verbs": ["get", "list"]})
    approver = _cluster_role("approver", {"apiGroups": [API_GROUP], "resources": ["incidents"], "verbs": ["approve"]})
    rbac = "rbac.authorization.k8s.io"
    _apply(
        api,
        viewer,
        approver,
        _binding(
            "ClusterRoleBinding",
            "viewers",
            ("ClusterRole", "viewer"),
            {"kind": "Group", "name": "oncall", "apiGroup": rbac},
        ),
        _binding(
            "ClusterRoleBinding",
            "bob-approves",
            ("ClusterRole", "approver"),
            {"kind": "User", "name": "bob", "apiGroup": rbac},
        ),
        _binding(
            "ClusterRoleBinding",
            "api-approves",
            ("ClusterRole", "approver"),
            {"kind": "ServiceAccount", "name": "gpufleet-api", "namespace": NAMESPACE},
        ),
    )
    allowed, reason = auth.allowed(_user("bob"), verb="approve", resource="incidents", name="gpu1")
    assert (
        allowed
        and reason == 'RBAC: allowed by ClusterRoleBinding "bob-approves" of ClusterRole "approver" to User "bob"'
    )
    allowed, reason = auth.allowed(_user("alice", "oncall"), verb="list", resource="incidents")
    assert (
        allowed and reason == 'RBAC: allowed by ClusterRoleBinding "viewers" of ClusterRole "viewer" to Group "oncall"'
    )
    account = Identity(name=f"system:serviceaccount:{NAMESPACE}:gpufleet-api", groups=["system:serviceaccounts"])
    allowed, reason = auth.allowed(account, verb="approve", resource="incidents")
    assert allowed and reason.endswith(f'to ServiceAccount "gpufleet-api/{NAMESPACE}"')
    # Denied otherwise: another verb, another user, another group, another API group.
    assert auth.allowed(_user("alice", "oncall"), verb="approve", resource="incidents") == (False, "")
    assert not auth.allowed(_user("mallory"), verb="get", resource="incidents")[0]
    assert not auth.allowed(_user("bob"), verb="approve", resource="incidents", group="")[0]
    other = Identity(name="system:serviceaccount:default:gpufleet-api", groups=["system:serviceaccounts"])
    assert not auth.allowed(other, verb="approve", resource="incidents")[0]


def test_resource_names_are_honoured(auth: KubeAuth, api: KubeApiProcess) -> None:
    rule = {"apiGroups": [API_GROUP], "resources": ["nodes"], "resourceNames": ["gpu1"], "verbs": ["return"]}
    _apply(
        api,
        _cluster_role("gpu1-returner", rule),
        _binding("ClusterRoleBinding", "dave", ("ClusterRole", "gpu1-returner"), {"kind": "User", "name": "dave"}),
    )
    assert auth.allowed(_user("dave"), verb="return", resource="nodes", name="gpu1")[0]
    assert not auth.allowed(_user("dave"), verb="return", resource="nodes", name="gpu2")[0]
    assert not auth.allowed(_user("dave"), verb="return", resource="nodes")[0]  # no name: not that one


def test_a_role_binding_counts_only_in_its_namespace(auth: KubeAuth, api: KubeApiProcess) -> None:
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}
    _apply(
        api,
        _cluster_role("pod-reader", rule),
        _binding(
            "RoleBinding",
            "erin-reads",
            ("ClusterRole", "pod-reader"),
            {"kind": "User", "name": "erin"},
            namespace=NAMESPACE,
        ),
    )
    allowed, reason = auth.allowed(_user("erin"), verb="get", resource="pods", namespace=NAMESPACE, group="")
    assert allowed and reason == (
        f'RBAC: allowed by RoleBinding "erin-reads/{NAMESPACE}" of ClusterRole "pod-reader" to User "erin"'
    )
    assert not auth.allowed(_user("erin"), verb="get", resource="pods", namespace="default", group="")[0]
    assert not auth.allowed(_user("erin"), verb="get", resource="pods", group="")[0]  # cluster-wide: no


def test_a_binding_to_a_missing_role_says_so(auth: KubeAuth, api: KubeApiProcess) -> None:
    _apply(api, _binding("ClusterRoleBinding", "dangling", ("ClusterRole", "gone"), {"kind": "User", "name": "frank"}))
    allowed, reason = auth.allowed(_user("frank"), verb="get", resource="incidents")
    assert not allowed and reason == 'clusterrole.rbac.authorization.k8s.io "gone" not found'
