"""A shortened `make chaos` (the baseline, a worker killed mid-checkpoint, a hanging webhook) in a
lab of its own: each incident resolves, the job resumes once, nothing is lost or claimed twice.

How long each fault costs is measured, not asserted here: `make chaos` reports it against its
targets (a worker kill at most 15 s, a dead or hanging webhook at most 1 s before the drain)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


def test_short_chaos_run_loses_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lab.chaos", "--short", "--home", str(tmp_path / "chaos")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    names = [scenario["name"] for scenario in result["scenarios"]]
    assert names == ["baseline", "worker_killed_at_checkpoint", "webhook_hangs"]
    wrong = [scenario for scenario in result["scenarios"] if not scenario.get("correct")]
    assert not wrong, json.dumps(wrong, indent=1) + done.stderr[-3000:]
    for total in ("jobs_lost", "double_claims", "nodes_undrained_not_ours", "claims_leaked"):
        assert result[total] == 0, total
    kill, webhook = result["scenarios"][1:]
    assert kill["faults"][0].startswith("worker") and "restarted" in kill["faults"][1]
    assert "SIGSTOP" in webhook["faults"][0]
    assert all(s["outcome"] == "resolved" and s["detect_to_resumed"] is not None for s in result["scenarios"])
    # `gpufleet report --json` over the run counts every incident the scenarios opened, each with a
    # ledger whose recovery phases add up to its recovery time.
    goodput = result["goodput"]
    assert goodput["passed"], json.dumps(goodput, indent=1)
    assert goodput["incidents"] >= goodput["expected"] == len(result["scenarios"])
