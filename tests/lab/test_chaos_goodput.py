"""The chaos run's goodput check reads `gpufleet report --json` as a user would check it."""

from __future__ import annotations

from typing import Any

from lab.chaos.goodput import check_report, incidents_of
from lab.chaos.leftovers import TERMINATED
from models.goodput import Phase


def incident(incident_id: str, seconds: dict[Phase, float], recovery: float) -> dict[str, Any]:
    phases = {phase.value: {"seconds": seconds.get(phase, 0.0), "gpu_seconds": 0.0} for phase in Phase}
    return {"incident_id": incident_id, "phases": phases, "recovery_seconds": recovery}


def document(*incidents: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"incidents": list(incidents), "totals": {"incidents": len(incidents)}, **extra}


def test_every_incident_with_a_ledger_that_adds_up_passes() -> None:
    doc = document(incident("a", {Phase.DETECTION: 2, Phase.DRAIN: 1.5, Phase.RESTART: 10}, 13.5))
    assert check_report(doc, {"a"})["passed"]


def test_an_incident_the_report_left_out_is_named() -> None:
    checked = check_report(document(incident("a", {Phase.DRAIN: 1}, 1)), {"a", "b"})
    assert not checked["passed"]
    assert checked["missing"] == ["b"]


def test_phases_that_do_not_add_up_fail_even_when_the_report_did_not_flag_them() -> None:
    checked = check_report(document(incident("a", {Phase.DRAIN: 1, Phase.GRACE: 2}, 4)), {"a"})
    assert not checked["passed"]
    assert checked["phases_not_adding_up"] == ["a"]


def test_an_incident_without_a_ledger_fails() -> None:
    doc = document(incident("a", {Phase.DRAIN: 1}, 1), without_ledger=[{"workflow_id": "remediate-c-gpu2"}])
    checked = check_report(doc, {"a"})
    assert not checked["passed"]
    assert checked["without_ledger"] == ["remediate-c-gpu2"]


def test_the_incidents_are_read_from_each_scenarios_result() -> None:
    results = [{"incident": "a"}, {"fresh_incident": "b", "incident": ""}, {"incidents": ["c"]}, {"name": "x"}]
    assert incidents_of(results) == {"a", "b", "c"}


def test_the_incident_a_person_terminated_is_expected_without_a_ledger() -> None:
    # incident_terminated_in_grace: the run is terminated in its grace, so it never closes itself
    # and never computes a ledger; the report names it among those without one, as it should.
    results: list[dict[str, Any]] = [
        {"name": "baseline", "incident": "c-gpu1-1"},
        {"name": TERMINATED, "incident": "c-gpu2-2"},
    ]
    expected = incidents_of(results)
    assert expected == {"c-gpu1-1"}
    doc = document(
        incident("c-gpu1-1", {Phase.DRAIN: 1}, 1),
        without_ledger=[{"workflow_id": "remediate-c-gpu2", "status": "TERMINATED"}],
    )
    assert check_report(doc, expected)["passed"]
    # Any other run without a ledger is still a failure.
    doc["without_ledger"].append({"workflow_id": "remediate-c-gpu3", "status": "FAILED"})
    checked = check_report(doc, expected)
    assert not checked["passed"] and checked["without_ledger"] == ["remediate-c-gpu3"]
