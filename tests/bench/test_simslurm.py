"""The simulated Slurm of `make bench-scale` answers as slurmctld does for what gpufleet relies on:
owned drains and resumes, a signalled job that exits, a requeue that runs again on a free node,
marks, partitions that keep their last node, and clear errors for unknown names and ids."""

from __future__ import annotations

import pytest

from activities.slurm import requeued_mark, signalled_mark
from bench.simslurm import SimulatedFleet, SimulatedSlurm
from clients.errors import InvalidInput, LastNodeOfPartition, NotFound, NotOwned
from clients.slurm import SlurmClient

OURS = "gpufleet: xid 79 incident remediate-scale-gpu1"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def slurm(clock: Clock) -> SimulatedSlurm:
    return SimulatedSlurm(
        partition="train", training=["gpu1", "gpu2"], spares=["spare1"], checkpoint_seconds=1.0, clock=clock
    )


def test_it_is_a_slurm_client(slurm: SimulatedSlurm) -> None:
    client: SlurmClient = slurm
    assert client.partition_nodes("train") == ["gpu1", "gpu2"]


def test_each_training_node_runs_a_job_and_a_spare_is_idle_outside_the_partition(slurm: SimulatedSlurm) -> None:
    gpu1 = slurm.node("gpu1")
    assert gpu1.state == "allocated" and gpu1.partitions == ["train"] and not gpu1.drained
    [job] = slurm.jobs_on_node("gpu1")
    assert job.state == "RUNNING" and job.nodes == "gpu1" and job.restarts == 0
    spare = slurm.node("spare1")
    assert spare.state == "idle" and spare.partitions == []


def test_a_drain_keeps_someone_elses_reason_and_a_resume_refuses_it(slurm: SimulatedSlurm) -> None:
    slurm.drain("gpu1", reason="dimm swap by ops")
    node = slurm.drain("gpu1", reason=OURS)
    assert node.drained and node.reason == "dimm swap by ops"
    with pytest.raises(NotOwned):
        slurm.resume("gpu1")
    node = slurm.drain("gpu2", reason=OURS)
    assert node.drained and node.reason == OURS
    slurm.resume("gpu2")
    assert not slurm.node("gpu2").drained


def test_a_signalled_job_exits_after_its_checkpoint_and_runs_again_once_requeued_on_a_free_node(
    slurm: SimulatedSlurm, clock: Clock
) -> None:
    slurm.drain("gpu1", reason=OURS)
    [job] = slurm.jobs_on_node("gpu1")
    assert slurm.mark_job(job.job_id, signalled_mark("incident"))
    slurm.signal_job(job.job_id)
    assert slurm.job(job.job_id).state == "RUNNING"  # saving its checkpoint
    clock.now = 1.0
    assert slurm.job(job.job_id).state == "COMPLETED"
    assert slurm.jobs_on_node("gpu1") == []
    assert not slurm.mark_job(job.job_id, requeued_mark("incident", 0))  # finished: Slurm refuses
    assert slurm.job_marks(job.job_id) == [signalled_mark("incident")]
    slurm.requeue(job.job_id)
    slurm.requeue(job.job_id)  # pending already: nothing more
    pending = slurm.job(job.job_id)
    assert pending.state == "PENDING" and pending.restarts == 1
    assert slurm.pending("train").jobs == 1
    slurm.add_to_partition("train", "spare1")  # the spare comes in
    again = slurm.job(job.job_id)
    assert again.state == "RUNNING" and again.nodes == "spare1" and again.restarts == 1
    assert slurm.running_again() == 1


def test_a_requeued_job_waits_while_no_node_is_free(slurm: SimulatedSlurm) -> None:
    [job] = slurm.jobs_on_node("gpu1")
    slurm.drain("gpu1", reason=OURS)
    slurm.requeue(job.job_id)
    assert slurm.job(job.job_id).state == "PENDING"  # gpu1 drained, gpu2 busy, spare1 not in train


def test_a_partition_keeps_its_last_node(slurm: SimulatedSlurm) -> None:
    slurm.remove_from_partition("train", "gpu1")
    with pytest.raises(LastNodeOfPartition):
        slurm.remove_from_partition("train", "gpu2")
    assert slurm.partition_nodes("train") == ["gpu2"]


def test_bad_input_is_refused_and_changes_nothing(slurm: SimulatedSlurm) -> None:
    with pytest.raises(NotFound):
        slurm.node("gpu9")
    with pytest.raises(NotFound):
        slurm.job(999)
    with pytest.raises(InvalidInput):
        slurm.drain("gpu1;rm -rf /", reason=OURS)
    with pytest.raises(InvalidInput):
        slurm.signal_job(1, signal="KILL")
    assert not slurm.node("gpu1").drained and slurm.job(1).state == "RUNNING"


def test_a_fleet_describes_its_slurm() -> None:
    fleet = SimulatedFleet(training=["gpu1"], spares=["spare1"], checkpoint_seconds=0)
    assert fleet.slurm().partition_nodes("train") == ["gpu1"]
