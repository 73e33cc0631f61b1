"""Which incident a Slurm drain reason names: a claim resumes a spare only from its own drain."""

from __future__ import annotations

from models.constants import drain_reason, drained_by


def test_a_gpufleet_drain_names_its_incident() -> None:
    reason = drain_reason(event="xid 79", action="REPLACE_NODE", incident_id="lab-spare1-20261205T050000Z")
    assert drained_by(reason) == "lab-spare1-20261205T050000Z"


def test_other_reasons_name_none() -> None:
    assert drained_by("dimm swap by ops") is None
    assert drained_by("Not responding") is None
    assert drained_by("gpufleet: rebalance to inference") is None
    assert drained_by("") is None
    assert drained_by("someone wrote incident x") is None  # not gpufleet's
