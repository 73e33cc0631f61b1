"""A stand-in training loop that checkpoints like a real one (no torch needed).

Every rank counts steps; rank 0 saves ``{"step": N}`` atomically (temp file, rename) every
``--checkpoint-every`` steps and on SIGTERM, then exits promptly. On start it loads the
checkpoint and logs ``resumed from step N``. Rank 0 reports its checkpoints to gpufleet
(``gpufleet checkpoint-done``, at most every ``--report-every`` seconds: lab/jobs/report.py).

In the lab (``$GPUFLEET_LAB_FAULTS`` set) every rank looks at its node's GPU fault at each step
(lab/faults.py): it crashes or hangs with its GPU, and stops as in a collective that never
completes when a GPU of another node of the step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from lab.faults import RankFaults
from lab.jobs.report import CheckpointReports


def save(path: Path, step: int) -> None:
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, path)


def load(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--report-every", type=float, default=30.0, help="seconds between reports; 0: none")
    args = parser.parse_args()
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    reports = CheckpointReports(args.report_every if rank == 0 else 0)  # rank 0 saves, and says so
    node = os.environ.get("SLURMD_NODENAME", "?")
    stopping = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    faults = RankFaults.from_env(wait_for_peers=True)
    step = load(args.checkpoint)
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if step > 0:
        print(f"rank {rank} on {node}: resumed from step {step} (restart {restarts})", flush=True)
    else:
        print(f"rank {rank} on {node}: starting from scratch", flush=True)
    while step < args.steps and not stopping:
        time.sleep(args.step_seconds)
        if faults is not None:
            faults.check(step)
        step += 1
        if rank == 0 and step % args.checkpoint_every == 0:
            save(args.checkpoint, step)
            print(f"checkpoint saved at step {step}", flush=True)
            reports.saved(step)
    if stopping:
        if rank == 0:
            save(args.checkpoint, step)
            print(f"SIGTERM: checkpoint saved at step {step}; exiting", flush=True)
        sys.exit(0)


if __name__ == "__main__":
    main()
