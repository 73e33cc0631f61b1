"""Connecting to Temporal (directly, or through the gpufleet API), and starting or joining a
node's incident (signal-with-start)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from models.constants import (
    SA_CLUSTER,
    SA_EVENT_KIND,
    SA_GPU_NODE,
    SA_XID,
    dry_run_workflow_id,
    remediation_workflow_id,
    task_queue,
)
from models.incident import IncidentStatus, RemediationInput
from models.names import validate_cluster_name, validate_node_name
from models.xid import XidEvent
from workflows.remediation import NodeRemediationWorkflow

# How long a command waits for the Temporal server to answer before it says it cannot reach it.
CONNECT_TIMEOUT_SECONDS = 5.0


class TemporalUnreachable(ConnectionError):
    """The Temporal server did not answer; the message names the address."""


class ApiRefused(TemporalUnreachable):
    """The gpufleet API refused the connection itself (no credentials, a token it does not accept)."""


class TemporalConfigInvalid(ValueError):
    """Temporal's env-config (TEMPORAL_* variables, the profile file) cannot be used; the message says why."""


def connect_config(profile: str | None = None) -> dict[str, Any]:
    """Temporal's env-config (``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``, profiles), with our defaults.

    Raises:
        TemporalConfigInvalid: a TEMPORAL_* value or the env-config file cannot be used.
    """
    try:
        config: dict[str, Any] = dict(ClientConfig.load_client_connect_config(profile=profile))
    except Exception as exc:  # the SDK's loader raises what its parser raises (TOML, files, values)
        raise TemporalConfigInvalid(f"Temporal's env-config (TEMPORAL_*, its profile file): {exc}") from None
    config.setdefault("target_host", "localhost:7233")
    return config


# Where the commands find the gpufleet API (host:port): set, every command goes there, never to Temporal.
API_ADDRESS_VARIABLE = "GPUFLEET_API_ADDRESS"
# The API's CA (PEM); unset: the system's roots.
API_CA_VARIABLE = "GPUFLEET_API_CA_FILE"
# Whose credentials are sent: this kubeconfig's current user (default $KUBECONFIG, then ~/.kube/config).
API_KUBECONFIG_VARIABLE = "GPUFLEET_API_KUBECONFIG"


@dataclass(frozen=True)
class ApiCredentials:
    """What the CLI proves itself with to the API: a bearer token, or a client certificate and key (PEM)."""

    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None


# Reads a kubeconfig's current user (clients/kubecreds.py, registered by the `gpufleet` entry point:
# this room may not import the Kubernetes client).
CredentialSource = Callable[[Path], ApiCredentials]
_credential_sources: list[CredentialSource] = []


def use_api_credentials(source: CredentialSource) -> None:
    """Read the user's credentials with ``source`` when a command connects to the API."""
    _credential_sources[:] = [source]


def api_address() -> str | None:
    """The gpufleet API the commands use (GPUFLEET_API_ADDRESS), or None: Temporal directly."""
    return os.environ.get(API_ADDRESS_VARIABLE, "").strip() or None


def api_kubeconfig() -> Path:
    """The kubeconfig whose current user the CLI sends: GPUFLEET_API_KUBECONFIG, the first file of
    $KUBECONFIG, else ~/.kube/config."""
    given = os.environ.get(API_KUBECONFIG_VARIABLE, "").strip()
    if given:
        return Path(given).expanduser()
    listed = [part for part in os.environ.get("KUBECONFIG", "").split(os.pathsep) if part.strip()]
    return Path(listed[0]).expanduser() if listed else Path.home() / ".kube" / "config"


def refused(exc: RPCError) -> bool:
    """Whether the error is the API's refusal (no credentials, no permission): never to be read
    as "not found" or retried; the command says it as it is."""
    return exc.status in (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED)


def refusal(exc: RPCError) -> str:
    """A refusal as the command says it: the gpufleet API's when the commands go through it
    (GPUFLEET_API_ADDRESS), else Temporal's own (its authorizer, a cloud namespace's API key)."""
    return f"the {'gpufleet API' if api_address() is not None else 'Temporal server'} refused: {exc.message}"


async def connect(
    *, address: str | None = None, profile: str | None = None, timeout_seconds: float = CONNECT_TIMEOUT_SECONDS
) -> Client:
    """The commands' connection: to the gpufleet API when GPUFLEET_API_ADDRESS is set (and no
    ``address`` is given), else to Temporal (``connect_temporal``).

    Raises:
        TemporalUnreachable: naming the address, when nothing answers there.
        TemporalConfigInvalid: the settings cannot be used (the env-config, the API's CA, the kubeconfig).
    """
    api = api_address()
    if api is not None and address is None:
        return await connect_api(api, profile=profile, timeout_seconds=timeout_seconds)
    return await connect_temporal(address=address, profile=profile, timeout_seconds=timeout_seconds)


async def connect_api(
    address: str,
    *,
    profile: str | None = None,
    timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
    ca_file: Path | None = None,
    kubeconfig: Path | None = None,
) -> Client:
    """Connect to the gpufleet API at ``address`` over TLS, as the current user of the kubeconfig.

    Args:
        ca_file: the API's CA (PEM); None: GPUFLEET_API_CA_FILE, else the system's roots.
        kubeconfig: whose current user connects; None: ``api_kubeconfig()`` (GPUFLEET_API_KUBECONFIG, ...).

    Raises:
        TemporalUnreachable: nothing answers at the address.
        TemporalConfigInvalid: the address, the CA file or the kubeconfig cannot be used.
    """
    if "://" in address:
        raise TemporalConfigInvalid(f"{API_ADDRESS_VARIABLE}={address!r}: give host:port, without a scheme")
    if ca_file is None:
        named = os.environ.get(API_CA_VARIABLE, "").strip()
        ca_file, ca_said = (Path(named), f"{API_CA_VARIABLE}={named}") if named else (None, "")
    else:
        ca_said = f"the API's CA {ca_file}"
    try:
        ca = ca_file.read_bytes() if ca_file is not None else None
    except OSError as exc:
        raise TemporalConfigInvalid(f"{ca_said}: {exc.strerror or exc}") from None
    kubeconfig = api_kubeconfig() if kubeconfig is None else kubeconfig
    if not _credential_sources:
        raise TemporalConfigInvalid("no reader of kubeconfig credentials is installed (run the `gpufleet` command)")
    try:
        credentials = _credential_sources[0](kubeconfig)
    except Exception as exc:  # the kubeconfig loader raises what its parser and providers raise
        raise TemporalConfigInvalid(
            f"the credentials of {kubeconfig} cannot be read ({exc}): set {API_KUBECONFIG_VARIABLE} or KUBECONFIG "
            "to a kubeconfig whose current user has a token or a client certificate"
        ) from None
    if credentials.token is None and credentials.cert is None:
        raise TemporalConfigInvalid(
            f"the current user of {kubeconfig} has neither a token nor a client certificate: the gpufleet API "
            f"at {address} needs one (set {API_KUBECONFIG_VARIABLE} to the kubeconfig to use)"
        )
    namespace = str(connect_config(profile).get("namespace") or "default")
    tls = TLSConfig(server_root_ca_cert=ca, client_cert=credentials.cert, client_private_key=credentials.key)
    try:
        return await asyncio.wait_for(
            Client.connect(
                address,
                namespace=namespace,
                data_converter=pydantic_data_converter,
                tls=tls,
                api_key=credentials.token,
            ),
            timeout=timeout_seconds,
        )
    except RPCError as exc:
        if refused(exc):
            raise
        raise TemporalUnreachable(f"the gpufleet API at {address} answered {exc.status.name}: {exc.message}") from None
    except (RuntimeError, OSError, TimeoutError) as exc:
        cause = str(exc) or f"no answer within {timeout_seconds:g} s"
        # The SDK's connect says a refusal of its first call in its own words: the API's message, as it said it.
        said = _REFUSAL.search(cause)
        if said is not None:
            raise ApiRefused(f"the gpufleet API refused: {said['message']}") from None
        raise TemporalUnreachable(
            f"cannot reach the gpufleet API at {address} ({cause}); check {API_ADDRESS_VARIABLE} and "
            f"{API_CA_VARIABLE} (the API's CA)"
        ) from None
    except ValueError as exc:
        raise TemporalConfigInvalid(f"{API_ADDRESS_VARIABLE}={address!r}: {exc}") from None


_REFUSAL = re.compile(r'code: (?:Unauthenticated|PermissionDenied), message: "(?P<message>(?:[^"\\]|\\.)*)"')


async def connect_temporal(
    *,
    address: str | None = None,
    profile: str | None = None,
    timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
    lazy: bool = False,
) -> Client:
    """Connect to Temporal itself, with the pydantic data converter: gpufleet's own services (the
    worker, the intake, the API, the lab), never the gpufleet API whatever GPUFLEET_API_ADDRESS says.

    Args:
        address: host:port to use instead of the env-config's (the lab knows its own server).
        timeout_seconds: give up (TemporalUnreachable) when the server has not answered by then.
        lazy: connect at the first call, not now (a service that must start, and answer "Temporal
            unavailable", while Temporal is away).

    Raises:
        TemporalUnreachable: naming the address, when nothing answers there.
        TemporalConfigInvalid: the env-config cannot be used, or the address is not host:port.
    """
    config = connect_config(profile)
    address = address or config.pop("target_host")
    config.pop("target_host", None)
    if "://" in address:
        raise TemporalConfigInvalid(f"Temporal address {address!r}: give host:port, without a scheme")
    try:
        return await asyncio.wait_for(
            Client.connect(address, data_converter=pydantic_data_converter, lazy=lazy, **config),
            timeout=timeout_seconds,
        )
    except (RuntimeError, OSError, TimeoutError) as exc:
        cause = str(exc) or f"no answer within {timeout_seconds:g} s"
        raise TemporalUnreachable(
            f"cannot reach the Temporal server at {address} ({cause}). Start one with `gpufleet server` "
            "(in a checkout: `gpufleet lab up`), or set TEMPORAL_ADDRESS (or a Temporal env-config profile) "
            "to your cluster."
        ) from None
    except ValueError as exc:  # an address that is not host:port
        raise TemporalConfigInvalid(f"Temporal address {address!r}: {exc}") from None


async def report_xid(
    client: Client,
    event: XidEvent,
    *,
    cluster: str,
    search_attributes: bool = True,
    dry_run: bool = False,
) -> WorkflowHandle[NodeRemediationWorkflow, IncidentStatus]:
    """Open the node's incident, or join the open one, with this Xid (signal-with-start).

    The caller passes what it knows (cluster, node, the Xid, and whether this is a dry run);
    grace, timeouts and policy are the worker's, read by the incident itself. The incident runs
    on the cluster's task queue. A dry run has its own workflow ID (``dryrun-{cluster}-{node}``).
    """
    validate_cluster_name(cluster)
    validate_node_name(event.node)
    params = RemediationInput(cluster=cluster, node=event.node, search_attributes=search_attributes, dry_run=dry_run)
    pairs: list[SearchAttributePair[Any]] = [
        SearchAttributePair(SA_GPU_NODE, event.node),
        SearchAttributePair(SA_CLUSTER, cluster),
        SearchAttributePair(SA_EVENT_KIND, event.kind.value),
    ]
    if event.gpu_xid is not None:
        pairs.append(SearchAttributePair(SA_XID, event.gpu_xid))
    attributes = TypedSearchAttributes(pairs) if search_attributes else None
    return await client.start_workflow(
        NodeRemediationWorkflow.run,
        params,
        id=dry_run_workflow_id(cluster, event.node) if dry_run else remediation_workflow_id(cluster, event.node),
        task_queue=task_queue(cluster),
        # A worker killed mid-task hands the incident on after this, not the default 10 s.
        task_timeout=timedelta(seconds=5),
        start_signal="report_xid",
        start_signal_args=[event],
        search_attributes=attributes,
        static_summary=f"{'dry run: ' if dry_run else ''}{event.label} on {event.node} ({cluster})",
        # A server that hangs is a failure to retry (the detector spools), not a wait without end.
        rpc_timeout=timedelta(seconds=10),
    )
