"""Every driver line format becomes the right Xid; nothing else ever does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detector.parse import KernelLogParser, parse_xid

FORMATS = [
    # (line, xid, pci, pid, process, message start)
    (
        "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        79,
        "0000:01:00",
        None,
        None,
        "GPU has fallen off the bus.",
    ),
    (
        "NVRM: Xid (PCI:0000:b5:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
        "(GPC 1, TPC 3, SM 0): Out Of Range Address",
        13,
        "0000:b5:00",
        None,
        None,
        "Graphics SM Warp Exception on (GPC 1",
    ),
    (
        "NVRM: Xid (PCI:0000:66:00): 32, pid=2280636, name=train.3, Channel ID 0000000d intr0 00040000",
        32,
        "0000:66:00",
        2280636,
        "train.3",
        "Channel ID 0000000d",
    ),
    (
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
        63,
        "0000:10:1c",
        1896,
        None,
        "Row Remapper: New row marked for remapping, reset gpu",
    ),
    (
        "NVRM: Xid (PCI:0000:3B:00): 48, pid=77, name=python3, An uncorrectable double bit error (DBE) has been "
        "detected on GPU in the framebuffer at partition 6, subpartition 0.",
        48,
        "0000:3b:00",
        77,
        "python3",
        "An uncorrectable double bit error",
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 119, Timeout after 6s of waiting for RPC response from GPU0 GSP!",
        119,
        "0000:3b:00",
        None,
        None,
        "Timeout after 6s",
    ),
]

PREFIXES = [
    "",
    "3,1234,5678901234,-;",
    "[ 1234.567890] ",
    "[Wed Dec  2 12:00:00 2026] ",
    "Dec  2 12:00:00 gpu-node-7 kernel: ",
    "2026-12-02T12:00:00.123456+00:00 gpu-node-7 kernel: [ 99.000001] ",
]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(("line", "xid", "pci", "pid", "process", "message"), FORMATS)
def test_driver_formats(
    prefix: str, line: str, xid: int, pci: str, pid: int | None, process: str | None, message: str
) -> None:
    [report] = KernelLogParser().feed(prefix + line + "\n")
    assert (report.xid, report.pci, report.pid, report.process) == (xid, pci, pid, process)
    assert report.message.startswith(message)


def test_mig_instances() -> None:
    gi = parse_xid("NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 31, pid=5, name=a, MMU Fault: ENGINE GRAPHICS")
    assert gi is not None and (gi.gpu_instance, gi.compute_instance, gi.xid) == (2, None, 31)
    ci = parse_xid("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:03): 43, pid=9, name=b, Ch 00000010")
    assert ci is not None and (ci.gpu_instance, ci.compute_instance, ci.xid) == (1, 3, 43)


def test_pci_to_uuid_from_the_driver_announcement() -> None:
    parser = KernelLogParser()
    assert parser.feed("NVRM: GPU at PCI:0000:3b:00: GPU-1f2e3d4c-aaaa-bbbb-cccc-0123456789ab") == []
    [report] = parser.feed("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    assert report.gpu_uuid == "GPU-1f2e3d4c-aaaa-bbbb-cccc-0123456789ab"


def test_fallen_off_the_bus_without_an_xid_line() -> None:
    parser = KernelLogParser()
    [one] = parser.feed("[ 5.1] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")
    assert (one.xid, one.pci) == (79, "0000:3b:00")
    lines = [
        "NVRM: The NVIDIA GPU 0000:af:00.0",
        "NVRM: (PCI ID: 10de:2330) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
    ]
    reports = [r for line in lines for r in parser.feed(line)]
    assert [(r.xid, r.pci) for r in reports] == [(79, "0000:af:00")]


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "NVRM: Xid (PCI:0000:3b:00): ",
        "NVRM: Xid (PCI:0000:3b:00)",
        "NVRM: Xid (PCI:0000:3b): 79, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:3b:00): seventy-nine, pid=1",
        "nvidia-smi: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "echo NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "audit: user said 'NVRM: Xid (PCI:0000:3b:00): 79, fallen off the bus'",
        "Dec  2 12:00:00 node sshd[1]: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "",
        "\x00\xff garbage",
    ],
)
def test_lines_that_must_not_match(line: str) -> None:
    assert KernelLogParser().feed(line) == []


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_or_invent(data: bytes) -> None:
    parser = KernelLogParser()
    for line in data.decode("utf-8", errors="replace").splitlines() or [""]:
        for report in parser.feed(line):
            # Anything reported comes from a driver line that names this Xid and this GPU.
            assert "NVRM: " in line
            assert report.pci in line.lower()
            assert str(report.xid) in line or "fallen off the bus" in line


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([f[0] for f in FORMATS]),
    st.integers(min_value=0, max_value=200),
    st.sampled_from(["", "x", "(", ")", ",", ":", " ", "\x00", "NVRM: ", "Xid", "99999"]),
)
def test_mutated_driver_lines_never_invent_an_xid(line: str, position: int, insert: str) -> None:
    position = min(position, len(line))
    mutated = line[:position] + insert + line[position:]
    reports = KernelLogParser().feed(mutated)
    for report in reports:
        # The Xid reported is the number written after the PCI field of the (mutated) line.
        assert f"): {report.xid}" in mutated
        assert report.pci in mutated.lower()
