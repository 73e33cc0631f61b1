"""Parsing the NVIDIA driver's kernel-log lines into Xid reports.

Accepts raw ``/dev/kmsg`` records (``prio,seq,usec,flags;message``), ``dmesg`` and
``dmesg -T`` lines (``[...] message``), ``journalctl -k`` / syslog lines (``... kernel: message``)
and bare messages. Only a driver line (``NVRM:`` at the start of the message) can become an
event; everything else, other NVRM messages included, is ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_PREFIXES = (
    re.compile(r"^\d+,\d+,\d+,[^;]*;"),  # /dev/kmsg
    re.compile(r"^\[[^\]]{1,40}\]\s?"),  # dmesg, dmesg -T
    re.compile(r"^(?:\w{3} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\S+) \S+ kernel: (?:\[[^\]]{1,40}\]\s?)?"),
)
_PCI = r"(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
_MIG = r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?"
_XID = re.compile(rf"^NVRM: Xid \(PCI:{_PCI}{_MIG}\): (?P<xid>\d{{1,5}})(?:, (?P<rest>.*)|,?)$")
_PID = re.compile(r"^pid=(?P<pid>'<unknown>'|<unknown>|\d+)(?:, |$)")
_NAME = re.compile(r"^name=(?P<name>[^,]*)(?:, |$)")
_GPU_AT = re.compile(rf"^NVRM: GPU at PCI:{_PCI}: (?P<uuid>GPU-[0-9a-fA-F-]+)\s*$")
# "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus." and the multi-line
# "NVRM: The NVIDIA GPU 0000:3b:00.0 / (PCI ID: ...) installed in this system has / fallen off the bus ..."
_GPU_NAMED = re.compile(r"^NVRM: (?:The NVIDIA )?GPU (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?\b")
_CONTINUATION_LINES = 4


@dataclass(frozen=True)
class XidReport:
    """One Xid as the driver reported it."""

    xid: int
    pci: str
    message: str
    pid: int | None = None
    process: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    gpu_uuid: str | None = None


def strip_prefix(line: str) -> str:
    """The kernel message without its kmsg/dmesg/journal prefix."""
    line = line.rstrip("\r\n")
    for prefix in _PREFIXES:
        match = prefix.match(line)
        if match:
            return line[match.end() :]
    return line


def parse_xid(message: str) -> XidReport | None:
    """An ``NVRM: Xid (...)`` message as a report, or None when it is not one."""
    match = _XID.match(message)
    if not match:
        return None
    rest = match.group("rest") or ""
    pid: int | None = None
    process: str | None = None
    if pid_match := _PID.match(rest):
        raw = pid_match.group("pid")
        pid = int(raw) if raw.isdigit() else None
        rest = rest[pid_match.end() :]
        if name_match := _NAME.match(rest):
            name = name_match.group("name").strip()
            process = None if name in {"<unknown>", ""} else name
            rest = rest[name_match.end() :]
    return XidReport(
        xid=int(match.group("xid")),
        pci=match.group("pci").lower(),
        message=rest.strip(),
        pid=pid,
        process=process,
        gpu_instance=int(match.group("gi")) if match.group("gi") else None,
        compute_instance=int(match.group("ci")) if match.group("ci") else None,
    )


@dataclass
class KernelLogParser:
    """Stateful parser over a stream of kernel-log lines.

    It remembers PCI -> GPU UUID from ``NVRM: GPU at PCI:...`` lines and joins the
    multi-line "fallen off the bus" message, which the driver prints without an Xid.
    """

    uuids: dict[str, str] = field(default_factory=dict)
    _pending_pci: str | None = None
    _pending_text: list[str] = field(default_factory=list)

    def feed(self, line: str) -> list[XidReport]:
        message = strip_prefix(line)
        if not message.startswith("NVRM: "):
            self._pending_pci = None
            return []
        if at := _GPU_AT.match(message):
            self.uuids[at.group("pci").lower()] = at.group("uuid")
            return []
        if report := parse_xid(message):
            self._pending_pci = None
            return [self._with_uuid(report)]
        if named := _GPU_NAMED.match(message):
            self._pending_pci = named.group("pci").lower()
            self._pending_text = [message[len("NVRM: ") :]]
        elif self._pending_pci is not None and len(self._pending_text) < _CONTINUATION_LINES:
            self._pending_text.append(message[len("NVRM: ") :])
        else:
            self._pending_pci = None
            return []
        text = " ".join(self._pending_text)
        if "fallen off the bus" in text:
            pci = self._pending_pci
            self._pending_pci = None
            assert pci is not None
            return [self._with_uuid(XidReport(xid=79, pci=pci, message=text))]
        return []

    def _with_uuid(self, report: XidReport) -> XidReport:
        uuid = self.uuids.get(report.pci)
        if uuid is None:
            return report
        return XidReport(**{**report.__dict__, "gpu_uuid": uuid})
