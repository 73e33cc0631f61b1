"""The intake: detectors post their events here over HTTPS, never to Temporal.

Each ``POST /v1/events`` carries the pod's projected ServiceAccount token (audience ``gpufleet``).
The intake has the Kubernetes API server review it (TokenReview), takes the node it speaks for
from the token (the node name the API server adds to pod-bound tokens, else the bound pod's
``spec.nodeName``), and accepts an event only for that node and for the intake's own cluster.
Each node has a token bucket (GPUFLEET_INTAKE_RATE per minute, GPUFLEET_INTAKE_BURST at once);
an accepted event opens or joins the node's incident exactly as ``gpufleet remediate`` does
(starters.temporal.report_xid). A refused one reaches Temporal in no way.

Answers: 202 ``{"incident": ID}``; 400 a body that is no event; 401 no token, or one the API
server does not vouch for with audience ``gpufleet`` (unknown, expired, another audience); 403 a
token of another ServiceAccount than the detectors' (GPUFLEET_INTAKE_SERVICE_ACCOUNTS), a token
for another node, or an event for another cluster; 429 over the node's rate (Retry-After);
503 Temporal or the Kubernetes API unreachable (Retry-After). Every refusal is logged with the node
claimed and the identity, and counted (models/intake.py names the metrics).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aiohttp import web
from pydantic import ValidationError
from temporalio.client import Client
from temporalio.common import MetricMeter
from temporalio.service import RPCError, RPCStatusCode

from clients.errors import ClientError
from clients.kubeauth import Unauthenticated
from gateway.cache import ExpiringCache
from models.auth import INTAKE_AUDIENCE, Identity
from models.intake import (
    EVENTS,
    EVENTS_HELP,
    EVENTS_PATH,
    HEALTH_PATH,
    REASONS,
    REFUSED,
    REFUSED_HELP,
    RESULTS,
    UNREADABLE_PREFIX,
    IntakeEvent,
    IntakeSettings,
)
from starters.temporal import TemporalConfigInvalid, TemporalUnreachable, report_xid

log = logging.getLogger("gpufleet.intake")

MAX_BODY_BYTES = 64 * 1024  # one event is well under 2 KiB
UNAVAILABLE_RETRY_SECONDS = 5
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


class Reviewer(Protocol):
    """What the intake asks of Kubernetes (clients.kubeauth.KubeAuth)."""

    def review_token(self, token: str, *, audiences: list[str]) -> Identity: ...

    def pod_node(self, namespace: str, name: str, uid: str = "") -> str | None: ...


class IntakeTlsError(ValueError):
    """The intake's certificate or key cannot be used; the message names the file and the fix."""


def server_tls(cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """The TLS context of the intake, from a PEM certificate (chain) and its key.

    Raises:
        IntakeTlsError: a file is not set, missing, unreadable, or the two do not belong together.
    """
    if cert is None or key is None:
        unset = [name for name, value in (("CERT", cert), ("KEY", key)) if value is None]
        raise IntakeTlsError(
            f"GPUFLEET_INTAKE_TLS_{' and GPUFLEET_INTAKE_TLS_'.join(unset)} not set: the intake serves HTTPS "
            "only; give the PEM files of its certificate and key (in Kubernetes: a Secret of type "
            "kubernetes.io/tls, mounted)"
        )
    for name, path in (("GPUFLEET_INTAKE_TLS_CERT", cert), ("GPUFLEET_INTAKE_TLS_KEY", key)):
        try:
            path.read_bytes()
        except OSError as exc:
            raise IntakeTlsError(f"{name}={path}: cannot be read ({exc.strerror or exc})") from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2

    def encrypted() -> bytes:  # asked by OpenSSL for an encrypted key, in place of a prompt on the tty
        raise IntakeTlsError(
            f"GPUFLEET_INTAKE_TLS_KEY={key}: the key is encrypted; give it unencrypted (as a kubernetes.io/tls "
            "Secret holds it), e.g. `openssl pkey -in KEY -out KEY.plain`"
        )

    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key), password=encrypted)
    except ssl.SSLError as exc:
        raise IntakeTlsError(
            f"GPUFLEET_INTAKE_TLS_CERT={cert} and GPUFLEET_INTAKE_TLS_KEY={key}: not a PEM certificate and its "
            f"private key ({exc.reason or exc})"
        ) from None
    return context


class TokenBuckets:
    """One token bucket per node: ``rate_per_minute`` refill, ``burst`` at most."""

    def __init__(self, *, rate_per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate_per_minute / 60.0
        self._burst = float(burst)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # node -> (tokens, when)

    def take(self, node: str) -> float:
        """Take one token for ``node``: 0 when it had one, else the seconds until it has."""
        now = self._clock()
        tokens, when = self._buckets.get(node, (self._burst, now))
        tokens = min(self._burst, tokens + (now - when) * self._rate)
        if tokens >= 1.0:
            self._buckets[node] = (tokens - 1.0, now)
            return 0.0
        self._buckets[node] = (tokens, now)
        return (1.0 - tokens) / self._rate


def service_account_namespace(username: str) -> str | None:
    """The namespace of ``system:serviceaccount:NS:NAME``; None for any other user."""
    if not username.startswith(SERVICE_ACCOUNT_PREFIX):
        return None
    namespace, _, name = username[len(SERVICE_ACCOUNT_PREFIX) :].partition(":")
    return namespace if namespace and name else None


@dataclass
class Refusal(Exception):
    """A request the intake answers with an error: its status, metric result and reason, and why."""

    status: int
    result: str
    message: str
    reason: str = ""
    retry_after: int | None = None


class IntakeMetrics:
    """The intake's counters, on the meter whose runtime serves them (a no-op meter: none)."""

    def __init__(self, meter: MetricMeter) -> None:
        self._events = meter.create_counter(EVENTS, EVENTS_HELP)
        self._refused = meter.create_counter(REFUSED, REFUSED_HELP)
        for result in RESULTS:  # every series present from the start, at 0
            self._events.add(0, {"result": result})
        for reason in REASONS:
            self._refused.add(0, {"reason": reason})

    def count(self, result: str, reason: str = "") -> None:
        self._events.add(1, {"result": result})
        if reason:
            self._refused.add(1, {"reason": reason})


ConnectTemporal = Callable[[], Awaitable[Client]]


class Intake:
    """Checks each posted event and hands the accepted ones to Temporal."""

    def __init__(
        self,
        *,
        cluster: str,
        kube: Reviewer,
        connect_temporal: ConnectTemporal,
        settings: IntakeSettings,
        meter: MetricMeter | None = None,
        dry_run: bool = False,
    ) -> None:
        self.cluster = cluster
        self.dry_run = dry_run  # GPUFLEET_DRY_RUN: every incident opened here is a dry run
        self._kube = kube
        # Reviewed tokens, by their digest: a detector draining a backlog costs one TokenReview.
        self._reviewed = ExpiringCache()
        self._connect = connect_temporal
        self._client: Client | None = None
        self._connecting = asyncio.Lock()
        self._buckets = TokenBuckets(rate_per_minute=settings.rate, burst=settings.burst)
        self.reporters = settings.reporters  # the detectors' ServiceAccounts, as their tokens name them
        self.metrics = IntakeMetrics(meter or MetricMeter.noop)

    async def temporal(self) -> Client:
        """The Temporal client, connected on first need (and again after Temporal was unreachable)."""
        async with self._connecting:
            if self._client is None:
                self._client = await self._connect()
            return self._client

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(EVENTS_PATH, self.post_event)
        app.router.add_get(HEALTH_PATH, self.healthz)
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def post_event(self, request: web.Request) -> web.Response:
        try:
            incident = await self._accept(request)
        except Refusal as refusal:
            self.metrics.count(refusal.result, refusal.reason)
            headers = {"Retry-After": str(refusal.retry_after)} if refusal.retry_after is not None else {}
            if refusal.status == 401:
                headers["WWW-Authenticate"] = f'Bearer realm="gpufleet", audience="{INTAKE_AUDIENCE}"'
            return web.json_response({"error": refusal.message}, status=refusal.status, headers=headers)
        self.metrics.count("accepted")
        return web.json_response({"incident": incident}, status=202)

    async def _accept(self, request: web.Request) -> str:
        """The incident the posted event opened or joined; Refusal for anything else."""
        peer = request.remote or "?"  # who, for a refusal before any identity is known
        token = _bearer(request.headers.get("Authorization", ""))
        if token is None:
            claimed = await _claimed_node(request)
            log.warning("refused (no_token): %s claimed node %s without an Authorization: Bearer header", peer, claimed)
            raise Refusal(401, "refused", "no bearer token: send the pod's ServiceAccount token", "no_token")
        identity = await self._review(token, request)
        if identity.name not in self.reporters:
            claimed = await _claimed_node(request)
            log.warning(
                "refused (wrong_service_account): %s claimed node %s; only %s may report "
                "(GPUFLEET_INTAKE_SERVICE_ACCOUNTS)",
                identity.name,
                claimed,
                ", ".join(sorted(self.reporters)),
            )
            raise Refusal(
                403, "refused", f"{identity.name} is not a detector's ServiceAccount", "wrong_service_account"
            )
        body = await self._body(request, identity)
        claimed = body.event.node
        node = await self._node_of(identity)
        if node != claimed:
            log.warning(
                "refused (wrong_node): %s claimed node %s, but its token speaks for %s",
                identity.name,
                claimed,
                node or "no node (not bound to a pod on one)",
            )
            raise Refusal(403, "refused", f"this token does not speak for node {claimed}", "wrong_node")
        if body.cluster != self.cluster:
            log.warning(
                "refused (wrong_cluster): %s (node %s) posted for cluster %s; this intake serves %s",
                identity.name,
                claimed,
                body.cluster,
                self.cluster,
            )
            raise Refusal(
                403, "refused", f"this intake serves cluster {self.cluster}, not {body.cluster}", "wrong_cluster"
            )
        wait = self._buckets.take(node)
        if wait > 0:
            log.warning("limited: node %s (%s) is over its rate; retry in %.1fs", node, identity.name, wait)
            raise Refusal(
                429, "limited", f"node {node} is over its rate of events", retry_after=max(1, math.ceil(wait))
            )
        try:
            client = await self.temporal()
            handle = await report_xid(client, body.event, cluster=self.cluster, dry_run=self.dry_run or body.dry_run)
        except (RPCError, TemporalUnreachable, TemporalConfigInvalid, RuntimeError, OSError, TimeoutError) as exc:
            if isinstance(exc, RPCError) and exc.status == RPCStatusCode.INVALID_ARGUMENT:
                # Temporal read the start and refused this event (a value past one of its limits):
                # no retry changes that, and the detector must not hold its later events behind it.
                log.error("Temporal refused %s on %s: %s", body.event.label, claimed, exc.message)
                raise Refusal(400, "malformed", f"{UNREADABLE_PREFIX}Temporal refused it: {exc.message}") from None
            if isinstance(exc, TemporalUnreachable):
                self._client = None
            log.error("Temporal did not take %s on %s: %s", body.event.label, claimed, exc)
            raise Refusal(
                503, "unavailable", "Temporal is unreachable; retry later", retry_after=UNAVAILABLE_RETRY_SECONDS
            ) from None
        log.info("%s on %s (%s) -> incident %s", body.event.label, claimed, identity.name, handle.id)
        return str(handle.id)

    async def _review(self, token: str, request: web.Request) -> Identity:
        peer = request.remote or "?"
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._reviewed.get(key)
        if isinstance(cached, Identity):
            return cached
        try:
            identity = await asyncio.to_thread(self._kube.review_token, token, audiences=[INTAKE_AUDIENCE])
        except Unauthenticated as exc:
            claimed = await _claimed_node(request)
            log.warning(
                "refused (unauthenticated): %s claimed node %s with a token not accepted: %s", peer, claimed, exc
            )
            raise Refusal(
                401,
                "refused",
                f"the token is not valid for audience {INTAKE_AUDIENCE!r} (unknown, expired, or for another audience)",
                "unauthenticated",
            ) from None
        except ClientError as exc:  # the API server away, or the intake's own RBAC missing
            log.error("cannot review a token from %s: %s", peer, exc)
            raise Refusal(
                503, "unavailable", "cannot check the token now; retry later", retry_after=UNAVAILABLE_RETRY_SECONDS
            ) from None
        self._reviewed.put(key, identity)
        return identity

    async def _body(self, request: web.Request, identity: Identity) -> IntakeEvent:
        try:
            raw = await request.read()
            return IntakeEvent.model_validate_json(raw)
        except web.HTTPRequestEntityTooLarge:
            message = f"the body is over {MAX_BODY_BYTES} bytes: post one event at a time"
        except ValidationError as exc:
            message = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        log.warning("malformed event from %s: %s", identity.name, message)
        raise Refusal(400, "malformed", f"{UNREADABLE_PREFIX}{message}")

    async def _node_of(self, identity: Identity) -> str | None:
        """The node the token speaks for: the API server's node name, else the bound pod's node."""
        if identity.node:
            return identity.node
        namespace = service_account_namespace(identity.name)
        if namespace is None or not identity.pod_name or not identity.pod_uid:
            # Without the pod's UID, the pod of that name now may be another one, on another node.
            return None
        try:
            return await asyncio.to_thread(self._kube.pod_node, namespace, identity.pod_name, identity.pod_uid)
        except ClientError as exc:
            log.error("cannot read pod %s/%s of %s: %s", namespace, identity.pod_name, identity.name, exc)
            raise Refusal(
                503,
                "unavailable",
                "cannot check the token's pod now; retry later",
                retry_after=UNAVAILABLE_RETRY_SECONDS,
            ) from None


async def _claimed_node(request: web.Request) -> str:
    """The node a refused body names, for the log only (never trusted): "?" when it names none."""
    try:
        node = json.loads(await request.read())["event"]["node"]
    except (ValueError, KeyError, TypeError, web.HTTPException):
        return "?"
    return repr(node)[:80]


def _bearer(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def serve(intake: Intake, settings: IntakeSettings, tls: ssl.SSLContext, stop: asyncio.Event) -> None:
    """Serve ``intake`` over HTTPS until ``stop``."""
    runner = web.AppRunner(intake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.bind, settings.port, ssl_context=tls)
    await site.start()
    log.info("intake for cluster %s on https://%s:%d%s", intake.cluster, settings.bind, settings.port, EVENTS_PATH)
    try:
        with_temporal = asyncio.create_task(_connect_early(intake))
        await stop.wait()
        with_temporal.cancel()
    finally:
        await runner.cleanup()


async def _connect_early(intake: Intake) -> None:
    """Connect to Temporal now, so that the first event does not wait; a failure is said and retried later."""
    try:
        await intake.temporal()
    except (TemporalUnreachable, TemporalConfigInvalid) as exc:
        log.error("%s (events are answered 503 until it answers)", exc)
