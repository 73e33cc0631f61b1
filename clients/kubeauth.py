"""Kubernetes authentication and authorization through the official client: TokenReview,
SubjectAccessReview, TokenRequest, and the node a token's pod runs on.

The service that calls these needs, in its ClusterRole: ``create`` on
``tokenreviews.authentication.k8s.io`` and ``subjectaccessreviews.authorization.k8s.io``, ``get``
on ``pods``, and (to issue tokens, as the lab does) ``create`` on ``serviceaccounts/token``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from clients.errors import ClientError, Forbidden, NotFound, Unavailable, error_for_status, redact
from clients.kube import api_client, checked_namespace, checked_object_name
from models.auth import API_GROUP, Identity

# Seconds one call may take before it is Unavailable, unless told (GPUFLEET_KUBE_TIMEOUT_SECONDS).
TIMEOUT = 15.0


class Unauthenticated(ClientError):
    """The credential does not authenticate (invalid, expired, revoked, or for another audience)."""

    retryable = False


class KubeAuth:
    """Who a bearer token is, and what RBAC lets them do, as the Kubernetes API server says."""

    def __init__(self, *, kubeconfig: Path | None = None, request_timeout_seconds: float = TIMEOUT) -> None:
        if not request_timeout_seconds > 0:
            raise ValueError(f"request_timeout_seconds={request_timeout_seconds}: give a number of seconds above 0")
        self._timeout = request_timeout_seconds
        client = api_client(kubeconfig)
        self._core = k8s.CoreV1Api(client)
        self._authn = k8s.AuthenticationV1Api(client)
        self._authz = k8s.AuthorizationV1Api(client)
        self.host: str = client.configuration.host

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, secret: str = "", **kwargs: Any) -> dict[str, Any]:
        """One call, its answer read as JSON; errors typed as clients/errors.py types them (a
        ``secret`` in the server's words is redacted)."""
        try:
            response = fn(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
            try:
                data: dict[str, Any] = json.loads(response.data)
            finally:
                response.release_conn()
        except ApiException as exc:
            status = exc.status or 0
            detail = redact(f"{what}: HTTP {status} {exc.reason}: {_message(exc.body)}", secret)
            if status in (401, 403):
                detail += (
                    " (this service's account needs create on tokenreviews.authentication.k8s.io and "
                    "subjectaccessreviews.authorization.k8s.io, and get on pods)"
                )
                raise Forbidden(detail) from None
            raise error_for_status(status, detail) from None
        except (Urllib3Error, OSError) as exc:
            raise Unavailable(redact(f"{what}: {exc}", secret)) from None
        except ValueError as exc:
            raise ClientError(f"{what}: the API server's answer is not JSON: {exc}") from None
        return data

    def review_token(self, token: str, *, audiences: list[str]) -> Identity:
        """Who ``token`` is (a TokenReview for ``audiences``; none: the API server's own).
        Unauthenticated when it is not valid, or valid for none of ``audiences``."""
        if not token:
            raise Unauthenticated("no bearer token was presented")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": list(audiences)},
        }
        answer = self._call("review a token", self._authn.create_token_review, body, secret=token)
        status = answer.get("status") or {}
        if not status.get("authenticated"):
            error = redact(str(status.get("error") or "no reason given"), token)
            raise Unauthenticated(f"the token was not authenticated: {error}")
        found = [str(a) for a in status.get("audiences") or []]
        if audiences and not set(audiences) & set(found):
            raise Unauthenticated(f"the token is valid for {found}, not for {list(audiences)}")
        user = status.get("user") or {}
        if not user.get("username"):
            raise Unauthenticated("the token review named no user")
        return Identity(
            name=str(user["username"]),
            uid=str(user.get("uid") or ""),
            groups=[str(g) for g in user.get("groups") or []],
            extra={str(k): [str(v) for v in values or []] for k, values in (user.get("extra") or {}).items()},
            audiences=found,
        )

    def allowed(
        self,
        identity: Identity,
        *,
        verb: str,
        resource: str,
        name: str = "",
        namespace: str = "",
        group: str = API_GROUP,
    ) -> tuple[bool, str]:
        """Whether ``identity`` may ``verb`` the ``resource`` (a SubjectAccessReview carrying its
        name, uid, groups and extra), and the authorizer's reason (or evaluation error)."""
        attributes = {"group": group, "resource": resource, "verb": verb, "name": name, "namespace": namespace}
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": identity.name,
                "uid": identity.uid,
                "groups": list(identity.groups),
                "extra": {k: list(v) for k, v in identity.extra.items()},
                "resourceAttributes": {k: v for k, v in attributes.items() if v},
            },
        }
        what = f"ask whether {identity.name} may {verb} {resource}{f' {name}' if name else ''}"
        status = self._call(what, self._authz.create_subject_access_review, body).get("status") or {}
        allowed = bool(status.get("allowed")) and not status.get("denied")
        reason = str(status.get("reason") or status.get("evaluationError") or "")
        return allowed, reason

    def pod_node(self, namespace: str, name: str, uid: str = "") -> str | None:
        """The node the pod runs on (``spec.nodeName``); None when the pod is gone, is another
        pod under that name (its uid is not ``uid``), or has no node yet."""
        namespace = checked_namespace(namespace)
        name = checked_object_name(name, "Pod")
        try:
            pod = self._call(f"read pod {namespace}/{name}", self._core.read_namespaced_pod, name, namespace)
        except NotFound:
            return None
        if uid and (pod.get("metadata") or {}).get("uid") != uid:
            return None
        node = (pod.get("spec") or {}).get("nodeName")
        return str(node) if node else None

    def request_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: list[str],
        expiration_seconds: int,
        pod: tuple[str, str] | None = None,
    ) -> str:
        """A token of the ServiceAccount for ``audiences`` (a TokenRequest), valid for
        ``expiration_seconds``, bound to ``pod`` (name, uid) when given."""
        namespace = checked_namespace(namespace)
        service_account = checked_object_name(service_account, "ServiceAccount")
        spec: dict[str, Any] = {"audiences": list(audiences), "expirationSeconds": int(expiration_seconds)}
        if pod is not None:
            pod_name, pod_uid = pod
            bound = {"kind": "Pod", "apiVersion": "v1", "name": checked_object_name(pod_name, "Pod")}
            spec["boundObjectRef"] = bound | ({"uid": pod_uid} if pod_uid else {})
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        answer = self._call(
            f"request a token for {namespace}/{service_account}",
            self._core.create_namespaced_service_account_token,
            service_account,
            namespace,
            body,
        )
        token = (answer.get("status") or {}).get("token")
        if not token:
            raise ClientError(f"request a token for {namespace}/{service_account}: the answer holds no token")
        return str(token)


def _message(body: Any) -> str:
    """The API server's Status message, or the start of what it said."""
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return str(message or body or "")[:300]
