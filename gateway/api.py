"""``gpufleet api``: Temporal's WorkflowService, authenticated and authorised, in front of Temporal.

Every ``gpufleet`` command speaks to this server (GPUFLEET_API_ADDRESS) with the same Temporal
client code it would use against Temporal. Each call is

1. authenticated: a bearer token (the kubeconfig's) through a TokenReview, or, where
   GPUFLEET_API_CLIENT_CA is set, a client certificate that TLS verified against it (user: its
   CN, groups: its O);
2. mapped to a gpufleet permission (gateway/calls.py; anything unmapped is refused);
3. authorised by a SubjectAccessReview carrying the user's name, groups, uid and extra;
4. stamped with the authenticated user (the request's identity, the ``by`` of what a person asks);
5. forwarded to Temporal with the API's own credentials, within the caller's deadline; Temporal's
   answer, error details included, goes back as it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import grpc
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from temporalio.api.workflowservice import v1 as workflowservice
from temporalio.client import Client
from temporalio.common import MetricCounter
from temporalio.service import RPCError

from clients.errors import ClientError
from clients.kubeauth import Unauthenticated
from gateway.cache import ExpiringCache
from gateway.calls import SERVICE, Access, Refused, access, stamp
from models.auth import API_GROUP, Identity

log = logging.getLogger("gpufleet.api")

DEFAULT_PORT = 7243
DEFAULT_METRICS_PORT = 9466
REQUESTS_METRIC = "gpufleet_api_requests"  # Prometheus shows it as gpufleet_api_requests_total
# The calls that change nothing (every other one is logged with who made it).
READS = frozenset(
    {
        "GetSystemInfo",
        "QueryWorkflow",
        "DescribeWorkflowExecution",
        "GetWorkflowExecutionHistory",
        "ListWorkflowExecutions",
        "CountWorkflowExecutions",
    }
)
# What a caller reads when the Kubernetes API did not answer a review.
UNCHECKED = "the Kubernetes API did not answer the gpufleet API (its log says why); try again"


class ApiSettings(BaseSettings):
    """The API's settings (GPUFLEET_API_*)."""

    model_config = SettingsConfigDict(env_prefix="GPUFLEET_API_", extra="ignore")

    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    bind: str = "0.0.0.0"  # noqa: S104 (every address of the pod)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None  # the cluster's CA: client certificates signed by it are accepted
    metrics_port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)  # 0: none


class Authority(Protocol):
    """Who the caller is and what they may do (clients/kubeauth.py's KubeAuth)."""

    def review_token(self, token: str, *, audiences: list[str]) -> Identity: ...

    def allowed(
        self,
        identity: Identity,
        *,
        verb: str,
        resource: str,
        name: str = "",
        namespace: str = "",
        group: str = API_GROUP,
    ) -> tuple[bool, str]: ...


class Denied(Exception):
    """A call refused: its gRPC status code and the message the caller reads."""

    def __init__(self, code: grpc.StatusCode, message: str, result: str) -> None:
        super().__init__(message)
        self.code = code
        self.result = result


def snake(method: str) -> str:
    """StartWorkflowExecution -> start_workflow_execution (the SDK's WorkflowService methods)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", method).lower()


def role_for(needed: Access) -> str:
    """The ClusterRole (deploy/) that grants ``needed``."""
    if needed.verb in ("get", "list"):
        return "gpufleet-viewer"
    if needed.resource == "incidents" and needed.verb in ("approve", "cancel", "update"):
        return "gpufleet-approver"
    return "gpufleet-operator"


def certificate_identity(auth_context: Mapping[str, Iterable[bytes]]) -> Identity | None:
    """The user of a client certificate TLS verified (CN: name, O: groups), as Kubernetes reads one;
    None when the caller sent none."""
    names = list(auth_context.get("x509_common_name") or [])
    if not names:
        return None
    groups: list[str] = []
    pem = next(iter(auth_context.get("x509_pem_cert") or []), b"")
    if pem:
        with tempfile.NamedTemporaryFile("wb", suffix=".pem") as file:
            file.write(pem)
            file.flush()
            # The standard library's own decoder of a certificate (no parsing of DER by hand here).
            decoded: dict[str, Any] = ssl._ssl._test_decode_cert(file.name)  # type: ignore[attr-defined]
        for rdn in decoded.get("subject", ()):
            groups += [value for key, value in rdn if key == "organizationName"]
    # As the API server does for every user it authenticates (a binding to system:authenticated counts).
    return Identity(name=names[0].decode(), groups=[*groups, "system:authenticated"], extra={}, audiences=[])


class Gateway:
    """The handler of every WorkflowService call: authenticate, authorise, stamp, forward."""

    def __init__(
        self,
        temporal: Client,
        authority: Authority,
        *,
        client_certificates: bool = False,
        requests: MetricCounter | None = None,
    ) -> None:
        self._temporal = temporal
        self._authority = authority
        self._certificates = client_certificates
        self._requests = requests
        self._tokens = ExpiringCache()
        self._answers = ExpiringCache()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler for ``/temporal.api.workflowservice.v1.WorkflowService/<Method>``."""
        gateway = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
                service, _, method = str(details.method).lstrip("/").partition("/")
                if service != SERVICE or not method:
                    return None
                request_type = getattr(workflowservice, f"{method}Request", None)
                response_type = getattr(workflowservice, f"{method}Response", None)

                async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                    return await gateway.call(method, request, context)

                return grpc.unary_unary_rpc_method_handler(
                    behaviour,
                    request_deserializer=request_type.FromString if request_type else None,
                    response_serializer=response_type.SerializeToString if response_type else None,
                )

        return Handler()

    def _count(self, method: str, result: str) -> None:
        if self._requests is not None:
            self._requests.add(1, {"method": method, "result": result})

    async def call(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """One call, end to end; a refusal aborts it with its status and a message saying why."""
        try:
            identity = await self._authenticate(context)
            try:
                needed = access(method, request, namespace=self._temporal.namespace)
            except Refused as exc:
                code = grpc.StatusCode.INVALID_ARGUMENT if exc.invalid else grpc.StatusCode.PERMISSION_DENIED
                raise Denied(code, f"{method}: {exc}", "invalid" if exc.invalid else "denied") from None
            for one in needed:
                await self._authorise(identity, one)
            try:
                stamp(method, request, identity.name)
            except Refused as exc:
                raise Denied(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {exc}", "invalid") from None
            if method not in READS:  # the audit line of every change let through
                log.info("%s: %s allowed (%s)", identity.name, method, "; ".join(one.said() for one in needed))
        except Denied as exc:
            self._count(method, exc.result)
            log.info("refused %s: %s", method, exc)
            await context.abort(exc.code, str(exc))
        except Exception:  # a fault of the API's own: its log has it, never the caller
            self._count(method, "error")
            log.exception("%s failed before it was forwarded", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method}: the gpufleet API failed (its log says why)")
        remaining = context.time_remaining()
        timeout = timedelta(seconds=max(remaining - 0.05, 0.01)) if remaining is not None else None
        forward: Callable[..., Awaitable[Any]] = getattr(self._temporal.workflow_service, snake(method))
        try:
            response = await forward(request, retry=False, timeout=timeout)
        except RPCError as exc:
            self._count(method, "error")
            # Temporal's details (e.g. "already started", a query's failure) reach the caller's SDK as they came.
            # (grpc's aio server takes a tuple here: a list fails the call as UNKNOWN, TypeError.)
            trailer: tuple[tuple[str, str | bytes], ...] = (
                (("grpc-status-details-bin", exc.raw_grpc_status),) if exc.raw_grpc_status else ()
            )
            await context.abort(grpc.StatusCode[exc.status.name], exc.message, trailing_metadata=trailer)
        except (RuntimeError, OSError) as exc:  # a lazy client that cannot connect (Temporal away)
            self._count(method, "error")
            log.warning("%s: Temporal unreachable: %s", method, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: Temporal is unreachable now; retry later")
        self._count(method, "ok")
        return response

    async def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Identity:
        metadata = {key: value for key, value in (context.invocation_metadata() or ())}
        header = str(metadata.get("authorization", ""))
        if header:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "authorization: send `Bearer <token>`", "unauthenticated")
            return await self._review(token.strip())
        if self._certificates:
            found = certificate_identity(context.auth_context())
            if found is not None:
                return found
        what = (
            "a bearer token or a client certificate signed by the cluster's CA"
            if self._certificates
            else ("a bearer token (this API accepts no client certificates: GPUFLEET_API_CLIENT_CA is not set)")
        )
        raise Denied(
            grpc.StatusCode.UNAUTHENTICATED,
            f"no credentials: the gpufleet API needs {what}, the current user's of your kubeconfig "
            "(GPUFLEET_API_KUBECONFIG, $KUBECONFIG or ~/.kube/config)",
            "unauthenticated",
        )

    async def _review(self, token: str) -> Identity:
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._tokens.get(key)
        if isinstance(cached, Identity):
            return cached
        try:
            identity = await asyncio.to_thread(self._authority.review_token, token, audiences=[])
        except Unauthenticated as exc:
            raise Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the token was not accepted ({exc}): refresh your kubeconfig's credentials",
                "unauthenticated",
            ) from None
        except ClientError as exc:
            # What failed (the API server's address, its words) is the API's log's, not the caller's.
            log.warning("a token review failed: %s", exc)
            raise Denied(
                grpc.StatusCode.UNAVAILABLE, f"the token cannot be checked now: {UNCHECKED}", "unavailable"
            ) from None
        self._tokens.put(key, identity)
        return identity

    async def _authorise(self, identity: Identity, needed: Access) -> None:
        key = (identity.model_dump_json(), needed)
        answer = self._answers.get(key)
        if answer is None:
            try:
                answer = await asyncio.to_thread(
                    self._authority.allowed, identity, verb=needed.verb, resource=needed.resource, name=needed.name
                )
            except ClientError as exc:
                log.warning("an access review failed: %s", exc)
                raise Denied(
                    grpc.StatusCode.UNAVAILABLE, f"permission cannot be checked now: {UNCHECKED}", "unavailable"
                ) from None
            self._answers.put(key, answer)
        allowed, reason = answer
        if not allowed:
            why = f" ({reason})" if reason else ""
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{identity.name} may not {needed.said()}{why}: ask for the {role_for(needed)} role",
                "denied",
            )


def server_credentials(settings: ApiSettings) -> grpc.ServerCredentials:
    """TLS with the API's certificate; where GPUFLEET_API_CLIENT_CA is set, mutual TLS: every
    caller presents a client certificate signed by it (gRPC's Python server cannot ask for one
    without requiring it), and a bearer token, when sent as well, names the caller instead.

    Raises:
        ValueError: the certificate or key is not set, or cannot be read.
    """
    if settings.tls_cert is None or settings.tls_key is None:
        raise ValueError(
            "GPUFLEET_API_TLS_CERT and GPUFLEET_API_TLS_KEY are needed: the API carries bearer tokens, "
            "never without TLS"
        )
    try:
        pair = (settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())
        roots = settings.client_ca.read_bytes() if settings.client_ca is not None else None
    except OSError as exc:
        raise ValueError(f"{exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=roots is not None)


async def serve(
    settings: ApiSettings,
    temporal: Client,
    authority: Authority,
    *,
    requests: MetricCounter | None = None,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or forever); ``ready`` is told the port once it listens."""
    server = grpc.aio.server()
    gateway = Gateway(temporal, authority, client_certificates=settings.client_ca is not None, requests=requests)
    server.add_generic_rpc_handlers((gateway.handler(),))
    host = f"[{settings.bind}]" if ":" in settings.bind else settings.bind
    port = server.add_secure_port(f"{host}:{settings.port}", server_credentials(settings))
    if port == 0:
        raise OSError(f"cannot listen on {host}:{settings.port}")
    await server.start()
    log.info("gpufleet API on %s:%d, forwarding to Temporal namespace %s", host, port, temporal.namespace)
    if ready is not None:
        ready(port)
    try:
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await server.stop(grace=5)
