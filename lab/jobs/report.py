"""How the lab's jobs report their checkpoints to gpufleet, as a team's training job would
(docs/goodput.md#reporting-checkpoints): after a save, rank 0 runs
``gpufleet checkpoint-done --step N --at UNIX`` inside the job, which writes the mark in the job's
Comment. Beside the training loop, at most every ``every`` seconds (the first save at once), and
never two at a time: a report costs a process, never a step.

A job whose interpreter cannot run gpufleet (a newer Slurm's root has python3 and none of
gpufleet's packages) reports nothing and says so once; a report that fails is said once, with
its last line, and reports stop after ``FAILURES_BEFORE_STOPPING`` in a row: the job's log is the
training's, not a traceback every half minute.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from typing import IO

# What `python -m workers.entry` needs besides the checkout (which PYTHONPATH names).
CLI_PACKAGES = ("typer", "pydantic", "temporalio")
FAILURES_BEFORE_STOPPING = 3


class CheckpointReports:
    """Reports a job's checkpoints in the background; what goes wrong is said once in the job's log."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self._last = -float("inf")
        self._running: subprocess.Popen[bytes] | None = None
        self._errors: IO[bytes] | None = None
        self._step = 0
        self._failures = 0
        # Outside a Slurm job (a test, a laptop) there is no Comment to write.
        self.enabled = every > 0 and os.environ.get("SLURM_JOB_ID", "").isdigit()
        if self.enabled:
            missing = [name for name in CLI_PACKAGES if importlib.util.find_spec(name) is None]
            if missing:
                self._stop(f"{sys.executable} cannot run gpufleet (no {', '.join(missing)})")

    def saved(self, step: int) -> None:
        """The checkpoint of ``step`` was just saved: report it when the last report is old enough."""
        now = time.monotonic()
        if not self.enabled or now - self._last < self.every:
            return
        if self._running is not None:
            if self._running.poll() is None:
                return  # the report before is still being written
            self._settle(self._running.returncode)
            if not self.enabled:
                return
        self._last = now
        self._step = step
        stamp = str(int(time.time()))
        argv = [sys.executable, "-m", "workers.entry", "checkpoint-done", "--step", str(step), "--at", stamp]
        # A file, not a pipe: a report that says much never blocks on a reader.
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - read and closed once the report ends
        self._running = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._errors)

    def _settle(self, code: int) -> None:
        """The report before ended with ``code``: a failure is said (the first of a run of them)."""
        errors, self._errors, self._running = self._errors, None, None
        said = b""
        if errors is not None:
            errors.seek(0)
            said = errors.read()
            errors.close()
        if code == 0:
            self._failures = 0
            return
        self._failures += 1
        lines = [line.strip() for line in said.decode(errors="replace").splitlines() if line.strip()]
        if self._failures == 1:
            last = lines[-1] if lines else "no message"
            print(f"gpufleet checkpoint-done for step {self._step} failed (exit {code}): {last}", file=sys.stderr)
        if self._failures >= FAILURES_BEFORE_STOPPING:
            self._stop(f"{self._failures} reports failed in a row")

    def _stop(self, why: str) -> None:
        self.enabled = False
        print(f"checkpoint reports off: {why}", file=sys.stderr, flush=True)
