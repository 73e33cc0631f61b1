"""Which incident a Slurm drain reason names: a claim resumes a spare only from its own drain."""

from __future__ import annotations

from models.constants import drain_reason, drained_by, drained_by_hook, held_by_someone_else, hook_drain, takes_over
from models.xid import GpuEventKind, XidEvent


def test_a_gpufleet_drain_names_its_incident() -> None:
    reason = drain_reason(event="xid 79", action="REPLACE_NODE", incident_id="lab-spare1-20261205T050000Z")
    assert drained_by(reason) == "lab-spare1-20261205T050000Z"


def test_other_reasons_name_none() -> None:
    assert drained_by("dimm swap by ops") is None
    assert drained_by("Not responding") is None
    assert drained_by("gpufleet: rebalance to inference") is None
    assert drained_by("") is None
    assert drained_by("someone wrote incident x") is None  # not gpufleet's


def test_slurms_prolog_and_epilog_drains_are_taken_over_by_a_health_check_incident_only() -> None:
    """Slurm 22.05 to 26.05 drain a node whose Prolog or Epilog failed with these reasons."""
    for slurms in ("Prolog error", "Epilog error", " prolog error "):
        hook = slurms.strip().lower().split()[0]
        ours = drain_reason(event=f"health_check {hook}", action="REBOOT_NODE", incident_id="lab-gpu1-20261206T100000Z")
        assert hook_drain(slurms)
        assert held_by_someone_else(slurms)  # for any other incident, someone else's hold
        assert takes_over(slurms, ours)
    # a check in another hook did not make this one fail (a drained node runs no prolog)
    incident = "lab-gpu1-20261206T100000Z"
    for other in ("health_check healthcheck", "health_check epilog", "health_check"):
        assert not takes_over("Prolog error", drain_reason(event=other, action="REBOOT_NODE", incident_id=incident))
    ours = drain_reason(event="health_check prolog", action="REBOOT_NODE", incident_id=incident)
    xid = drain_reason(event="xid 79", action="REPLACE_NODE", incident_id="lab-gpu1-20261206T100000Z")
    assert not takes_over("Prolog error", xid)  # an Xid's incident did not make the prolog fail
    assert not takes_over("dimm swap by ops", ours)  # a person's hold stays theirs
    assert not takes_over("Prolog error", "health_check by hand")  # not gpufleet's reason
    assert not hook_drain("Prolog error: see ticket 12")


def test_a_hook_drain_follows_a_health_check_in_that_same_hook_only() -> None:
    assert drained_by_hook("Prolog error", "prolog: gpu_count: NVML sees 1 GPU(s), the node should have 2")
    assert drained_by_hook(" Epilog error ", "epilog: gpu_lost: GPU 1 is lost")
    assert not drained_by_hook("Prolog error", "epilog: gpu_lost: GPU 1 is lost")
    assert not drained_by_hook("Prolog error", "healthcheck: gpu_count: NVML sees 1")  # drains with its own reason
    assert not drained_by_hook("Epilog error", "")
    assert not drained_by_hook("PSU swap", "prolog: nvml")


def test_a_health_checks_drain_reason_names_the_hook_it_failed_in() -> None:
    def word(message: str) -> str:
        return XidEvent(node="gpu1", kind=GpuEventKind.HEALTH_CHECK, message=message).reason_word

    assert word("prolog: gpu_count: NVML sees 1 GPU(s), the node should have 2") == "health_check prolog"
    assert word("epilog: gpu_lost: GPU 1 is lost") == "health_check epilog"
    assert word("healthcheck: nvml: NVML does not answer") == "health_check healthcheck"
    assert word("validation rung quick: gpu_count") == "health_check"  # no hook named: the kind alone
    assert word("") == "health_check"
