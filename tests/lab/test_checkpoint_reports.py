"""How the lab's jobs report their checkpoints (lab/jobs/report.py): in the background, and quietly
when they cannot: a job whose interpreter cannot run gpufleet, or whose reports fail, says so once
in its log rather than a traceback every half minute."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lab.jobs import report
from lab.jobs.report import CheckpointReports


def _fake_python(tmp_path: Path, *, code: int) -> tuple[Path, Path]:
    """An interpreter that counts its runs in a file and exits ``code`` with a traceback (as the
    root's python3 without gpufleet's packages does)."""
    runs = tmp_path / "runs"
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        f"echo run >> {runs}\n"
        "echo 'Traceback (most recent call last):' >&2\n"
        "echo \"ModuleNotFoundError: No module named 'typer'\" >&2\n"
        f"exit {code}\n"
    )
    script.chmod(0o755)
    return script, runs


def _report_steps(reports: CheckpointReports, steps: int) -> None:
    """Each step saved and its report (if one started) waited for, as a job's saves far apart."""
    for step in range(steps):
        reports.saved(step)
        if reports._running is not None:
            reports._running.wait(timeout=30)


def test_reports_that_fail_are_said_once_and_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    script, runs = _fake_python(tmp_path, code=1)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(sys, "executable", str(script))
    reports = CheckpointReports(every=1e-9)
    _report_steps(reports, 10)
    assert len(runs.read_text().splitlines()) == report.FAILURES_BEFORE_STOPPING
    err = capfd.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines == [
        "gpufleet checkpoint-done for step 0 failed (exit 1): ModuleNotFoundError: No module named 'typer'",
        f"checkpoint reports off: {report.FAILURES_BEFORE_STOPPING} reports failed in a row",
    ]


def test_an_interpreter_without_gpufleets_packages_reports_nothing_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    script, runs = _fake_python(tmp_path, code=1)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(sys, "executable", str(script))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "typer" else real(name, *a))
    reports = CheckpointReports(every=1e-9)
    _report_steps(reports, 5)
    assert not runs.exists()
    assert capfd.readouterr().err.splitlines() == [f"checkpoint reports off: {script} cannot run gpufleet (no typer)"]


def test_reports_that_succeed_go_on_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    script, runs = _fake_python(tmp_path, code=0)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(sys, "executable", str(script))
    reports = CheckpointReports(every=1e-9)
    _report_steps(reports, 5)
    assert len(runs.read_text().splitlines()) == 5
    assert capfd.readouterr().err == ""
