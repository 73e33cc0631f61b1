"""The GPU event (an Xid, an NVSwitch SXid, or a failure the driver reports without one)
and the Xid catalog shipped with the package."""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from enum import IntEnum, StrEnum
from functools import cache
from importlib import resources

from pydantic import BaseModel, Field, field_validator, model_validator

from models.names import validate_node_name


class RecoveryAction(IntEnum):
    """nvmlDeviceGpuRecoveryAction_t, also named in the text of Xid 154."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4


# The modes of `gpufleet health-check` (detector/healthcheck.py), which start its event's message.
HEALTH_CHECK_HOOKS = ("prolog", "epilog", "healthcheck")


class GpuEventKind(StrEnum):
    """What the driver reported. Policy looks events up by (kind, code), so an NVSwitch SXid
    never meets the GPU Xid of the same number."""

    XID = "xid"  # NVRM: Xid (PCI:...): N, ...
    SXID = "sxid"  # nvidia-nvswitchN: SXid (PCI:...): N, ... (``pci`` is the switch's)
    BUS_LOST = "bus_lost"  # "GPU ... has fallen off the bus" with no Xid line: acts as Xid 79
    INIT_FAILED = "init_failed"  # RmInitAdapter failed / rm_init_adapter failed: no code
    POWER_CABLE = "power_cable"  # a GPU's auxiliary power cables are not connected: no code
    # A quick check failed (`gpufleet health-check`, from Slurm's Prolog, Epilog or
    # HealthCheckProgram); ``message`` names the check.
    HEALTH_CHECK = "health_check"
    # Silent degradation the NVML source polls for (no Xid); ``message`` says what it read.
    PCIE_LINK = "pcie_link"  # link width below its maximum (generation: only under load)
    CLOCKS_THROTTLED = "clocks_throttled"  # a hardware throttle reason (slowdown, power brake, thermal)
    ROW_REMAP = "row_remap"  # rows remapped pending a reset, or a remapping failure (Ampere and later)
    RETIRED_PAGES = "retired_pages"  # pages retired pending a reset (before Ampere)
    NVLINK_ERRORS = "nvlink_errors"  # NVLink error counters rising
    GPU_MISSING = "gpu_missing"  # fewer GPUs than the node advertises
    FABRIC_MANAGER = "fabric_manager"  # NVSwitch fabric not in service (fabric manager stopped or failed)

    @property
    def has_code(self) -> bool:
        return self in (GpuEventKind.XID, GpuEventKind.SXID, GpuEventKind.BUS_LOST)


BUS_LOST_XID = 79


class XidEvent(BaseModel):
    """One GPU event reported for one node: an Xid, an SXid, or a failure without a code."""

    node: str
    kind: GpuEventKind = GpuEventKind.XID
    xid: int | None = Field(default=None, ge=0, le=65535)
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

    @model_validator(mode="after")
    def _code_matches_kind(self) -> XidEvent:
        if self.kind is GpuEventKind.BUS_LOST and self.xid is None:
            self.xid = BUS_LOST_XID
        if self.kind is GpuEventKind.BUS_LOST and self.xid != BUS_LOST_XID:
            raise ValueError(f"a bus_lost event is Xid {BUS_LOST_XID}, not {self.xid}")
        if self.kind.has_code and self.xid is None:
            raise ValueError(f"a {self.kind.value} event needs its code in 'xid'")
        if not self.kind.has_code and self.xid is not None:
            raise ValueError(f"a {self.kind.value} event has no code; 'xid' must be null")
        return self

    @property
    def gpu_xid(self) -> int | None:
        """The GPU Xid this event counts as (a bus loss is Xid 79); None for SXids and codeless kinds."""
        return self.xid if self.kind in (GpuEventKind.XID, GpuEventKind.BUS_LOST) else None

    @property
    def label(self) -> str:
        """How people name it: "Xid 79", "SXid 22013", "init_failed"."""
        if self.kind is GpuEventKind.XID:
            return f"Xid {self.xid}"
        if self.kind is GpuEventKind.SXID:
            return f"SXid {self.xid}"
        if self.kind is GpuEventKind.BUS_LOST:
            return "bus_lost (Xid 79)"
        return self.kind.value

    @property
    def reason_word(self) -> str:
        """How a drain reason names it: "xid 79" (a bus loss too), "sxid 22013", "init_failed";
        "health_check prolog" (the Slurm hook whose check failed, as its message names it)."""
        if self.gpu_xid is not None:
            return f"xid {self.gpu_xid}"
        if self.kind is GpuEventKind.SXID:
            return f"sxid {self.xid}"
        if self.kind is GpuEventKind.HEALTH_CHECK:
            hook = self.message.split(":", 1)[0].strip()
            if hook in HEALTH_CHECK_HOOKS:
                return f"{self.kind.value} {hook}"
        return self.kind.value


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
