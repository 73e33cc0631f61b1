"""Kubernetes authentication and authorisation: TokenReview, SubjectAccessReview, TokenRequest."""

from __future__ import annotations

from pathlib import Path

import kubernetes.client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from clients.errors import ClientError, Unavailable, error_for_status, redact
from models.auth import Identity


class Unauthenticated(ClientError):
    """The API server does not vouch for the token (or not for the audiences asked)."""

    retryable = False


class KubeAuth:
    """TokenReview and pod lookups over the official client, from a kubeconfig or in-cluster config."""

    def __init__(self, *, kubeconfig: Path | None = None) -> None:
        configuration = k8s.Configuration()
        if kubeconfig is not None:
            k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            try:
                k8s_config.load_incluster_config(client_configuration=configuration)
            except k8s_config.ConfigException:
                k8s_config.load_kube_config(client_configuration=configuration)
        configuration.retries = 0
        api_client = k8s.ApiClient(configuration)
        self._auth = k8s.AuthenticationV1Api(api_client)
        self._core = k8s.CoreV1Api(api_client)

    def review_token(self, token: str, *, audiences: list[str]) -> Identity:
        body = k8s.V1TokenReview(spec=k8s.V1TokenReviewSpec(token=token, audiences=audiences))
        try:
            review = self._auth.create_token_review(body)
        except ApiException as exc:
            raise error_for_status(exc.status or 0, redact(str(exc.reason), token)) from None
        except HTTPError as exc:
            raise Unavailable(f"TokenReview: {exc}") from None
        status = review.status
        if status is None or not status.authenticated or status.user is None:
            raise Unauthenticated(f"token not authenticated: {(status.error if status else None) or 'no reason given'}")
        got = list(status.audiences or [])
        if not set(got) & set(audiences):
            raise Unauthenticated(f"token is for audiences {got}, not {audiences}")
        user = status.user
        return Identity(
            name=user.username or "",
            uid=user.uid or "",
            groups=list(user.groups or []),
            extra={k: list(v) for k, v in (user.extra or {}).items()},
            audiences=got,
        )

    def pod_node(self, namespace: str, name: str, uid: str = "") -> str | None:
        try:
            pod = self._core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise error_for_status(exc.status or 0, str(exc.reason)) from None
        except HTTPError as exc:
            raise Unavailable(f"pod {namespace}/{name}: {exc}") from None
        if uid and (pod.metadata is None or pod.metadata.uid != uid):
            return None
        node = pod.spec.node_name if pod.spec else None
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
        bound = k8s.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod[0], uid=pod[1]) if pod else None
        body = k8s.AuthenticationV1TokenRequest(
            spec=k8s.V1TokenRequestSpec(
                audiences=audiences, expiration_seconds=expiration_seconds, bound_object_ref=bound
            )
        )
        try:
            answer = self._core.create_namespaced_service_account_token(service_account, namespace, body)
        except ApiException as exc:
            raise error_for_status(exc.status or 0, str(exc.reason)) from None
        except HTTPError as exc:
            raise Unavailable(f"TokenRequest: {exc}") from None
        if answer.status is None or not answer.status.token:
            raise Unavailable("TokenRequest: the API server answered without a token")
        return str(answer.status.token)
