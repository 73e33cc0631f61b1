"""A start without a usable cursor does not report again what was most likely handled before.

When the cursor is lost (its folder wiped, the file unreadable) or refused (journalctl no longer
has it), a source reads its log again from the oldest record of the boot (or a file from its
start): every Xid the detector already reported would open or join an incident once more. An
event whose record is older than the detector's start less ``GPUFLEET_DETECTOR_REPLAY_CUTOFF_SECONDS``
(default 300) is skipped and counted; newer ones are reported, and a cursor the reader accepts
still vouches for everything after it, however old.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import yaml

from detector.cursor import CursorFile
from detector.daemon import Detector, KernelLogSource
from detector.follow import KmsgReader
from detector.parse import line_time
from models.policy import Policy
from tests.conftest import gpufleet_cli
from tests.detector.test_journal import DATA, detect_journal, recent, stand_in
from tests.detector.test_kmsg import BOOT, Ring

REAL = Path(__file__).parent / "data" / "real_lines.yaml"


def real_line(family: str, contains: str) -> str:
    """One line of ``data/real_lines.yaml``: the first of ``family`` that contains ``contains``."""
    for entry in yaml.safe_load(REAL.read_text()):
        if entry["family"] == family:
            for line in entry["lines"]:
                if contains in line:
                    return str(line)
    raise LookupError(f"no {family} line with {contains!r}")


def run_once(log: Path, state: Path, **env: str) -> tuple[list[dict[str, object]], str]:
    done = gpufleet_cli(
        "detect", "--kmsg", str(log), "--node", "gpu7", "--dry-run", "--once", "--state-dir", str(state), env=env
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


def test_a_lost_cursor_does_not_replay_old_xids_from_a_log_file(tmp_path: Path) -> None:
    # Real records as dmesg -T and dmesg --time-format iso printed them in 2025, then the same
    # record again as it would be printed now.
    old_119 = real_line("dmesg-T", "Xid (PCI:0000:9b:00): 119, pid=2024380")
    old_13 = real_line("dmesg-iso", "Xid (PCI:0000:38:00): 13")
    now = datetime.now().strftime("%a %b %d %H:%M:%S %Y").replace(" 0", "  ", 1)  # dmesg pads the day
    new_119 = f"[{now}]" + old_119.partition("]")[2]
    log = tmp_path / "kern.log"
    log.write_text(f"{old_119}\n{old_13}\nusb 1-1: new high-speed USB device\n{new_119}\n")
    state = tmp_path / "state"  # empty: the cursor is lost

    events, stderr = run_once(log, state)
    assert [(e["xid"], e["pci"]) for e in events] == [(119, "0000:9b:00")]
    assert "2 event(s) older than the replay cutoff skipped" in stderr
    assert json.loads((state / "kmsg.json").read_text())["offset"] == log.stat().st_size

    # With a window that reaches back to 2025 (or a cursor that vouches for the lines), all count.
    (state / "kmsg.json").unlink()
    events, _ = run_once(log, state, GPUFLEET_DETECTOR_REPLAY_CUTOFF_SECONDS=str(3 * 365 * 86400))
    assert [e["xid"] for e in events] == [119, 13]  # the second 119 folded into the first


def test_a_lost_cursor_does_not_replay_old_xids_of_a_dmesg_uptime_log(tmp_path: Path) -> None:
    # dmesg's own format (and the lab's kernel logs): seconds since boot, from the clock the
    # kernel stamps its records with. One Xid ten minutes old, one just now.
    uptime = time.clock_gettime(time.CLOCK_MONOTONIC)
    line = "NVRM: Xid (PCI:0000:3b:00): {}, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    log = tmp_path / "kern.log"
    log.write_text(f"[{uptime - 600:12.6f}] {line.format(79)}\n[{uptime:12.6f}] {line.format(48)}\n")

    events, stderr = run_once(log, tmp_path / "state")  # no cursor: lost
    assert [e["xid"] for e in events] == [48]
    assert "1 event(s) older than the replay cutoff skipped" in stderr


def test_a_journal_cursor_refused_does_not_replay_the_boot(tmp_path: Path) -> None:
    """journalctl refuses the saved cursor; the restart reads the boot whole (``-n all``): the
    Xids recorded long ago are skipped and said, the one written since is reported."""
    entries = tmp_path / "journal.json"
    old = recent(DATA, tmp_path / "old.json", last_at=time.time() - 3600)  # the recorded boot, ending an hour ago
    entries.write_text(old.read_text())
    last = json.loads(old.read_text().splitlines()[-1])
    newer = {
        **last,
        "__CURSOR": last["__CURSOR"].replace("i=1a4c", "i=1a4d"),
        "__REALTIME_TIMESTAMP": str(int((time.time() - 2) * 1e6)),
        "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 64, pid=2412, name=python3, Row remapping failure",
    }
    with open(entries, "a") as out:
        out.write(json.dumps(newer) + "\n")
    env, _ = stand_in(tmp_path, entries)
    state = tmp_path / "state"
    state.mkdir()
    (state / "journal.json").write_text(json.dumps({"kind": "journal", "cursor": "s=vacuumed;i=1"}))

    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 1 and events == []  # refused: dropped, so that the restart reads the boot
    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 0, stderr
    assert [(e["xid"], e["pci"]) for e in events] == [(64, "0000:3b:00")]
    assert "journal: 3 event(s) older than the replay cutoff skipped" in stderr

    # A cursor the journal accepts vouches for what follows it, however old.
    entries.write_text(old.read_text())
    first = json.loads(old.read_text().splitlines()[0])["__CURSOR"]
    (state / "journal.json").write_text(json.dumps({"kind": "journal", "cursor": first}))
    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 0, stderr
    assert [e["xid"] for e in events] == [48, 79, 13]


async def test_a_deleted_kmsg_cursor_does_not_replay_the_ring_buffer(tmp_path: Path) -> None:
    boot_time = time.time() - 86400  # up a day; a record carries microseconds since boot

    def rec(seq: int, ago: float, message: str) -> bytes:
        return f"4,{seq},{int((time.time() - ago - boot_time) * 1e6)},-;{message}\n".encode()

    ring = Ring(
        rec(1, 86000, "NVRM: GPU at PCI:0000:3b:00: GPU-2f6a3b4c-5d6e-7f80-91a2-b3c4d5e6f708"),
        rec(2, 7200, "NVRM: Xid (PCI:0000:3b:00): 48, pid=2412, name=python3, An uncorrectable double bit error"),
    )
    cursor = CursorFile(tmp_path / "state", "kmsg")

    async def start() -> list[dict[str, object]]:
        """The detector as ``gpufleet detect`` starts it: the cutoff is its start less 300 s."""
        printed: list[str] = []
        detector = Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append)
        kmsg = KmsgReader(
            Path("/dev/kmsg"), read_record=ring.reopen().read, boot_id=BOOT, resume=cursor.load(), boot_time=boot_time
        )
        source = KernelLogSource(kmsg, once=True, cursor=cursor, replay_cutoff=time.time() - 300)
        await detector.run([source], once=True)
        return [json.loads(line) for line in printed]

    assert await start() == []  # a first start: the Xid 48 of two hours ago was handled long ago
    ring.add(rec(3, 1200, "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."))
    # Resumed from the cursor: the 79 of 20 minutes ago came after it (the detector was away).
    assert [e["xid"] for e in await start()] == [79]
    assert cursor.load() == {"kind": "kmsg", "boot_id": BOOT, "seq": 3}

    cursor.path.unlink()  # the cursor is lost
    ring.add(rec(4, 1, "NVRM: Xid (PCI:0000:3b:00): 64, pid=2412, name=python3, Row remapping failure"))
    events = await start()
    assert [e["xid"] for e in events] == [64]  # neither the 48 nor the 79 again
    assert events[0]["gpu_uuid"] == "GPU-2f6a3b4c-5d6e-7f80-91a2-b3c4d5e6f708"


async def test_a_cursor_of_an_earlier_boot_vouches_for_this_boot_whole(tmp_path: Path) -> None:
    """After a reboot the saved cursor is the last boot's: every record of this boot is new,
    however long before the detector's start (a failure at boot, the detector started late)."""
    boot_time = time.time() - 3600
    old = f"4,1,{60 * 1_000_000},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n".encode()
    cursor = CursorFile(tmp_path / "state", "kmsg")
    cursor.save({"kind": "kmsg", "boot_id": "an-earlier-boot", "seq": 812})
    printed: list[str] = []
    kmsg = KmsgReader(
        Path("/dev/kmsg"), read_record=Ring(old).read, boot_id=BOOT, resume=cursor.load(), boot_time=boot_time
    )
    source = KernelLogSource(kmsg, once=True, cursor=cursor, replay_cutoff=time.time() - 300)
    await Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append).run([source], once=True)
    assert [json.loads(line)["xid"] for line in printed] == [79]


async def test_a_damaged_cursor_of_this_boot_vouches_for_nothing(tmp_path: Path) -> None:
    """A cursor of this very boot whose record number cannot be used (damaged, hand-edited) does
    not say where reading stopped: the cutoff holds, and the old Xid is not reported again."""
    boot_time = time.time() - 86400
    old = f"4,1,{int((86400 - 7200) * 1e6)},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
    cursor = CursorFile(tmp_path / "state", "kmsg")
    cursor.save({"kind": "kmsg", "boot_id": BOOT, "seq": "812"})
    printed: list[str] = []
    kmsg = KmsgReader(
        Path("/dev/kmsg"), read_record=Ring(old.encode()).read, boot_id=BOOT, resume=cursor.load(), boot_time=boot_time
    )
    source = KernelLogSource(kmsg, once=True, cursor=cursor, replay_cutoff=time.time() - 300)
    await Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append).run([source], once=True)
    assert printed == []


def test_a_lines_own_time_is_read_from_the_formats_logs_use() -> None:
    utc = "2025-01-21T04:41:44,283302+00:00"
    assert line_time(f"kern  :warn  : {utc} NVRM: Xid ...") == 1737434504.283302
    assert line_time("2025-01-21T04:41:44Z gpu1 kernel: NVRM: Xid ...") == 1737434504.0
    # dmesg's uptime: seconds since the boot given (by default this machine's).
    assert line_time("[ 1843.308145] NVRM: Xid ...", boot=1737430000.0) == 1737430000.0 + 1843.308145
    assert line_time("kern  :warn  : [    3.500000] NVRM: Xid ...", boot=1000.0) == 1003.5
    assert line_time("NVRM: Xid (PCI:0000:3b:00): 79, ...") is None
    local = time.mktime((2025, 2, 23, 16, 24, 18, 0, 0, -1))
    assert line_time("[Sun Feb 23 16:24:18 2025] NVRM: Xid ...") == local
    # Syslog gives no year: the one that puts the line at most a day ahead of now.
    now = time.mktime((2026, 1, 2, 12, 0, 0, 0, 0, -1))
    assert line_time("Dec 31 23:59:59 gpu1 kernel: NVRM: Xid ...", now=now) == time.mktime(
        (2025, 12, 31, 23, 59, 59, 0, 0, -1)
    )
    assert line_time("Jan  2 11:00:00 gpu1 kernel: NVRM: Xid ...", now=now) == time.mktime(
        (2026, 1, 2, 11, 0, 0, 0, 0, -1)
    )
