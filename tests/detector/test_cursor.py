"""A cursor per source: a restart of the detector over a log file neither loses nor repeats events."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from detector.cursor import CursorFile, Position
from detector.daemon import Detector, KernelLogSource
from detector.follow import LogFollower
from models.policy import Policy
from tests.conftest import gpufleet_cli
from tests.detector.test_follow import append

XID = "NVRM: Xid (PCI:0000:3b:00): {xid}, pid=2412, name=python3, {text}\n"


def test_a_follower_resumes_right_after_the_last_line_it_yielded(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("one\ntwo\nthree\npart")
    first = LogFollower(log, from_start=True)
    lines = first.read_available()
    assert next(lines) == "one"
    assert next(lines) == "two"
    saved = first.position()
    assert saved is not None and saved["offset"] == len("one\ntwo\n")
    first.close()

    second = LogFollower(log, resume=saved)
    assert list(second.read_available()) == ["three"]
    append(log, "ial line\n")
    assert list(second.read_available()) == ["partial line"]


def test_a_file_rotated_while_away_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old\n")
    follower = LogFollower(log, from_start=True)
    assert list(follower.read_available()) == ["old"]
    saved = follower.position()
    follower.close()
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text("written while the detector was away\n")
    # Every line of the new file came after the last one handled: nothing lost, nothing repeated.
    assert list(LogFollower(log, resume=saved).read_available()) == ["written while the detector was away"]


def test_a_file_shorter_than_the_cursor_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a line long enough\n")
    follower = LogFollower(log, from_start=True)
    list(follower.read_available())
    saved = follower.position()
    follower.close()
    log.write_text("short\n")  # truncated, same inode
    assert list(LogFollower(log, resume=saved).read_available()) == ["short"]


def test_an_unreadable_cursor_is_a_first_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cursor = CursorFile(tmp_path, "kmsg")
    cursor.path.write_text('{"kind": "file", "off')
    with caplog.at_level(logging.ERROR, logger="gpufleet.detector"):
        assert cursor.load() is None
    assert f"cursor {cursor.path} is unreadable" in caplog.text
    cursor.save({"kind": "file", "offset": 3})
    assert cursor.load() == {"kind": "file", "offset": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["kmsg.json"]  # no temporary file left behind


def run_once(log: Path, state: Path) -> list[dict[str, object]]:
    done = gpufleet_cli(
        "detect", "--kmsg", str(log), "--node", "gpu7", "--dry-run", "--once", "--state-dir", str(state)
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_gpufleet_detect_twice_over_a_growing_file(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    state = tmp_path / "state"
    log.write_text(XID.format(xid=48, text="An uncorrectable double bit error") + "usb 1-1: new device\n")
    assert [e["xid"] for e in run_once(log, state)] == [48]

    append(log, XID.format(xid=64, text="Row remapping failure") + "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU")
    assert [e["xid"] for e in run_once(log, state)] == [64]  # the last line is not complete yet

    append(log, " has fallen off the bus.\n")
    assert [e["xid"] for e in run_once(log, state)] == [79]
    assert run_once(log, state) == []
    saved = json.loads((state / "kmsg.json").read_text())
    assert saved["kind"] == "file" and saved["offset"] == log.stat().st_size


class RecordingCursor(CursorFile):
    """A real cursor file that also notes, at each save, how many events had been printed."""

    def __init__(self, folder: Path, printed: list[str]) -> None:
        super().__init__(folder, "kmsg")
        self._printed = printed
        self.saves: list[tuple[int, Position]] = []

    def save(self, position: Position) -> None:
        super().save(position)
        self.saves.append((len(self._printed), position))


async def test_a_position_is_saved_only_after_its_events_are_handled(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    lines = ["usb 1-1: new device\n"] * 3 + [XID.format(xid=48, text="DBE")] + ["eth0: link up\n"] * 2
    lines += [XID.format(xid=64, text="Row remapping failure")]
    log.write_text("".join(lines))
    events_before = [sum("NVRM" in line for line in lines[: i + 1]) for i in range(len(lines))]
    ends = [sum(len(line) for line in lines[: i + 1]) for i in range(len(lines))]

    printed: list[str] = []
    cursor = RecordingCursor(tmp_path / "state", printed)
    detector = Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append)
    source = KernelLogSource(LogFollower(log, from_start=True), once=True, cursor=cursor)
    await detector.run([source], once=True)

    assert len(printed) == 2
    for printed_then, position in cursor.saves:
        line = ends.index(position["offset"])
        assert printed_then >= events_before[line], f"saved past line {line} before its event was printed"
    assert cursor.saves[-1][1]["offset"] == log.stat().st_size


async def test_a_burst_of_other_lines_is_not_saved_line_by_line(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("usb 1-1: new device\n" * 5000 + XID.format(xid=48, text="DBE") + "eth0: link up\n" * 5000)
    printed: list[str] = []
    cursor = RecordingCursor(tmp_path / "state", printed)
    detector = Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append)
    await detector.run([KernelLogSource(LogFollower(log, from_start=True), once=True, cursor=cursor)], once=True)
    assert len(printed) == 1
    assert len(cursor.saves) < 20  # one after the event, one at the end, one each half second at most
    assert cursor.saves[-1][1]["offset"] == log.stat().st_size


def test_a_cursor_saved_for_another_log_is_a_first_start(tmp_path: Path) -> None:
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text("one\n")
    follower = LogFollower(first, from_start=True)
    assert list(follower.read_available()) == ["one"]
    saved = follower.position()
    follower.close()
    second.write_text("old line of another log\n")
    assert list(LogFollower(second, resume=saved).read_available()) == []  # from its end
