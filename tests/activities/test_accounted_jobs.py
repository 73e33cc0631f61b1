"""With slurmdbd: a job slurmctld has already purged (MinJobAge) is still found, through sacct,
and reported as lost with what its owner must do; without it only squeue is read.

A cluster of its own (MariaDB, slurmdbd, slurmctld with a 2 s MinJobAge, three slurmd), so that
a failed job leaves the controller within a minute."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.slurm import SlurmActivities
from clients.slurm import SlurmCli
from lab.accounting import Accounting, accounting_installed
from lab.procs import wait_for
from lab.slurm import SlurmLab, SlurmLabSpec
from models.requests import FailureJobsRequest

pytestmark = pytest.mark.slurm
NODES = ["gpu1", "gpu2", "gpu3"]


@pytest.fixture(scope="module")
def accounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    missing = accounting_installed()
    if missing:
        pytest.fail(f"slurmdbd is needed here: {missing}")
    root = tmp_path_factory.mktemp("accounted")
    spec = SlurmLabSpec(nodes=NODES, spares=[])
    plain = SlurmLab(root, spec)
    site = [line for line in plain.site_lines() if not line.startswith("MinJobAge=")]
    lines = [
        "ClusterName=gpufleetacct",
        *site,
        "MinJobAge=2",  # a finished job leaves slurmctld at its next purge
        "AccountingStorageType=accounting_storage/slurmdbd",
        *Accounting.site_lines(plain.munge_socket),
        "KillWait=5",
        *(f"NodeName={node} {plain.node_options()} State=UNKNOWN" for node in NODES),
        f"PartitionName=train Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    ]
    lab = SlurmLab(root, spec, conf="\n".join(lines) + "\n", nodes=NODES)
    lab.start(timeout=120)
    yield lab
    lab.stop()


def test_a_job_slurmctld_purged_is_found_in_accounting_and_reported_lost(accounted: SlurmLab, tmp_path: Path) -> None:
    client = SlurmCli(slurm_conf=accounted.conf)
    acts = SlurmActivities(client, poll_seconds=0.2)
    since = datetime.now(UTC) - timedelta(seconds=120)
    script = tmp_path / "crashes.sh"
    script.write_text("#!/bin/bash\necho 'RuntimeError: CUDA error: unspecified launch failure' >&2\nexit 1\n")
    job_id = accounted.sbatch(script, "--requeue", "-w", "gpu2", "-o", "/dev/null")
    # Gone from slurmctld (squeue no longer knows it), kept in the accounting database.
    wait_for(lambda: job_id not in client.jobs_by_id([job_id]), timeout=150, what="slurmctld to purge the job")
    accounted_jobs = wait_for(
        lambda: [j for j in client.accounted_jobs("gpu2", since) or [] if j.job_id == job_id],
        timeout=60,
        what="sacct to list the job",
    )
    assert accounted_jobs[0].state == "FAILED" and not accounted_jobs[0].in_controller
    touched = ActivityEnvironment().run(acts.jobs_hit, FailureJobsRequest(node="gpu2", since=since))
    assert [(job.job_id, job.state, job.in_controller) for job in touched] == [(job_id, "FAILED", False)]
    # A job on another node, or one that ended before the window, is not the failure's.
    assert ActivityEnvironment().run(acts.jobs_hit, FailureJobsRequest(node="gpu1", since=since)) == []
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert ActivityEnvironment().run(acts.jobs_hit, FailureJobsRequest(node="gpu2", since=later)) == []
