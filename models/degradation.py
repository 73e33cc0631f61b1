"""How the detector polls NVML for silent degradation (the policy file's ``degradation:``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from models.numbers import Finite, Whole


class DegradationSettings(BaseModel):
    """What the NVML source reads between Xids, and when it calls a reading a degradation.

    Each degradation is reported once, when it is first seen at ``confirm_polls`` polls in a row;
    not again while it lasts; again once it has cleared at a poll and comes back.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # How often every GPU is read. 0: never (the detector then listens to Xid events only).
    poll_seconds: Finite = Field(default=30.0, ge=0, le=86400)
    # Polls in a row a degradation must be seen at before it is reported: a clock change shows
    # a hardware slowdown for an instant, fabric registration takes a while after boot.
    confirm_polls: Whole = Field(default=2, ge=1, le=100)
    # A GPU this busy (NVML's utilisation, percent) is under load: only then is a PCIe link
    # generation below its maximum a degradation (links drop generation at idle by design).
    load_percent: Whole = Field(default=30, ge=1, le=100)
    # How much one NVLink error counter of one link must rise between two polls to count.
    nvlink_error_rise: Whole = Field(default=1, ge=1, le=10**12)
