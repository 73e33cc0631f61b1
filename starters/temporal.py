"""Connecting to Temporal, and starting or joining a node's incident (signal-with-start)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig

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


async def connect(
    *, address: str | None = None, profile: str | None = None, timeout_seconds: float = CONNECT_TIMEOUT_SECONDS
) -> Client:
    """Connect with the pydantic data converter.

    Args:
        address: host:port to use instead of the env-config's (the lab knows its own server).
        timeout_seconds: give up (TemporalUnreachable) when the server has not answered by then.

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
            Client.connect(address, data_converter=pydantic_data_converter, **config),
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
