"""`gpufleet worker` refuses a Slurm backend that cannot serve it, before it contacts anything,
naming each method it lacks; an unknown backend is a one-line error too."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import gpufleet_cli


def worker_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    token = tmp_path / "slurmrestd.token"
    token.write_text("a-token\n")
    token.chmod(0o600)
    return {
        **os.environ,
        "GPUFLEET_HOME": str(tmp_path / "home"),
        "GPUFLEET_METRICS_PORT": "0",
        "GPUFLEET_SLURMRESTD_TOKEN_FILE": str(token),
        "TEMPORAL_ADDRESS": "127.0.0.1:1",  # nothing there: the worker must stop before it tries
        **settings,
    }


def test_a_worker_on_slurm_22_05s_rest_api_refuses_to_start_and_names_what_is_missing(tmp_path: Path) -> None:
    env = worker_env(
        tmp_path,
        GPUFLEET_SLURM_BACKEND="rest",
        GPUFLEET_SLURMRESTD_URL="http://127.0.0.1:1",
        GPUFLEET_SLURMRESTD_VERSION="v0.0.38",
    )
    done = gpufleet_cli("worker", env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "Slurm backend rest" in said
    for method in ("drain", "requeue", "signal_job", "add_to_partition"):
        assert method in said, said
    assert "cannot reach the Temporal server" not in said  # refused before it tried


def test_an_unknown_backend_is_named(tmp_path: Path) -> None:
    done = gpufleet_cli("worker", env=worker_env(tmp_path, GPUFLEET_SLURM_BACKEND="ftp"), timeout=60)
    assert done.returncode == 2
    assert "slurm_backend" in (done.stdout + done.stderr).lower().replace("gpufleet_", "")
