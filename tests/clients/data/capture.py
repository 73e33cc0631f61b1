"""Capture ``squeue --json`` from real clusters of the lab's newer Slurm releases, as test_slurm.py reads them.

    flock /tmp/gpufleet-lab.lock python -m tests.clients.data.capture [RELEASE...]

For each release (default 24.11 and 26.05; root only: lab/slurmroots.py), a small cluster holds
four jobs: ``prep`` finished, ``ddp-train`` running on gpu1, ``sweep`` requeued once and waiting,
``eval`` waiting for gpu1 (``--no-requeue``). What ``squeue --json --states=all`` prints (as
``SlurmCli.jobs`` runs it) is written to ``squeue_<release>.json`` beside this file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lab.procs import wait_for
from lab.slurm import SlurmLab, SlurmLabSpec

HERE = Path(__file__).resolve().parent
RELEASES = ("24.11", "26.05")


def capture(release: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"gpufleet-capture-{release}-", dir="/tmp"))
    root.chmod(0o755)
    lab = SlurmLab(root, SlurmLabSpec(nodes=["gpu1", "gpu2"], spares=[]), release=release)
    try:
        lab.start()
        cli = lab.client()
        (root / "true.sh").write_text("#!/bin/sh\ntrue\n")
        (root / "sleep.sh").write_text("#!/bin/sh\nsleep 600\n")
        out = str(root / "%x-%j.out")

        def submit(script: str, name: str, *args: str) -> int:
            return lab.sbatch(root / script, "-J", name, "-o", out, *args)

        prep = submit("true.sh", "prep", "-w", "gpu2")
        wait_for(lambda: cli.job(prep).state == "COMPLETED", timeout=60, what="prep to finish")
        train = submit("sleep.sh", "ddp-train", "-w", "gpu1", "--requeue")
        sweep = submit("sleep.sh", "sweep", "-w", "gpu2", "--requeue")
        wait_for(lambda: cli.job(train).state == cli.job(sweep).state == "RUNNING", timeout=60, what="the jobs to run")
        lab.scontrol("hold", str(sweep))  # requeued and held: it waits without starting again
        lab.scontrol("requeue", str(sweep))
        wait_for(lambda: cli.job(sweep).restarts == 1, timeout=60, what="sweep to be requeued")
        evaluation = submit("sleep.sh", "eval", "-w", "gpu1", "--no-requeue")
        wait_for(lambda: cli.job(evaluation).state == "PENDING", timeout=30, what="eval to wait")
        done = subprocess.run(
            lab.argv(["squeue", "--json", "--states=all"]),
            env=lab.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        data = json.loads(done.stdout)
        path = HERE / f"squeue_{release}.json"
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return path
    finally:
        lab.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    for release in argv or RELEASES:
        print(f"Slurm {release}: {capture(release)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
