"""`gpufleet worker` serves one named cluster: it has no default, not even in a checkout with the
lab (whose own worker is given GPUFLEET_CLUSTER), and says what to set before contacting anything.
A lab installed without its extra's packages leaves its own command out, saying what is missing,
and the rest of gpufleet works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, gpufleet_cli


def test_a_worker_without_gpufleet_cluster_refuses_to_start_saying_so(tmp_path: Path) -> None:
    env = {"GPUFLEET_HOME": str(tmp_path), "GPUFLEET_METRICS_PORT": "0", "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    unset = tuple(name for name in os.environ if name.startswith("GPUFLEET_") and name not in env)
    done = gpufleet_cli("worker", env=env, unset=(*unset, "GPUFLEET_CLUSTER"), timeout=60)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, said
    assert "GPUFLEET_CLUSTER is not set" in said and "Traceback" not in said
    assert "cannot reach the Temporal server" not in said  # refused before it tried


def test_the_lab_without_its_extra_leaves_out_only_its_command_saying_what_is_missing() -> None:
    # kmock is one of the lab extra's packages (the emulated Kubernetes API): as if never installed.
    code = (
        "import sys\nsys.modules['kmock'] = None\nsys.argv = ['gpufleet', '--help']\n"
        "from workers.entry import main\nmain()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    commands = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("│ ") and line.split()[1:]}
    assert {"worker", "remediate", "cluster"} <= commands and "lab" not in commands
    said = " ".join(done.stderr.split())
    assert "`gpufleet lab` is left out" in said and "'kmock'" in said and "Traceback" not in said
