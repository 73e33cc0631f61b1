"""The goodput ledger (models/goodput.py): its phases, their GPU-seconds and the lost work."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta, timezone

import pytest

from models.goodput import RECOVERY_PHASES, Phase, count_hosts, ledger_for
from models.incident import IncidentStatus, JobInfo, Step, TimelineEntry, with_checkpoint
from models.xid import XidEvent

T = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T + timedelta(seconds=seconds)


def entry(step: Step, event: str, seconds: float) -> TimelineEntry:
    return TimelineEntry(step=step, event=event, at=at(seconds))


def xid(seconds: float, code: int = 79) -> XidEvent:
    return XidEvent(node="gpu01", xid=code, timestamp=at(seconds))


def replaced(job: JobInfo, *, ran_again: float | None = 2000.0) -> IncidentStatus:
    """An Xid 79 replaced by a spare it waited for, its one job running again at ``ran_again``:
    opened at 30 s, drained at 32, checkpoint's grace over at 152, requeued at 153, waiting for a
    spare from 160 to 1160, the claim done at 1160, the incident closed at 2100."""
    timeline = [
        entry(Step.CLASSIFY, "started", 30),
        entry(Step.CLASSIFY, "finished", 31),
        entry(Step.DRAIN_SLURM, "started", 31),
        entry(Step.DRAIN_SLURM, "finished", 32),
        entry(Step.REQUEUE_ENDED, "finished", 32.5),
        entry(Step.CHECKPOINT, "started", 33),
        entry(Step.CHECKPOINT, "finished", 152),
        entry(Step.REQUEUE, "started", 152),
        entry(Step.REQUEUE, "finished", 153),
        entry(Step.CLAIM_SPARE, "started", 155),
        entry(Step.WAIT_FOR_SPARE, "started", 160),
        entry(Step.CLAIM_SPARE, "finished", 1160),
        entry(Step.RESUME, "started", 1161),
        entry(Step.CLOSED, "started", 2100),
    ]
    status = IncidentStatus(incident_id="c-gpu01-1", cluster="c", node="gpu01", timeline=timeline, jobs=[job])
    status.signalled = [job.job_id]
    status.requeued = [job.job_id]
    if ran_again is not None:
        status.ran_again = [job.job_id]
        status.ran_again_at = {job.job_id: at(ran_again)}
    return status


def test_a_hand_computed_incident_gives_each_phase_exactly() -> None:
    # 8 GPUs; the job checkpointed 600 s before the failure (at 0 s).
    job = JobInfo(job_id=7, gpus=8, nodes="gpu01", comment=f"gpufleet:checkpoint:{int(at(-600).timestamp())}")
    ledger = ledger_for(replaced(job), [xid(0)], node_gpus=8, now=at(5000), cause="Xid 79")
    expected = {
        Phase.DETECTION: 30,
        Phase.DRAIN: 2,
        Phase.GRACE: 120,
        Phase.REQUEUE: 1,
        Phase.SPARE_WAIT: 1000,  # 160 to 1160
        Phase.RESTART: 847,  # 153 to 160, then 1160 to 2000
        Phase.LOST_WORK: 600,
    }
    for phase, seconds in expected.items():
        assert ledger.cost(phase).seconds == pytest.approx(seconds), phase
        assert ledger.cost(phase).gpu_seconds == pytest.approx(seconds * 8), phase
    assert [cost.phase for cost in ledger.phases] == list(Phase)
    assert ledger.failed_at == at(0) and ledger.detected_at == at(30) and ledger.recovered_at == at(2000)
    assert ledger.recovery_seconds == pytest.approx(2000)
    assert ledger.gpus == 8 and ledger.cause == "Xid 79" and ledger.lost_work_unknown == []
    assert ledger.gpu_seconds_lost == pytest.approx((2000 + 600) * 8)


def test_a_job_without_a_checkpoint_is_unknown_not_zero() -> None:
    ledger = ledger_for(replaced(JobInfo(job_id=7, gpus=4)), [xid(0)], node_gpus=8, now=at(5000))
    assert ledger.lost_work_unknown == [7]
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds is None
    assert ledger.gpu_seconds_lost == pytest.approx(2000 * 4)


def test_a_checkpoint_mark_with_a_step_counts() -> None:
    job = JobInfo(job_id=7, gpus=2, comment=f"owner note gpufleet:checkpoint:{int(at(-90).timestamp())}:4200")
    ledger = ledger_for(replaced(job), [xid(0)], node_gpus=8, now=at(5000))
    assert ledger.cost(Phase.LOST_WORK).seconds == pytest.approx(90)
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds == pytest.approx(180)


def test_a_job_that_never_ran_again_costs_until_the_close() -> None:
    ledger = ledger_for(replaced(JobInfo(job_id=7, gpus=8), ran_again=None), [xid(0)], node_gpus=8, now=at(9999))
    assert ledger.recovered_at == at(2100)
    assert ledger.cost(Phase.RESTART).seconds == pytest.approx(2100 - 153 - 1000)


def test_drain_after_jobs_jobs_that_ran_on_cost_nothing() -> None:
    """DRAIN_AFTER_JOBS signals nothing: the jobs that ran on to their end were never stopped."""
    timeline = [
        entry(Step.CLASSIFY, "started", 5),
        entry(Step.DRAIN_SLURM, "finished", 6),
        entry(Step.REQUEUE_ENDED, "finished", 7),
        entry(Step.WAIT_FOR_JOBS, "started", 7),
        entry(Step.WAIT_FOR_JOBS, "finished", 3600),
        entry(Step.CLOSED, "started", 3700),
    ]
    status = IncidentStatus(
        incident_id="c-gpu01-2",
        cluster="c",
        node="gpu01",
        timeline=timeline,
        jobs=[JobInfo(job_id=1, gpus=8, state="RUNNING"), JobInfo(job_id=2, gpus=8, state="RUNNING")],
    )
    ledger = ledger_for(status, [xid(0, code=63)], node_gpus=8, now=at(4000))
    assert ledger.gpus == 0
    assert ledger.gpu_seconds_lost == 0
    assert ledger.lost_work_unknown == []
    assert all(cost.gpu_seconds == 0 for cost in ledger.phases)
    assert ledger.recovery_seconds == pytest.approx(3700)


def test_a_job_without_gpus_counts_the_node_gpus_per_node() -> None:
    status = replaced(JobInfo(job_id=7, gpus=0, nodes="gpu[01-02]"))
    assert ledger_for(status, [xid(0)], node_gpus=4, now=at(5000)).gpus == 8
    status.jobs = []  # not listed at all: one node's GPUs
    assert ledger_for(status, [xid(0)], node_gpus=4, now=at(5000)).gpus == 4


def test_each_job_pays_until_it_runs_again() -> None:
    """Two jobs: the one back first stops paying; the incident recovers with the last."""
    status = replaced(JobInfo(job_id=7, gpus=8))
    status.jobs.append(JobInfo(job_id=8, gpus=2))
    status.signalled.append(8)
    status.requeued.append(8)
    status.ran_again_at[8] = at(1300)
    ledger = ledger_for(status, [xid(0)], node_gpus=8, now=at(5000))
    assert ledger.gpus == 10 and ledger.recovered_at == at(2000)
    assert ledger.cost(Phase.SPARE_WAIT).gpu_seconds == pytest.approx(1000 * 8 + 1000 * 2)
    assert ledger.cost(Phase.RESTART).gpu_seconds == pytest.approx(847 * 8 + (7 + 140) * 2)


def test_the_jobs_as_the_failure_found_them_carry_the_checkpoint() -> None:
    """After the restart the job's Comment may name a later checkpoint: the failure's listing counts."""
    before = JobInfo(job_id=7, gpus=8, comment=f"gpufleet:checkpoint:{int(at(-300).timestamp())}")
    status = replaced(before.model_copy(update={"comment": f"gpufleet:checkpoint:{int(at(2050).timestamp())}"}))
    ledger = ledger_for(status, [xid(0)], node_gpus=8, now=at(5000), jobs=[before])
    assert ledger.cost(Phase.LOST_WORK).seconds == pytest.approx(300)


def test_an_incident_that_stopped_no_job_costs_no_gpu_time() -> None:
    status = IncidentStatus(
        incident_id="c-gpu01-3", cluster="c", node="gpu01", timeline=[entry(Step.CLASSIFY, "started", 3)]
    )
    ledger = ledger_for(status, [xid(0, code=13)], node_gpus=8, now=at(10))
    assert ledger.gpus == 0 and ledger.gpu_seconds_lost == 0
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds == 0
    assert ledger.recovered_at == at(10) and ledger.recovery_seconds == pytest.approx(10)


def test_an_empty_record_gives_a_ledger_of_nothing() -> None:
    status = IncidentStatus(incident_id="c-gpu01-4", cluster="c", node="gpu01")
    ledger = ledger_for(status, [], node_gpus=8, now=at(0))
    assert ledger.recovery_seconds == 0 and ledger.gpu_seconds_lost == 0


@pytest.mark.parametrize("seed", range(200))
def test_recovery_phases_always_sum_to_the_recovery(seed: int) -> None:
    """Any record, boundaries in any order, a detector clock ahead or behind: the recovery phases
    sum to recovery_seconds, none is negative, and GPU-seconds never exceed seconds times GPUs."""
    rng = random.Random(seed)
    steps = [
        Step.CLASSIFY,
        Step.DRAIN_SLURM,
        Step.REQUEUE_ENDED,
        Step.CHECKPOINT,
        Step.REQUEUE,
        Step.WAIT_FOR_SPARE,
        Step.CLAIM_SPARE,
        Step.RESUME,
        Step.CLOSED,
    ]
    timeline = sorted(
        (
            entry(rng.choice(steps), rng.choice(["started", "finished"]), rng.uniform(0, 5000))
            for _ in range(rng.randint(0, 14))
        ),
        key=lambda item: item.at if rng.random() < 0.8 else at(rng.uniform(0, 5000)),
    )
    jobs = [
        JobInfo(
            job_id=job_id,
            gpus=rng.choice([0, 1, 8]),
            nodes=rng.choice(["", "gpu01", "gpu[01-04]", "bad[["]),
            comment=rng.choice(["", f"gpufleet:checkpoint:{int(at(rng.uniform(-900, 900)).timestamp())}"]),
        )
        for job_id in range(1, rng.randint(1, 5))
    ]
    ids = [job.job_id for job in jobs] + [99]
    status = IncidentStatus(
        incident_id="c-gpu01-5",
        cluster="c",
        node="gpu01",
        timeline=timeline,
        jobs=jobs,
        signalled=rng.sample(ids, rng.randint(0, len(ids))),
        ended=rng.sample(ids, rng.randint(0, len(ids))),
        requeued=rng.sample(ids, rng.randint(0, len(ids))),
        ran_again_at={job_id: at(rng.uniform(-100, 6000)) for job_id in rng.sample(ids, rng.randint(0, len(ids)))},
    )
    events = [xid(rng.uniform(-600, 600)) for _ in range(rng.randint(0, 3))]
    ledger = ledger_for(status, events, node_gpus=8, now=at(rng.uniform(0, 7000)))
    recovery = [ledger.cost(phase) for phase in RECOVERY_PHASES]
    assert sum(cost.seconds for cost in recovery) == pytest.approx(ledger.recovery_seconds, abs=1e-6)
    assert ledger.recovery_seconds == pytest.approx((ledger.recovered_at - ledger.failed_at).total_seconds())
    assert ledger.failed_at <= ledger.detected_at <= ledger.recovered_at
    for cost in recovery:
        assert cost.seconds >= 0
        assert cost.gpu_seconds is not None
        assert 0 <= cost.gpu_seconds <= cost.seconds * ledger.gpus + 1e-6
    known = sum(cost.gpu_seconds or 0 for cost in ledger.phases)
    assert ledger.gpu_seconds_lost == pytest.approx(known)


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [("gpu01", 1), ("gpu[01-04,07],cpu1", 6), ("r[1-2]n[1-2]", 4), ("", 0), ("gpu[4-1]", 0), ("gpu[", 0)],
)
def test_hosts_are_counted_as_slurm_expands_them(hostlist: str, hosts: int) -> None:
    assert count_hosts(hostlist) == hosts


def test_a_checkpoint_mark_names_its_time_and_its_step() -> None:
    job = JobInfo(job_id=1, comment="run 3 gpufleet:checkpoint:1764756000:4200")
    assert job.checkpointed_at == datetime(2025, 12, 3, 10, 0, tzinfo=UTC)
    assert job.checkpoint_step == 4200
    assert JobInfo(job_id=1, comment="gpufleet:checkpoint:1764756000").checkpoint_step is None


def test_a_new_checkpoint_mark_replaces_the_old_and_keeps_the_rest() -> None:
    assert with_checkpoint("", 100) == "gpufleet:checkpoint:100"
    assert with_checkpoint("owner: alice gpufleet:checkpoint:50:7", 100, 9) == "owner: alice gpufleet:checkpoint:100:9"
    assert with_checkpoint("a gpufleet:checkpoint:50 b", 100) == "a b gpufleet:checkpoint:100"


def test_a_new_checkpoint_mark_keeps_the_rest_of_the_comment_as_it_was() -> None:
    # Only the mark and the blank before it go: the owner's spacing and lines stay.
    kept = "owner: alice\nrun  7"
    assert with_checkpoint(kept, 100, 3) == f"{kept} gpufleet:checkpoint:100:3"
    assert with_checkpoint(f"{kept} gpufleet:checkpoint:50:2", 100) == f"{kept} gpufleet:checkpoint:100"
    assert with_checkpoint(f"gpufleet:checkpoint:50 {kept}", 100) == f"{kept} gpufleet:checkpoint:100"


@pytest.mark.parametrize(("at", "step"), [(100, 10**18), (100, -1), (10**12, None), (-5, None)])
def test_a_checkpoint_mark_no_job_could_read_back_is_refused(at: int, step: int | None) -> None:
    # A step of 19 digits would be written, read back as no step, and left behind in the Comment
    # by the next mark.
    with pytest.raises(ValueError, match="checkpoint"):
        with_checkpoint("", at, step)


def test_the_failure_time_is_in_utc_whatever_zone_the_detector_wrote() -> None:
    job = JobInfo(job_id=7, state="RUNNING", gpus=8, nodes="gpu01")
    status = replaced(job)
    plus_two = timezone(timedelta(hours=2))
    event = XidEvent(node="gpu01", xid=79, timestamp=at(-30).astimezone(plus_two))
    ledger = ledger_for(status, [event], node_gpus=8, now=at(3000))
    assert ledger.failed_at == at(-30)
    assert ledger.failed_at.utcoffset() == timedelta(0)


def test_a_job_the_failure_ended_that_could_not_be_requeued_costs_until_the_close() -> None:
    # Ended by the failure and purged by slurmctld before the requeue (or refused it): the job is
    # lost, its owner told to resubmit it. Its GPUs were stopped as surely as a requeued job's.
    lost = JobInfo(job_id=9, state="NODE_FAIL", gpus=4, nodes="gpu01")
    status = replaced(JobInfo(job_id=7, gpus=8, nodes="gpu01"))
    status.jobs.append(lost)
    status.unrequeued = {9: "slurmctld had already purged it (MinJobAge) when gpufleet looked: resubmit it"}
    ledger = ledger_for(status, [xid(0)], node_gpus=8, now=at(9999))
    assert ledger.gpus == 12
    assert ledger.recovered_at == at(2100)  # the lost job never ran again: until the close
    assert ledger.lost_work_unknown == [7, 9]
    assert ledger.cost(Phase.DETECTION).gpu_seconds == pytest.approx(30 * 12)
    restart = ledger.cost(Phase.RESTART).gpu_seconds or 0.0
    spare_wait = ledger.cost(Phase.SPARE_WAIT).gpu_seconds or 0.0
    # Job 7 from 153 to its return at 2000, job 9 from 153 to the close at 2100.
    assert restart + spare_wait == pytest.approx(8 * (2000 - 153) + 4 * (2100 - 153))


def test_a_signalled_job_that_saved_in_its_grace_lost_nothing() -> None:
    """Signalled (not ended by the failure), it saved on SIGTERM: the work since is kept."""
    before = JobInfo(job_id=7, gpus=8, comment=f"gpufleet:checkpoint:{int(at(-300).timestamp())}")
    told = replaced(before)
    told.checkpointed.append(7)  # checkpoint-done during the grace
    assert ledger_for(told, [xid(0)], node_gpus=8, now=at(5000)).cost(Phase.LOST_WORK).gpu_seconds == 0
    marked = replaced(before.model_copy(update={"comment": f"gpufleet:checkpoint:{int(at(100).timestamp())}"}))
    ledger = ledger_for(marked, [xid(0)], node_gpus=8, now=at(5000), jobs=[before])
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds == 0  # its Comment names a save within the grace
    ended = replaced(before)
    ended.checkpointed.append(7)
    ended.ended.append(7)  # the failure itself ended it: its save came too late
    assert ledger_for(ended, [xid(0)], node_gpus=8, now=at(5000)).cost(Phase.LOST_WORK).seconds == pytest.approx(300)


def test_a_job_failing_again_before_its_first_checkpoint_since_a_restart_loses_that_run_only() -> None:
    """Its Comment still names the checkpoint it restarted from; the outage before its restart was
    the earlier incident's."""
    stamp = int(at(-5000).timestamp())
    job = JobInfo(job_id=7, gpus=8, comment=f"gpufleet:checkpoint:{stamp}", start_time=at(-200))
    ledger = ledger_for(replaced(job), [xid(0)], node_gpus=8, now=at(5000))
    assert ledger.cost(Phase.LOST_WORK).seconds == pytest.approx(200)
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds == pytest.approx(200 * 8)
