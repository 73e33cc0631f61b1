"""The NVSwitch SXid catalog shipped with the package: which SXids are fatal.

NVIDIA's NVSwitch documentation (the Fabric Manager user guide) classifies each SXid as
fatal (the switch, and the NVLink fabric through it, must be reset: every GPU of the node's
NVLink domain is affected) or non-fatal (logged, corrected or contained). ``sxid_catalog.csv``
keeps that classification, one row per SXid, with where it was documented.
"""

from __future__ import annotations

import csv
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import BaseModel


class SxidEntry(BaseModel):
    """One row of the SXid catalog."""

    sxid: int
    name: str
    severity: Literal["fatal", "non-fatal"]
    notes: str = ""


@cache
def sxid_catalog() -> dict[int, SxidEntry]:
    """The catalog in ``models/sxid_catalog.csv``, keyed by SXid."""
    text = resources.files("models").joinpath("sxid_catalog.csv").read_text(encoding="utf-8")
    return {int(row["sxid"]): SxidEntry.model_validate(row) for row in csv.DictReader(text.splitlines())}
