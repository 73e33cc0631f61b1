"""Finding the NVIDIA driver's records in kernel logs, wherever a log puts them.

The driver writes a handful of records that matter (``models.xid.GpuEventKind``):

- ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., message`` (older drivers: ``(0000:01:00)``
  without ``PCI:``; MIG adds ``GPU-I:nn GPU-CI:nn``; a redacted ``PCI:...`` is an unknown address;
  the payload after the number may be missing);
- ``nvidia-nvswitchN: SXid (PCI:0000:04:00.0): 22013, ...``, NVSwitch errors, often repeated over
  several lines that carry the same header (``Severity ...``, ``Data {...}``): one event;
- "fallen off the bus" without an Xid line: ``NVRM: GPU at 0000:01:00.0 has fallen off the bus.``,
  ``NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.``, or three lines starting
  ``NVRM: The NVIDIA GPU 0000:3b:00.0`` whose continuation lines may have no ``NVRM:`` of their own;
- ``RmInitAdapter failed!`` / ``rm_init_adapter failed`` (the GPU never came up) and a GPU whose
  auxiliary power cables are not connected.

A record can sit behind any prefix: ``/dev/kmsg`` fields, dmesg and syslog timestamps in any
locale, journald formats, a bare ``kernel:`` tag, a health agent's own prefix, a Markdown fence.
A JSON log record (keys ``MESSAGE``, ``message`` or ``log``) is unwrapped and its text parsed.

A *quotation* of a record never counts. The record is in shell context when the text before it

- starts with a shell prompt (``$ ``, ``# ``, ``user@host:~$ ``, ``[root@host ~]# ``),
- contains one of the commands ``echo``, ``printf``, ``logger``, ``tee`` or a ``grep``,
- or ends with an opening quote right after a word, as an argument is quoted (``--text 'NVRM...``,
  ``said 'NVRM...``; a field's value such as ``XID: "NVRM...``, ``msg="NVRM...`` or a tool's
  ``(54 minutes ago) "NVRM...`` is a wrapper);

and a record logged by a user-space program (a syslog ``program[pid]:`` tag, a ``dmesg --decode``
facility other than ``kern``, a JSON record of another transport or facility) is not the kernel's.

Other numbers in a record's text (``... caused by previous Xid 149``) never replace its own code,
and GSP diagnostics (``_kgspLogXid119``, ``krcRcAndNotifyAllChannels ... critical error 79``) are
not events of their own. Lines without a driver record cost two substring checks: the parser
has to keep up with a chatty kernel and with a replayed journal.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

_HEX_PCI = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
_MIG = r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?"
_XID = re.compile(
    rf"Xid \((?:PCI:(?:(?P<pci>{_HEX_PCI})(?:\.[0-7])?|[.xX:]+)|(?P<bare>{_HEX_PCI})"
    rf"|(?P<busdev>[0-9a-fA-F]{{4}}:[0-9a-fA-F]{{2}})){_MIG}\): "
    r"(?P<xid>\d{1,5})(?:, ?(?P<rest>.*?)|,?)\s*$"
)
_SXID = re.compile(
    rf"^nvidia-nvswitch\d+: SXid \((?:PCI:)?(?:(?P<pci>{_HEX_PCI}(?:\.[0-7])?)|[.xX:]+)\): "
    r"(?P<xid>\d{1,5})(?:, ?(?P<rest>.*?)|,?)\s*$"
)
_SXID_CONTINUATION = ("Severity ", "Data {", "Data:", "Data ")
_PID = re.compile(r"^pid=(?P<pid>'<unknown>'|<unknown>|\d+)(?:, ?|$)")
_NAME = re.compile(r"^name=(?P<name>[^,]*)(?:, ?|$)")
_GPU_AT_UUID = re.compile(rf"^GPU at PCI:(?P<pci>{_HEX_PCI}): (?P<uuid>GPU-[0-9a-fA-F-]+)\s*$")
_BUS_LOST_ONE_LINE = re.compile(
    rf"^GPU (?:at )?(?:PCI:)?(?P<pci>{_HEX_PCI})(?:\.[0-7])?:? (?:GPU )?has fallen off the bus"
)
_BUS_LOST_START = re.compile(rf"^The NVIDIA GPU (?:PCI:)?(?P<pci>{_HEX_PCI})(?:\.[0-7])?\b")
_GPU_NAMED = re.compile(rf"\bGPU (?:at )?(?:PCI:)?(?P<pci>{_HEX_PCI})")
_INIT_FAILED = re.compile(r"RmInitAdapter failed|rm_init_adapter(?:\(\d+\))? failed")
_POWER_CABLE = re.compile(
    r"power (?:cable|connector)s?\b.*\bnot (?:be )?connected|not .*\bpower cables? connected", re.IGNORECASE
)

_ANCHOR = re.compile(r"NVRM: |nvidia-nvswitch\d+: ")
_KMSG_HEADER = re.compile(r"\d+,\d+,\d+,[^;]*;")
_PROMPT = re.compile(r"^\s*(?:\[[\w.-]+@[^\]]*\]|[\w.-]+@[\w.-]+(?::\S*)?)?\s*[$#]\s")
_COMMAND = re.compile(r"(?:^|[\s;&|(`'\"])(?:echo|printf|logger|tee|[ezf]?grep|rg)(?=[\s'\"]|$)")
_PROGRAM_TAG = re.compile(r"\S+\[\d+\]:\s*$")
# dmesg --decode names each record's facility: only "kern" is the kernel's own.
_DECODED_NOT_KERNEL = re.compile(
    r"^\s*(?:user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:\s*[a-z]+\s*:"
)
_QUOTED_ARGUMENT = re.compile(r"[\w.-]\s+$")  # a word, a space, the quote: `said 'NVRM...`, `--text 'NVRM...`
_FENCE = re.compile(r"^\s*```\w*\s*")
_JSON_KEYS = ("MESSAGE", "message", "log")

MAX_CODE = 65535  # Xid and SXid codes are 16-bit
_CONTINUATION_LINES = 4  # a multi-line bus-loss record is three lines; allow one stray between
_RECENT_LINES = 50  # how far back a record's companion (Xid 79, RmInitAdapter) is remembered


@dataclass(frozen=True)
class XidReport:
    """One event as the driver reported it: an Xid, an SXid, or a failure without a code.

    ``kind`` is a ``models.xid.GpuEventKind`` value; ``xid`` is None for kinds without a code;
    ``pci`` is None when the log does not say (a redacted address).
    """

    xid: int | None
    pci: str | None
    message: str
    kind: str = "xid"
    pid: int | None = None
    process: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    gpu_uuid: str | None = None


def in_shell_context(prefix: str) -> bool:
    """Whether a record behind ``prefix`` is a quotation (a command, a prompt, a quoted argument)
    or was logged by a user-space program rather than the kernel."""
    if not prefix:
        return False
    if _PROMPT.match(prefix) or _COMMAND.search(prefix) or _PROGRAM_TAG.search(prefix):
        return True
    if ":" in prefix and _DECODED_NOT_KERNEL.match(prefix):
        return True
    before = prefix.rstrip()
    return before.endswith(("'", '"', "`")) and bool(_QUOTED_ARGUMENT.search(before[:-1]))


def parse_xid(message: str) -> XidReport | None:
    """An ``NVRM: Xid (...)`` message (no prefix) as a report, or None when it is not one."""
    if not message.startswith("NVRM: "):
        return None
    match = _XID.match(message, 6)
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
            process = None if name in {"<unknown>", "'<unknown>'", ""} else name
            rest = rest[name_match.end() :]
    code = int(match.group("xid"))
    if code > MAX_CODE:
        return None  # no such Xid: a garbled line, not a record
    pci = match.group("pci") or match.group("bare")
    if pci is None and match.group("busdev"):  # older drivers: (bus:device), bus in four digits
        bus, device = match.group("busdev").split(":")
        pci = f"0000:{bus[-2:]}:{device}"
    return XidReport(
        xid=code,
        pci=pci.lower() if pci else None,
        message=rest.strip(),
        pid=pid,
        process=process,
        gpu_instance=int(match.group("gi")) if match.group("gi") else None,
        compute_instance=int(match.group("ci")) if match.group("ci") else None,
    )


def journal_text(value: Any) -> str | None:
    """A field as journalctl writes it: a string, byte values (not valid UTF-8), or a list of either
    (the field appears more than once); None for null (too large to show without --all)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(b, int) and 0 <= b <= 255 for b in value):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, list):
        parts = [journal_text(item) for item in value if not isinstance(item, int)]
        return "\n".join(part for part in parts if part is not None) or None
    return None


def marked_user_space(transport: str | None, facility: str | None) -> bool:
    """Whether journald's fields say user space wrote a record: a transport other than "kernel"
    (``logger -t kernel`` gets "syslog") or a facility other than 0 (a write into /dev/kmsg)."""
    return transport not in (None, "kernel") or facility not in (None, "0")


def _unwrap_json(line: str) -> list[str] | None:
    """The kernel text inside a JSON log record, as lines; None when the line is not one.

    A record that says where it came from (journald's ``_TRANSPORT``) counts only from the kernel.
    """
    start, end = line.find("{"), line.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        record = json.loads(line[start : end + 1])
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if marked_user_space(journal_text(record.get("_TRANSPORT")), journal_text(record.get("SYSLOG_FACILITY"))):
        return []
    for key in _JSON_KEYS:
        value = journal_text(record.get(key))
        if value is not None:
            return value.splitlines()
    return None


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
# journald short-iso, dmesg --time-format iso, RFC 5424 syslog: 2025-01-25T10:34:54,859532+00:00
_ISO_TIME = re.compile(
    r"(?P<date>\d{4}-\d{2}-\d{2})[T ](?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,9}))?"
    r"(?P<zone>Z|[+-]\d{2}:?\d{2})?"
)
# dmesg -T: [Mon Aug  5 03:54:13 2024]
_DMESG_T = re.compile(r"\[\w{3} (?P<mon>\w{3}) +(?P<day>\d{1,2}) (?P<time>\d{2}:\d{2}:\d{2}) (?P<year>\d{4})\]")
# RFC 3164 syslog, English month names: Aug  5 03:54:13 host kernel: ...
_SYSLOG_TIME = re.compile(r"(?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) (?P<time>\d{2}:\d{2}:\d{2})\b")
# dmesg's default, journalctl -o short-monotonic: [ 1843.308145], seconds since boot, at the
# line's start or behind a dmesg --decode facility (kern  :warn  : [ 1843.308145] ...).
_UPTIME = re.compile(r"(?:^|:\s+)\[\s*(?P<seconds>\d+\.\d{1,9})\]")
_TIME_SEARCH = 48  # a line's time is near its start: behind a dmesg --decode facility at most


def boot_time() -> float:
    """The Unix time this machine booted, as the kernel's record stamps count from it.

    A kernel record's stamp (dmesg's ``[ 1843.308145]``, /dev/kmsg's microseconds) is read from
    a clock that stops while the machine is suspended, as CLOCK_MONOTONIC does; so boot is taken
    as now less CLOCK_MONOTONIC, not as /proc/stat ``btime`` (now less CLOCK_BOOTTIME, suspend
    included). After a suspend a record older than it is then placed later than it happened,
    never earlier: a record this makes look old is old.
    """
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


def line_time(line: str, *, now: float | None = None, boot: float | None = None) -> float | None:
    """The Unix time a text log line carries at its start, if it says one this parser knows.

    ISO 8601 (journald ``short-iso``, ``dmesg --time-format iso``, RFC 5424; local time when no
    zone is given), ``dmesg -T`` and RFC 3164 syslog with English month names (local time; the
    year is the one that puts the line no more than a day ahead of ``now``). A dmesg uptime
    (``[ 1843.308145]``, seconds since boot) is placed after ``boot`` (default: this machine's,
    ``boot_time()``); a line printed in an earlier boot is then placed later than it was written,
    never earlier.
    """
    head = line[:_TIME_SEARCH]
    if iso := _ISO_TIME.search(head):
        zone = iso.group("zone") or ""
        if zone and zone != "Z" and ":" not in zone:
            zone = f"{zone[:3]}:{zone[3:]}"
        frac = (iso.group("frac") or "0")[:6]
        try:
            stamp = datetime.fromisoformat(f"{iso.group('date')}T{iso.group('time')}.{frac:0<6}{zone}")
        except ValueError:
            return None
        return stamp.timestamp()  # a naive stamp is local time
    if (dmesg := _DMESG_T.match(head)) and dmesg.group("mon") in _MONTHS:
        return _local(int(dmesg.group("year")), dmesg.group("mon"), dmesg.group("day"), dmesg.group("time"))
    if (syslog := _SYSLOG_TIME.match(head)) and syslog.group("mon") in _MONTHS:
        now = time.time() if now is None else now
        year = datetime.fromtimestamp(now).year
        when = _local(year, syslog.group("mon"), syslog.group("day"), syslog.group("time"))
        if when is not None and when > now + 86400:  # December's line read in January
            when = _local(year - 1, syslog.group("mon"), syslog.group("day"), syslog.group("time"))
        return when
    if uptime := _UPTIME.search(head):
        return (boot_time() if boot is None else boot) + float(uptime.group("seconds"))
    return None


def _local(year: int, month: str, day: str, clock: str) -> float | None:
    try:
        return time.mktime(time.strptime(f"{year} {_MONTHS.index(month) + 1} {day} {clock}", "%Y %m %d %H:%M:%S"))
    except (ValueError, OverflowError):
        return None


@dataclass
class KernelLogParser:
    """Stateful parser over a stream of kernel-log lines.

    It remembers PCI -> GPU UUID from ``NVRM: GPU at PCI:...`` lines, joins multi-line records,
    and keeps a record's companion lines (the bus-loss line after an Xid 79, ``rm_init_adapter``
    after ``RmInitAdapter``, an SXid's continuation lines) from counting twice.
    """

    uuids: dict[str, str] = field(default_factory=dict)
    # For sources that vouch for the writer (/dev/kmsg, the journal): the kernel's message must
    # *be* the record, not carry one inside (an audit record quoting ``msg='NVRM: Xid ...'``).
    strict: bool = False
    _line: int = 0
    _pending_pci: str | None = None
    _pending_left: int = 0
    _recent: dict[tuple[str, str | None], int] = field(default_factory=dict)
    _last_sxid: dict[str | None, int] = field(default_factory=dict)  # per switch: its last SXid

    def feed(self, line: str) -> list[XidReport]:
        """The events completed by this line (usually none)."""
        self._line += 1
        if "NVRM" not in line and "nvswitch" not in line:
            if self._pending_left:
                return self._continuation(line)
            return []
        if self.strict:
            return self._strict(line)
        if "{" in line:
            inner = _unwrap_json(line)
            if inner is not None:
                if in_shell_context(line[: line.find("{")]):
                    return []  # a JSON record quoted in a command: `echo '{"MESSAGE": "NVRM..."}'`
                return [report for text in inner for report in self.feed(text)]
        anchor = _ANCHOR.search(line)
        if anchor is None:
            return self._continuation(line) if self._pending_left else []
        reports: list[XidReport] = []
        while anchor is not None:  # a tool's report can carry several records on one line
            following = _ANCHOR.search(line, anchor.end())
            prefix = line[: anchor.start()]
            if "```" in prefix:
                prefix = _FENCE.sub("", prefix)
            if in_shell_context(prefix):
                self._pending_left = 0
                return reports
            message = line[anchor.start() : following.start() if following else len(line)].rstrip()
            if message.startswith("NVRM: "):
                reports += self._driver(message)
            else:
                self._pending_left = 0
                reports += self._nvswitch(message)
            anchor = following
        return reports

    def _strict(self, line: str) -> list[XidReport]:
        header = _KMSG_HEADER.match(line)
        start = header.end() if header else 0
        anchor = _ANCHOR.match(line, start)
        if anchor is None:
            return self._continuation(line) if self._pending_left else []
        message = line[start:].rstrip()
        if message.startswith("NVRM: "):
            return self._driver(message)
        self._pending_left = 0
        return self._nvswitch(message)

    def learn(self, line: str) -> None:
        """Take what a line already handled says about the GPUs (their UUIDs), reporting nothing."""
        start = line.find("NVRM: GPU at PCI:")
        if start >= 0 and (at := _GPU_AT_UUID.match(line[start + 6 :].rstrip())):
            self.uuids[at.group("pci").lower()] = at.group("uuid")

    def _driver(self, message: str) -> list[XidReport]:
        if report := parse_xid(message):
            self._pending_left = 0
            if report.xid == 79 and report.pci:
                self._recent[("xid79", report.pci)] = self._line
            return [self._with_uuid(report)]
        body = message[6:]
        if at := _GPU_AT_UUID.match(body):
            self.uuids[at.group("pci").lower()] = at.group("uuid")
            return []
        if lost := _BUS_LOST_ONE_LINE.match(body):
            self._pending_left = 0
            return self._bus_lost(lost.group("pci").lower(), body)
        if start := _BUS_LOST_START.match(body):
            self._pending_pci = start.group("pci").lower()
            self._pending_left = _CONTINUATION_LINES
            return self._continuation(body) if "fallen off the bus" in body else []
        if "nit" in body and _INIT_FAILED.search(body):
            return self._init_failed(body)
        if "power" in body and _POWER_CABLE.search(body):
            named = _GPU_NAMED.search(body)
            pci = named.group("pci").lower() if named else None
            return [self._with_uuid(XidReport(xid=None, pci=pci, message=body, kind="power_cable"))]
        if self._pending_left:
            return self._continuation(body)
        return []

    def _continuation(self, text: str) -> list[XidReport]:
        self._pending_left -= 1
        if "fallen off the bus" not in text or self._pending_pci is None:
            return []
        pci, self._pending_pci, self._pending_left = self._pending_pci, None, 0
        return self._bus_lost(pci, text.strip())

    def _bus_lost(self, pci: str, text: str) -> list[XidReport]:
        seen = self._recent.get(("xid79", pci))
        if seen is not None and self._line - seen <= _RECENT_LINES:
            return []  # the driver's companion line to the Xid 79 just reported
        return [self._with_uuid(XidReport(xid=79, pci=pci, message=text, kind="bus_lost"))]

    def _init_failed(self, body: str) -> list[XidReport]:
        named = _GPU_NAMED.search(body)
        pci = named.group("pci").lower() if named else None
        if "rm_init_adapter" in body:
            # The companion of the RmInitAdapter line of the same failure (of the same GPU, when
            # both name it; older drivers name none).
            seen = self._recent.get(("init", pci)) or (self._recent.get(("init", None)) if pci is None else None)
            if seen is not None and self._line - seen <= _RECENT_LINES:
                return []
        else:
            self._recent[("init", pci)] = self._line
            self._recent[("init", None)] = self._line
        return [self._with_uuid(XidReport(xid=None, pci=pci, message=body, kind="init_failed"))]

    def _nvswitch(self, message: str) -> list[XidReport]:
        match = _SXID.match(message)
        if not match:
            return []
        pci = match.group("pci").lower() if match.group("pci") else None
        code = int(match.group("xid"))
        if code > MAX_CODE:
            return []
        rest = (match.group("rest") or "").strip()
        same = self._last_sxid.get(pci) == code
        self._last_sxid[pci] = code
        if same and rest.startswith(_SXID_CONTINUATION):
            return []  # the same SXid's severity or data line
        return [XidReport(xid=code, pci=pci, message=rest, kind="sxid")]

    def _with_uuid(self, report: XidReport) -> XidReport:
        uuid = self.uuids.get(report.pci) if report.pci else None
        return report if uuid is None else replace(report, gpu_uuid=uuid)
