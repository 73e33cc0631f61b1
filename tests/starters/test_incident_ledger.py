"""`gpufleet incidents show` prints what the incident cost: each phase, its seconds and GPU-hours."""

from __future__ import annotations

import pytest

from models.goodput import ledger_for
from models.incident import JobInfo
from starters.cli import print_incident
from tests.models.test_goodput import at, replaced, xid


def test_the_ledger_is_printed_phase_by_phase_with_unknown_lost_work_named(capsys: pytest.CaptureFixture[str]) -> None:
    status = replaced(JobInfo(job_id=7, gpus=8))
    status.ledger = ledger_for(status, [xid(0)], node_gpus=8, now=at(3000), cause="Xid 79")
    print_incident(status, as_json=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "cost of Xid 79: recovered in 2000.0s" in out
    assert "8 GPU(s) stopped, 4.44 GPU-hours lost and lost work unknown" in out
    for phase, seconds, hours in [
        ("detection", "30.0", "0.07"),
        ("grace", "120.0", "0.27"),
        ("spare wait", "1000.0", "2.22"),
        ("restart", "847.0", "1.88"),
        ("lost work", "0.0", "unknown"),
    ]:
        assert f"│ {phase} │ {seconds} │ {hours} │" in out.replace("  ", " "), phase
    assert "lost work unknown for job(s) 7: no checkpoint reported" in out


def test_the_ledger_is_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    status = replaced(JobInfo(job_id=7, gpus=8, comment=f"gpufleet:checkpoint:{int(at(-60).timestamp())}"))
    status.ledger = ledger_for(status, [xid(0)], node_gpus=8, now=at(3000))
    print_incident(status, as_json=True)
    assert '"lost_work_unknown":[]' in capsys.readouterr().out
