"""/dev/kmsg records: only the kernel's are believed, a restart resumes after the last one handled.

The device cannot be written reliably from a test (and writing it needs root), so the records
come from ``Ring``, which answers reads the way /dev/kmsg does: one record per read,
BlockingIOError when there is none yet, EPIPE when records were overwritten before being read.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from detector.cursor import CursorFile, Position
from detector.daemon import Detector, KernelLogSource
from detector.follow import KmsgReader
from models.policy import Policy

BOOT = "70ba8bca-3a95-4834-bb51-9162a8ca70f4"


class Ring:
    """What reading /dev/kmsg returns, record by record; ``overrun()`` makes the next read fail with EPIPE."""

    def __init__(self, *records: bytes) -> None:
        self.records: list[bytes | OSError] = list(records)
        self._next = 0

    def add(self, *records: bytes) -> None:
        self.records.extend(records)

    def overrun(self) -> None:
        self.records.append(OSError(errno.EPIPE, "Broken pipe"))

    def reopen(self) -> Ring:
        """A new reader of the same device starts again at the oldest record it holds."""
        return Ring(*(r for r in self.records if isinstance(r, bytes)))

    def read(self) -> bytes:
        if self._next >= len(self.records):
            raise BlockingIOError(errno.EAGAIN, "no new record")
        item = self.records[self._next]
        self._next += 1
        if isinstance(item, OSError):
            raise item
        return item


def record(seq: int, message: str, *, facility: int = 0, level: int = 4) -> bytes:
    return f"{facility << 3 | level},{seq},{seq * 1000},-;{message}\n".encode()


def reader(ring: Ring, resume: Position | None = None) -> KmsgReader:
    return KmsgReader(Path("/dev/kmsg"), read_record=ring.read, boot_id=BOOT, resume=resume)


def test_only_the_kernels_records_are_yielded(caplog: pytest.LogCaptureFixture) -> None:
    ring = Ring(
        record(1, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."),
        record(2, "NVRM: Xid (PCI:0000:5e:00): 79, GPU has fallen off the bus.", facility=1),  # echo > /dev/kmsg
        record(3, "NVRM: Xid (PCI:0000:86:00): 48, forged", facility=3),  # "<30>..." names daemon
        record(4, "usb 1-1: new high-speed USB device number 3 using xhci_hcd", level=6),
    )
    kmsg = reader(ring)
    with caplog.at_level(logging.WARNING, logger="gpufleet.detector"):
        lines = list(kmsg.read_available())
    assert lines == [
        "4,1,1000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "6,4,4000,-;usb 1-1: new high-speed USB device number 3 using xhci_hcd",
    ]
    assert kmsg.stats.untrusted == 2
    assert "dropped record 2 from facility 1 (user), not the kernel" in caplog.text
    assert kmsg.position() == {"kind": "kmsg", "boot_id": BOOT, "seq": 4}  # dropped records are read too


def test_property_lines_after_the_message_are_not_part_of_it() -> None:
    ring = Ring(
        b"4,7,7000,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
    )
    assert list(reader(ring).read_available()) == ["4,7,7000,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE"]


def test_a_cursor_of_this_boot_skips_what_was_handled() -> None:
    ring = Ring(*(record(seq, f"line {seq}") for seq in range(10, 14)))
    kmsg = reader(ring, resume={"kind": "kmsg", "boot_id": BOOT, "seq": 11})
    assert [line.split(";")[1] for line in kmsg.read_available()] == ["line 12", "line 13"]
    assert kmsg.position() == {"kind": "kmsg", "boot_id": BOOT, "seq": 13}


def test_a_cursor_of_another_boot_reads_this_boot_whole() -> None:
    ring = Ring(record(1, "first of this boot"), record(2, "second"))
    kmsg = reader(ring, resume={"kind": "kmsg", "boot_id": "another-boot", "seq": 500})
    assert [line.split(";")[1] for line in kmsg.read_available()] == ["first of this boot", "second"]


def test_records_overwritten_are_said_and_reading_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    ring = Ring(record(1, "one"))
    ring.overrun()
    ring.add(record(9, "nine"))
    kmsg = reader(ring)
    with caplog.at_level(logging.WARNING, logger="gpufleet.detector"):
        assert [line.split(";")[1] for line in kmsg.read_available()] == ["one", "nine"]
    assert "overwrote records before they were read" in caplog.text
    assert kmsg.stats.errors == 1


def test_records_overwritten_while_away_are_said(caplog: pytest.LogCaptureFixture) -> None:
    kmsg = reader(Ring(record(20, "twenty")), resume={"kind": "kmsg", "boot_id": BOOT, "seq": 15})
    with caplog.at_level(logging.WARNING, logger="gpufleet.detector"):
        assert len(list(kmsg.read_available())) == 1
    assert "records 16 to 19 were overwritten while the detector was away" in caplog.text


async def test_a_restart_neither_loses_nor_repeats(tmp_path: Path) -> None:
    ring = Ring(
        record(1, "NVRM: GPU at PCI:0000:3b:00: GPU-2f6a3b4c-5d6e-7f80-91a2-b3c4d5e6f708"),
        record(2, "NVRM: Xid (PCI:0000:3b:00): 48, pid=2412, name=python3, An uncorrectable double bit error"),
        record(3, "systemd[1]: Started Session 7 of User root.", facility=3),
        record(4, "usb 1-1: new high-speed USB device number 3 using xhci_hcd"),
    )
    cursor = CursorFile(tmp_path / "state", "kmsg")

    async def run_once(ring: Ring) -> list[str]:
        printed: list[str] = []
        detector = Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append)
        source = KernelLogSource(reader(ring, resume=cursor.load()), once=True, cursor=cursor)
        await detector.run([source], once=True)
        return printed

    first = await run_once(ring)
    assert len(first) == 1 and '"xid": 48' in first[0]
    assert cursor.load() == {"kind": "kmsg", "boot_id": BOOT, "seq": 4}

    ring.add(
        record(5, "NVRM: Xid (PCI:0000:3b:00): 64, pid=2412, name=python3, Row remapping failure"),
        record(6, "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."),
    )
    second = await run_once(ring.reopen())  # the device again from its oldest record, as after a restart
    assert len(second) == 2
    assert '"xid": 64' in second[0] and '"xid": 79' in second[1]
    # The UUID the driver announced at boot, before the cursor, is still known after the restart.
    assert '"gpu_uuid": "GPU-2f6a3b4c-5d6e-7f80-91a2-b3c4d5e6f708"' in second[0]
    assert cursor.load() == {"kind": "kmsg", "boot_id": BOOT, "seq": 6}
    assert await run_once(ring.reopen()) == []
