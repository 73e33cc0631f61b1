"""``gpufleet pool``: the shared GPU pool between training (Slurm) and inference (Kubernetes)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Annotated, Any

import typer
from rich.markup import escape
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from models.constants import task_queue
from models.names import InvalidName, validate_cluster_name
from models.poolops import (
    POOL_PAUSE_SIGNAL,
    POOL_RESUME_SIGNAL,
    POOL_WORKFLOW,
    REBALANCE_SIGNAL,
    SET_DEMAND_SIGNAL,
    PoolSettings,
    PoolState,
    PoolStatus,
    pool_workflow_id,
)
from models.rebalance import PRESETS, PoolLimits
from models.settings import ClusterNotSet, Settings
from starters.cli import _who, console, fail, run_async, unknown
from starters.temporal import connect, refused
from workflows.pool import PoolRebalanceWorkflow

pool_app = typer.Typer(
    help="The GPU pool shared by training (Slurm) and inference (Kubernetes): its split follows demand.",
    no_args_is_help=True,
)

NameOption = Annotated[str | None, typer.Option("--name", help="The pool (default: the cluster's name).")]


def _cluster(settings: Settings) -> str:
    """The cluster whose worker runs the pool (GPUFLEET_CLUSTER, or the default an installed
    package gives), or exit 2 saying what to set."""
    try:
        return settings.command_cluster()
    except ClusterNotSet as exc:
        fail(f"{exc}: set GPUFLEET_CLUSTER", code=2)
    except ValueError as exc:
        fail(str(exc), code=2)


def _name(name: str | None) -> str:
    if name is None:
        try:
            return Settings().command_cluster()
        except ClusterNotSet as exc:
            fail(f"{exc}: give --name POOL or set GPUFLEET_CLUSTER (a pool is named after its cluster)", code=2)
        except ValueError as exc:
            fail(str(exc), code=2)
    try:
        return validate_cluster_name(name)
    except InvalidName as exc:
        fail(str(exc).replace("cluster name", "pool name"), code=2)


async def _handle(client: Client, name: str) -> WorkflowHandle[Any, Any]:
    handle = client.get_workflow_handle(pool_workflow_id(name))
    try:
        await handle.describe()
    except RPCError as exc:
        if refused(exc):
            raise
        fail(f"no pool {name}: start it with `gpufleet pool start --name {name}`", code=unknown(exc))
    return handle


@pool_app.command()
def start(
    name: NameOption = None,
    preset: Annotated[
        str | None, typer.Option(help=f"Inference server whose load to follow: {', '.join(PRESETS)}.")
    ] = None,
    query: Annotated[
        str | None, typer.Option(help="PromQL measuring the inference load (instead of a preset).")
    ] = None,
    per_node: Annotated[float | None, typer.Option(help="The load one inference node carries.")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between looks at the pool.")] = 30.0,
    min_training: Annotated[
        int, typer.Option(help="Nodes training always keeps (Slurm keeps a partition's last node in any case).")
    ] = 1,
    min_inference: Annotated[int, typer.Option(help="Nodes inference always keeps.")] = 0,
    max_inference: Annotated[int | None, typer.Option(help="Nodes inference may have at most.")] = None,
    batch: Annotated[int, typer.Option(help="Nodes moved per decision at most.")] = 1,
    cooldown: Annotated[float, typer.Option(help="Seconds after a move before the next.")] = 300.0,
    hysteresis: Annotated[float, typer.Option(help="Nodes of demand to spare before a move.")] = 0.5,
    drain_deadline: Annotated[
        float, typer.Option(help="Seconds a move to inference waits for running jobs before it requeues them.")
    ] = 600.0,
    eviction_deadline: Annotated[
        float,
        typer.Option(
            help="Seconds a move to training waits for PodDisruptionBudgets to allow its evictions; "
            "then it is undone and the node serves inference on."
        ),
    ] = 600.0,
) -> None:
    """Start rebalancing the cluster's pool: nodes labelled gpufleet.io/pool=training|inference,
    the training ones in the worker's partition (GPUFLEET_PARTITION)."""
    if preset is not None and query is not None:
        fail("give --preset or --query, not both", code=2)
    if preset is not None and preset not in PRESETS:
        fail(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}", code=2)
    promql, default_per_node = PRESETS[preset] if preset else (query or "", 32.0)
    settings = Settings()
    cluster = _cluster(settings)
    pool = _name(name)
    try:
        limits = PoolLimits(
            min_training=min_training,
            min_inference=min_inference,
            max_inference=max_inference,
            batch=batch,
            cooldown_seconds=cooldown,
            hysteresis=hysteresis,
        )
        pool_settings = PoolSettings(
            name=pool,
            cluster=cluster,
            partition=settings.partition,
            limits=limits,
            query=promql,
            per_node=per_node or default_per_node,
            interval_seconds=interval,
            drain_deadline_seconds=drain_deadline,
            eviction_deadline_seconds=eviction_deadline,
        )
    except ValueError as exc:
        fail(str(exc), code=2)

    async def go() -> None:
        client = await connect()
        try:
            await client.start_workflow(
                POOL_WORKFLOW,
                PoolState(settings=pool_settings),
                id=pool_workflow_id(pool),
                task_queue=task_queue(cluster),
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                static_summary=f"shared GPU pool {pool}: training (partition {settings.partition}) and inference",
            )
        except RPCError as exc:
            if exc.status == RPCStatusCode.ALREADY_EXISTS:
                fail(f"pool {pool} is running already (gpufleet pool status --name {pool})")
            raise
        source = promql or "`gpufleet pool set-demand` only"
        console.print(f"pool {pool} rebalancing every {interval:g}s; demand from {escape(source)}", highlight=False)

    run_async(go())


def status_json(status: PoolStatus) -> dict[str, Any]:
    view, decision, state = status.view, status.decision, status.state
    return {
        "name": state.settings.name,
        "training": view.training if view else [],
        "inference": view.inference if view else [],
        "busy": view.busy if view else {},
        "demand": view.demand.model_dump(mode="json") if view else None,
        "target": decision.inference if decision else None,
        "decision": decision.why if decision else None,
        "paused": state.paused,
        "override": state.override,
        "last_moves": [m.model_dump(mode="json") for m in state.moves],
        # Moves an incident took over halfway: settled once it lets go of the node.
        "handed_over": [m.node for m in state.handed_over],
        # Nodes a PodDisruptionBudget kept serving inference, left be until then.
        "kept_until": {node: until.isoformat() for node, until in state.kept.items()},
        "observed_at": status.observed_at.isoformat() if status.observed_at else None,
    }


@pool_app.command()
def status(name: NameOption = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Who serves training and inference, the demand, the target and the last moves."""
    pool = _name(name)

    async def go() -> PoolStatus:
        client = await connect()
        result: PoolStatus = await (await _handle(client, pool)).query(PoolRebalanceWorkflow.status)
        return result

    found = status_json(run_async(go()))
    if as_json:
        print(json.dumps(found))
        return
    console.print(f"pool {pool}{' (paused)' if found['paused'] else ''}", highlight=False)
    console.print(f"  training:  {', '.join(found['training']) or '-'}", highlight=False)
    console.print(f"  inference: {', '.join(found['inference']) or '-'}", highlight=False)
    for node, why in found["busy"].items():
        console.print(f"  not movable: {node} ({escape(why)})", highlight=False)
    for node in found["handed_over"]:
        console.print(f"  handed over: {node} (an incident took it mid-move; settled once it lets go)", highlight=False)
    for node, until in found["kept_until"].items():
        console.print(f"  kept serving by its budget: {node} (tried again after {until})", highlight=False)
    console.print(f"  decision:  {escape(str(found['decision']))}", highlight=False)
    for move in found["last_moves"][-5:]:
        console.print(f"  {move['at']} {move['node']} -> {move['to']}: {move['outcome']}", highlight=False)


@pool_app.command()
def rebalance(
    name: NameOption = None,
    to_inference: Annotated[int, typer.Option(min=0, help="Nodes to move to inference now.")] = 0,
    to_training: Annotated[int, typer.Option(min=0, help="Nodes to move to training now.")] = 0,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the moves are done.")] = False,
) -> None:
    """Move nodes now, whatever the demand says (cooldown, hysteresis and pause aside). A one-off:
    once the cooldown after it ends, demand decides again; `set-demand` keeps a split."""
    if bool(to_inference) == bool(to_training):
        fail("give one of --to-inference N or --to-training N", code=2)
    count = to_inference or -to_training
    pool = _name(name)

    async def go() -> None:
        client = await connect()
        handle = await _handle(client, pool)
        before: PoolStatus = await handle.query(PoolRebalanceWorkflow.status)
        seen, looked = before.state.seq, before.observed_at
        await handle.signal(REBALANCE_SIGNAL, count)
        console.print(f"asked pool {pool} to move {abs(count)} node(s) to {'inference' if count > 0 else 'training'}")
        taken_at = None  # the look that took the request; its moves follow it
        while wait:
            now: PoolStatus = await handle.query(PoolRebalanceWorkflow.status)
            # By number, not by place: the list keeps only the latest moves.
            for move in (m for m in now.state.moves if m.seq > seen):
                console.print(f"  {move.node} -> {move.to}: {move.outcome}", highlight=False)
            seen = max(seen, now.state.seq)
            if taken_at is None and now.state.manual == 0 and now.observed_at != looked:
                taken_at = now.observed_at
            elif taken_at is not None and now.observed_at != taken_at:
                return  # the next look has come: every move asked was tried
            await asyncio.sleep(1)

    run_async(go())


@pool_app.command("set-demand")
def set_demand(
    value: Annotated[str, typer.Argument(help="Nodes inference wants, or 'clear' to measure again.")],
    name: NameOption = None,
) -> None:
    """Override the measured inference demand (a number of nodes) until cleared."""
    if value == "clear":
        nodes: float | None = None
    else:
        try:
            nodes = float(value)
        except ValueError:
            fail(f"{value!r} is not a number of nodes (or 'clear')", code=2)
        if not math.isfinite(nodes) or nodes < 0:
            fail("demand is a finite number of nodes, 0 or more", code=2)
    pool = _name(name)

    async def go() -> None:
        client = await connect()
        await (await _handle(client, pool)).signal(SET_DEMAND_SIGNAL, args=[nodes, _who()])

    run_async(go())
    console.print(f"pool {pool}: demand {'measured again' if nodes is None else f'set to {nodes:g} node(s)'}")


def _tell(name: str | None, signal: str, said: str) -> None:
    pool = _name(name)

    async def go() -> None:
        client = await connect()
        await (await _handle(client, pool)).signal(signal)

    run_async(go())
    console.print(f"pool {pool}: {said}")


@pool_app.command()
def pause(name: NameOption = None) -> None:
    """No more moves until resumed (a move under way finishes)."""
    _tell(name, POOL_PAUSE_SIGNAL, "paused")


@pool_app.command()
def resume(name: NameOption = None) -> None:
    """Moves follow demand again."""
    _tell(name, POOL_RESUME_SIGNAL, "resumed")
