"""The lab on Slurm 26.05 (a cached Debian forky root), as a user drives it from the command line:
lab up --slurm 26.05, lab status --json saying the release, lab drill --json resolving with the job
running again from its checkpoint, and lab down leaving no daemon, job step or mount behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lab.procs import pids_holding
from lab.slurmroots import cached_root, root_unavailable
from tests.conftest import gpufleet_cli

RELEASE = "26.05"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slurm,
    pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or ""),
]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("lab-26.05")
    up = gpufleet_cli(
        "lab", "up", "--slurm", RELEASE, env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",), timeout=600
    )
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        assert f"Slurm {RELEASE}." in up.stdout
        yield home
    finally:
        gpufleet_cli("lab", "down", env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",), timeout=120)


def _status(home: Path) -> dict[str, object]:
    done = gpufleet_cli("lab", "status", "--json", env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",))
    assert done.returncode == 0, done.stderr
    status: dict[str, object] = json.loads(done.stdout)
    return status


def test_lab_status_says_the_release_and_reads_the_nodes_through_it(home: Path) -> None:
    status = _status(home)
    slurm = status["slurm"]
    assert isinstance(slurm, dict)
    assert slurm["release"] == RELEASE and str(slurm["version"]).startswith(RELEASE + ".")
    assert slurm["root"] == str(cached_root(RELEASE))
    nodes = {node["name"]: node for node in status["nodes"]}  # type: ignore[attr-defined]
    assert {"gpu1", "gpu2", "spare1"} <= set(nodes)
    assert nodes["gpu1"]["partitions"] == ["train"] and nodes["spare1"]["partitions"] == []
    text = gpufleet_cli("lab", "status", env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",))
    assert f"Slurm {slurm['version']} (a Debian root, {cached_root(RELEASE)})" in text.stdout


def test_another_release_is_refused_while_the_lab_runs(home: Path) -> None:
    done = gpufleet_cli("lab", "up", "--slurm", "24.11", env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",))
    assert done.returncode != 0
    assert f"the lab runs Slurm {RELEASE}; stop it first (gpufleet lab down)" in done.stderr + done.stdout
    assert _status(home)["running"] is True


def test_an_unknown_release_is_refused_before_anything_starts(tmp_path: Path) -> None:
    done = gpufleet_cli("lab", "up", "--slurm", "23.02", env={"GPUFLEET_HOME": str(tmp_path)})
    assert done.returncode != 0
    assert "no Slurm release '23.02' in the lab; choose one of 22.05, 24.11, 26.05" in done.stderr + done.stdout
    assert not (tmp_path / "lab.json").exists()


def test_the_drill_resolves_and_the_job_runs_again_from_its_checkpoint(home: Path) -> None:
    done = gpufleet_cli(
        "lab", "drill", "--json", env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",), timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    drill = json.loads(done.stdout.strip().splitlines()[-1])
    assert drill["outcome"] == "resolved", drill
    assert drill["job_resumed"] is True and drill["job_state"] == "RUNNING"
    assert drill["job_restarts"] == drill["restarts_before"] + 1
    assert drill["resumed_from_step"] is not None and drill["resumed_from_step"] >= 1
    assert drill["replacement_node"] in {"spare1", "spare2"}
    nodes = {node["name"]: node for node in _status(home)["nodes"]}  # type: ignore[attr-defined]
    assert nodes[drill["node"]]["reason"].startswith("gpufleet:")  # drained on 26.05, by gpufleet
    assert "train" in nodes[drill["replacement_node"]]["partitions"]


KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH"


def _cluster_spec(tmp_path: Path, name: str, **extra: object) -> Path:
    body = {
        "name": name,
        "partitions": [{"name": "train", "nodes": 1, "default": True}],
        "users": [{"name": "alice", "uid": 20001, "account": "vision", "ssh_keys": [f"{KEY} alice"]}],
        "spares": 0,
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_cluster_created_in_the_lab_runs_the_same_release(home: Path, tmp_path: Path) -> None:
    env = {"GPUFLEET_HOME": str(home)}
    done = gpufleet_cli("cluster", "create", str(_cluster_spec(tmp_path, "tiny")), "--json", env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["outcome"] == "ready"
    # Its controller is 26.05, asked with the lab's own commands pointed at its slurm.conf.
    conf = home / "clusters" / "tiny" / "slurm.conf"
    wrappers = home / "slurm" / "bin"
    shown = subprocess.run(
        [str(wrappers / "scontrol"), "show", "config"],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert re.search(rf"^SLURM_VERSION\s*=\s*{re.escape(RELEASE)}\.\d+$", shown.stdout, re.M), shown.stdout[-500:]
    gone = gpufleet_cli("cluster", "delete", "tiny", "--force", "--reason", "test over", "--json", env=env, timeout=300)
    assert gone.returncode == 0, gone.stdout[-2000:] + gone.stderr[-2000:]
    assert not conf.parent.exists()


def test_accounting_is_refused_on_a_newer_release_saying_why(home: Path, tmp_path: Path) -> None:
    spec = _cluster_spec(tmp_path, "ledger", accounting=True)
    done = gpufleet_cli("cluster", "create", str(spec), env={"GPUFLEET_HOME": str(home)}, timeout=300)
    assert done.returncode != 0
    assert f"accounting runs in the lab on the host's Slurm only, not on Slurm {RELEASE}" in done.stderr + done.stdout
    assert not (home / "clusters" / "ledger").exists()


def test_lab_down_leaves_no_daemon_job_step_or_mount(home: Path) -> None:
    root = cached_root(RELEASE)
    assert root is not None
    done = gpufleet_cli("lab", "down", env={"GPUFLEET_HOME": str(home)}, unset=("TEMPORAL_ADDRESS",), timeout=120)
    assert done.returncode == 0, done.stderr
    # Another lab may use the same root: only what holds this lab's files, or names them, counts.
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == str(root) and str(home).encode() in (entry / "cmdline").read_bytes():
                    left.append(int(entry.name))
            except OSError:
                continue
    in_root = sorted({*left, *pids_holding(home, [root])})
    assert in_root == []
    assert str(root) not in Path("/proc/self/mountinfo").read_text()
