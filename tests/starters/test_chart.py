"""The timeline chart: one bar per step in order, the job's outage marked, three file formats."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from models.incident import IncidentStatus, JobInfo, Outcome, Step, TimelineEntry
from starters.chart import bars, outage, write_chart

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def entry(step: Step, event: str, seconds: float) -> TimelineEntry:
    return TimelineEntry(step=step, event=event, at=T0 + timedelta(seconds=seconds))


@pytest.fixture
def status() -> IncidentStatus:
    timeline = [
        entry(Step.CLASSIFY, "started", 0),
        entry(Step.CLASSIFY, "finished", 0.1),
        entry(Step.DRAIN_SLURM, "started", 0.1),
        entry(Step.DRAIN_SLURM, "finished", 0.2),
        entry(Step.CHECKPOINT, "started", 0.2),
        entry(Step.CHECKPOINT, "finished", 1.5),
        entry(Step.DRAIN_KUBERNETES, "started", 1.6),
        entry(Step.CLAIM_SPARE, "started", 1.6),
        entry(Step.CLAIM_SPARE, "finished", 1.7),
        entry(Step.RESUME, "started", 1.7),
        entry(Step.DRAIN_KUBERNETES, "finished", 2.0),
        entry(Step.RESUME, "finished", 9.0),
        entry(Step.CLOSED, "started", 9.1),
    ]
    return IncidentStatus(
        incident_id="lab-gpu1-x",
        cluster="lab",
        node="gpu1",
        xids=[79],
        outcome=Outcome.RESOLVED,
        jobs=[JobInfo(job_id=1)],
        timeline=timeline,
    )


def test_bars_follow_the_timeline(status: IncidentStatus) -> None:
    rows = bars(status)
    assert [name for name, _, _ in rows] == [
        "classify",
        "drain_slurm",
        "checkpoint",
        "drain_kubernetes",
        "claim_spare",
        "resume",
    ]
    assert rows[-1] == ("resume", 1.7, 9.0)
    assert outage(status) == (0.2, 9.0)


def test_svg_and_html_are_self_contained(status: IncidentStatus, tmp_path: Path) -> None:
    page = write_chart(status, tmp_path / "incident.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert "job outage 8.8 s" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    drawing = write_chart(status, tmp_path / "incident.svg").read_text()
    assert drawing.count("<rect") == 7  # six steps and the outage band


def test_png(status: IncidentStatus, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = write_chart(status, tmp_path / "incident.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_format_is_refused(status: IncidentStatus, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"use \.html, \.svg or \.png"):
        write_chart(status, tmp_path / "incident.pdf")
    assert not (tmp_path / "incident.pdf").exists()
