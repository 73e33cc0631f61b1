"""Every benchmark's JSON says where it comes from: the commit (and whether the tree differed from
it, its own results aside), the date in UTC, and the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lab import chaos
from lab.provenance import REPO_ROOT, provenance, write_result


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_the_provenance_of_this_checkout() -> None:
    found = provenance()
    assert found["commit"] == git(REPO_ROOT, "rev-parse", "HEAD")
    assert isinstance(found["dirty"], bool)
    assert datetime.fromisoformat(found["date"]).utcoffset() == UTC.utcoffset(None)
    machine = found["machine"]
    assert machine["cores"] == os.cpu_count()
    assert machine["python"] == ".".join(str(part) for part in sys.version_info[:3])
    assert machine["memory_total_mb"] is None or machine["memory_total_mb"] > 0
    assert set(machine) == {"cores", "cpu_model", "memory_total_mb", "python"}


def test_dirty_is_a_change_to_the_code_not_to_the_results(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-q", "-m", "code")
    assert provenance(tmp_path)["dirty"] is False
    write_result({"figure": 1}, tmp_path / "docs" / "results" / "bench.json")
    (tmp_path / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    assert provenance(tmp_path)["dirty"] is False
    assert provenance(tmp_path)["commit"] == git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance(tmp_path)["dirty"] is True


def test_outside_a_checkout_the_commit_is_unknown_not_invented(tmp_path: Path) -> None:
    found = provenance(tmp_path)
    assert found["commit"] is None and found["dirty"] is None


def test_make_chaos_keeps_its_json_with_its_provenance_even_when_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failed_run(home: Path, **_: Any) -> dict[str, Any]:
        return {"scenarios": [{"name": "baseline", "passed": False}], "passed": False, "jobs_lost": 1}

    monkeypatch.setattr(chaos, "chaos", failed_run)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main's SIGTERM handler stays out of pytest
    out = tmp_path / "results" / "chaos.json"
    monkeypatch.setattr(sys, "argv", ["chaos", "--home", str(tmp_path / "home"), "--output", str(out)])
    with pytest.raises(SystemExit) as stopped:
        chaos.main()
    assert stopped.value.code == 1
    kept = json.loads(out.read_text())
    assert kept["provenance"]["commit"] == git(REPO_ROOT, "rev-parse", "HEAD")
    assert kept["passed"] is False and kept["jobs_lost"] == 1
