"""Every gpufleet command, with its servers stopped or given bad input: one line, no traceback.

The command tree is walked as the ``gpufleet`` entry point builds it (the starters' commands,
``worker``, ``detect``, ``cluster``, ``pool`` and the lab's, added by entry point), so that a new
command is covered without being listed here. Each runs in this process through the entry point's
``run`` (what ``gpufleet`` calls before it exits), against a Temporal address where nothing
listens and with the lab stopped (an empty GPUFLEET_HOME).

Exit codes (docs/operations.md): 2 for bad input, nothing contacted or changed; 1 for a failure,
a server that does not answer among them; 0 for success.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import os
import signal
import socket
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import typer
from temporalio.testing import WorkflowEnvironment

from lab.procs import free_port
from starters.temporal import CONNECT_TIMEOUT_SECONDS, connect
from workers.entry import command, run

REPO = Path(__file__).resolve().parents[2]

# A guard, not a measure: a command that hangs (a connect without its timeout) fails its test here.
pytestmark = pytest.mark.timeout(60)

# Commands that start a server: run here only with bad input (below), never for real.
STARTS_SERVERS = {
    ("server",): "starts the Temporal dev server",
    ("lab", "up"): "starts the lab",
    ("api",): "serves the gpufleet API (its TLS files and Kubernetes API are settings, named when missing)",
    ("intake",): "serves the intake (its TLS files are settings, named when missing)",
    ("whatif",): "starts Temporal's test server and simulates (tests/sim)",
}


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one line the command wrote on stderr (asserted to be one, and no traceback)."""
        lines = [line for line in self.err.splitlines() if line.strip()]
        assert "Traceback" not in self.err, self.err
        assert len(lines) == 1, self.err
        assert lines[0].startswith("error: "), lines[0]
        return lines[0]


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """The detector installs SIGTERM/SIGINT handlers of its own: give pytest its own back."""
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            signal.signal(signum, handler)


def gpufleet(*args: str, env: dict[str, str]) -> Ran:
    """``gpufleet ARGS`` in this process, through the entry point, with ``env`` added."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, env),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _signals_kept(),
    ):
        code = run(list(args))
    return Ran(code, out.getvalue(), err.getvalue())


def _commands() -> list[tuple[tuple[str, ...], Any]]:
    """Every command of the tree: its path of names and its click command."""
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        if hasattr(cmd, "commands"):
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, (*path, name))
        else:
            found.append((path, cmd))

    walk(typer.main.get_command(command()), ())
    return found


COMMANDS = _commands()


def _annotations(cmd: Any) -> dict[str, Any]:
    """The Python types of a command's parameters, from the function behind it."""
    return typing.get_type_hints(inspect.unwrap(cmd.callback))


# A plausible value for each parameter a command needs, by the parameter's name. A new command
# with a required parameter of another name fails test_every_command_... until it is added here.
PLAUSIBLE = {
    "node": "gpu1",
    "incident": "gpu1",
    "job_id": "7",
    "name": "research",
    "value": "3",
    "requests": "5",
    "spec_file": "{spec}",
    "xid": "79",
    "user": "carol",
    "uid": "2100",
    "policy": str(REPO / "examples" / "policy.yaml"),
    "domain": "rack/a",
}
USER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH carol@laptop"
# What a command needs beyond that to do its work once: the detector reads a log holding an Xid
# (once, not following /dev/kmsg) and delivers it to Temporal.
EXTRA = {
    ("detect",): ["--once", "--kmsg", "{xid_log}"],
    ("pool", "rebalance"): ["--to-inference", "1"],
    ("cluster", "users", "add"): ["--key", USER_KEY],
    ("cluster", "users", "set-keys"): ["--key", USER_KEY],
}


def plausible_args(path: tuple[str, ...], cmd: Any, files: dict[str, str]) -> list[str]:
    args = list(path)
    for param in cmd.params:
        if param.param_type_name == "argument":
            assert param.name in PLAUSIBLE, f"gpufleet {' '.join(path)}: give argument {param.name} a plausible value"
            args.append(PLAUSIBLE[param.name].format(**files))
        elif param.required:
            assert param.name in PLAUSIBLE, f"gpufleet {' '.join(path)}: give option {param.name} a plausible value"
            args += [param.opts[0], PLAUSIBLE[param.name].format(**files)]
    return args + [arg.format(**files) for arg in EXTRA.get(path, [])]


@pytest.fixture
def stopped(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine where Temporal is not running and the lab is stopped."""
    token = tmp_path / "slurm-token"
    token.write_text("a-token")
    return {
        "TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
        "GPUFLEET_HOME": str(tmp_path / "home"),
        "GPUFLEET_CLUSTER": "research",
        # The worker's Slurm: slurmrestd, checked without being contacted before Temporal is.
        "GPUFLEET_SLURM_BACKEND": "rest",
        "GPUFLEET_SLURMRESTD_URL": f"http://127.0.0.1:{free_port()}",
        "GPUFLEET_SLURMRESTD_TOKEN_FILE": str(token),
    }


def _id(item: tuple[tuple[str, ...], Any]) -> str:
    return " ".join(item[0])


def test_every_command_is_walked() -> None:
    """The walk finds the commands of every room, the lab's (an entry point) among them."""
    paths = {path for path, _ in COMMANDS}
    for expected in [("remediate",), ("worker",), ("detect",), ("cluster", "create"), ("pool", "start"), ("lab", "up")]:
        assert expected in paths


@pytest.mark.parametrize("item", [c for c in COMMANDS if c[0] not in STARTS_SERVERS], ids=_id)
def test_every_command_with_its_servers_stopped_says_what_to_start_in_one_line(
    item: tuple[tuple[str, ...], Any], stopped: dict[str, str], tmp_path: Path
) -> None:
    path, cmd = item
    xid_log = tmp_path / "kern.log"
    xid_log.write_text("NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n")
    files = {"spec": str(REPO / "examples" / "cluster.yaml"), "xid_log": str(xid_log)}
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    ran = gpufleet(*plausible_args(path, cmd, files), env=stopped)
    if ran.code == 0:  # done without a server (`lab down` with nothing up): nothing to say on stderr
        assert "Traceback" not in ran.err and not ran.err.strip(), ran.err
        return
    line = ran.error_line()
    assert ran.code == 1, line  # plausible input: not refused as bad
    address = stopped["TEMPORAL_ADDRESS"]
    if address in line:
        assert "gpufleet server" in line and "TEMPORAL_ADDRESS" in line, line
    elif path in {("worker",), ("checkpoint-done",)}:  # their Slurm first (checkpoint-done: only Slurm)
        assert stopped["GPUFLEET_SLURMRESTD_URL"] in line and "GPUFLEET_SLURMRESTD_URL" in line, line
    elif path[0] == "detect":  # a detector keeps what it could not deliver, and says where
        assert "still spooled" in line, line
    else:
        assert "gpufleet lab up" in line, line
    if path[0] not in ("detect", "worker"):  # the detector spools, the worker its metrics' home
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("item", COMMANDS, ids=_id)
def test_every_command_refuses_an_unknown_option_in_one_line(
    item: tuple[tuple[str, ...], Any], stopped: dict[str, str]
) -> None:
    path, _ = item
    ran = gpufleet(*path, "--no-such-option", env=stopped)
    assert ran.code == 2
    line = ran.error_line()
    assert "--no-such-option" in line and f"gpufleet {' '.join(path)} --help" in line


NUMBERS = [
    (path, param.opts[0])
    for path, cmd in COMMANDS
    for param in cmd.params
    if param.param_type_name == "option" and _annotations(cmd).get(param.name) in (int, float, int | None, float | None)
]


@pytest.mark.parametrize(("path", "option"), NUMBERS, ids=[f"{' '.join(p)} {o}" for p, o in NUMBERS])
def test_every_numeric_option_refuses_words_in_one_line(
    path: tuple[str, ...], option: str, stopped: dict[str, str]
) -> None:
    cmd = dict(COMMANDS)[path]
    files = {"spec": str(REPO / "examples" / "cluster.yaml"), "xid_log": "-"}
    args = [a for a in plausible_args(path, cmd, files) if a not in ("--once",)]
    ran = gpufleet(*args, option, "many", env=stopped)
    assert ran.code == 2
    assert option in ran.error_line()


def test_the_connect_timeout_is_at_most_five_seconds() -> None:
    assert CONNECT_TIMEOUT_SECONDS <= 5
    assert inspect.signature(connect).parameters["timeout_seconds"].default == CONNECT_TIMEOUT_SECONDS


def test_a_temporal_that_accepts_but_never_answers_is_named_after_the_timeout(stopped: dict[str, str]) -> None:
    """A server that takes the connection and says nothing (hung, or not Temporal) is given
    CONNECT_TIMEOUT_SECONDS, then named, as one that refuses it is."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        ran = gpufleet("incidents", "list", env={**stopped, "TEMPORAL_ADDRESS": address})
    assert ran.code == 1
    line = ran.error_line()
    assert f"cannot reach the Temporal server at {address}" in line
    assert f"no answer within {CONNECT_TIMEOUT_SECONDS:g} s" in line


@pytest.mark.parametrize(
    ("address", "said"),
    [("http://localhost:7233", "without a scheme"), ("::::", "'::::'"), ("localhost:99999", "port")],
)
def test_a_malformed_temporal_address_is_bad_input(address: str, said: str, stopped: dict[str, str]) -> None:
    ran = gpufleet("incidents", "list", env={**stopped, "TEMPORAL_ADDRESS": address})
    assert ran.code == 2
    line = ran.error_line()
    assert "Temporal address" in line and said in line


def test_a_folder_that_cannot_be_made_is_named_in_one_line(stopped: dict[str, str], tmp_path: Path) -> None:
    """A file where a folder must go (GPUFLEET_HOME, --db, --ready-file) is named, in one line."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for args in (["server", "--db", str(blocker / "db" / "temporal.db")], ["lab", "down"]):
        ran = gpufleet(*args, env={**stopped, "GPUFLEET_HOME": str(blocker / "home")})
        assert ran.code == 1
        line = ran.error_line()
        assert str(blocker) in line and "Traceback" not in line


def test_an_unexpected_failure_is_one_line_naming_how_to_see_more(stopped: dict[str, str], tmp_path: Path) -> None:
    """A failure no command foresaw is one line with its type; GPUFLEET_DEBUG=1 lets it through."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text((REPO / "examples" / "cluster.yaml").read_text())
    args = ("cluster", "create", str(spec), "--dry-run", "--backend", "slinky")
    with mock.patch("starters.cluster.planned_objects", side_effect=LookupError("a bug")):
        ran = gpufleet(*args, env=stopped)
        assert ran.code == 1
        assert ran.error_line() == "error: LookupError: a bug (unexpected: set GPUFLEET_DEBUG=1 for the traceback)"
        with pytest.raises(LookupError):
            gpufleet(*args, env={**stopped, "GPUFLEET_DEBUG": "1"})


@pytest.mark.parametrize(
    "args",
    [
        ["incidents", "show", "research-gpu1-20260101T000000Z", "--cluster", "other"],
        ["incidents", "show", "gpu1", "--cluster", "[/red]"],
        ["approve", "[bold]x[/]"],
        ["nodes", "return", "gpu1", "--as", "[/x]"],
        ["pool", "set-demand", "nan"],
        ["pool", "set-demand", "-inf"],
        ["pool", "start", "--preset", "[/]"],
        ["pool", "start", "--interval", "nan"],
        ["pool", "start", "--per-node", "-inf"],
        ["pool", "start", "--min-training", "-3"],
        ["pool", "rebalance", "--to-inference", "-1"],
        ["remediate", "gpu1", "--xid", "99999999999999999999999"],
        ["remediate", "gpu1", "--xid", "79", "--timeout", "nan"],
        ["checkpoint-done", "99999999999999999999", "--node", "gpu1"],
        ["cluster", "create", "--resume", "Bad Name"],
        ["cluster", "show", "../x"],
        ["cluster", "delete", "x" * 300],
        ["cluster", "delete", "research", "--deadline", "-5"],
        ["cluster", "create", "{spec}", "--backend", "nowhere"],
        ["cluster", "create", "{spec}", "--output", "xml", "--dry-run"],
        ["cluster", "create", "{missing}"],
        ["cluster", "create", "{folder}"],
        ["detect", "--once", "--kmsg", "{missing}"],
        ["detect", "--once", "--kmsg", "{empty}", "--fold-seconds", "nan"],
        ["detect", "--once", "--kmsg", "{empty}", "--spool-max", "-1"],
        ["detect", "--once", "--kmsg", "{empty}", "--health-port", "70000"],
        ["detect", "--once", "--kmsg", "{empty}", "--node", "a b"],
        ["lab", "drill", "--job", "nope"],
        ["lab", "drill", "--effect", "explode"],
        ["lab", "clear-fault", "nosuch"],
        ["lab", "demand", "--", "-1"],
        ["incidents", "list", "--limit", "-5"],
    ],
)
def test_malformed_input_anywhere_is_refused_in_one_line(
    args: list[str], stopped: dict[str, str], tmp_path: Path
) -> None:
    files = {
        "spec": str(REPO / "examples" / "cluster.yaml"),
        "missing": str(tmp_path / "missing.yaml"),
        "folder": str(tmp_path),
        "empty": str(tmp_path / "empty.log"),
    }
    (tmp_path / "empty.log").write_text("")
    ran = gpufleet(*[a.format(**files) for a in args], env=stopped)
    assert ran.code == 2, (ran.out, ran.err)
    ran.error_line()


@pytest.fixture(scope="module")
def temporal(temporal_test_server: str) -> Iterator[str]:
    """A Temporal server (the test server) that knows no incident, cluster or pool: its address."""
    loop = asyncio.new_event_loop()
    environment = loop.run_until_complete(
        WorkflowEnvironment.start_time_skipping(
            test_server_existing_path=temporal_test_server, test_server_startup_timeout=timedelta(seconds=60)
        )
    )
    yield environment.client.service_client.config.target_host
    loop.run_until_complete(environment.shutdown())
    loop.close()


@pytest.mark.parametrize(
    "args",
    [
        ["incidents", "show", "gpu9"],
        ["incidents", "show", "research-gpu9-20260101T000000Z"],
        ["approve", "gpu9"],
        ["reject", "dryrun-research-gpu9"],
        ["spare-available", "gpu9"],
        ["checkpoint-done", "7", "--node", "gpu9"],
        ["cluster", "show", "nosuch"],
        ["cluster", "delete", "nosuch"],
        ["cluster", "create", "--resume", "nosuch"],
        ["cluster", "create", "--roll-back", "nosuch"],
        ["cluster", "users", "list", "nosuch"],
        ["cluster", "users", "remove", "nosuch", "--user", "carol"],
        ["pool", "status", "--name", "nosuch"],
        ["pool", "pause", "--name", "nosuch"],
        ["pool", "set-demand", "2", "--name", "nosuch"],
    ],
)
def test_a_name_that_names_nothing_is_bad_input_in_one_line(
    args: list[str], temporal: str, stopped: dict[str, str]
) -> None:
    ran = gpufleet(*args, env={**stopped, "TEMPORAL_ADDRESS": temporal})
    assert ran.code == 2, (ran.out, ran.err)
    assert "no " in ran.error_line()


def test_what_a_server_or_person_wrote_is_printed_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    """An error, a reason or a step's detail that looks like markup (``[/x]``) is printed as it
    is: never read as markup, which would drop it or end the command with a traceback."""
    from datetime import UTC, datetime

    from models.guard import GuardEvent, GuardState, GuardStatus
    from models.incident import IncidentStatus, Step, TimelineEntry
    from models.policy import GuardSettings
    from starters.cli import _print_guard, print_incident

    now = datetime.now(UTC)
    incident = IncidentStatus(
        incident_id="research-gpu1-20260101T000000Z",
        cluster="research",
        node="gpu1",
        error="kubectl said [/x] and [bold]",
        timeline=[TimelineEntry(step=Step.CLASSIFY, event="failed", at=now, detail="[errno 5] [/oops]")],
    )
    print_incident(incident, as_json=False)
    guard = GuardState(cluster="research", paused=True, paused_by="ops", paused_reason="[/maintenance]")
    guard.log.append(GuardEvent(at=now, event="paused", detail="[red]x[/red] [/y]"))
    _print_guard("research", GuardStatus(state=guard, limits=GuardSettings()), as_json=False)
    out = capsys.readouterr().out
    for written in ("kubectl said [/x] and [bold]", "[errno 5] [/oops]", "[/maintenance]", "[red]x[/red] [/y]"):
        assert written in " ".join(out.split()) or written in out, out


def test_a_model_refusing_what_a_command_passed_it_is_bad_input_not_a_settings_error(
    stopped: dict[str, str], tmp_path: Path
) -> None:
    """A value a command handed on to a model unchecked (here: an Xid event without a node) is
    refused in one line naming the model and field, not blamed on GPUFLEET_* settings."""
    from models.xid import XidEvent

    def refused(*_: Any, **__: Any) -> Any:
        return XidEvent.model_validate({"xid": 79})  # raises: no node

    spec = tmp_path / "cluster.yaml"
    spec.write_text((REPO / "examples" / "cluster.yaml").read_text())
    with mock.patch("starters.cluster.planned_objects", side_effect=refused):
        ran = gpufleet("cluster", "create", str(spec), "--dry-run", "--backend", "slinky", env=stopped)
    assert ran.code == 2
    line = ran.error_line()
    assert line.startswith("error: invalid XidEvent: node: ") and "GPUFLEET" not in line


def test_nodes_return_while_an_earlier_return_still_validates_says_so_in_one_line(
    temporal: str, stopped: dict[str, str]
) -> None:
    """A return's validation ladder may take most of an hour: a second ``nodes return`` of the
    node meanwhile (the first one's terminal went away) names the return under way."""
    from temporalio.client import Client

    from models.constants import RETURN_NODE_WORKFLOW, return_workflow_id, task_queue

    async def under_way() -> None:
        client = await Client.connect(temporal)
        await client.start_workflow(
            RETURN_NODE_WORKFLOW,
            id=return_workflow_id("research", "gpu1"),
            task_queue=task_queue("research"),  # no worker: it stays under way
        )

    asyncio.run(under_way())
    ran = gpufleet("nodes", "return", "gpu1", env={**stopped, "TEMPORAL_ADDRESS": temporal})
    assert ran.code == 1, (ran.out, ran.err)
    line = ran.error_line()
    assert "gpu1's return is already under way (workflow return-research-gpu1" in line, line
