"""SlurmCli against real slurmctld and slurmd daemons: drain ownership, signals, requeue, partitions,
on each Slurm release the lab runs (22.05 on the host, 24.11 and 26.05 in cached Debian roots:
lab/slurmroots.py), one cluster per release for the module.

The parsers of squeue's outputs are tested without Slurm: ``squeue --json`` as real clusters
printed it (tests/clients/data, 24.11 and 26.05 captured by tests/clients/data/capture.py), the
--Format records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from clients.errors import ClientError, InvalidInput, NotFound, NotOwned, Unavailable
from clients.slurm import (
    Pending,
    SlurmCli,
    completing_on,
    gpus_allocated,
    gpus_in,
    job_from_json,
    parse_node_record,
    parse_squeue_format,
    parse_squeue_json,
    primary_state,
)
from lab.procs import free_port, wait_for
from lab.slurm import SlurmLab, SlurmLabSpec, slurm_installed
from lab.slurmroots import RootError, root_unavailable
from models.incident import JobInfo
from tests.conftest import REPO

DATA = Path(__file__).parent / "data"
slurm_daemons = pytest.mark.slurm


@pytest.fixture(scope="module", params=["22.05", "24.11", "26.05"], ids=lambda release: f"slurm{release}")
def slurm_lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    """A real Slurm cluster of each release: gpu1..gpu3 in partition 'train', spare1 and spare2 outside it."""
    release = str(request.param)
    why = root_unavailable(release)
    if why:
        pytest.skip(f"Slurm {release} cannot run here: {why}")
    lab = SlurmLab(
        tmp_path_factory.mktemp(f"slurm-{release}"),
        SlurmLabSpec(nodes=["gpu1", "gpu2", "gpu3"], spares=["spare1", "spare2"]),
        release=release,
    )
    try:
        if lab.install.on_host and not slurm_installed():
            pytest.fail("Slurm is not installed: run `make test` as root, or apt-get install slurm-wlm munge")
    except RootError as exc:
        pytest.skip(f"Slurm {release} cannot run here: {exc}")
    try:
        lab.start()
        yield lab
    finally:
        lab.stop()


@pytest.fixture
def slurm(slurm_lab: SlurmLab) -> Iterator[SlurmCli]:
    client = slurm_lab.client()
    yield client
    subprocess.run(["scancel", "--user", "root"], env=slurm_lab.env, check=False)
    for node in slurm_lab.all_nodes:
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
            env=slurm_lab.env,
            capture_output=True,
            check=False,
        )
    subprocess.run(
        ["scontrol", "update", "PartitionName=train", f"Nodes={','.join(slurm_lab.spec.nodes)}"],
        env=slurm_lab.env,
        check=True,
    )


def submit(lab: SlurmLab, tmp_path: Path, script: str, *args: str) -> int:
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n" + script)
    return lab.sbatch(path, "--requeue", "-o", str(tmp_path / "job-%j.out"), "--open-mode=append", *args)


@slurm_daemons
def test_drain_with_our_reason_is_idempotent(slurm: SlurmCli) -> None:
    reason = "gpufleet: xid 79 incident lab-gpu3-1"
    first = slurm.drain("gpu3", reason=reason)
    again = slurm.drain("gpu3", reason=reason)
    assert first.drained and again.drained
    assert slurm.node("gpu3").reason == reason
    slurm.resume("gpu3")
    assert not slurm.node("gpu3").drained


@slurm_daemons
def test_node_drained_by_someone_else_keeps_their_reason(slurm: SlurmCli, slurm_lab: SlurmLab) -> None:
    slurm_lab.scontrol("update", "NodeName=gpu3", "State=DRAIN", "Reason=disk swap by ops")
    after = slurm.drain("gpu3", reason="gpufleet: xid 79 incident x")
    assert after.reason == "disk swap by ops"
    with pytest.raises(NotOwned):
        slurm.resume("gpu3")
    with pytest.raises(NotOwned):
        slurm.down("gpu3", reason="gpufleet: retired")
    node = slurm.node("gpu3")
    assert node.drained and node.reason == "disk swap by ops"


@slurm_daemons
def test_a_slurm_without_a_topology_plugin_has_no_switches_and_says_so(slurm: SlurmCli) -> None:
    """22.05's scontrol says "No topology information available" on stderr and exits 0; 26.05
    prints nothing: either way no switches, and a note, never an error."""
    topology = slurm.topology()
    assert topology.switches == []
    assert "Slurm has no switch topology" in topology.note


@slurm_daemons
def test_unknown_node_is_not_found(slurm: SlurmCli) -> None:
    with pytest.raises(NotFound, match="no node named 'nosuch'"):
        slurm.node("nosuch")


def test_unsafe_name_is_rejected_before_any_command_runs(tmp_path: Path) -> None:
    # An empty bin dir: running any Slurm command here would fail as "not installed".
    client = SlurmCli(bin_dir=tmp_path)
    with pytest.raises(InvalidInput, match="invalid node name"):
        client.drain("gpu1; scontrol shutdown", reason="gpufleet: x")
    with pytest.raises(InvalidInput):
        client.add_to_partition("train", "$(reboot)")


@slurm_daemons
def test_unreachable_controller_is_unavailable(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    conf = slurm_lab.conf.read_text()
    port = next(line for line in conf.splitlines() if line.startswith("SlurmctldPort="))
    dead = tmp_path / "slurm.conf"
    dead.write_text(conf.replace(port, f"SlurmctldPort={free_port()}"))
    with pytest.raises(Unavailable):
        SlurmCli(slurm_conf=dead, bin_dir=slurm_lab.bin_dir, timeout_seconds=20).node("gpu1")


@slurm_daemons
def test_requeue_of_a_running_job(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    job_id = submit(slurm_lab, tmp_path, "echo run $SLURM_RESTART_COUNT\nsleep 300\n", "-w", "gpu1")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
    assert [job.job_id for job in slurm.jobs_on_node("gpu1")] == [job_id]
    slurm.requeue(job_id)
    slurm.requeue(job_id)  # already pending again: a no-op
    job = wait_for(
        lambda: (j := slurm.job(job_id)).state == "RUNNING" and j.restarts == 1 and j, timeout=60, what="the restart"
    )
    assert job.restarts == 1
    assert "run 1" in wait_for(
        lambda: "run 1" in (out := (tmp_path / f"job-{job_id}.out").read_text()) and out, timeout=30, what="the log"
    )


@slurm_daemons
def test_sigterm_reaches_the_batch_script(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    marker, ready = tmp_path / "got-term", tmp_path / "trap-set"
    job_id = submit(
        slurm_lab,
        tmp_path,
        f"trap 'touch {marker}; exit 0' TERM\ntouch {ready}\nwhile true; do sleep 0.1; done\n",
        "-w",
        "gpu2",
    )
    wait_for(ready.exists, timeout=30, what="the trap to be set")
    slurm.signal_job(job_id)
    wait_for(marker.exists, timeout=30, what="SIGTERM to arrive")
    assert wait_for(lambda: slurm.job(job_id).state in {"COMPLETED", "CANCELLED"}, timeout=30, what="the job to end")
    assert slurm.jobs_on_node("gpu2") == []


@slurm_daemons
def test_job_submitted_without_requeue_cannot_be_requeued(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    path = tmp_path / "norequeue.sh"
    path.write_text("#!/bin/bash\nsleep 300\n")
    job_id = slurm_lab.sbatch(path, "--no-requeue", "-o", "/dev/null", "-w", "gpu3")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
    with pytest.raises(InvalidInput, match="--no-requeue"):
        slurm.requeue(job_id)


@slurm_daemons
def test_partition_membership(slurm: SlurmCli) -> None:
    slurm.add_to_partition("train", "spare1")
    slurm.add_to_partition("train", "spare1")
    assert slurm.partition_nodes("train") == ["gpu1", "gpu2", "gpu3", "spare1"]
    slurm.remove_from_partition("train", "gpu1")
    assert "gpu1" not in slurm.partition_nodes("train")
    assert slurm.node("gpu1").partitions == []


def test_parse_node_record_with_reason_and_flags() -> None:
    line = (
        "NodeName=gpu1 Arch=x86_64 OS=Linux 6.1 #1 SMP State=DOWN*+DRAIN ThreadsPerCore=1 "
        "Partitions=train,debug  BootTime=None Reason=gpufleet: xid 79 incident a=b [root@2026-12-02T12:39:18]"
    )
    node = parse_node_record(line)
    assert node.state == "down"
    assert node.flags == ["DRAIN", "NOT_RESPONDING"]
    assert node.partitions == ["train", "debug"]
    assert node.reason == "gpufleet: xid 79 incident a=b"


def test_parse_node_record_of_a_dynamic_node() -> None:
    """A ``slurmd -Z`` node (a Slinky NodeSet pod) as Slurm 26.05 prints it: ``DYNAMIC_NORM``
    says how it was made and is no flag of its condition; 26.05 may spell not responding as a flag."""
    line = (
        "NodeName=slinky-0 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=1 CPUTot=1 "
        "AvailableFeatures=slinky ActiveFeatures=slinky Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm "
        "Port=35059 Version=26.05.5 RealMemory=256 State=IDLE+DRAIN+DYNAMIC_NORM ThreadsPerCore=1 "
        "Partitions=slinky  SlurmdStartTime=2026-12-05T09:13:31 "
        "Reason=gpufleet: xid 79 [root@2026-12-05T09:14:33]"
    )
    node = parse_node_record(line)
    assert (node.name, node.state, node.flags, node.partitions) == ("slinky-0", "idle", ["DRAIN"], ["slinky"])
    assert node.drained and node.reason == "gpufleet: xid 79"
    idle = parse_node_record("NodeName=slinky-1 State=IDLE+DYNAMIC_NORM Partitions=slinky")
    assert (idle.state, idle.flags) == ("idle", [])
    lost = parse_node_record("NodeName=slinky-1 State=IDLE*+DYNAMIC_NORM+NOT_RESPONDING Partitions=slinky")
    assert (lost.state, lost.flags) == ("idle", ["NOT_RESPONDING"])


# -- scoped job queries (real Slurm) -------------------------------------------------------------


class RecordingSlurmCli(SlurmCli):
    """A real SlurmCli that also records the argv of every command it runs."""

    def __init__(self, lab: SlurmLab) -> None:
        super().__init__(slurm_conf=lab.conf, bin_dir=lab.bin_dir)
        self.calls: list[list[str]] = []

    def _run(self, argv: list[str], *, env: dict[str, str] | None = None) -> str:
        self.calls.append(list(argv))
        return super()._run(argv, env=env)


@slurm_daemons
def test_jobs_on_node_reads_only_that_node(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    alone = submit(slurm_lab, tmp_path, "sleep 300\n", "-w", "gpu1")
    wide = submit(slurm_lab, tmp_path, "sleep 300\n", "-N", "2", "-w", "gpu2,gpu3")
    wait_for(lambda: slurm.job(alone).state == "RUNNING", timeout=60, what="the job on gpu1 to run")
    wait_for(lambda: slurm.job(wide).state == "RUNNING", timeout=60, what="the job on gpu[2-3] to run")
    client = RecordingSlurmCli(slurm_lab)

    assert [job.job_id for job in client.jobs_on_node("gpu1")] == [alone]
    assert len(client.calls) == 1
    argv = client.calls[0]
    assert argv[0] == "squeue" and "--nodelist=gpu1" in argv and "--json" not in argv

    # A job on gpu[2-3] belongs to each of its nodes, without expanding the host list ourselves.
    client.calls.clear()
    on_gpu3 = client.jobs_on_node("gpu3")
    assert [(job.job_id, job.nodes, job.state) for job in on_gpu3] == [(wide, "gpu[2-3]", "RUNNING")]
    assert [job.job_id for job in client.jobs_on_node("gpu2")] == [wide]
    assert client.jobs_on_node("spare1") == []
    assert len(client.calls) == 3
    with pytest.raises(NotFound, match="no node named 'nosuch'"):
        client.jobs_on_node("nosuch")


@slurm_daemons
def test_a_job_still_completing_on_another_node_is_listed_on_the_node_it_left(
    slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    """Once a node has finished its part of a job that is COMPLETING, Slurm lists the job on the
    nodes still completing only: a failure that ended a job on gpu1 while gpu2 was slow to clean up
    found no job on gpu1, and its incident requeued nothing (seen in make chaos). The node's recent
    jobs still hold it, with its whole allocation."""
    job = submit(slurm_lab, tmp_path, "srun sleep 300\n", "-N", "2", "-w", "gpu[1-2]")
    wait_for(lambda: slurm.job(job).state == "RUNNING", timeout=60, what="the job on gpu[1-2] to run")
    held = slurm_lab.slurmd_pid("gpu2")
    os.kill(held, signal.SIGSTOP)  # gpu2 cannot finish its part: the job stays COMPLETING there
    try:
        # 24.11 and later: scancel may time out waiting on gpu2; the job is ended all the same.
        subprocess.run(["scancel", str(job)], env=slurm_lab.env, capture_output=True, check=False)
        wait_for(
            lambda: (found := slurm.job(job)).state == "COMPLETING" and found.nodes == "gpu2",
            timeout=60,
            what="gpu1 to finish its part while gpu2 still completes",
        )
        plain = [found.job_id for found in slurm._squeue("--states=all", "--nodelist=gpu1")]
        assert job not in plain  # what Slurm's own listing shows
        # (Earlier tests' finished jobs are there too: only this job is looked at.)
        on_gpu1 = [(found.state, found.nodes) for found in slurm.recent_jobs_on_node("gpu1") if found.job_id == job]
        assert on_gpu1 == [("COMPLETING", "gpu[1-2]")]
        assert [found.job_id for found in slurm.recent_jobs_on_node("gpu2")].count(job) == 1
        assert job not in [found.job_id for found in slurm.recent_jobs_on_node("gpu3")]
    finally:
        os.kill(held, signal.SIGCONT)
    wait_for(lambda: slurm.job(job).state == "CANCELLED", timeout=60, what="the job to finish completing")
    # Completed, it is listed on each of its nodes again, once.
    again = [found.nodes for found in slurm.recent_jobs_on_node("gpu1") if found.job_id == job]
    assert again == ["gpu[1-2]"]


@pytest.mark.parametrize("release", ["22.05", "24.11", "26.05"])
def test_only_a_completing_jobs_own_allocation_places_it_on_a_node(release: str) -> None:
    """Each record carries its own allocation (an array task, a het component: never its
    siblings'); text its owner controls (the name) is never read as nodes; a record whose
    allocation is not a hostlist is skipped, not an error; a job the node lists already is not
    listed twice."""
    base = json.loads((DATA / f"squeue_{release}.json").read_text())["jobs"][0]
    ENDED = 1796615750

    def record(job_id: int, state: str, nodes: str, allocation: str, name: str = "train") -> dict[str, Any]:
        raw = json.loads(json.dumps(base))
        resources = raw["job_resources"]
        if isinstance(resources["nodes"], dict):
            resources["nodes"]["list"] = allocation
        else:
            resources["nodes"] = allocation
        listed_state = isinstance(raw["job_state"], list)
        raw.update(job_id=job_id, nodes=nodes, name=name, job_state=[state] if listed_state else state)
        if isinstance(raw["end_time"], dict):
            raw["end_time"].update(set=True, number=ENDED)
        else:
            raw["end_time"] = ENDED
        return raw

    records = [
        record(100, "COMPLETING", "gpu4", "gpu[3-4]", name="x\nNodes=gpu1"),  # an array task on gpu[3-4]
        record(101, "COMPLETING", "gpu2", "gpu[1-2]"),  # its sibling, which ran on gpu1
        record(102, "RUNNING", "gpu1", "gpu1"),  # listed by the node itself
        record(103, "COMPLETING", "gpu5", "gpu[1-"),  # not a hostlist
        record(104, "COMPLETING", "gpu9", "gpu[1,9]"),  # the node lists it already
    ]
    found = completing_on("gpu1", records, listed={102, 104})
    assert [(job.job_id, job.state, job.nodes) for job in found] == [(101, "COMPLETING", "gpu[1-2]")]
    # A completing job has ended: its EndTime says when (a running one's is its time limit).
    assert found[0].end_time == datetime.fromtimestamp(ENDED, UTC)
    assert job_from_json(records[2]).end_time is None
    assert completing_on("gpu3", records, listed=set())[0].job_id == 100
    assert completing_on("spare1", records, listed=set()) == []


@slurm_daemons
def test_jobs_by_id_reads_several_jobs_in_one_query(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    finished = submit(slurm_lab, tmp_path, "true\n", "-w", "gpu1")
    wait_for(lambda: slurm.job(finished).state == "COMPLETED", timeout=60, what="the short job to finish")
    # Free text from the user: a long name with the characters a delimiter would use, a newline too.
    odd_name = "name longer than twenty | with, colons: \x1f and a\nnewline"
    running = submit(slurm_lab, tmp_path, "sleep 300\n", "-w", "gpu1", "-J", odd_name)
    wait_for(lambda: slurm.job(running).state == "RUNNING", timeout=60, what="the job to run")
    pending = submit(slurm_lab, tmp_path, "sleep 300\n", "-w", "gpu1")  # gpu1 is busy: it waits
    client = RecordingSlurmCli(slurm_lab)

    jobs = client.jobs_by_id([pending, running, finished, 2_000_000_000, running])
    assert len(client.calls) == 1
    argv = client.calls[0]
    assert argv[0] == "squeue" and "--states=all" in argv and "--json" not in argv
    assert sorted(jobs) == sorted([pending, running, finished])
    assert jobs[finished].state == "COMPLETED" and jobs[finished].nodes == "gpu1"
    assert jobs[running].state == "RUNNING" and jobs[running].name == odd_name
    assert jobs[running].stdout == str(tmp_path / "job-%j.out")
    assert jobs[running].requeue and jobs[running].restarts == 0
    assert jobs[pending].state == "PENDING" and jobs[pending].nodes == ""

    # Asked alone, a job Slurm does not know makes squeue fail: absent, and NotFound from job().
    assert client.jobs_by_id([2_000_000_000]) == {}
    with pytest.raises(NotFound, match="no job 2000000000"):
        client.job(2_000_000_000)
    assert client.job(running) == jobs[running]
    assert client.jobs_by_id([]) == {}


@slurm_daemons
def test_whole_cluster_json_listing_agrees_with_the_scoped_reads(
    slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    job_id = submit(slurm_lab, tmp_path, "sleep 300\n", "-w", "gpu2")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=60, what="the job to run")
    listed = {job.job_id: job for job in slurm.jobs()}
    scoped = slurm.job(job_id)
    if slurm_lab.release == "24.11":
        # 24.11's squeue --json names the output file as the job writes it (job-42.out); its
        # --Format, slurmrestd and every other release keep the pattern given (job-%j.out).
        assert listed[job_id].stdout == str(tmp_path / f"job-{job_id}.out")
        assert scoped.stdout == str(tmp_path / "job-%j.out")
        scoped = scoped.model_copy(update={"stdout": listed[job_id].stdout})
    assert listed[job_id] == scoped


def test_job_ids_are_checked_before_any_command_runs(tmp_path: Path) -> None:
    # An empty bin dir: running any Slurm command here would fail as "not installed".
    client = SlurmCli(bin_dir=tmp_path)
    assert client.jobs_by_id([]) == {}
    for bad in (0, -5, True, 2**31, "12; scancel --user=all", 1.5):
        with pytest.raises(InvalidInput, match="invalid job id"):
            client.jobs_by_id([bad])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        client.job("7 --states=all")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        client.signal_job("7,8")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        client.jobs_on_node("gpu1 --states=all")


# -- parsers (no Slurm) --------------------------------------------------------------------------


def _sample(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


def test_parse_squeue_json_of_slurm_22_05() -> None:
    parsed = {job.job_id: job for job in parse_squeue_json(_sample("squeue_22.05.json"))}
    assert parsed[2].start_time == datetime.fromtimestamp(1796235842, tz=UTC)
    # A pending job's start_time is when Slurm expects it to start: kept as it says.
    # An ended job says when it ended; one that runs or waits has none (its EndTime is its limit's).
    assert parsed[1].end_time is not None and parsed[4].end_time is not None
    assert parsed[2].end_time is None and parsed[5].end_time is None
    jobs = {job_id: job.model_copy(update={"start_time": None, "end_time": None}) for job_id, job in parsed.items()}
    assert jobs == {
        1: JobInfo(job_id=1, name="prep", user="root", state="COMPLETED", nodes="gpu3", stdout="/srv/runs/prep-%j.out"),
        2: JobInfo(
            job_id=2,
            name="ddp-train",
            user="root",
            state="RUNNING",
            restarts=1,
            nodes="gpu[1-2]",
            stdout="/srv/runs/ddp-%j.out",
        ),
        3: JobInfo(
            job_id=3,
            name="eval",
            user="root",
            state="RUNNING",
            nodes="gpu3",
            requeue=False,
            stdout="/srv/runs/eval-%j.out",
        ),
        4: JobInfo(
            job_id=4, name="sweep", user="root", state="CANCELLED", nodes="gpu1", stdout="/srv/runs/sweep-%j.out"
        ),
        5: JobInfo(job_id=5, name="sweep2", user="root", state="PENDING", nodes="", stdout="/srv/runs/sweep-%j.out"),
    }


@pytest.mark.parametrize("release", ["24.11", "26.05"])
def test_parse_squeue_json_as_real_clusters_print_it(release: str) -> None:
    """``squeue --json --states=all`` of a real cluster (data_parser v0.0.42 on 24.11, v0.0.45 on
    26.05): states as lists, counts as numbers or {set, infinite, number}, times as objects."""
    data = _sample(f"squeue_{release}.json")
    assert data["meta"]["slurm"]["version"]["major"] == release.split(".")[0]
    jobs = {job.name: job for job in parse_squeue_json(data)}
    assert {name: (job.state, job.restarts, job.nodes, job.requeue, job.user) for name, job in jobs.items()} == {
        "prep": ("COMPLETED", 0, "gpu2", True, "root"),
        "ddp-train": ("RUNNING", 0, "gpu1", True, "root"),
        "sweep": ("PENDING", 1, "", True, "root"),  # requeued once, held
        "eval": ("PENDING", 0, "", False, "root"),
    }
    prep, train, sweep = jobs["prep"], jobs["ddp-train"], jobs["sweep"]
    assert prep.start_time is not None and prep.end_time is not None and prep.end_time >= prep.start_time
    assert train.start_time is not None and train.end_time is None  # running: its EndTime is its limit's
    assert sweep.end_time is None and jobs["eval"].start_time is None
    assert sorted(job.job_id for job in jobs.values()) == [1, 2, 3, 4]
    # 24.11 prints the output file as the job will write it; 26.05 as it was given.
    assert train.stdout.endswith("/ddp-train-2.out" if release == "24.11" else "/%x-%j.out")


@pytest.mark.parametrize(
    ("job_state", "expected"),
    [
        ("RUNNING", "RUNNING"),  # 22.05: already one word
        ("requeued", "REQUEUED"),
        (["RUNNING"], "RUNNING"),
        (["PENDING", "REQUEUED"], "REQUEUED"),
        (["PENDING", "REQUEUE_HOLD"], "REQUEUE_HOLD"),
        (["RUNNING", "CONFIGURING"], "CONFIGURING"),
        (["CANCELLED", "COMPLETING"], "COMPLETING"),
        (["PENDING", "REQUEUED", "COMPLETING"], "COMPLETING"),
        (["RUNNING", "SIGNALING"], "SIGNALING"),
        (["RUNNING", "UPDATE_DB"], "RUNNING"),  # a flag job_state_string() does not name
        (["NEW_STATE"], "NEW_STATE"),
        ([], ""),
        (None, ""),
    ],
)
def test_primary_state_reads_like_job_state_string(job_state: object, expected: str) -> None:
    assert primary_state(job_state) == expected


@pytest.mark.parametrize(
    ("restart_cnt", "expected"),
    [
        (3, 3),
        ({"set": True, "infinite": False, "number": 3}, 3),
        ({"set": False, "infinite": False, "number": 0}, 0),
        ({"set": True, "infinite": True, "number": 0}, 0),
        ("4", 4),
        (None, 0),
    ],
)
def test_counts_read_plain_or_as_objects(restart_cnt: object, expected: int) -> None:
    job = job_from_json({"job_id": {"set": True, "infinite": False, "number": 9}, "restart_cnt": restart_cnt})
    assert (job.job_id, job.restarts) == (9, expected)


def test_a_json_job_without_an_id_is_an_error() -> None:
    with pytest.raises(ClientError, match="without an ID"):
        job_from_json({"name": "x", "job_state": ["RUNNING"]})


def test_parse_squeue_format_splits_on_the_call_token_only() -> None:
    sep, end = "\x1fabc123\x1f", "\x1eabc123\x1e"
    rows = [
        [
            "12",
            "a|b\x1fc\nd",
            "alice",
            "RUNNING",
            "2",
            "gpu[1-2]",
            "1",
            "2026-12-03T10:00:00",
            "(null)",
            "/out|x/%j.out",
            "2026-12-03T11:00:00",  # a running job's EndTime is when its time limit ends: not kept
            "cpu=16,mem=64G,node=2,billing=16,gres/gpu=16",  # tres-alloc: its GPUs on both nodes
        ],
        [
            "13",
            "plain",
            "bob",
            "FAILED",
            "0",
            "",
            "0",
            "N/A",
            "gpufleet:checkpoint:1764756000 ok",
            "/dev/null",
            "2026-12-03T10:05:00",
            "cpu=1,node=1,billing=1",  # no GPU named (a cluster without gres.conf)
        ],
    ]
    out = "".join(sep.join(row) + end + "\n" for row in rows)
    assert parse_squeue_format(out, separator=sep, terminator=end) == [
        JobInfo(
            job_id=12,
            name="a|b\x1fc\nd",
            user="alice",
            state="RUNNING",
            restarts=2,
            nodes="gpu[1-2]",
            requeue=True,
            stdout="/out|x/%j.out",
            start_time=datetime.fromisoformat("2026-12-03T10:00:00").astimezone(UTC),
            gpus=16,
        ),
        JobInfo(
            job_id=13,
            name="plain",
            user="bob",
            state="FAILED",
            restarts=0,
            nodes="",
            requeue=False,
            stdout="/dev/null",
            end_time=datetime.fromisoformat("2026-12-03T10:05:00").astimezone(UTC),
            comment="gpufleet:checkpoint:1764756000 ok",
        ),
    ]
    # A stamp that is no time at all is as if the job had said nothing.
    assert JobInfo(job_id=1, comment="gpufleet:checkpoint:999999999999").checkpointed_at is None
    assert parse_squeue_format(out, separator=sep, terminator=end)[1].checkpointed_at == datetime(
        2025, 12, 3, 10, 0, tzinfo=UTC
    )
    assert parse_squeue_format("", separator=sep, terminator=end) == []
    with pytest.raises(ClientError):
        parse_squeue_format(sep.join(rows[0][:5]) + end + "\n", separator=sep, terminator=end)
    with pytest.raises(ClientError):
        parse_squeue_format(sep.join(rows[0]) + "\n", separator=sep, terminator=end)
    with pytest.raises(ClientError):
        parse_squeue_format(sep.join(["x", *rows[0][1:]]) + end + "\n", separator=sep, terminator=end)


@slurm_daemons
def test_marks_are_kept_on_the_job_beside_what_the_site_wrote(
    slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    job_id = submit(slurm_lab, tmp_path, "sleep 300\n", "-w", "gpu2")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
    subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "AdminComment=site billing tag"], env=slurm_lab.env, check=True
    )
    assert slurm.mark_job(job_id, "gpufleet:signalled:lab-gpu2-20261202T000000Z")
    assert slurm.mark_job(job_id, "gpufleet:signalled:lab-gpu2-20261202T000000Z")  # once only
    assert slurm.job_marks(job_id) == ["gpufleet:signalled:lab-gpu2-20261202T000000Z"]
    assert slurm._admin_comment(job_id).startswith("site billing tag; ")
    slurm.requeue(job_id)  # the marks survive a requeue: a retry after it still reads them
    assert slurm.job_marks(job_id) == ["gpufleet:signalled:lab-gpu2-20261202T000000Z"]
    with pytest.raises(InvalidInput):
        slurm.mark_job(job_id, "gpufleet:x:y; rm -rf /")
    subprocess.run(["scancel", str(job_id)], env=slurm_lab.env, check=True)
    wait_for(lambda: slurm.job(job_id).state == "CANCELLED", timeout=30, what="the cancel")
    assert slurm.mark_job(job_id, "gpufleet:requeued:lab-gpu2-20261202T000000Z:0") is False  # finished: refused


@pytest.mark.parametrize(
    ("tres", "gpus"),
    [
        ("cpu=2,mem=1G,node=1,billing=2,gres/gpu=2", 2),  # 22.05 and 23.11+ alike
        ("cpu=64,mem=512G,node=8,billing=64,gres/gpu=64,gres/gpu:h100=64", 64),  # typed beside the total
        ("cpu=8,node=1,gres/gpu:a100=4,gres/gpu:v100=2", 6),  # typed only
        ("cpu=1,node=1,billing=1", 0),
        ("", 0),
        ("(null)", 0),
        ("gres/gpu=lots", 0),
    ],
)
def test_a_jobs_gpus_are_read_from_its_tres(tres: str, gpus: int) -> None:
    assert gpus_allocated(tres) == gpus


def test_the_json_names_a_jobs_gpus_in_its_tres() -> None:
    raw = {"job_id": 5, "job_state": ["RUNNING"], "tres_alloc_str": "cpu=4,node=1,billing=4,gres/gpu=4"}
    assert job_from_json(raw).gpus == 4
    # A requeued job waits: nothing allocated, what it asks for counts.
    waiting = {"job_id": 6, "job_state": "PENDING", "tres_alloc_str": "", "tres_req_str": "cpu=8,node=1,gres/gpu=8"}
    assert job_from_json(waiting).gpus == 8
    for release in ("22.05", "24.11", "26.05"):  # the lab's Slurm has no gres.conf: no GPUs named
        data = json.loads((Path(__file__).parent / "data" / f"squeue_{release}.json").read_text())
        assert {job.gpus for job in parse_squeue_json(data)} == {0}


def test_gpus_are_read_from_the_gres_squeue_prints() -> None:
    assert [gpus_in(g) for g in ("gres:gpu:2", "gres/gpu:a100:4", "gpu:8,gres/shard:2", "N/A", "")] == [2, 4, 8, 0, 0]


@slurm_daemons
def test_pending_counts_what_waiting_jobs_ask_for(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    assert slurm.pending("train") == Pending()
    whole = submit(slurm_lab, tmp_path, "sleep 300\n", "-p", "train", "-N", "3", "--exclusive")
    wait_for(lambda: slurm.job(whole).state == "RUNNING", timeout=30, what="the first job to hold every node")
    submit(slurm_lab, tmp_path, "sleep 1\n", "-p", "train", "-N", "2", "--exclusive")  # waits for nodes
    submit(slurm_lab, tmp_path, "sleep 1\n", "-p", "train", "-N", "1", "--hold")  # held: asks for nothing yet
    # The lab's nodes have no GPUs for Slurm (no gres.conf): the jobs ask for none.
    wait_for(lambda: slurm.pending("train") == Pending(jobs=1, nodes=2), timeout=30, what="the waiting job counted")
    with pytest.raises(InvalidInput):
        slurm.pending("train;rm")  # checked before any command runs


@slurm_daemons
def test_a_job_says_when_it_checkpointed_in_its_comment(slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path) -> None:
    job_id = submit(slurm_lab, tmp_path, "sleep 300\n", "-p", "train", "-w", "gpu2")
    wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
    [job] = [j for j in slurm.partition_jobs("train") if j.job_id == job_id]
    assert job.start_time is not None and job.checkpointed_at is None
    # What a training script runs after each save (its owner may update its own job's Comment).
    subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "Comment=gpufleet:checkpoint:1764756000"],
        env=slurm_lab.env,
        check=True,
    )
    [job] = [j for j in slurm.partition_jobs("train") if j.job_id == job_id]
    assert job.checkpointed_at == datetime(2025, 12, 3, 10, 0, tzinfo=UTC)
    assert slurm.hostnames(job.nodes) == ["gpu2"]


@slurm_daemons
def test_a_job_reports_its_checkpoint_from_inside_with_gpufleet(
    slurm: SlurmCli, slurm_lab: SlurmLab, tmp_path: Path
) -> None:
    """`gpufleet checkpoint-done --step N` run inside the job (its $SLURM_JOB_ID) writes the mark in
    the job's Comment; a later one replaces it, and what else the Comment says is kept. (A release
    that runs in its own root cannot run this checkout's gpufleet in a job: the client writes there.)"""
    owner_note = "scontrol update JobId=$SLURM_JOB_ID 'Comment=run 7 '\"$(squeue -h -j $SLURM_JOB_ID -o %k)\"\n"
    if slurm_lab.install.on_host:
        gpufleet = f"PYTHONPATH={REPO} {sys.executable} -m workers.entry checkpoint-done"
        script = (
            f"{gpufleet} --step 41 --at 1764755000 || exit 3\n{owner_note}"
            f"{gpufleet} --step 42 --at 1764756000 || exit 4\ntouch {tmp_path / 'reported'}\nsleep 300\n"
        )
        job_id = submit(slurm_lab, tmp_path, script, "-p", "train", "-w", "gpu2")
        try:
            wait_for(lambda: (tmp_path / "reported").exists(), timeout=60, what="the job to report its checkpoints")
        except TimeoutError:
            pytest.fail("; ".join(out.read_text() for out in tmp_path.glob("job-*.out")) or "the job printed nothing")
    else:
        job_id = submit(slurm_lab, tmp_path, "sleep 300\n", "-p", "train", "-w", "gpu2")
        wait_for(lambda: slurm.job(job_id).state == "RUNNING", timeout=30, what="the job to run")
        slurm.record_checkpoint(job_id, 1764755000, 41)
        comment = f"Comment=run 7 {slurm.job(job_id).comment}"
        subprocess.run(["scontrol", "update", f"JobId={job_id}", comment], env=slurm_lab.env, check=True)
        slurm.record_checkpoint(job_id, 1764756000, 42)
    job = slurm.job(job_id)
    assert job.comment == "run 7 gpufleet:checkpoint:1764756000:42"
    assert job.checkpointed_at == datetime(2025, 12, 3, 10, 0, tzinfo=UTC) and job.checkpoint_step == 42
    assert slurm.record_checkpoint(job_id, 1764756600) == "run 7 gpufleet:checkpoint:1764756600"
    assert slurm.job(job_id).checkpoint_step is None
