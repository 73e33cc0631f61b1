"""The intake's body: a newer detector's fields are ignored, not a reason to refuse the event."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from models.intake import IntakeEvent
from models.xid import XidEvent


def test_fields_a_newer_detector_adds_are_ignored_and_the_event_taken() -> None:
    body = {
        "cluster": "lab",
        "dry_run": False,
        "sent_at": "2026-12-06T16:00:00Z",  # unknown to this intake
        "event": {**json.loads(XidEvent(node="gpu1", xid=79).model_dump_json()), "driver_branch": "580"},
    }
    taken = IntakeEvent.model_validate_json(json.dumps(body))
    assert taken.cluster == "lab" and taken.event.node == "gpu1" and taken.event.gpu_xid == 79


def test_what_it_needs_is_still_checked() -> None:
    with pytest.raises(ValidationError, match="event"):
        IntakeEvent.model_validate_json(json.dumps({"cluster": "lab"}))
    with pytest.raises(ValidationError, match="cluster"):
        IntakeEvent.model_validate_json(
            json.dumps({"cluster": "Not A Name", "event": json.loads(XidEvent(node="gpu1", xid=79).model_dump_json())})
        )
