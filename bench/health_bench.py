"""The wall time of ``gpufleet health-check``, as Slurm's Prolog runs it before every job.

Each run is the installed command's whole process (``python -m workers.command health-check``:
the interpreter's start, the imports, NVML's session over the lab's stand-in for two GPUs),
measured from its start to its exit; beside it, a bare interpreter's start on the same machine.
``python -m bench.health_bench [RUNS]`` prints the figures as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lab.nvmlstub import build_stub
from lab.slurmroots import REPO_ROOT

TARGET_SECONDS = 0.5  # "well under a second": a prolog runs before every job


def _wall(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=REPO_ROOT, check=True, capture_output=True)
    return time.perf_counter() - started


def health_check_wall(runs: int, *, home: Path) -> dict[str, Any]:
    """Median, 95th percentile and worst wall time of ``runs`` passing health checks (seconds)."""
    stub = build_stub(home / "nvml")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "LD_LIBRARY_PATH": str(stub),
        "SLURMD_NODENAME": "bench1",
        "GPUFLEET_INBOX": str(home / "inbox"),
    }
    argv = [sys.executable, "-m", "workers.command", "health-check", "--mode", "prolog", "--gpus", "2"]
    _wall(argv, env)  # the first run fills the page cache and bytecode cache
    walls = sorted(_wall(argv, env) for _ in range(runs))
    bare = sorted(_wall([sys.executable, "-c", "pass"], env) for _ in range(max(runs // 2, 1)))
    return {
        "runs": runs,
        "median_s": round(statistics.median(walls), 3),
        "p95_s": round(walls[min(len(walls) - 1, int(0.95 * len(walls)))], 3),
        "max_s": round(walls[-1], 3),
        "interpreter_start_median_s": round(statistics.median(bare), 3),
        "target_median_s": TARGET_SECONDS,
    }


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory(prefix="gpufleet-health-bench-") as tmp:
        print(json.dumps(health_check_wall(runs, home=Path(tmp))))


if __name__ == "__main__":
    main()
