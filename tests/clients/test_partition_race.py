"""Two worker processes edit one Slurm partition at the same instant: the partition's Lease keeps every edit.

Slurm 22.05 changes membership read-modify-write (``scontrol update PartitionName=P Nodes=...``),
and SlurmCli's lock only serialises the threads of one process. Here two real processes, each
with its own SlurmCli, KubernetesApi and SparePool, start together at a barrier and each toggle
their own spare in and out of ``train`` through SparePool's locked edit path. Without the Lease
one's stale write drops the other's spare (or puts back one just taken out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.slurm import SlurmCli
from lab.slurm import SlurmLab
from tests.conftest import REPO, KubeApiProcess

pytestmark = pytest.mark.slurm

ROUNDS = 15

# One worker process: wait at the barrier, then add, check, remove, check ... ending with its node added.
WORKER = """
import json, sys, time
from pathlib import Path

from clients.errors import ClientError
from clients.kube import KubernetesApi
from clients.slurm import SlurmCli
from clients.spares import SparePool

slurm_conf, kubeconfig, node, rounds, barrier = sys.argv[1:]
rounds, barrier = int(rounds), Path(barrier)
slurm = SlurmCli(slurm_conf=Path(slurm_conf))
pool = SparePool(kube=KubernetesApi(kubeconfig=Path(kubeconfig)), slurm=slurm, partition="train", cluster="lab")
lost, errors, edits = [], [], 0
wanted = node in slurm.partition_nodes("train")


def check(when):
    members = slurm.partition_nodes("train")
    if (node in members) != wanted:
        lost.append(f"{when}: {node} {'missing from' if wanted else 'back in'} train {members}")


(barrier / f"ready-{node}").touch()
while not (barrier / "go").exists():
    pass
started = time.time()
for i in range(rounds):
    for add in (True, False) if i < rounds - 1 else (True,):
        check(f"before edit {edits}")
        try:
            (pool.add_to_partition if add else pool.remove_from_partition)(node)
        except ClientError as exc:
            errors.append(f"edit {edits}: {type(exc).__name__}: {exc}")
        wanted = add
        edits += 1
        check(f"after edit {edits - 1}")
span = [started, time.time()]
print(json.dumps({"node": node, "edits": edits, "lost": lost, "errors": errors, "span": span}))
"""


@pytest.fixture
def train(slurm_lab: SlurmLab) -> Iterator[SlurmCli]:
    """The session's partition as every test expects it, before and after."""
    restore = ["scontrol", "update", "PartitionName=train", f"Nodes={','.join(slurm_lab.spec.nodes)}"]
    subprocess.run(restore, env=slurm_lab.env, check=True)
    yield SlurmCli(slurm_conf=slurm_lab.conf)
    subprocess.run(restore, env=slurm_lab.env, check=True)


def test_two_processes_editing_one_partition_lose_nothing(
    train: SlurmCli, slurm_lab: SlurmLab, kube_api: KubeApiProcess, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(slurm_lab.conf),
                str(kube_api.kubeconfig),
                node,
                str(ROUNDS),
                str(barrier),
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in ("spare1", "spare2")
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((barrier / f"ready-{node}").exists() for node in ("spare1", "spare2")):
            assert all(w.poll() is None for w in workers), [w.communicate() for w in workers]
            assert time.monotonic() < deadline, "the workers never reached the barrier"
            time.sleep(0.01)
        (barrier / "go").touch()  # both leave the barrier at this instant
        results = []
        for worker in workers:
            out, err = worker.communicate(timeout=180)
            assert worker.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    # The two really ran at the same time (same machine, so one wall clock).
    assert max(r["span"][0] for r in results) < min(r["span"][1] for r in results), results
    for result in results:
        assert result["edits"] == 2 * ROUNDS - 1
        assert result["errors"] == [], result
        assert result["lost"] == [], result
    assert sorted(train.partition_nodes("train")) == ["gpu1", "gpu2", "gpu3", "spare1", "spare2"]
