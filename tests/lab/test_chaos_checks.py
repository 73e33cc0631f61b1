"""What `make chaos` holds a scenario to, without a lab: a fault that did not fire fails it, with
the reason; a job the failure ended that did not run again counts as lost."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from temporalio.service import RPCError, RPCStatusCode

from lab.chaos import (
    CURSOR_LOST,
    POD_PROTECT_BLOCKS,
    RACE,
    SATURATED,
    STORM,
    TERMINATED,
    scenario_names,
    scenarios,
    slinky_scenarios,
)
from lab.chaos.fleet import double_claims, job_lost, leaked_claims, met_gpu_fault
from lab.chaos.leftovers import CONFIGMAP_BAD, config_ok
from lab.chaos.outages import KILL_STEPS, Context, Scenario, kill_worker, operator_drains
from lab.chaos.scenarios import at_or_after, fault_missed
from lab.chaos.slinky import eviction_timeout
from lab.drill import _new_run
from lab.faults import Effect
from lab.fleet import FleetLab, LabConfig, LabError
from models.incident import JobInfo, Step


def context(tmp_path: Path, *fired: str) -> Context:
    return Context(lab=FleetLab(tmp_path, LabConfig()), say=lambda _: None, fired=list(fired))


def test_a_fault_that_never_fired_says_how_far_the_incident_got(tmp_path: Path) -> None:
    scenario = Scenario(name="worker_killed_at_resume", fault=kill_worker, at=Step.RESUME)
    [reason] = fault_missed(scenario, context(tmp_path), [], ["classify", "notify", "closed"])
    assert "never fired" in reason and "resume" in reason and "classify, notify, closed" in reason


def test_a_fault_that_fired_past_its_step_did_not_fire_where_it_says(tmp_path: Path) -> None:
    scenario = Scenario(name="worker_killed_at_classify", fault=kill_worker, at=Step.CLASSIFY)
    [reason] = fault_missed(scenario, context(tmp_path, "worker 1 SIGKILLed"), ["guard"], ["guard"])
    assert reason == "its fault fired at guard: the incident passed classify between two looks"
    assert fault_missed(scenario, context(tmp_path, "worker 1 SIGKILLed"), ["classify"], ["classify"]) == []


def test_a_fault_before_the_xid_must_have_happened(tmp_path: Path) -> None:
    scenario = Scenario(name="operator_drained_before_xid", before=operator_drains, expect_approval=True)
    assert fault_missed(scenario, context(tmp_path), [], []) == ["its fault never fired"]
    assert fault_missed(scenario, context(tmp_path, "gpu1 drained"), [], []) == [
        "the incident never waited for approval"
    ]
    assert fault_missed(scenario, context(tmp_path, "gpu1 drained", "approved"), [], []) == []
    assert fault_missed(Scenario(name="baseline"), context(tmp_path), [], []) == []


def test_a_step_outside_the_order_is_never_at_or_after() -> None:
    assert at_or_after(Step.CHECKPOINT, Step.CHECKPOINT) and at_or_after(Step.RESUME, Step.CHECKPOINT)
    assert not at_or_after(Step.NOTIFY, Step.CHECKPOINT)
    assert not at_or_after(Step.REPAIR, Step.CHECKPOINT)


def test_a_job_is_lost_unless_it_runs_again() -> None:
    assert job_lost(0, JobInfo(job_id=1, state="RUNNING", restarts=1)) == 0
    assert job_lost(0, JobInfo(job_id=1, state="FAILED", restarts=0)) == 1  # ended with its GPU, never requeued
    assert job_lost(0, JobInfo(job_id=1, state="RUNNING", restarts=0)) == 1  # still the run that hung
    assert job_lost(0, JobInfo(job_id=1, state="PENDING", restarts=1)) == 1
    assert job_lost(0, None) == 1


def test_where_a_job_met_its_gpu_fault(tmp_path: Path) -> None:
    lab = FleetLab(tmp_path, LabConfig())
    since = time.time() - 1
    lab.faults.record_hit({"job": 7, "node": "gpu1", "effect": "crash", "at": time.time()})
    lab.faults.record_hit({"job": 7, "node": "gpu2", "effect": "stalled", "at": time.time()})
    lab.faults.record_hit({"job": 8, "node": "gpu2", "effect": "crash", "at": time.time()})
    assert met_gpu_fault(lab, 7, ["gpu1"], "crash", since=since) == []
    assert met_gpu_fault(lab, 7, ["gpu1", "gpu2"], "crash", since=since) == ["gpu2"]
    assert met_gpu_fault(lab, 7, ["gpu1"], "crash", since=time.time() + 60) == ["gpu1"]  # an earlier drill's


def test_the_new_scenarios_are_in_the_full_run_only() -> None:
    full = {scenario.name: scenario for scenario in scenarios(short=False)}
    assert full["job_crashes_with_its_gpu"].effect is Effect.CRASH
    assert full["job_hangs_with_its_gpu"].effect is Effect.HANG
    assert SATURATED == "guard_saturated"
    short = [scenario.name for scenario in scenarios(short=True)]
    assert short == ["worker_killed_at_checkpoint", "webhook_hangs"]


def test_the_leftover_scenarios_are_in_the_full_run_only() -> None:
    full = {scenario.name: scenario for scenario in scenarios(short=False)}
    bad = full[CONFIGMAP_BAD]
    assert bad.before is not None and bad.after is not None and bad.verify is not None
    assert CONFIGMAP_BAD not in {scenario.name for scenario in scenarios(short=True)}
    assert {TERMINATED, CURSOR_LOST} == {"incident_terminated_in_grace", "detector_cursor_lost"}


def test_the_configmaps_health_is_read_from_the_workers_metrics() -> None:
    scrape = (
        "# HELP gpufleet_config_ok 1 while the source's last read was good\n"
        "# TYPE gpufleet_config_ok gauge\n"
        'gpufleet_config_ok{cluster="lab",source="policy_file"} 1\n'
        'gpufleet_config_ok{cluster="lab",source="configmap"} 0\n'
        'gpufleet_config_rejected_total{cluster="lab",source="configmap"} 1\n'
    )
    assert config_ok(scrape, "configmap") == 0
    assert config_ok(scrape, "policy_file") == 1
    assert config_ok(scrape, "elsewhere") is None


def test_the_slinky_flavor_runs_its_own_scenarios() -> None:
    names = scenario_names("slinky")
    assert {f"worker_killed_at_{step.value}" for step in KILL_STEPS} <= names
    assert {
        "slurmrestd_down_30s",
        "operator_down_at_drain_kubernetes",
        "operator_down_at_claim_spare",
        POD_PROTECT_BLOCKS,
        RACE,
    } <= names
    # What needs the default flavor's lab (static nodes, four-node labs of their own) is not there.
    assert not {STORM, SATURATED, TERMINATED, CURSOR_LOST, "slurmctld_stopped_30s"} & names
    # The operator's outage during the claim waits for the Kubernetes drain beside it to be done.
    claim = {s.name: s for s in slinky_scenarios(short=False)}["operator_down_at_claim_spare"]
    assert claim.at is Step.CLAIM_SPARE and claim.once_done is Step.DRAIN_KUBERNETES
    assert [s.name for s in slinky_scenarios(short=True)] == ["worker_killed_at_checkpoint", "slurmrestd_down_30s"]


def test_on_slinky_a_claim_is_used_when_the_partitions_pods_run_on_its_node() -> None:
    # fleet_facts on the slinky flavor: the partition as the Kubernetes nodes its pods run on.
    facts = {
        "claims": {"spare1": "lab-gpu1-1", "spare2": "lab-gpu2-1", "gpu1": None},
        "partition": ["gpu2", "gpu3", "spare1"],
        "slurm_partition": ["lab-train-0", "lab-train-1", "lab-train-2"],
    }
    assert leaked_claims(facts) == 1  # spare2 hosts no pod of the partition
    assert double_claims(facts) == 0
    assert double_claims({**facts, "claims": {"spare1": "lab-gpu1-1", "spare2": "lab-gpu1-1"}}) == 1


def test_a_pod_kept_by_pod_protect_gets_a_short_eviction_timeout_for_its_incident_only(tmp_path: Path) -> None:
    lab = FleetLab(tmp_path, LabConfig(flavor="slinky", slurm="26.05"))
    policy = "remediation:\n  eviction_timeout_seconds: 60\n  grace_seconds: 60\n"
    lab.policy_file.write_text(policy)
    with eviction_timeout(lab, 5):
        assert "  eviction_timeout_seconds: 5\n  grace_seconds: 60\n" in lab.policy_file.read_text()
    assert lab.policy_file.read_text() == policy


class _Opened:
    """A workflow handle whose run starts once ``opened`` is set (what ``describe`` tells of it)."""

    def __init__(self) -> None:
        self.opened = False

    async def describe(self) -> SimpleNamespace:
        if not self.opened:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return SimpleNamespace(start_time=datetime.now(UTC))


def test_the_detection_clock_starts_when_the_outage_ends() -> None:
    """An incident the detector opens 1.5 s after its Xid, 0.5 s after the intake came back: within
    a 1 s detection timeout counted from the return, and out of it counted from the Xid."""

    async def run(held: bool) -> None:
        handle = _Opened()
        since = datetime.now(UTC)
        outage = asyncio.get_running_loop().time() + 1.0

        async def intake_back_then_detected() -> None:
            await asyncio.sleep(1.5)
            handle.opened = True

        opener = asyncio.create_task(intake_back_then_detected())
        try:
            in_outage = (lambda: asyncio.get_running_loop().time() < outage) if held else None
            await _new_run(handle, since=since, timeout=1.0, held=in_outage)
        finally:
            await opener

    asyncio.run(run(held=True))
    with pytest.raises(LabError, match="did not open an incident within 1s"):
        asyncio.run(run(held=False))
