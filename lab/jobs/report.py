"""How the lab's jobs report their checkpoints to gpufleet, as a team's training job would
(docs/goodput.md#reporting-checkpoints): after a save, rank 0 runs
``gpufleet checkpoint-done --step N --at UNIX`` inside the job, which writes the mark in the job's
Comment. Beside the training loop, at most every ``every`` seconds (the first save at once), and
never two at a time: a report costs a process, never a step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


class CheckpointReports:
    """Reports a job's checkpoints in the background; a report that fails is the job's log's to say."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self._last = -float("inf")
        self._running: subprocess.Popen[bytes] | None = None
        # Outside a Slurm job (a test, a laptop) there is no Comment to write.
        self.enabled = every > 0 and os.environ.get("SLURM_JOB_ID", "").isdigit()

    def saved(self, step: int) -> None:
        """The checkpoint of ``step`` was just saved: report it when the last report is old enough."""
        now = time.monotonic()
        if not self.enabled or now - self._last < self.every:
            return
        if self._running is not None and self._running.poll() is None:
            return  # the report before is still being written
        self._last = now
        stamp = str(int(time.time()))
        argv = [sys.executable, "-m", "workers.entry", "checkpoint-done", "--step", str(step), "--at", stamp]
        self._running = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
