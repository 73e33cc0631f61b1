"""The Xid event and the Xid catalog shipped with the package."""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from enum import IntEnum
from functools import cache
from importlib import resources

from pydantic import BaseModel, Field, field_validator

from models.names import validate_node_name


class RecoveryAction(IntEnum):
    """nvmlDeviceGpuRecoveryAction_t, also named in the text of Xid 154."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4


class XidEvent(BaseModel):
    """One Xid reported for one GPU of one node."""

    node: str
    xid: int = Field(ge=0, le=65535)
    pci: str | None = None
    gpu_uuid: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    pid: int | None = None
    process: str | None = None
    message: str = ""
    source: str = "manual"
    timestamp: datetime = Field(default_factory=lambda: datetime.now(UTC))
    recovery_action: RecoveryAction | None = None

    @field_validator("node")
    @classmethod
    def _node_is_safe(cls, value: str) -> str:
        return validate_node_name(value)


class CatalogEntry(BaseModel):
    """One row of the Xid catalog: the immediate-action bucket NVIDIA documents for the code."""

    xid: int
    name: str
    category: str
    bucket: str
    notes: str = ""


@cache
def xid_catalog() -> dict[int, CatalogEntry]:
    """The catalog in ``models/xid_catalog.csv``, keyed by Xid."""
    text = resources.files("models").joinpath("xid_catalog.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(text.splitlines())
    return {int(row["xid"]): CatalogEntry.model_validate(row) for row in rows}
