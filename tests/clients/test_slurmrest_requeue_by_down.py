"""Requeue over REST by setting a drained node DOWN (``SlurmRest.requeue_by_down``), against real
Slurm 26.05 daemons and the root's own slurmrestd (API v0.0.44, what Slinky's 25.11 serves too).

One cluster: gpu1 (4 CPUs) holds a requeue-able job, a ``--no-requeue`` one, a ``--no-kill`` one
spanning gpu2, a failed and a completed job, and a job pending for it; gpu2 and gpu3 take what is
requeued; gpu4, drained by an operator, runs a job of its own.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from clients.dryrun import dry_run
from clients.errors import InvalidInput, NotOwned
from clients.slurm import SlurmCli
from clients.slurmrest import jwt_token
from clients.slurmrest_protocol import ENDED, KEPT_RUNNING, KILLED, PENDING, REQUEUED, SlurmRest
from lab.procs import free_port, port_in_use, spawn, stop, wait_for
from lab.slurm import SlurmLab
from lab.slurmrest import jwt_lines
from lab.slurmroots import root_unavailable
from models.constants import drain_reason

RELEASE = "26.05"
VERSION = "v0.0.44"
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(root_unavailable(RELEASE)), reason=root_unavailable(RELEASE) or ""),
]
REASON = drain_reason(event="xid 79", action="REPLACE_NODE", incident_id="lab-gpu1-20261205T000000Z")
OPERATOR = "site maintenance: PSU swap"


@dataclass
class Live:
    slurm: SlurmLab
    url: str
    key_file: Path
    cli: SlurmCli

    def rest(self) -> SlurmRest:
        return SlurmRest(self.url, version=VERSION, key_file=self.key_file)

    def http(self, method: str, path: str, body: dict[str, object] | None = None) -> httpx.Response:
        token = jwt_token(self.key_file.read_bytes(), "root")
        headers = {"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": token}
        return httpx.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=30)


def _start_restd(slurm: SlurmLab, folder: Path) -> tuple[int, str]:
    """The root's slurmrestd, serving every data parser of the release, as ``nobody`` given by
    number (in the root it fails to resolve the name), on a copy of slurm.conf it can read."""
    conf = folder / "slurm.conf"
    shutil.copyfile(slurm.conf, conf)
    conf.chmod(0o644)
    port = free_port()
    argv = ["slurmrestd", "-a", "rest_auth/jwt", "-s", "openapi/slurmctld", "-u", "65534", "-g", "65534"]
    pid = spawn(
        slurm.argv([*argv, "-f", str(conf), f"127.0.0.1:{port}"]),
        log=slurm.logs / "slurmrestd.out",
        env={**slurm.env, "SLURM_CONF": str(conf), "SLURM_JWT": "daemon"},
    )
    wait_for(lambda: port_in_use(port), timeout=30, what=f"slurmrestd to listen (log: {slurm.logs})")
    return pid, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    root = Path(tempfile.mkdtemp(prefix="gpufleet-requeue-down-", dir="/tmp"))
    root.chmod(0o755)
    folder = Path(tempfile.mkdtemp(prefix="gpufleet-slurmrestd-", dir="/tmp"))
    folder.chmod(0o755)
    key_file = root / "jwt.key"
    key_file.write_bytes(b"gpufleet-test-key-" + b"0" * 32)
    key_file.chmod(0o600)
    cpus = {"gpu1": 4, "gpu2": 2, "gpu3": 2, "gpu4": 1}
    site = SlurmLab(root, release=RELEASE)
    conf = [
        "ClusterName=requeuedown",
        *site.site_lines(),
        *jwt_lines(key_file),
        "AccountingStorageType=accounting_storage/none",
        "JobRequeue=1",
        "KillWait=5",
        *(f"NodeName={node} {site.node_options(count)} State=UNKNOWN" for node, count in cpus.items()),
        f"PartitionName=train Nodes={','.join(cpus)} Default=YES MaxTime=INFINITE State=UP",
    ]
    slurm = SlurmLab(root, conf="\n".join(conf) + "\n", nodes=list(cpus), release=RELEASE)
    pid = 0
    try:
        slurm.start()
        pid, url = _start_restd(slurm, folder)
        yield Live(slurm, url, key_file, slurm.client())
    finally:
        if pid:
            stop([pid])
        slurm.stop()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _sbatch(live: Live, *args: str) -> int:
    done = subprocess.run(
        live.slurm.argv(["sbatch", "--parsable", "-o", "/dev/null", *args]),
        env=live.slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(done.stdout.strip().split(";")[0])


def _states(live: Live, jobs: dict[str, int]) -> dict[str, tuple[str, int, str]]:
    found = live.cli.jobs_by_id(list(jobs.values()))
    return {name: (found[i].state, found[i].restarts, found[i].nodes) for name, i in jobs.items()}


@pytest.fixture(scope="module")
def jobs(live: Live) -> dict[str, int]:
    """The jobs of gpu1, placed there with no node named (so that a requeued job may run
    elsewhere) while gpu2 and gpu3 are held; then one spanning gpu1 and gpu2 and one pending
    for gpu1; and a job on gpu4, which an operator then drains."""
    held = ("gpu2", "gpu3", "gpu4")
    for node in held:
        live.slurm.scontrol("update", f"NodeName={node}", "State=DRAIN", "Reason=test: placing jobs on gpu1")
    made = {
        "completed": _sbatch(live, "--wrap", "true"),
        "failed": _sbatch(live, "--wrap", "exit 3"),
        "requeue": _sbatch(live, "--requeue", "--wrap", "sleep 600"),
        "no_requeue": _sbatch(live, "--no-requeue", "--wrap", "sleep 600"),
    }
    want = {"completed": "COMPLETED", "failed": "FAILED", "requeue": "RUNNING", "no_requeue": "RUNNING"}
    wait_for(
        lambda: {name: state for name, (state, _, _) in _states(live, made).items()} == want,
        timeout=60,
        what="gpu1's jobs to run or end",
    )
    for node in held:
        live.slurm.scontrol("update", f"NodeName={node}", "State=RESUME")
    made["no_kill"] = _sbatch(live, "--no-kill", "-N2", "-w", "gpu1,gpu2", "--wrap", "sleep 600")
    made["other_node"] = _sbatch(live, "-w", "gpu4", "--wrap", "sleep 600")
    wait_for(
        lambda: {state for state, _, _ in _states(live, made).values()} == {"COMPLETED", "FAILED", "RUNNING"},
        timeout=60,
        what="the jobs to run",
    )
    # Two CPUs on gpu1 alone (-N1: else Slurm may start it on gpu1 and another node); gpu1 has one free.
    made["pending"] = _sbatch(live, "-N1", "-w", "gpu1", "-n2", "--wrap", "sleep 600")
    assert all(_states(live, made)[name][2] == "gpu1" for name in ("completed", "failed", "requeue", "no_requeue"))
    live.slurm.scontrol("update", "NodeName=gpu4", "State=DRAIN", f"Reason={OPERATOR}")
    return made


def test_down_requeues_what_may_be_requeued_and_says_what_became_of_each_job(live: Live, jobs: dict[str, int]) -> None:
    rest = live.rest()
    assert rest.drain("gpu1", reason=REASON).drained

    outcome = rest.requeue_by_down("gpu1", reason=REASON)

    assert outcome == {
        jobs["requeue"]: REQUEUED,
        jobs["no_requeue"]: KILLED,
        jobs["no_kill"]: KEPT_RUNNING,
        jobs["failed"]: ENDED,
        jobs["completed"]: ENDED,
    }
    # The requeue-able job runs again, once more, on another node.
    wait_for(lambda: live.cli.job(jobs["requeue"]).state == "RUNNING", timeout=30, what="the requeued job to run")
    again = live.cli.job(jobs["requeue"])
    assert again.restarts == 1 and again.nodes in {"gpu2", "gpu3"}
    states = _states(live, jobs)
    assert states["no_requeue"][:2] == ("NODE_FAIL", 0)
    assert states["no_kill"] == ("RUNNING", 0, "gpu2")  # lost gpu1, runs on
    assert states["failed"] == ("FAILED", 0, "gpu1") and states["completed"] == ("COMPLETED", 0, "gpu1")
    assert states["pending"][:2] == ("PENDING", 0)
    assert states["other_node"] == ("RUNNING", 0, "gpu4")
    node = live.cli.node("gpu1")
    assert node.drained and node.reason == REASON  # DOWN, or back IDLE once slurmd answers: drained either way


def test_a_second_call_reports_the_same_and_changes_nothing(live: Live, jobs: dict[str, int]) -> None:
    wait_for(lambda: live.cli.job(jobs["requeue"]).state == "RUNNING", timeout=30, what="the requeued job to run")
    before = _states(live, jobs)
    seen = [job_id for name, job_id in jobs.items() if name != "other_node"]  # what gpufleet saw on gpu1
    with dry_run(True):  # any write would raise DryRunViolation
        outcome = live.rest().requeue_by_down("gpu1", reason=REASON, job_ids=seen)
    assert outcome == {
        jobs["requeue"]: REQUEUED,
        jobs["no_requeue"]: KILLED,
        jobs["no_kill"]: KEPT_RUNNING,
        jobs["failed"]: ENDED,
        jobs["completed"]: ENDED,
        jobs["pending"]: PENDING,
    }
    assert _states(live, jobs) == before
    assert live.cli.node("gpu1").reason == REASON


def test_a_node_someone_else_drained_is_refused_and_not_set_down(live: Live, jobs: dict[str, int]) -> None:
    rest = live.rest()
    with pytest.raises(NotOwned, match=OPERATOR):
        rest.requeue_by_down("gpu4", reason=REASON)
    node = live.cli.node("gpu4")
    assert node.state != "down" and node.reason == OPERATOR
    assert live.cli.job(jobs["other_node"]).state == "RUNNING"


def test_a_node_not_drained_or_a_reason_not_gpufleets_is_refused(live: Live, jobs: dict[str, int]) -> None:
    rest = live.rest()
    with pytest.raises(InvalidInput, match="drain it before"):
        rest.requeue_by_down("gpu3", reason=REASON)
    with pytest.raises(InvalidInput, match="not gpufleet's"):
        rest.requeue_by_down("gpu1", reason="replacing the node")
    assert not live.cli.node("gpu3").drained and live.cli.node("gpu3").state != "down"


def test_an_ended_job_is_not_requeued_by_a_v0_0_44_job_update_but_is_by_v0_0_45(
    live: Live, jobs: dict[str, int]
) -> None:
    """What is left for a job that had ended: no job update of v0.0.44 requeues it; v0.0.45's
    requeue (Slurm 26.05) and ``scontrol requeue`` do."""
    failed = jobs["failed"]
    bodies: list[dict[str, object]] = [{"requeue": True}, {"hold": False}, {"priority": {"set": True, "number": 100}}]
    for body in bodies:
        refused = live.http("POST", f"/slurm/{VERSION}/job/{failed}", body)
        assert refused.status_code == 422, refused.text
        assert "Job update requested failed" in refused.text
    assert live.cli.job(failed).state == "FAILED"
    assert live.http("GET", f"/slurm/v0.0.45/job/{failed}/requeue").status_code == 200
    requeued = live.cli.job(failed)
    assert requeued.state == "PENDING" and requeued.restarts == 1
    killed = live.http("GET", f"/slurm/v0.0.45/job/{jobs['no_requeue']}/requeue")
    assert killed.status_code == 422 and "presently disabled" in killed.text  # --no-requeue: not even so


def test_resume_returns_the_node_and_its_pending_job_runs_there(live: Live, jobs: dict[str, int]) -> None:
    live.rest().resume("gpu1")
    node = live.cli.node("gpu1")
    assert not node.drained and node.reason == ""
    wait_for(lambda: live.cli.job(jobs["pending"]).state == "RUNNING", timeout=30, what="the pending job to run")
    assert live.cli.job(jobs["pending"]).nodes == "gpu1"
