"""The parser on real kernel logs: lines users pasted in public reports, every prefix, no quotation.

``data/real_lines.yaml`` holds real records, each with the report it was copied from; the
properties below then put any prefix before a record (same event) and any record into shell
context (nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from detector.parse import KernelLogParser, XidReport
from tests.conftest import gpufleet_cli

DATA = Path(__file__).parent / "data" / "real_lines.yaml"
ENTRIES: list[dict[str, Any]] = yaml.safe_load(DATA.read_text(encoding="utf-8")) if DATA.exists() else []


def events(lines: list[str]) -> list[XidReport]:
    parser = KernelLogParser()
    return [report for line in lines for report in parser.feed(line)]


def entry_id(entry: dict[str, Any]) -> str:
    return f"{entry['family']}:{entry['lines'][0][:60]}"


def test_the_table_covers_every_family() -> None:
    families = {entry["family"] for entry in ENTRIES}
    for needed in [
        "dmesg",
        "dmesg-T",
        "dmesg-iso",
        "syslog",
        "syslog-nohost",
        "locale-month",
        "kernel-tag",
        "wrapped-agent",
        "wrapped-json",
        "markdown",
        "old-driver",
        "no-payload",
        "mig",
        "domain",
        "previous-xid",
        "bus-lost-oneline",
        "bus-lost-multiline",
        "sxid",
        "init-failed",
        "gsp-negative",
        "quotation-negative",
    ]:
        assert needed in families, needed
    assert all(entry.get("source") for entry in ENTRIES), "every line says where it was found"


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry_id(entry) for entry in ENTRIES])
def test_real_line(entry: dict[str, Any]) -> None:
    got = events(entry["lines"])
    expected = entry["expect"] or []
    assert len(got) == len(expected), [report.__dict__ for report in got]
    for report, want in zip(got, expected, strict=True):
        for key, value in want.items():
            assert getattr(report, key) == value, (key, report)


# Canonical records of each kind (shapes from the driver's format strings) and their events.
RECORDS: list[tuple[str, tuple[str, int | None, str | None]]] = [
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.", ("xid", 79, "0000:3b:00")),
    ("NVRM: Xid (PCI:0002:00:00 GPU-I:03): 31, pid=9, name=t, MMU Fault", ("xid", 31, "0002:00:00")),
    ("NVRM: Xid (0000:01:00): 16, Head 00000000 Count 0001a8e6", ("xid", 16, "0000:01:00")),
    ("NVRM: Xid (PCI:0000:1a:00): 79", ("xid", 79, "0000:1a:00")),
    ("NVRM: Xid (PCI:0000:1a:00): 154, GPU recovery action changed from 0x0 (None) to 0x2", ("xid", 154, "0000:1a:00")),
    ("NVRM: GPU at 0000:01:00.0 has fallen off the bus.", ("bus_lost", 79, "0000:01:00")),
    ("NVRM: GPU 0000:3c:00.0: GPU has fallen off the bus.", ("bus_lost", 79, "0000:3c:00")),
    ("nvidia-nvswitch2: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 12 Minion", ("sxid", 22013, "0000:04:00.0")),
    ("NVRM: GPU 0000:07:00.0: RmInitAdapter failed! (0x26:0x56:1474)", ("init_failed", None, "0000:07:00")),
]

_SAFE_PREFIX_TEXT = st.text(
    alphabet=st.characters(
        codec="utf-8",
        exclude_categories=["Cs", "Cc"],
        exclude_characters="'\"`$#{}[]",  # quotes, prompts, JSON and program[pid] tags: tested apart
    ),
    max_size=60,
)
_PREFIXES = st.one_of(
    _SAFE_PREFIX_TEXT,
    st.sampled_from(
        [
            "[ 1843.308145] ",
            "[1234567.000001] ",
            "6,1041,5678901234,-;",
            "[Mon Aug  5 03:54:13 2024] ",
            "Aug  5 03:54:13 gpu-node-7 kernel: [ 12.5] ",
            "Okt 14 09:12:01 kernel: ",
            "kwi 02 11:00:00 host kernel: ",
            "4月 14 09:12:01 host kernel: ",
            "kernel: ",
            "kern  :err   : 2025-01-25T10:34:54,859532+00:00 ",
            "2025-01-25T10:34:54.859532+0000 node kernel: ",
            "[gpu-health] [WARN] 2025-01-25 10:34:54 XID: ",
            "```",
            "```text ",
        ]
    ),
)


@settings(max_examples=300, deadline=None)
@given(prefix=_PREFIXES, record=st.sampled_from(RECORDS))
def test_any_prefix_before_a_record_gives_the_same_event(
    prefix: str, record: tuple[str, tuple[str, int | None, str | None]]
) -> None:
    line, (kind, code, pci) = record
    if any(word in prefix for word in ("echo", "printf", "logger", "tee", "grep", " rg")):
        return  # a command: shell context, tested below
    [report] = events([prefix + line])
    assert (report.kind, report.xid, report.pci) == (kind, code, pci)


SHELL_CONTEXTS = [
    "echo {q}{r}{q}",
    "echo {r}",
    "printf '%s\\n' {q}{r}{q}",
    "logger -t kernel {q}{r}{q}",
    "sudo logger -p kern.err {r}",
    "echo {q}{r}{q} | sudo tee /dev/kmsg",
    "dmesg | grep {q}{r}{q}",
    "grep -rn {q}{r}{q} /var/log/",
    "$ {r}",
    "# {r}",
    "root@gpu-node-7:~# {r}",
    "[root@gpu-node-7 ~]# {r}",
    "user@host:~/logs$ {r}",
    "python3 alert.py --text {q}{r}{q}",
    "Aug  5 03:54:13 gpu-node-7 myscript[4242]: {r}",
    "Dec  2 12:00:00 node sshd[1]: {r}",
    "user  :warn  : 2025-01-25T10:34:54,859532+00:00 {r}",
    "syslog:err   : 2025-05-27T04:18:56,089671+00:00 {r}",
]


@pytest.mark.parametrize(
    "line",
    [
        'echo \'{"MESSAGE": "RECORD", "_TRANSPORT": "kernel"}\'',
        'grep -r \'{"log": "RECORD"}\' /var/log',
        'curl -d \'{"message": "RECORD"}\' http://alerts',
        'myscript[42]: {"log": "RECORD"}',
        '{"MESSAGE": "RECORD", "_TRANSPORT": "kernel", "SYSLOG_FACILITY": "1"}',
        '{"MESSAGE": "RECORD", "_TRANSPORT": "syslog", "SYSLOG_IDENTIFIER": "kernel"}',
    ],
)
def test_a_json_record_quoted_or_from_user_space_is_never_an_event(line: str) -> None:
    assert events([line.replace("RECORD", RECORDS[0][0])]) == []


@settings(max_examples=300, deadline=None)
@given(context=st.sampled_from(SHELL_CONTEXTS), record=st.sampled_from(RECORDS), quote=st.sampled_from(["'", '"']))
def test_a_record_in_shell_context_is_never_an_event(
    context: str, record: tuple[str, tuple[str, int | None, str | None]], quote: str
) -> None:
    line = context.format(q=quote, r=record[0])
    assert events([line]) == []


def test_a_json_record_is_unwrapped_and_only_the_kernels_counts() -> None:
    xid = RECORDS[0][0]
    shipped = json.dumps({"log": f"[ 12.5] {xid}\n", "stream": "stdout", "time": "2025-01-25T10:34:54Z"})
    journal = json.dumps({"MESSAGE": xid, "_TRANSPORT": "kernel", "PRIORITY": "3"})
    forged = json.dumps({"MESSAGE": xid, "_TRANSPORT": "syslog", "SYSLOG_IDENTIFIER": "kernel"})
    assert [r.xid for r in events([shipped])] == [79]
    assert [r.xid for r in events([journal])] == [79]
    assert events([forged]) == []


def test_shapes_no_public_report_showed() -> None:
    """No pasted log had these; they follow the driver's format strings: a redacted address is
    unknown, not "...", and a GPU without its power cables is an event of its own."""
    [redacted] = events(["[ 12.5] NVRM: Xid (PCI:...): 79, pid=1, name=x, GPU has fallen off the bus."])
    assert (redacted.kind, redacted.xid, redacted.pci) == ("xid", 79, None)
    [power] = events(["NVRM: GPU 0000:01:00.0: GPU does not have the necessary power cables connected."])
    assert (power.kind, power.xid, power.pci) == ("power_cable", None, "0000:01:00")
    journal_precise = "2025-01-25T10:34:54.859532+0000 gpu-node-7 kernel: NVRM: Xid (PCI:0000:1a:00): 79"
    assert [(r.xid, r.pci) for r in events([journal_precise])] == [(79, "0000:1a:00")]


def test_companion_lines_count_once_per_gpu_and_other_gpus_still_count() -> None:
    lines = [
        "NVRM: GPU 0000:3b:00.0: GPU does not have the necessary power cables connected.",
        "NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
        "NVRM: GPU 0000:3b:00.0: rm_init_adapter failed, device minor number 0",
        "NVRM: GPU 0000:5e:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
        "NVRM: GPU 0000:5e:00.0: rm_init_adapter failed, device minor number 1",
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
        "NVRM: GPU 0000:86:00.0: GPU has fallen off the bus.",  # another GPU: its own event
    ]
    assert [(r.kind, r.pci) for r in events(lines)] == [
        ("power_cable", "0000:3b:00"),
        ("init_failed", "0000:3b:00"),
        ("init_failed", "0000:5e:00"),
        ("xid", "0000:3b:00"),
        ("bus_lost", "0000:86:00"),
    ]


def test_from_the_kernels_own_sources_the_message_is_the_record() -> None:
    """kmsg and the journal vouch for the writer, so a record must be the whole message: an
    audit record (facility 0 too) quoting one in ``msg='...'`` is not the driver speaking."""
    strict = KernelLogParser(strict=True)
    assert [r.xid for r in strict.feed("4,12,5000,-;" + RECORDS[0][0])] == [79]
    assert [r.xid for r in strict.feed(RECORDS[1][0])] == [31]  # a journal MESSAGE has no header
    audit = "5,13,6000,-;audit: type=1107 audit(1.2:3): pid=1 uid=0 msg='" + RECORDS[0][0] + "'"
    assert strict.feed(audit) == []
    assert [r.xid for r in KernelLogParser().feed(audit)] == [79]  # a text file cannot tell


def test_codes_beyond_16_bits_are_no_record() -> None:
    assert events(["NVRM: Xid (PCI:0000:3b:00): 99999, pid=1, name=x, garbled"]) == []
    assert events(["nvidia-nvswitch0: SXid (PCI:0000:04:00.0): 70000, Fatal, garbled"]) == []


def test_an_sxid_on_one_switch_does_not_hide_anothers() -> None:
    lines = [
        "nvidia-nvswitch0: SXid (PCI:0000:04:00.0): 12028, Non-fatal, Link 1 egress error (First)",
        "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 2 egress error (First)",
        "nvidia-nvswitch0: SXid (PCI:0000:04:00.0): 12028, Severity 0 Engine instance 01 Sub-engine instance 00",
        "nvidia-nvswitch1: SXid (PCI:0000:05:00.0): 12028, Severity 0 Engine instance 02 Sub-engine instance 00",
    ]
    assert [r.pci for r in events(lines)] == ["0000:04:00.0", "0000:05:00.0"]


def test_a_records_own_code_is_never_replaced_by_another_in_its_text() -> None:
    [report] = events(["NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, caused by previous Xid 149, DBE"])
    assert report.xid == 48


def test_the_bus_loss_line_after_an_xid_79_is_the_same_event() -> None:
    lines = [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "NVRM: GPU 0000:3b:00.0: GPU serial number is 1234567890.",
        "NVRM: krcRcAndNotifyAllChannels_IMPL: RC all channels for critical error 79.",
    ]
    assert [(r.kind, r.xid) for r in events(lines)] == [("xid", 79)]


def test_the_three_line_bus_loss_with_bare_continuations() -> None:
    lines = [
        "[ 5.1] NVRM: The NVIDIA GPU 0000:af:00.0",
        "[ 5.1] (PCI ID: 10de:2330) installed in this system has",
        "[ 5.1] fallen off the bus and is not responding to commands.",
    ]
    assert [(r.kind, r.xid, r.pci) for r in events(lines)] == [("bus_lost", 79, "0000:af:00")]


def test_an_sxid_over_several_lines_is_one_event() -> None:
    lines = [
        "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
        "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Severity 0 Engine instance 32 Sub-engine instance 00",
        "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Data {0x00000000, 0x00000000, 0x00000000, 0x00000000}",
        "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 33 egress non-posted PRIV error (First)",
    ]
    assert [(r.kind, r.xid, r.pci) for r in events(lines)] == [("sxid", 12028, "0000:05:00.0")] * 2


DETECT_FIELDS = {
    "node",
    "kind",
    "xid",
    "pci",
    "gpu_uuid",
    "pid",
    "process",
    "message",
    "source",
    "timestamp",
    "action",
}


def test_detect_dry_run_json_keeps_its_fields_and_names_each_kind(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("\n".join(record for record, _ in RECORDS) + "\n")
    done = gpufleet_cli(
        "detect", "--kmsg", str(log), "--node", "gpu7", "--once", "--dry-run", "--json", "--fold-seconds", "0"
    )
    assert done.returncode == 0, done.stderr
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert all(set(record) == DETECT_FIELDS for record in printed)
    assert [(r["kind"], r["xid"], r["pci"]) for r in printed] == [expected for _, expected in RECORDS]
    actions = {(r["kind"], r["xid"]): r["action"] for r in printed}
    assert actions[("bus_lost", 79)] == actions[("xid", 79)] == "REPLACE_NODE"
    assert actions[("init_failed", None)] == "REPLACE_NODE"
