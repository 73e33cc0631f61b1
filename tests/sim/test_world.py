"""The simulated world's own accounting, without Temporal: what a crash, a SIGTERM and a wait for
nodes cost, second by second."""

from __future__ import annotations

import pytest

from models.policy import Action
from sim.whatif import case_result
from sim.world import FleetSpec, JobSpec, Where, World

GPUS = 4 * 8


def world(**fleet: object) -> World:
    options: dict[str, object] = {
        "nodes": 4,
        "spares": 1,
        "jobs": [JobSpec(checkpoint_seconds=1800, restart_seconds=600, checkpoint_write_seconds=13)],
        "needs": {"gpu": Action.REPLACE_NODE},
        **fleet,
    }
    spec = FleetSpec.model_validate(options)
    return World(spec, seed=1)


def test_a_crash_loses_the_work_since_the_checkpoint_and_waits_for_a_node() -> None:
    w = world()
    record = w.fail(4000, cause="gpu", node="gpu0002", visible=True, kills_job=True)
    assert record.job == 1000 and record.lost_work == pytest.approx(400)  # checkpoint at 3600
    job = w.jobs[1000]
    assert job.state == "NODE_FAIL" and w.nodes["gpu0002"].fault is Action.REPLACE_NODE
    w.advance(4030)
    w.drain("gpu0002", "gpufleet: Xid 79")
    assert w.requeue(1000) and job.state == "PENDING"  # three usable nodes: it waits
    assert w.claim("incident-1", "gpu0002") == "spare001"
    assert job.state == "RUNNING" and job.restarts == 1 and "spare001" in job.nodes
    assert record.running_again_at == pytest.approx(4030) and record.training_again_at == pytest.approx(4630)
    w.retire("gpu0002")
    assert w.nodes["gpu0002"].where is Where.REPAIR
    w.finish(86400)
    trained = 3600 + (86400 - 4630)
    assert w.trained_gpu_seconds() == pytest.approx(trained * GPUS)
    # What was not trained is the failure's: its lost work, the wait for the spare, the start-up.
    assert w.lost_by_cause == pytest.approx({"gpu": (86400 - trained) * GPUS})
    assert w.lost_work_by_cause == pytest.approx({"gpu": 400 * GPUS})


def test_a_sigterm_keeps_the_work_and_the_job_exits_once_its_checkpoint_is_written() -> None:
    w = world()
    record = w.fail(4000, cause="gpu", node="gpu0002", visible=True, kills_job=False)
    job = w.jobs[1000]
    assert job.state == "RUNNING" and record.job == 1000
    w.advance(4030)
    assert w.signal(1000)
    w.advance(4042)
    assert job.state == "RUNNING"  # still writing
    w.advance(4043)
    assert job.state == "COMPLETED" and record.stopped_at == pytest.approx(4030) and record.lost_work == 0
    assert w.checkpoint_time(job, 4043) == pytest.approx(4030)


def test_an_invisible_failure_restarts_the_job_on_its_nodes() -> None:
    w = world()
    record = w.fail(1000, cause="software", node=None, visible=False, kills_job=True)
    job = w.jobs[1000]
    assert job.state == "RUNNING" and job.restarts == 1 and record.incident is None
    w.finish(3600)
    assert w.lost_by_cause == pytest.approx({"software": (1000 + 600) * GPUS})  # nothing saved yet, start-up


def test_a_repair_below_what_the_fault_needs_does_not_hold() -> None:
    w = world()
    w.fail(100, cause="gpu", node="gpu0001", visible=True, kills_job=True)
    assert not w.repair("gpu0001", Action.RESET_GPU)
    w.fail(200, cause="hbm", node="gpu0003", visible=True, kills_job=True)
    assert w.repair("gpu0003", Action.RESET_GPU)
    assert w.nodes["gpu0003"].busy_until == pytest.approx(500)


def test_a_retired_node_is_back_as_a_spare_after_its_repair() -> None:
    w = world(spares=0)
    w.fail(100, cause="gpu", node="gpu0001", visible=True, kills_job=True)
    w.retire("gpu0001")
    assert w.claim("incident-1", "gpu0001") is None and w.announce() == []
    back = 100 + FleetSpec().repair_seconds[Action.REPLACE_NODE]
    assert w.next_return() == pytest.approx(back)
    w.advance(back)
    assert w.nodes["gpu0001"].where is Where.POOL and w.announce() == ["gpu0001"]
    assert w.claim("incident-1", "gpu0001") == "gpu0001" and w.jobs[1000].state == "NODE_FAIL"
    assert w.spare_waited == pytest.approx(back - 100)


def test_a_trace_node_is_the_same_fleet_node_each_time() -> None:
    w = world(nodes=8)
    first = w.fail(10, cause="software", node="dgx-a17", visible=False, kills_job=False)
    again = w.fail(20, cause="software", node="dgx-a17", visible=False, kills_job=False)
    assert first.node == again.node and first.node in w.nodes


def test_a_run_stopped_in_its_start_up_is_charged_only_until_then() -> None:
    w = world()
    w.fail(1000, cause="software", node=None, visible=False, kills_job=True)  # start-up until 1600
    w.fail(1300, cause="network", node=None, visible=False, kills_job=True)  # start-up until 1900
    w.finish(1700)  # still starting
    assert w.trained_gpu_seconds() == 0  # no checkpoint before 1,800 s: the first 1,000 s are lost work
    assert w.lost_by_cause == pytest.approx({"software": (1000 + 300) * GPUS, "network": 400 * GPUS})


def test_a_claim_asked_again_for_the_same_incident_is_the_same_spare() -> None:
    w = world(spares=2)
    w.fail(100, cause="gpu", node="gpu0001", visible=True, kills_job=True)
    first = w.claim("incident-1", "gpu0001")
    # An activity asked again (a retry, a run continued as new) takes no second spare.
    assert w.claim("incident-1", "gpu0001") == first == "spare001"
    assert w.spares_claimed == 1 and w.nodes["spare002"].where is Where.POOL


def test_a_crash_loses_the_steps_since_the_checkpoint_and_the_report_counts_them() -> None:
    # Two steps a second, checkpoints every 1,800 s: a crash at 4,000 s loses the 400 s since the
    # checkpoint at 3,600 s, 800 steps; back on the spare at 4,030 s, training again at 4,630 s.
    w = world(jobs=[JobSpec(checkpoint_seconds=1800, restart_seconds=600, steps_per_second=2.0)])
    record = w.fail(4000, cause="gpu", node="gpu0002", visible=True, kills_job=True)
    assert record.lost_work == pytest.approx(400) and record.lost_steps == pytest.approx(800)
    w.advance(4030)
    w.drain("gpu0002", "gpufleet: Xid 79")
    w.requeue(1000)
    assert w.claim("incident-1", "gpu0002") == "spare001"
    w.fail(5000, cause="software", node=None, visible=False, kills_job=True)  # 370 s in, no checkpoint
    w.finish(86400)
    trained = 3600 + (86400 - 5600)  # kept before the crash, then from the second restart's end
    assert w.steps_trained() == pytest.approx(2 * trained)
    assert w.steps_lost() == pytest.approx(800 + 2 * 370)
    assert w.lost_steps_by_cause == pytest.approx({"gpu": 800, "software": 740})
    case = case_result("hand", w, 86400, [])
    assert case.steps_trained == 2 * trained == round(case.trained_gpu_hours * 3600 / GPUS * 2)
    assert (case.steps_lost, case.steps_lost_by_cause) == (1540, {"gpu": 800, "software": 740})
    assert case.job_stops == 2 and case.steps_lost_per_failure == pytest.approx(770)


def test_a_sigterm_loses_no_steps() -> None:
    w = world(jobs=[JobSpec(checkpoint_seconds=1800, restart_seconds=600, checkpoint_write_seconds=13)])
    record = w.fail(4000, cause="gpu", node="gpu0002", visible=True, kills_job=False)
    w.advance(4030)
    w.signal(1000)
    w.advance(4043)
    assert record.lost_steps == 0 and w.steps_lost() == 0
    assert w.steps_trained() == pytest.approx(4030 * JobSpec().steps_per_second)  # kept up to SIGTERM


def test_each_job_counts_steps_at_its_own_rate() -> None:
    w = world(
        spares=0,
        jobs=[
            JobSpec(nodes=2, checkpoint_seconds=1800, restart_seconds=600, steps_per_second=1.0),
            JobSpec(nodes=2, checkpoint_seconds=1800, restart_seconds=600, steps_per_second=0.25),
        ],
    )
    assert w.jobs[1000].nodes == ["gpu0001", "gpu0002"]
    w.fail(2000, cause="software", node="gpu0001", visible=False, kills_job=True)  # 200 s since 1,800
    w.finish(3600)
    assert w.jobs[1000].steps_trained == pytest.approx(1800 + (3600 - 2600))
    assert w.jobs[1001].steps_trained == pytest.approx(3600 * 0.25)
    assert w.steps_lost() == pytest.approx(200)


def test_a_step_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="steps_per_second"):
        JobSpec(steps_per_second=0)
