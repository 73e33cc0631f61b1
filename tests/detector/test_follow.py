"""Following a log file through appends, partial lines, rotation and truncation."""

from __future__ import annotations

import os
from pathlib import Path

from detector.follow import LogFollower, open_source


def append(path: Path, text: str) -> None:
    with open(path, "a") as out:
        out.write(text)


def test_appends_and_a_partial_last_line(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line\n")
    follower = LogFollower(log)
    assert list(follower.read_available()) == []  # starts at the end by default
    append(log, "one\ntw")
    assert list(follower.read_available()) == ["one"]
    append(log, "o\nthree\n")
    assert list(follower.read_available()) == ["two", "three"]


def test_from_start_reads_what_is_there(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    assert list(LogFollower(log, from_start=True).read_available()) == ["a", "b"]


def test_rotation_finishes_the_old_file_then_reads_the_new(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    follower = LogFollower(log)
    list(follower.read_available())
    append(log, "before rotation\n")
    os.rename(log, tmp_path / "kern.log.1")
    append(tmp_path / "kern.log.1", "late write to the old file\n")
    log.write_text("first of the new file\n")
    assert list(follower.read_available()) == ["before rotation", "late write to the old file", "first of the new file"]
    append(log, "next\n")
    assert list(follower.read_available()) == ["next"]


def test_truncation_starts_over(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    follower = LogFollower(log)
    list(follower.read_available())
    append(log, "a long line before truncation\n")
    assert list(follower.read_available()) == ["a long line before truncation"]
    with open(log, "w") as out:
        out.write("x\n")
    assert list(follower.read_available()) == ["x"]


def test_a_file_that_appears_later_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    follower = open_source(log, from_start=False)
    assert list(follower.read_available()) == []
    log.write_text("hello\n")
    assert list(follower.read_available()) == ["hello"]


def test_a_stream_on_standard_input(tmp_path: Path) -> None:
    from tests.conftest import gpufleet_cli

    stream = (
        "Dec  2 12:00:00 gpu-node-7 kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n"
        "Dec  2 12:00:01 gpu-node-7 kernel: usb 1-1: new device\n"
    )
    done = gpufleet_cli("detect", "--kmsg", "-", "--node", "gpu7", "--dry-run", "--once", stdin=stream)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line] == [done.stdout.strip()]
    assert '"xid": 79' in done.stdout and '"node": "gpu7"' in done.stdout


def test_a_named_pipe(tmp_path: Path) -> None:
    import threading

    fifo = tmp_path / "journal"
    os.mkfifo(fifo)

    def writer() -> None:
        with open(fifo, "w") as out:
            out.write("first\nsecond\n")

    thread = threading.Thread(target=writer)
    thread.start()
    reader = open_source(fifo, from_start=False)
    assert list(reader.read_available()) == ["first", "second"]
    thread.join()
    reader.close()
