"""The ``gpufleet`` console script: the starter commands plus ``worker``, and the commands
installed packages add (entry point group gpufleet.commands: ``lab`` in a checkout).

This is the composition root: it alone may see every room, so it lives with the workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from temporalio.runtime import Runtime
from temporalio.service import RPCError

from models.plugins import COMMANDS, installed
from models.policy import PolicyError
from models.settings import CLUSTER_HELP, Settings, settings_error
from starters.cli import app, checked_job_id, fail, run_async, say_error, signal_incident
from starters.temporal import (
    ApiCredentials,
    TemporalUnreachable,
    connect_temporal,
    refusal,
    refused,
    use_api_credentials,
)
from workflows.remediation import NodeRemediationWorkflow

try:  # typer 0.2x carries its own copy of click
    from typer._click.exceptions import ClickException
    from typer._click.exceptions import NoArgsIsHelpError as NoArgsIsHelp
except ImportError:  # pragma: no cover - typer on click
    from click.exceptions import ClickException  # type: ignore[assignment]
    from click.exceptions import NoArgsIsHelpError as NoArgsIsHelp  # type: ignore[assignment]


@app.command()
def worker() -> None:
    """Run the worker of one cluster, on task queue gpufleet-CLUSTER (SIGTERM stops it gracefully).

    Settings come from GPUFLEET_* and the policy file (GPUFLEET_POLICY_FILE); Temporal's address,
    namespace and TLS from Temporal's env-config (TEMPORAL_ADDRESS, profiles).
    """
    from clients.errors import ClientError, Unavailable
    from workers.main import (
        BackendNotInstalled,
        backend_factories,
        run_worker,
        slurm_backend_said,
        slurm_from_settings,
    )
    from workers.metrics import install_metrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx's INFO lines quote every request's URL: a webhook's secret path would be in the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = Settings()
    try:
        settings.worker_config()  # a wrong policy file is named before anything is contacted
    except PolicyError as exc:
        fail(f"policy file: {exc}", code=2)
    try:
        # Before anything else: a Slurm backend that cannot serve the worker stops it, saying why.
        checked = slurm_from_settings(settings)
        logging.getLogger("gpufleet.worker").info("Slurm backend %s", slurm_backend_said(settings, checked))
        close = getattr(checked, "close", None)
        if callable(close):
            close()  # the worker builds its own; this one only proved the backend serves it
    except Unavailable as exc:  # a service that does not answer is not bad input: exit 1, as Temporal's
        fail(f"Slurm backend {settings.slurm_backend}: {exc} (start it, or set GPUFLEET_SLURMRESTD_URL)")
    except (ClientError, ValueError) as exc:
        fail(f"Slurm backend {settings.slurm_backend}: {exc}", code=2)
    if not settings.cluster:
        fail(
            "GPUFLEET_CLUSTER is not set: name the cluster this worker serves "
            "(its task queue is gpufleet-NAME; the lab sets it for its own worker)",
            code=2,
        )
    try:
        backend_factories(settings)  # a cluster-creation backend that is not installed here is named now
    except BackendNotInstalled as exc:
        fail(str(exc), code=2)
    # Before the client connects: it takes the runtime that serves GET /metrics (GPUFLEET_METRICS_PORT).
    runtime = install_metrics(settings)

    async def go() -> None:
        client = await connect_temporal()
        await run_worker(client, settings, metrics=runtime.metric_meter if runtime else None)

    try:
        run_async(go())
    except PolicyError as exc:
        fail(f"policy file: {exc}", code=2)
    except ClientError as exc:  # a service it needs at start (e.g. Kubernetes, to tell Slinky from Slurm)
        fail(f"worker: {exc}")
    except KeyboardInterrupt:
        pass


# A Unix time gpufleet takes for a checkpoint: after 2001 and before the year 33658.
_CHECKPOINT_TIMES = (10**9, 10**12)
# The largest step a checkpoint mark carries (18 digits: models/incident.py CHECKPOINT_MARK).
_MAX_STEP = 10**18 - 1


@app.command("checkpoint-done")
def checkpoint_done(
    job_id: Annotated[
        int | None,
        typer.Argument(
            help="The Slurm job that saved a checkpoint (default: $SLURM_JOB_ID, inside the job).", show_default=False
        ),
    ] = None,
    step: Annotated[
        int | None, typer.Option(min=0, max=_MAX_STEP, help="The training step the checkpoint holds.")
    ] = None,
    at: Annotated[
        int | None, typer.Option(help="When it was saved, in Unix seconds (default: now).", show_default=False)
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(help="A node of the job with an open incident: tell it too, so its grace ends early."),
    ] = None,
    cluster: Annotated[str | None, typer.Option(help=CLUSTER_HELP)] = None,
    mark: Annotated[
        bool, typer.Option(help="Write the mark in the job's Comment (--no-mark: only tell the incident).")
    ] = True,
) -> None:
    """A job saved a checkpoint: record it in the job's Comment (gpufleet:checkpoint:UNIX[:STEP]),
    and with --node tell the node's open incident. Run it inside the job after each save.

    gpufleet counts what a failure costs from the last checkpoint a job reported (docs/goodput.md);
    a job that reports none has lost work gpufleet counts as unknown. The mark replaces an earlier
    one and keeps the rest of the Comment; the job's owner may write it (scontrol update).
    """
    if job_id is None:
        from_env = os.environ.get("SLURM_JOB_ID", "").strip()
        if not (from_env.isascii() and from_env.isdigit()):  # "²" is a digit to isdigit, not to int
            fail("no JOB given and $SLURM_JOB_ID is not set: run it inside the job, or name the job", code=2)
        job_id = int(from_env)
    job_id = checked_job_id(job_id)
    saved = int(time.time()) if at is None else at
    if not _CHECKPOINT_TIMES[0] <= saved < _CHECKPOINT_TIMES[1]:
        fail(f"--at {saved} is not a Unix time in seconds (e.g. $(date +%s))", code=2)
    if not mark and node is None:
        fail("--no-mark without --node does nothing: name the node whose incident to tell", code=2)
    if node is not None:
        signal_incident(node, cluster, NodeRemediationWorkflow.checkpoint_done, job_id)
    if mark:
        _record_checkpoint(job_id, saved, step)


def _record_checkpoint(job_id: int, at: int, step: int | None) -> None:
    """The job's checkpoint mark written through the Slurm backend the settings name."""
    from clients.errors import ClientError, NotFound, Unavailable
    from workers.main import slurm_named_by

    try:
        settings = Settings()
    except ValidationError as exc:
        fail(settings_error(exc), code=2)
    try:
        slurm = slurm_named_by(settings)
        record = getattr(slurm, "record_checkpoint", None)
        if record is None:
            fail(f"Slurm backend {settings.slurm_backend} cannot write a job's Comment", code=2)
        record(job_id, at, step)
    except NotFound as exc:
        fail(f"{exc}: is the job still known to Slurm?", code=2)
    except Unavailable as exc:  # a service that does not answer is not bad input: exit 1
        where = "GPUFLEET_SLURMRESTD_URL" if settings.slurm_backend == "rest" else "SLURM_CONF"
        fail(f"job {job_id}'s checkpoint mark was not written: Slurm did not answer: {exc} (start it, or set {where})")
    except (ClientError, ValueError) as exc:
        fail(f"job {job_id}'s checkpoint mark was not written: {exc}", code=2)


@app.command()
def api(
    port: Annotated[int | None, typer.Option(help="The gRPC port (default: $GPUFLEET_API_PORT, else 7243).")] = None,
) -> None:
    """Serve gpufleet's API: Temporal's WorkflowService for the `gpufleet` commands, each call
    authenticated (a kubeconfig's token or client certificate) and authorised (RBAC, group gpufleet.io).

    Settings: GPUFLEET_API_PORT, GPUFLEET_API_TLS_CERT, GPUFLEET_API_TLS_KEY, GPUFLEET_API_CLIENT_CA,
    GPUFLEET_API_METRICS_PORT; GPUFLEET_KUBECONFIG (the API server for its reviews; unset: in-cluster);
    Temporal's own env-config (TEMPORAL_ADDRESS, TEMPORAL_TLS_*, TEMPORAL_API_KEY) for Temporal.
    """
    from clients.errors import ClientError
    from clients.kubeauth import KubeAuth
    from gateway.api import REQUESTS_METRIC, ApiSettings, serve
    from workers.metrics import prometheus_runtime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ApiSettings()
    if port is not None:
        settings.port = port
    try:
        worker_settings = Settings()
        authority = KubeAuth(
            kubeconfig=worker_settings.kubeconfig, request_timeout_seconds=worker_settings.kube_timeout_seconds
        )
    except Exception as exc:  # the loader raises its own errors for a kubeconfig it cannot use
        fail(f"the Kubernetes API for token and access reviews: {exc} (set GPUFLEET_KUBECONFIG)", code=2)
    requests = None
    if settings.metrics_port:
        try:
            runtime = prometheus_runtime(f"0.0.0.0:{settings.metrics_port}")
        except ValueError as exc:
            fail(f"GPUFLEET_API_METRICS_PORT={settings.metrics_port}: {exc}", code=2)
        Runtime.set_default(runtime)
        requests = runtime.metric_meter.create_counter(REQUESTS_METRIC, "WorkflowService calls, by method and result")

    async def go() -> None:
        # Lazily: the API starts, and says "Temporal unavailable", while Temporal is away.
        await serve(settings, await connect_temporal(lazy=True), authority, requests=requests)

    try:
        run_async(go())
    except ValueError as exc:  # TLS files
        fail(str(exc), code=2)
    except ClientError as exc:
        fail(f"api: {exc}")
    except KeyboardInterrupt:
        pass


def _api_credentials(kubeconfig: Path) -> ApiCredentials:
    from clients.kubecreds import user_credentials

    return ApiCredentials(*user_credentials(kubeconfig))


@app.command()
def intake() -> None:
    """Run the intake of one cluster: detectors post their events here over HTTPS (SIGTERM stops it).

    Each event's bearer token (the detector pod's ServiceAccount token, audience gpufleet) is
    checked with a TokenReview, and the event accepted only from the detectors' ServiceAccount
    (GPUFLEET_INTAKE_SERVICE_ACCOUNTS, NAMESPACE:NAME, default gpufleet:gpufleet-detector), for the
    node the token speaks for and for GPUFLEET_CLUSTER, at most GPUFLEET_INTAKE_RATE a minute per
    node. Settings:
    GPUFLEET_INTAKE_PORT (8443), GPUFLEET_INTAKE_TLS_CERT and _KEY (PEM files, required),
    GPUFLEET_INTAKE_METRICS_PORT (9465, plain HTTP GET /metrics), GPUFLEET_INTAKE_RATE (30) and
    _BURST (60); the Kubernetes API from GPUFLEET_KUBECONFIG, else the pod's service account;
    Temporal's address and credentials from Temporal's env-config (TEMPORAL_ADDRESS, profiles).
    """
    import asyncio
    import signal

    from clients.kubeauth import KubeAuth
    from gateway.intake import Intake, IntakeTlsError, serve, server_tls
    from models.intake import IntakeSettings
    from workers.metrics import prometheus_runtime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = Settings()
    try:
        intake_settings = IntakeSettings()
    except ValidationError as exc:
        fail(settings_error(exc).replace("GPUFLEET_", "GPUFLEET_INTAKE_"), code=2)
    if not settings.cluster:
        fail("GPUFLEET_CLUSTER is not set: name the cluster whose detectors post to this intake", code=2)
    try:
        tls = server_tls(intake_settings.tls_cert, intake_settings.tls_key)
    except IntakeTlsError as exc:
        fail(str(exc), code=2)
    try:
        kube = KubeAuth(kubeconfig=settings.kubeconfig, request_timeout_seconds=settings.kube_timeout_seconds)
    except Exception as exc:  # the kubernetes client's loaders raise their own types
        fail(f"Kubernetes API (GPUFLEET_KUBECONFIG, else the pod's service account): {exc}", code=2)
    meter = None
    if intake_settings.metrics_port:
        host = intake_settings.bind if ":" not in intake_settings.bind else f"[{intake_settings.bind}]"
        address = f"{host}:{intake_settings.metrics_port}"
        try:
            runtime = prometheus_runtime(address)
        except ValueError as exc:
            fail(f"GPUFLEET_INTAKE_METRICS_PORT {intake_settings.metrics_port}: {exc}", code=2)
        from temporalio.runtime import Runtime

        Runtime.set_default(runtime)  # before the client connects: its metrics are served there too
        meter = runtime.metric_meter
        logging.getLogger("gpufleet.intake").info("metrics on http://%s/metrics", address)
    service = Intake(
        cluster=settings.cluster,
        kube=kube,
        connect_temporal=connect_temporal,
        settings=intake_settings,
        meter=meter,
        dry_run=settings.dry_run,
    )

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(service, intake_settings, tls, stop)

    try:
        run_async(go())
    except OSError as exc:
        fail(f"GPUFLEET_INTAKE_PORT {intake_settings.port} on {intake_settings.bind}: {exc.strerror or exc}")


def _left_out(name: str, exc: ModuleNotFoundError) -> None:
    print(
        f"warning: `gpufleet {name}` is left out: it needs the Python module {exc.name!r}, which is not "
        f"installed (in a checkout: pip install -e '.[{name}]')",
        file=sys.stderr,
    )


# Set to 1 (or anything) to see the traceback of an unexpected failure instead of its one line.
DEBUG_VARIABLE = "GPUFLEET_DEBUG"

_built: list[typer.Typer] = []


def command() -> typer.Typer:
    """The whole ``gpufleet`` command tree: the starters' commands, ``worker``, ``detect``,
    ``cluster``, ``pool`` and the commands installed packages add (built once per process)."""
    if _built:
        return _built[0]
    from detector.cli import detect
    from starters.cluster import cluster_app
    from starters.domains import domains_app
    from starters.pool import pool_app

    app.command()(detect)
    app.command(
        "health-check",
        add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(health_check)
    app.add_typer(cluster_app, name="cluster")
    app.add_typer(pool_app, name="pool")
    app.add_typer(domains_app, name="domains")
    _add_whatif(app)
    # Commands of installed packages (the lab's, in a checkout). One whose own package is absent
    # is left out; one that needs a module not installed is left out saying which, so that the
    # rest of gpufleet still works (the lab installed without its extra); any other error is raised.
    for name, commands in installed(COMMANDS, lacking=_left_out).items():
        app.add_typer(commands, name=name)
    _built.append(app)
    return app


def _add_whatif(tree: typer.Typer) -> None:
    """`gpufleet whatif`, where the simulator (sim/) is installed: the production image leaves it out."""
    try:
        from sim.cli import whatif
    except ModuleNotFoundError as exc:
        if exc.name != "sim" and not (exc.name or "").startswith("sim."):
            raise
        return
    tree.command()(whatif)


def health_check(ctx: typer.Context) -> None:
    """Quick GPU checks for Slurm's Prolog, Epilog and HealthCheckProgram (docs/health-check.md).

    The installed `gpufleet` runs this before importing anything else (workers/command.py);
    `gpufleet health-check --help` lists its options.
    """
    from detector.healthcheck import main as run_health_check

    raise typer.Exit(run_health_check(ctx.args))


def _usage_line(exc: ClickException) -> str:
    """A usage error (an unknown command or option, a value of the wrong type, a missing
    argument) in one line, with where to find the command's usage."""
    ctx = getattr(exc, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return f"{exc.format_message()}{where}"


def run(args: Sequence[str] | None = None) -> int:
    """Run ``gpufleet ARGS`` in this process; its exit code.

    The one place where whatever a command raises becomes one line on stderr (``error: ...``),
    without a traceback: 2 for bad input (usage, GPUFLEET_* values, the policy file), 1 for
    anything else that failed. Commands say their own specific errors (starters.cli.fail); this
    catches the rest. GPUFLEET_DEBUG=1 lets an unexpected failure's traceback through.
    """
    tree = command()
    use_api_credentials(_api_credentials)
    try:
        code = tree(args=list(sys.argv[1:] if args is None else args), prog_name="gpufleet", standalone_mode=False)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except NoArgsIsHelp as exc:  # the help of a group given no command: already printed
        return exc.exit_code
    except ClickException as exc:
        say_error(_usage_line(exc))
        return exc.exit_code
    except ValidationError as exc:
        if exc.title == Settings.__name__:  # GPUFLEET_* values, validated as a command starts
            say_error(settings_error(exc))
        else:  # a value a command passed on to a model unchecked: still input, refused as a whole
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(value)'}: {e['msg']}" for e in exc.errors())
            say_error(f"invalid {exc.title}: {problems}")
        return 2
    except PolicyError as exc:
        say_error(f"policy file: {exc}")
        return 2
    except (KeyboardInterrupt, typer.Abort):
        say_error("interrupted")
        return 130
    except TemporalUnreachable as exc:
        say_error(str(exc))
        return 1
    except OSError as exc:  # a file or folder the command needs (GPUFLEET_HOME, --db, --ready-file)
        where = f"{exc.filename}: " if exc.filename else ""
        say_error(f"{where}{exc.strerror or exc}")
        return 1
    except RPCError as exc:  # the server answered with an error no command expected
        if refused(exc):
            say_error(refusal(exc))
            return 1
        say_error(f"the Temporal server answered {exc.status.name}: {exc.message}")
        return 1
    except Exception as exc:
        if os.environ.get(DEBUG_VARIABLE):
            raise
        said = str(exc) or "no message"
        say_error(f"{type(exc).__name__}: {said} (unexpected: set {DEBUG_VARIABLE}=1 for the traceback)")
        return 1
    return code if isinstance(code, int) else 0


def main() -> None:
    exit_now(run())


def exit_now(code: int) -> None:
    """Leave without interpreter teardown.

    The Temporal client's Rust threads can outlive the event loop, and CPython's finalisation
    then aborts the process (SIGABRT, "PyGILState_Release: thread state ... must be current")
    after the command has done its work: temporalio/sdk-python issue 300.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`| head`), or the stream closed
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
