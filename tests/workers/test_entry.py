"""`gpufleet worker` serves one named cluster: it has no default, not even in a checkout with the
lab (whose own worker is given GPUFLEET_CLUSTER), and says what to set before contacting anything."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import gpufleet_cli


def test_a_worker_without_gpufleet_cluster_refuses_to_start_saying_so(tmp_path: Path) -> None:
    env = {"GPUFLEET_HOME": str(tmp_path), "GPUFLEET_METRICS_PORT": "0", "TEMPORAL_ADDRESS": "127.0.0.1:1"}
    unset = tuple(name for name in os.environ if name.startswith("GPUFLEET_") and name not in env)
    done = gpufleet_cli("worker", env=env, unset=(*unset, "GPUFLEET_CLUSTER"), timeout=60)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, said
    assert "GPUFLEET_CLUSTER is not set" in said and "Traceback" not in said
    assert "cannot reach the Temporal server" not in said  # refused before it tried
