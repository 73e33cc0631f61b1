"""Validation rungs against the emulated API, with the lab's Job runner standing for the kubelet
and the lab's stand-in rungs (lab/validate.py) told by their knob files how to end.

A rung passes when its Job completes, is skipped when its tool is missing (exit 127), fails
otherwise; the NCCL rung is held to the policy's floor until the node type has passes of its
own, then to a fraction of their median; a retry of a rung finds its own Job.
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.validation import BASELINES_CONFIG_MAP, ValidationActivities, bus_bandwidth
from clients.kube import KubernetesApi
from models.constants import PROBATION_LABEL, PROBATION_UNTIL_ANNOTATION
from models.validation import ProbationRequest, Rung, RungKind, RungOutcome, RungRequest, RungResult, ValidationSettings
from tests.activities import test_repair

STAND_IN = [sys.executable, "-m", "lab.validate"]
# The repair tests' fixtures: the Job runner, its GPUFLEET_HOME (the knob files), the client.
home, runner, kube = test_repair.home, test_repair.runner, test_repair.kube


def lab_rung(kind: RungKind, **extra: object) -> Rung:
    return Rung(
        name=kind.value,
        kind=kind,
        image="lab",
        command=[*STAND_IN, kind.value, "--node", "{node}", "--gpus", "{gpus}", "--level", "{level}"],
        timeout_seconds=60,
        skip_exit_code=127 if kind is RungKind.DCGM else None,
        **extra,  # type: ignore[arg-type]
    )


def climb(kube: KubernetesApi, kind: RungKind, *, request_id: str = "return-gpu1/1", **settings: object) -> RungResult:
    request = RungRequest(
        node="gpu1",
        request_id=request_id,
        rung=lab_rung(kind),
        settings=ValidationSettings(enabled=True, **settings),  # type: ignore[arg-type]
    )
    result: RungResult = ActivityEnvironment().run(ValidationActivities(kube, poll_seconds=0.05).run_rung, request)
    return result


def test_nccl_tests_summary_is_read() -> None:
    assert bus_bandwidth("# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 181.342 \n#\n") == 181.342
    assert bus_bandwidth("nothing here") is None
    # As srun prefixes it, and after NCCL's own lines.
    assert bus_bandwidth(" 0: # Out of bounds values : 0 OK\n 0: # Avg bus bandwidth    : 37.9868\n") == 37.9868


def test_a_bus_bandwidth_printed_with_an_exponent_is_read_whole() -> None:
    """nccl-tests prints the average with %g: a link all but dead reads "5e-05", never 5 GB/s."""
    assert bus_bandwidth("# Avg bus bandwidth    : 5e-05 \n#\n") == 5e-05
    assert bus_bandwidth("# Avg bus bandwidth    : 1.23457e+06\n") == 1234570.0


@pytest.mark.usefixtures("runner")
@pytest.mark.parametrize("kind", [RungKind.QUICK, RungKind.DCGM, RungKind.SITE])
def test_each_rung_passes_and_fails_by_its_job(kube: KubernetesApi, home: Path, kind: RungKind) -> None:
    passed = climb(kube, kind)
    assert passed.outcome is RungOutcome.PASSED, passed.detail
    assert kube.job_state("gpufleet", passed.job).succeeded
    # Its pod ended, as a drain of the node reads it: nothing that holds the node.
    [pod] = [p for p in kube.pods_on_node("gpu1") if p.name.startswith(passed.job)]
    assert not pod.holds_node
    (home / "validate-fails").write_text(f"{kind.value}\n")
    failed = climb(kube, kind, request_id="return-gpu1/2")
    assert failed.outcome is RungOutcome.FAILED
    assert f"gpu1: {kind.value} failed (the lab was told so)" in failed.detail
    # A retry of the same rung finds its own Job, and its verdict, and runs nothing again.
    (home / "validate-fails").unlink()
    again = climb(kube, kind, request_id="return-gpu1/2")
    assert again.job == failed.job and again.outcome is RungOutcome.FAILED


@pytest.mark.usefixtures("runner")
def test_a_rung_whose_tool_is_missing_is_skipped_and_says_so(kube: KubernetesApi, home: Path) -> None:
    (home / "validate-missing").write_text("dcgm\n")
    result = climb(kube, RungKind.DCGM)
    assert result.outcome is RungOutcome.SKIPPED and result.passed
    assert "its tool is not on gpu1 (exit status 127)" in result.detail


@pytest.mark.usefixtures("runner")
def test_nccl_is_held_to_the_floor_then_to_the_median_of_its_own_passes(kube: KubernetesApi, home: Path) -> None:
    (home / "nccl-busbw").write_text("90\n")
    under = climb(kube, RungKind.NCCL, nccl_floor_gbps=100)
    assert under.outcome is RungOutcome.FAILED and under.figure == 90 and under.threshold == 100
    assert "bus bandwidth 90 GB/s is under the policy's floor (0 of 5 own passes on default so far)" in under.detail
    for n, figure in enumerate([200, 210, 190]):
        (home / "nccl-busbw").write_text(f"{figure}\n")
        ok = climb(kube, RungKind.NCCL, request_id=f"r{n}", nccl_floor_gbps=100, nccl_own_passes=3)
        assert ok.outcome is RungOutcome.PASSED and ok.threshold == 100, ok.detail
    # Three passes of its own: from now on 0.9 of their median (200), not the floor.
    (home / "nccl-busbw").write_text("170\n")
    slow = climb(kube, RungKind.NCCL, request_id="r9", nccl_floor_gbps=100, nccl_own_passes=3)
    assert slow.outcome is RungOutcome.FAILED and slow.threshold == 180, slow.detail
    assert "0.9 of the median 200 GB/s of 3 passes on default" in slow.detail
    kept = json.loads(kube.config_map_data("gpufleet", BASELINES_CONFIG_MAP)["default"])  # type: ignore[index]
    assert [p["gbps"] for p in kept] == [200, 210, 190]  # failures are not baselines


def test_two_writers_of_the_baselines_lose_nothing(kube: KubernetesApi) -> None:
    def add(n: int) -> None:
        for i in range(5):
            kube.update_config_map(
                "gpufleet",
                BASELINES_CONFIG_MAP,
                lambda data, key=f"w{n}-{i}": {**data, "k": json.dumps([*json.loads(data.get("k", "[]")), key])},
            )

    writers = [threading.Thread(target=add, args=(n,)) for n in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    written = json.loads(kube.config_map_data("gpufleet", BASELINES_CONFIG_MAP)["k"])  # type: ignore[index]
    assert sorted(written) == sorted(f"w{n}-{i}" for n in range(2) for i in range(5))


def test_probation_is_labelled_and_ends_only_if_still_the_same(kube: KubernetesApi) -> None:
    acts, env = ValidationActivities(kube), ActivityEnvironment()
    until = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    assert env.run(acts.set_probation, ProbationRequest(node="gpu1", until=until))
    node = kube.get_node("gpu1")
    assert node.labels[PROBATION_LABEL] == "true" and node.annotations[PROBATION_UNTIL_ANNOTATION] == until.isoformat()
    # An older timer leaves a later probation alone; its own ends it.
    assert not env.run(acts.set_probation, ProbationRequest(node="gpu1", ending=until - timedelta(hours=1)))
    assert env.run(acts.set_probation, ProbationRequest(node="gpu1", ending=until))
    node = kube.get_node("gpu1")
    assert PROBATION_LABEL not in node.labels and PROBATION_UNTIL_ANNOTATION not in node.annotations
