"""Where a measurement comes from: the commit, the date and the machine, for every JSON that
`make bench`, `make chaos` and `make bench-scale` write (docs/results/, read by bench/report.py).

Taken when a run starts: the code it loaded is the commit's, plus the changes ``dirty`` says
there were (``git status --porcelain``, leaving out the results and the page made from them).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# What the runs write: a change there is a result, not a change to the code measured.
GENERATED = ("docs/results", "docs/benchmarks.md")


def _git(*args: str, repo: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _proc_field(path: str, name: str) -> str | None:
    """The first ``name: value`` line's value in a /proc file (None where there is none)."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def machine() -> dict[str, Any]:
    """The machine: its cores, CPU model, memory and Python (None for what it does not say)."""
    memory = _proc_field("/proc/meminfo", "MemTotal")  # "16314272 kB"
    memory_mb = round(int(memory.split()[0]) / 1024) if memory and memory.split()[0].isdigit() else None
    return {
        "cores": os.cpu_count(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "memory_total_mb": memory_mb,
        "python": platform.python_version(),
    }


def provenance(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit (None outside a git checkout), whether the tree differed from it, the date (UTC)
    and the machine."""
    head = _git("rev-parse", "HEAD", repo=repo)
    status = _git("status", "--porcelain", "--", ".", *(f":(exclude){path}" for path in GENERATED), repo=repo)
    return {
        "commit": head.strip() if head else None,
        "dirty": None if status is None else bool(status.strip()),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def write_result(result: dict[str, Any], path: Path) -> None:
    """The run's JSON, indented, where the Makefile keeps it (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
