"""`gpufleet whatif`'s input that can only fail after the run (where the picture goes, a trace's
own size) is refused before anything runs: one line, exit code 2. In process, with the runner
replaced by one that says it was called, so that no test server starts whatever happens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import sim.cli
from models.trace import Trace, TraceFailure

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "policy.yaml")


class Ran(Exception):
    """The simulation was started."""


@pytest.fixture
def whatif(monkeypatch: pytest.MonkeyPatch) -> typer.Typer:
    async def run_whatif(*args: Any, **kwargs: Any) -> None:
        raise Ran

    monkeypatch.setattr(sim.cli, "run_whatif", run_whatif)
    monkeypatch.setattr(sim.cli, "server_binary", lambda: Path("temporal-test-server"))
    app = typer.Typer()
    app.command()(sim.cli.whatif)
    app.command("other")(lambda: None)  # two commands: `whatif` is named, as in gpufleet
    return app


def refused(app: typer.Typer, *args: str) -> str:
    result = CliRunner().invoke(app, ["whatif", *args])
    assert not isinstance(result.exception, Ran), "the run started"
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_a_picture_that_cannot_be_written_is_refused_before_the_run(whatif: typer.Typer, tmp_path: Path) -> None:
    synthetic = ["--synthetic", "llama3", "--days", "1", "--nodes", "8", "--policy", EXAMPLE, "--spares", "0"]
    line = refused(whatif, *synthetic, "--png", str(tmp_path / "absent" / "out.png"))
    assert "--png" in line and "absent" in line


def test_a_trace_too_large_to_simulate_is_refused_before_the_run(whatif: typer.Typer, tmp_path: Path) -> None:
    huge = tmp_path / "huge.json"
    huge.write_text(Trace(seconds=3600, nodes=5_000_000).model_dump_json(), encoding="utf-8")
    assert "--nodes" in refused(whatif, "--trace", str(huge), "--policy", EXAMPLE, "--spares", "0")
    long = tmp_path / "long.json"
    years = Trace(seconds=5 * 366 * 86400, nodes=8, failures=[TraceFailure(at=10, cause="software")])
    long.write_text(years.model_dump_json(), encoding="utf-8")
    assert "--days" in refused(whatif, "--trace", str(long), "--policy", EXAMPLE, "--spares", "0")
