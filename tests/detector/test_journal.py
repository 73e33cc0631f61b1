"""The journal as a source: only entries the kernel wrote, resumed after the saved journal cursor.

``data/journal_kernel.json`` is ``journalctl -o json`` output (no ``-k``, so other transports
show) of a node where, between driver records, a user ran ``logger -t kernel "NVRM: Xid ..."``
(transport syslog, GPU 0000:86:00) and root wrote ``kernel: NVRM: Xid ...`` into /dev/kmsg
(transport kernel, facility 1, GPU 0000:af:00). The old driver's three-line "fallen off the bus"
message is three entries; one process name is not UTF-8, so that MESSAGE is a list of byte values.

``gpufleet detect --journal`` is run against a stand-in ``journalctl`` that prints the entries
(after ``--after-cursor`` when given) and records its arguments: this machine has no journald.
The stand-in's entries are the recorded ones moved in time to end a few seconds ago (``recent``),
as a journal read right after it was written; the replay cutoff (a start without a cursor skips
what is older than the detector's start less a few minutes) is tested on them as recorded.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

from detector.follow import JournalReader, parse_journal_entry
from detector.parse import journal_text
from lab.procs import alive, stop, wait_for
from tests.conftest import gpufleet_cli, gpufleet_daemon

DATA = Path(__file__).parent / "data" / "journal_kernel.json"

STAND_IN = """#!{python}
import json, os, signal, sys
args = sys.argv[1:]
with open({calls!r}, "a") as calls:
    calls.write(json.dumps({{"pid": os.getpid(), "args": args}}) + "\\n")
with open({entries!r}, "rb") as entries:
    lines = entries.read().splitlines(keepends=True)
if "--after-cursor" in args:
    cursor = args[args.index("--after-cursor") + 1]
    at = next(i for i, line in enumerate(lines) if json.loads(line)["__CURSOR"] == cursor)
    lines = lines[at + 1 :]
sys.stdout.buffer.write(b"".join(lines))
sys.stdout.flush()
if "-f" in args and {exit_code} == 0:
    signal.pause()  # following: nothing more to say until it is told to stop
sys.exit({exit_code})
"""


def test_only_the_kernels_entries_are_read_each_line_its_own() -> None:
    reader = JournalReader(io.BytesIO(DATA.read_bytes()))
    lines = list(reader.read_available())
    assert [line for line in lines if line.startswith("NVRM: ")] == [
        "NVRM: GPU at PCI:0000:3b:00: GPU-2f6a3b4c-5d6e-7f80-91a2-b3c4d5e6f708",
        "NVRM: GPU Board Serial Number: 1652922012345",
        "NVRM: Xid (PCI:0000:3b:00): 48, pid=2412, name=python3, An uncorrectable double bit error (DBE) has "
        "been detected on GPU in the framebuffer at partition 6, subpartition 0.",
        "NVRM: The NVIDIA GPU 0000:5e:00.0 (PCI ID: 10de:20b0)",
        "NVRM: installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=caf\ufffd, Graphics SM Warp Exception on (GPC 0, TPC 0, "
        "SM 0): Out Of Range Address",
    ]
    assert not any("0000:86:00" in line or "0000:af:00" in line for line in lines)
    assert reader.stats.untrusted == 3  # logger, the /dev/kmsg write, journald's own message
    last = json.loads(DATA.read_text().splitlines()[-1])["__CURSOR"]
    assert reader.position() == {"kind": "journal", "cursor": last}


def test_a_message_may_be_text_bytes_or_several() -> None:
    assert journal_text("NVRM: x") == "NVRM: x"
    assert journal_text(list(b"caf\xc3\xa9")) == "café"
    assert journal_text(list(b"caf\xe9")) == "caf\ufffd"
    assert journal_text(["one", list(b"two")]) == "one\ntwo"
    assert journal_text(None) is None
    assert parse_journal_entry(b"not json") is None
    assert parse_journal_entry(b'["a list"]') is None


def test_a_multi_line_message_is_fed_line_by_line_and_the_cursor_moves_after_it() -> None:
    entry = {"__CURSOR": "s=1;i=2", "_TRANSPORT": "kernel", "SYSLOG_FACILITY": "0", "MESSAGE": "first\nsecond"}
    reader = JournalReader(io.BytesIO(json.dumps(entry).encode() + b"\n"))
    lines = reader.read_available()
    assert next(lines) == "first"
    assert reader.position() is None  # the entry is not handled until its last line is
    assert next(lines) == "second"
    # Once the last line's events are handled the entry is: a save then must not repeat it.
    assert reader.position() == {"kind": "journal", "cursor": "s=1;i=2"}
    assert list(lines) == []


def recent(entries: Path, into: Path, *, last_at: float | None = None) -> Path:
    """``entries`` with every ``__REALTIME_TIMESTAMP`` moved by as much, so that the last is ``last_at``
    (default: 5 seconds ago)."""
    records = [json.loads(line) for line in entries.read_text().splitlines()]
    end = int(records[-1]["__REALTIME_TIMESTAMP"])
    shift = int(((time.time() - 5) if last_at is None else last_at) * 1e6) - end
    for entry in records:
        entry["__REALTIME_TIMESTAMP"] = str(int(entry["__REALTIME_TIMESTAMP"]) + shift)
    into.write_text("".join(json.dumps(entry) + "\n" for entry in records))
    return into


def stand_in(tmp_path: Path, entries: Path, *, exit_code: int = 0) -> tuple[dict[str, str], Path]:
    """A folder with the stand-in journalctl first on PATH, printing ``entries`` moved to end just
    now (``recent``); returns the env and its argument log."""
    if entries == DATA:
        entries = recent(DATA, tmp_path / "recent.json")
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    calls = tmp_path / "journalctl.calls"
    script = folder / "journalctl"
    script.write_text(
        STAND_IN.format(python=sys.executable, calls=str(calls), entries=str(entries), exit_code=exit_code)
    )
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}, calls


def detect_journal(env: dict[str, str], state: Path, *extra: str) -> tuple[int, list[dict[str, object]], str]:
    done = gpufleet_cli(
        "detect", "--journal", "--node", "gpu7", "--dry-run", "--state-dir", str(state), *extra, env=env
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, events, done.stderr


def test_gpufleet_detect_journal_resumes_after_its_cursor(tmp_path: Path) -> None:
    entries = recent(DATA, tmp_path / "journal.json")
    env, calls = stand_in(tmp_path, entries)
    state = tmp_path / "state"

    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 0, stderr
    assert [(e["pci"], e["xid"], e["source"]) for e in events] == [
        ("0000:3b:00", 48, "journal"),
        ("0000:5e:00", 79, "journal"),
        ("0000:3b:00", 13, "journal"),
    ]
    assert events[0]["gpu_uuid"] == "GPU-2f6a3b4c-5d6e-7f80-91a2-b3c4d5e6f708"
    assert events[2]["process"] == "caf\ufffd"
    assert "journal: dropped an entry with transport syslog and facility 1 from 'kernel'" in stderr

    last = json.loads(entries.read_text().splitlines()[-1])
    newer = {
        **last,
        "__CURSOR": last["__CURSOR"].replace("i=1a4c", "i=1a4d"),
        "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 64, pid=2412, name=python3, Row remapping failure",
    }
    with open(entries, "a") as out:
        out.write(json.dumps(newer) + "\n")
    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 0, stderr
    assert [(e["pci"], e["xid"]) for e in events] == [("0000:3b:00", 64)]

    argvs = [json.loads(line)["args"] for line in calls.read_text().splitlines()]
    assert argvs == [
        ["-k", "-o", "json", "-n", "all"],
        ["-k", "-o", "json", "--after-cursor", last["__CURSOR"]],
    ]
    assert json.loads((state / "journal.json").read_text()) == {"kind": "journal", "cursor": newer["__CURSOR"]}


def test_journalctl_ending_while_followed_ends_the_detector(tmp_path: Path) -> None:
    env, calls = stand_in(tmp_path, DATA, exit_code=1)
    code, events, stderr = detect_journal(env, tmp_path / "state")
    assert code == 1
    assert len(events) == 3  # what it printed before it died was handled
    assert stderr.strip().splitlines()[-1] == (
        "error: source journal failed: JournalctlExited: journalctl exited with code 1 (its own message, if any, "
        "is logged above); exiting so the DaemonSet restarts it"
    )
    assert json.loads(calls.read_text())["args"][:4] == ["-k", "-o", "json", "-f"]


def test_a_clean_stop_ends_journalctl_too(tmp_path: Path) -> None:
    env, calls = stand_in(tmp_path, DATA)
    state = tmp_path / "state"
    ready = tmp_path / "ready"
    argv = ["detect", "--journal", "--node", "gpu7", "--dry-run", "--state-dir", str(state), "--ready-file", str(ready)]
    detector = gpufleet_daemon(*argv, env=env)
    try:
        wait_for(lambda: ready.exists() and calls.exists(), timeout=60, what="the detector and its journalctl")
        journalctl = json.loads(calls.read_text())["pid"]
        last = json.loads(DATA.read_text().splitlines()[-1])["__CURSOR"]
        saved = state / "journal.json"
        wait_for(lambda: json.loads(saved.read_text())["cursor"] == last, timeout=30, what="the last entry's cursor")
        assert alive(journalctl)  # still following
        detector.terminate()
        out, err = detector.communicate(timeout=30)
        assert detector.returncode == 0, err
        assert len(out.splitlines()) == 3
        assert not alive(journalctl)
    finally:
        stop([detector.pid])


def test_without_journalctl_the_option_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    done = gpufleet_cli("detect", "--journal", "--dry-run", "--once", env={"PATH": str(empty)})
    assert done.returncode == 2
    assert done.stderr == "error: --journal needs journalctl, which is not on PATH\n"


def test_a_cursor_journalctl_refuses_is_dropped_so_the_restart_works(tmp_path: Path) -> None:
    """A saved cursor the journal no longer has (rotated away, vacuumed): journalctl fails at once.
    The detector says so and forgets the cursor, so the restart reads this boot whole, not fail again."""
    env, calls = stand_in(tmp_path, DATA)
    state = tmp_path / "state"
    state.mkdir()
    (state / "journal.json").write_text(json.dumps({"kind": "journal", "cursor": "s=vacuumed;i=1"}))
    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 1 and events == []
    assert "JournalCursorRejected" in stderr and "cursor" in stderr and "dropped" in stderr
    assert not (state / "journal.json").exists()
    code, events, stderr = detect_journal(env, state, "--once")
    assert code == 0, stderr
    assert len(events) == 3
    assert [json.loads(line)["args"][-2:] for line in calls.read_text().splitlines()] == [
        ["--after-cursor", "s=vacuumed;i=1"],
        ["-n", "all"],
    ]
