"""The what-if over gpufleet's real remediation and guard workflows, on the time-skipping test
server: a day of a small fleet, a hand-computable failure, and the month of `make whatif`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.goodput import Phase
from models.policy import Policy, load_policy
from models.trace import Trace, TraceEvent, TraceFailure
from sim.whatif import Closed, NamedPolicy, WhatIfResult, run_whatif
from sim.world import FleetSpec, JobSpec, World
from tests.conftest import gpufleet_cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "policy.yaml"
HOUR = 3600.0
DAY = 86400.0


def one_day() -> Trace:
    """A handful of failures in a day on 16 nodes: a GPU off the bus (replaced), a double-bit ECC
    error (reset), a software crash (nothing for gpufleet to see), another GPU off the bus."""
    return Trace(
        source="one day",
        seconds=DAY,
        nodes=16,
        failures=[
            TraceFailure(at=2 * HOUR, cause="gpu_faulty", event=TraceEvent(xid=79)),
            TraceFailure(at=8 * HOUR, cause="gpu_hbm3", event=TraceEvent(xid=48)),
            TraceFailure(at=14 * HOUR, cause="software_bug"),
            TraceFailure(at=18 * HOUR, cause="gpu_faulty", event=TraceEvent(xid=79)),
        ],
    )


def assert_accounted(result: WhatIfResult) -> None:
    for case in result.cases:
        assert case.trained_gpu_hours + case.lost_gpu_hours == pytest.approx(case.training_gpu_hours, abs=0.02)
        assert sum(case.lost_gpu_hours_by_cause.values()) == pytest.approx(case.lost_gpu_hours, abs=0.1)


async def test_a_day_of_a_small_fleet_gains_with_spares_and_every_visible_failure_opens_an_incident(
    temporal_test_server: str,
) -> None:
    fleet = FleetSpec(nodes=16, needs={"gpu_faulty": "REPLACE_NODE", "gpu_hbm3": "RESET_GPU"})
    policy = NamedPolicy(name="example", policy=load_policy(EXAMPLE))
    result = await run_whatif(one_day(), fleet, [policy], [0, 1, 4], server=Path(temporal_test_server))
    effective = [case.effective_training_time for case in result.cases]
    assert effective == sorted(effective) and effective[1] > effective[0], effective
    assert_accounted(result)
    for case in result.cases:
        assert case.failures == 4 and case.visible_failures == 3
        assert case.unreported == 0 and case.incidents == 3
    no_spare, one, four = result.cases
    # The job ran when the software failed: counted under its cause, not dropped (nothing runs
    # without a spare by then: the first replaced node is still in repair).
    assert four.lost_gpu_hours_by_cause["software_bug"] > 0 and "software_bug" not in no_spare.lost_gpu_hours_by_cause
    assert (no_spare.spares_claimed, one.spares_claimed, four.spares_claimed) == (0, 1, 2)
    assert no_spare.spare_wait_hours > one.spare_wait_hours > four.spare_wait_hours == 0
    assert four.incidents_closed == 3  # the replacements had their spares, the reset held


def hand_case(*, kills_job: bool) -> tuple[Trace, FleetSpec]:
    """One GPU off the bus at 4,000 s on one of 4 nodes, one spare free: a job of 4 x 8 GPUs that
    saves every 1,800 s (so 400 s since its last checkpoint), detected 30 s later, 13 s to write
    a checkpoint on SIGTERM, 600 s to start again, training a step every 2 s."""
    trace = Trace(
        seconds=3 * HOUR,
        nodes=4,
        failures=[
            TraceFailure(at=4000, node="gpu0002", cause="gpu_faulty", event=TraceEvent(xid=79), kills_job=kills_job)
        ],
    )
    fleet = FleetSpec(
        nodes=4,
        detection_seconds=30,
        jobs=[JobSpec(checkpoint_seconds=1800, restart_seconds=600, checkpoint_write_seconds=13, steps_per_second=0.5)],
        needs={"gpu_faulty": "REPLACE_NODE"},
    )
    return trace, fleet


@pytest.mark.parametrize("kills_job", [True, False], ids=["crash", "sigterm"])
async def test_one_failure_costs_what_its_timings_say(temporal_test_server: str, kills_job: bool) -> None:
    trace, fleet = hand_case(kills_job=kills_job)
    gpus = 32
    kept: list[tuple[World, list[Closed]]] = []
    result = await run_whatif(
        trace,
        fleet,
        [NamedPolicy(name="default", policy=Policy())],
        [1],
        server=Path(temporal_test_server),
        keep=kept,
    )
    case = result.cases[0]
    assert case.incidents == 1 and case.incidents_closed == 1 and case.spares_claimed == 1
    world, incidents = kept[0]
    record = world.failures[0]
    assert record.stopped_at is not None and record.running_again_at is not None
    assert record.training_again_at is not None
    grace = 0.0 if kills_job else 13.0
    # The world's own accounting: stopped by the crash, or by SIGTERM once detected; back on the
    # spare as soon as the job ended (drain, requeue and claim take no simulated time), then 600 s.
    stopped = 4000 if kills_job else 4030
    assert record.stopped_at == pytest.approx(stopped, abs=1)
    assert record.running_again_at - 4030 == pytest.approx(grace, abs=1)
    assert record.training_again_at - record.running_again_at == pytest.approx(600, abs=1e-6)
    lost_work = 400.0 if kills_job else 0.0
    assert record.lost_work == pytest.approx(lost_work, abs=1e-6)
    # Steps: the 400 s since the checkpoint at 0.5 a second lost to the crash, none to SIGTERM;
    # trained, what was kept before the failure and all from the start-up's end to the trace's.
    assert (record.lost_steps, case.steps_lost, case.job_stops) == (pytest.approx(lost_work / 2), lost_work / 2, 1)
    kept_before = 3600.0 if kills_job else record.stopped_at
    assert case.steps_trained == pytest.approx((kept_before + trace.seconds - record.training_again_at) / 2, abs=1)
    down = record.training_again_at - record.stopped_at
    assert case.lost_gpu_hours == pytest.approx((down + lost_work) * gpus / HOUR, abs=1 * gpus / HOUR)
    ((closed, ledger),) = incidents
    assert closed
    assert ledger is not None, "every closed incident carries its ledger"
    expected = {
        Phase.DETECTION: 30.0,
        Phase.DRAIN: 0.0,
        Phase.GRACE: grace,
        Phase.REQUEUE: 0.0,
        Phase.SPARE_WAIT: 0.0,
        Phase.RESTART: 0.0,  # RUNNING again at once on the spare; the job's own start-up is not Slurm's to see
    }
    for phase, seconds in expected.items():
        cost = ledger.cost(phase)
        assert cost.seconds == pytest.approx(seconds, abs=1), phase
        assert cost.gpu_seconds == pytest.approx(seconds * gpus, abs=gpus), phase
    # The crash lost the 400 s since the checkpoint; a job signalled in time saved and lost nothing.
    assert ledger.cost(Phase.LOST_WORK).gpu_seconds == pytest.approx(lost_work * gpus, abs=gpus)


@pytest.mark.whatif
@pytest.mark.timeout(1800)
def test_a_month_of_llama3_gains_with_spares(tmp_path: Path) -> None:
    """The issue's figure: `gpufleet whatif --synthetic llama3 --policy examples/policy.yaml
    --spares 0,2,8 --json` (a month of 2,048 nodes; minutes)."""
    run = gpufleet_cli(
        "whatif",
        "--synthetic",
        "llama3",
        "--policy",
        str(EXAMPLE),
        "--spares",
        "0,2,8",
        "--json",
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = WhatIfResult.model_validate(json.loads(run.stdout))
    effective = [case.effective_training_time for case in result.cases]
    assert effective == sorted(effective) and effective[1] > effective[0], effective
    assert_accounted(result)
    assert all(case.unreported == 0 for case in result.cases)
