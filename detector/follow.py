"""Following a kernel log: a file that grows, rotates or is truncated, ``/dev/kmsg`` itself,
a stream, or the systemd journal.

Every reader yields lines and says, through ``position()``, where to resume after the last
line it yielded (None for a stream, which cannot be resumed); ``detector.cursor`` keeps it.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import select
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from detector.cursor import Position
from detector.parse import boot_time as parse_boot_time
from detector.parse import journal_text, marked_user_space

log = logging.getLogger("gpufleet.detector")

MAX_LINE = 64 * 1024  # a line longer than this is not a kernel record; drop it rather than grow forever
DEV_KMSG = Path("/dev/kmsg")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
Idle = Callable[[], None]


def _nothing() -> None:
    """The default ``idle``: nothing to do when caught up."""


@dataclass
class SourceStats:
    """What a reader counts for the metrics; only ever incremented, read from the metrics thread."""

    untrusted: int = 0  # records dropped because the kernel did not write them
    errors: int = 0  # records lost or unreadable, and the failure that ends a source


class LineReader(Protocol):
    """What every reader offers the kernel-log source.

    ``resumed``: reading started from a saved cursor this reader accepted (so every record read
    is one not handled before). ``last_time``: the Unix time the record of the last line yielded
    carries, when the source says it (the kmsg timestamp, the journal's ``__REALTIME_TIMESTAMP``);
    None for text, whose time, if any, is in the line itself.
    """

    stats: SourceStats
    resumed: bool
    last_time: float | None

    def prime(self) -> None: ...

    def read_available(self) -> Iterator[str]: ...

    def follow(self, *, stop: Callable[[], bool], idle: Idle = _nothing) -> Iterator[str]: ...

    def position(self) -> Position | None: ...

    def close(self) -> None: ...


def _polling(
    read_available: Callable[[], Iterator[str]], poll: float, stop: Callable[[], bool], idle: Idle
) -> Iterator[str]:
    """Follow a source that can only be polled: what is there, then ``idle``, then a short sleep."""
    while not stop():
        yield from read_available()
        idle()
        time.sleep(poll)


class WarnEvery:
    """At most one warning per ``seconds``; the next one says how many were held back.

    Anyone who may write a forged record may write a million: the log must not drown.
    """

    def __init__(self, seconds: float = 1.0) -> None:
        self._seconds = seconds
        self._last = -seconds
        self._held = 0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < self._seconds:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like it not shown)"
        self._last, self._held = now, 0
        log.warning("%s", message)


class LogFollower:
    """Yields complete lines appended to ``path``; a partial last line waits for its newline.

    Rotation (the path now names another file) finishes the old file, then starts the new
    one from its beginning; truncation starts over from the beginning.

    ``resume`` (a saved ``position()``) continues right after the last line handled, if the
    path still names that file (same device and inode) and it has not shrunk below it.
    """

    def __init__(
        self,
        path: Path,
        *,
        from_start: bool = False,
        poll_seconds: float = 0.05,
        resume: Position | None = None,
    ) -> None:
        self.path = path
        self._poll = poll_seconds
        self._from_start = from_start
        self._resume = resume
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._offset = 0  # where the next read starts
        self._partial = b""  # the start of a line still waiting for its newline
        self._partial_at = 0  # the file offset of ``_partial``
        self._line_end = 0  # the file offset just after the last line yielded
        self.stats = SourceStats()
        self.resumed = False
        self.last_time: float | None = None

    def _open(self, *, at_end: bool) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        info = os.fstat(fd)
        self._fd = fd
        self._inode = (info.st_dev, info.st_ino)
        self._offset = self._start_offset(info, at_end=at_end)
        self._partial = b""
        self._partial_at = self._line_end = self._offset
        return True

    def _start_offset(self, info: os.stat_result, *, at_end: bool) -> int:
        resume, self._resume = self._resume, None  # only the first file opened can be the cursor's
        if resume is not None and resume.get("path") not in (None, str(self.path)):
            log.info("%s: the saved cursor is for %s, another log: a first start", self.path, resume.get("path"))
            resume = None
        if resume is not None:
            same_file = (resume.get("kind"), resume.get("dev"), resume.get("ino")) == ("file", info.st_dev, info.st_ino)
            offset = resume.get("offset")
            self.resumed = True  # the cursor names this log: whatever is read from here came after it
            if same_file and isinstance(offset, int) and 0 <= offset <= info.st_size:
                log.info("%s: resuming at byte %d, after the last line handled", self.path, offset)
                return offset
            if same_file:
                log.warning("%s: shorter than the saved cursor (truncated since); reading it from its start", self.path)
                return 0
            # Rotated while we were away: every line of the file now at this path came after the
            # last one we handled (had we read any of it, the cursor would name it), so read it all.
            log.info("%s: not the file the saved cursor names (rotated while away): reading it whole", self.path)
            return 0
        return info.st_size if at_end else 0

    def position(self) -> Position | None:
        """Just after the last line yielded, in this very file; None before a file is open."""
        if self._inode is None:
            return None
        dev, ino = self._inode
        return {"kind": "file", "path": str(self.path), "dev": dev, "ino": ino, "offset": self._line_end}

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def _drain(self) -> Iterator[str]:
        assert self._fd is not None
        while True:
            chunk = os.pread(self._fd, 65536, self._offset)
            if not chunk:
                return
            self._offset += len(chunk)
            data = self._partial + chunk
            complete, newline, rest = data.rpartition(b"\n")
            end = self._partial_at
            if newline and complete.isascii():  # the common case: one decode and split per chunk
                for line in complete.decode("ascii").split("\n"):
                    end += len(line) + 1
                    self._line_end = end
                    yield line
            elif newline:
                for raw in complete.split(b"\n"):
                    end += len(raw) + 1
                    self._line_end = end
                    yield raw.decode("utf-8", errors="replace")
            self._partial = rest
            self._partial_at = self._offset - len(self._partial)
            if len(self._partial) > MAX_LINE:
                self._partial = b""
                self._partial_at = self._offset

    def prime(self) -> None:
        """Open the file now, fixing where reading starts (its end, unless ``from_start``).

        A file that does not exist yet is read whole once it appears, so nothing written
        after this call is missed.
        """
        if self._fd is None:
            self._open(at_end=not self._from_start)
            self._from_start = True  # a file that appears later, or a rotated one, is read whole

    def read_available(self) -> Iterator[str]:
        """Every complete line available now (opening, reopening after rotation, as needed)."""
        self.prime()
        if self._fd is None:
            return
        yield from self._drain()
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return
        assert self._fd is not None
        if (current.st_dev, current.st_ino) != self._inode:
            yield from self._drain()  # whatever the old file got before it was rotated away
            self._close()
            if self._open(at_end=False):
                yield from self._drain()
        elif current.st_size < self._offset:
            self._offset = self._partial_at = self._line_end = 0  # truncated: start over
            self._partial = b""
            yield from self._drain()

    def follow(self, *, stop: Callable[[], bool] = lambda: False, idle: Idle = _nothing) -> Iterator[str]:
        """Lines as they are written, until ``stop``; ``idle`` is called each time it has caught up."""
        return _polling(self.read_available, self._poll, stop, idle)

    def close(self) -> None:
        self._close()


FACILITIES = ("kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv", "ftp")


def facility_name(facility: int) -> str:
    """A syslog facility as people write it: 1 is "user", 16 "local0"."""
    if facility < len(FACILITIES):
        return FACILITIES[facility]
    if 16 <= facility <= 23:
        return f"local{facility - 16}"
    return str(facility)


def read_boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id: a kmsg sequence number means something only within one boot."""
    return path.read_text().strip()


class KmsgReader:
    """Records from ``/dev/kmsg``, one per read, starting at the oldest record of this boot still held.

    Only the kernel's own records (facility 0) are yielded. Whoever may write ``/dev/kmsg`` gets
    facility 1 (user), or another one they name, never 0: those records are counted and dropped.

    ``resume`` (a saved ``position()`` of this boot) skips every record up to its sequence number;
    one from another boot is ignored. ``read_record`` replaces reading the device, for tests: it
    behaves as ``os.read`` on ``/dev/kmsg`` does (one record per call, BlockingIOError when there
    is none yet, OSError EPIPE when the ring buffer overwrote records not yet read).
    """

    def __init__(
        self,
        path: Path = DEV_KMSG,
        *,
        resume: Position | None = None,
        boot_id: str | None = None,
        poll_seconds: float = 0.05,
        read_record: Callable[[], bytes] | None = None,
        boot_time: float | None = None,
    ) -> None:
        self.path = path
        self._fd: int | None = None
        # Called with each kernel record skipped as already handled (the parser learns from it).
        self.on_skipped: Callable[[str], None] | None = None
        if read_record is None:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            read_record = functools.partial(os.read, self._fd, 8192)
        self._read_record = read_record
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        # The Unix time of the kernel's clock zero: a record's timestamp counts microseconds from it.
        self._boot_time = parse_boot_time() if boot_time is None else boot_time
        self.last_time: float | None = None
        self.resumed = False
        self._poll = poll_seconds
        self._skip_through = self._resume_seq(resume)  # records up to this one were handled before
        self._seq: int | None = None  # the last record read
        self.stats = SourceStats()
        self._untrusted_warning = WarnEvery()

    def _resume_seq(self, resume: Position | None) -> int | None:
        if resume is None:
            return None
        seq = resume.get("seq")
        if resume.get("kind") == "kmsg" and resume.get("boot_id") == self.boot_id and isinstance(seq, int):
            log.info("%s: resuming after record %d of this boot", self.path, seq)
            self.resumed = True
            return seq
        # A cursor of an earlier boot vouches for this one: nothing of it was handled yet. One of
        # this boot without a usable record number vouches for nothing (the replay cutoff holds).
        boot = resume.get("boot_id")
        self.resumed = resume.get("kind") == "kmsg" and isinstance(boot, str) and boot != self.boot_id
        log.info("%s: the saved cursor is from another boot; reading this boot's records from the oldest", self.path)
        return None

    def prime(self) -> None:
        """Already open: reading starts at the oldest record the kernel still holds."""

    def position(self) -> Position | None:
        """This boot and the last record read (yielded or dropped); None before the first new one."""
        seq = self._seq if self._seq is not None else self._skip_through
        return None if seq is None else {"kind": "kmsg", "boot_id": self.boot_id, "seq": seq}

    def read_available(self) -> Iterator[str]:
        while True:
            try:
                record = self._read_record()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the next read returns the oldest record left
                    self.stats.errors += 1
                    log.warning("%s: the kernel overwrote records before they were read; some are lost", self.path)
                    continue
                raise
            if not record:
                return
            line = self._accept(record)
            if line is not None:
                yield line

    def _accept(self, record: bytes) -> str | None:
        """The record's first line (``prio,seq,usec,flags;message``) if the kernel wrote it and it is new."""
        line = record.split(b"\n", 1)[0].decode("utf-8", errors="replace")  # " KEY=value" lines may follow
        header, semicolon, message = line.partition(";")
        fields = header.split(",")
        if not semicolon or len(fields) < 3 or not fields[0].isdigit() or not fields[1].isdigit():
            self.stats.errors += 1
            log.warning("%s: not a kmsg record, dropped: %.80r", self.path, line)
            return None
        priority, seq = int(fields[0]), int(fields[1])
        if self._skip_through is not None and seq <= self._skip_through:
            if priority >> 3 == 0 and self.on_skipped is not None:
                self.on_skipped(line)  # handled before the restart, but it may name a GPU's UUID
            return None
        if self._seq is None and self._skip_through is not None and seq > self._skip_through + 1:
            self.stats.errors += 1
            log.warning(
                "%s: records %d to %d were overwritten while the detector was away; they are lost",
                self.path,
                self._skip_through + 1,
                seq - 1,
            )
        self._seq = seq
        facility = priority >> 3
        if facility != 0:
            self.stats.untrusted += 1
            self._untrusted_warning.warn(
                f"{self.path}: dropped record {seq} from facility {facility} ({facility_name(facility)}), "
                f"not the kernel: {message[:80]!r}"
            )
            return None
        self.last_time = self._boot_time + int(fields[2]) / 1e6 if fields[2].isdigit() else None
        return line

    def follow(self, *, stop: Callable[[], bool] = lambda: False, idle: Idle = _nothing) -> Iterator[str]:
        """Lines as they are written, until ``stop``; ``idle`` is called each time it has caught up."""
        return _polling(self.read_available, self._poll, stop, idle)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class StreamReader:
    """Lines from a stream: standard input (``-``) or a named pipe, e.g. ``dmesg -w`` piped in.

    A stream has no position to resume from: a restart reads what is written from then on.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.stats = SourceStats()
        self.resumed = False
        self.last_time: float | None = None

    def prime(self) -> None:
        """A stream has no position to fix: what is written to it from now on is read."""

    def position(self) -> Position | None:
        return None

    def read_available(self) -> Iterator[str]:
        """With --once: everything until the stream ends."""
        for raw in self._stream:
            yield raw[:MAX_LINE].decode("utf-8", errors="replace").rstrip("\n")

    def follow(self, *, stop: Callable[[], bool] = lambda: False, idle: Idle = _nothing) -> Iterator[str]:
        for line in self.read_available():
            yield line
            if stop():
                return

    def close(self) -> None:
        self._stream.close()


@dataclass(frozen=True)
class JournalEntry:
    """The fields of one ``journalctl -o json`` entry that decide whether and what to parse."""

    cursor: str | None
    transport: str | None
    facility: str | None
    identifier: str | None
    message: str | None
    realtime: float | None = None  # __REALTIME_TIMESTAMP, as Unix time

    @property
    def from_kernel(self) -> bool:
        """Written by the kernel: journald read it from /dev/kmsg (transport "kernel") with facility 0.

        ``logger -t kernel`` gets transport "syslog" whatever it calls itself, and a record someone
        wrote into /dev/kmsg gets transport "kernel" but a facility other than 0.
        """
        return self.transport == "kernel" and not marked_user_space(self.transport, self.facility)


def parse_journal_entry(raw: bytes) -> JournalEntry | None:
    """One line of ``journalctl -o json`` output; None when it is not a JSON object."""
    try:
        fields = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    return JournalEntry(
        cursor=journal_text(fields.get("__CURSOR")),
        transport=journal_text(fields.get("_TRANSPORT")),
        facility=journal_text(fields.get("SYSLOG_FACILITY")),
        identifier=journal_text(fields.get("SYSLOG_IDENTIFIER")),
        message=journal_text(fields.get("MESSAGE")),
        realtime=_journal_time(fields.get("__REALTIME_TIMESTAMP")),
    )


def _journal_time(value: object) -> float | None:
    """``__REALTIME_TIMESTAMP`` (microseconds since the epoch, as a string) as Unix time."""
    text = journal_text(value)
    return int(text) / 1e6 if text is not None and text.isdigit() else None


class JournalctlMissing(RuntimeError):
    """``--journal`` needs the journalctl command."""


class JournalctlExited(RuntimeError):
    """journalctl stopped while it should have been following the journal, or failed."""


class JournalCursorRejected(JournalctlExited):
    """journalctl failed before any entry after being given a saved cursor: the cursor is bad
    (a journal rotated away or vacuumed), and starting from it again would fail again."""


class JournalReader:
    """Kernel records from ``journalctl -o json`` output: one JSON object per line, from any byte stream.

    Only entries the kernel wrote are kept (``JournalEntry.from_kernel``); the others are counted
    and dropped. Each line of a kept entry's MESSAGE is yielded; ``position()`` is the journal
    cursor of the last entry read. ``process`` is the journalctl writing the stream, if any: its
    end is the end of the stream, and an error unless it was reading without ``-f``.
    """

    def __init__(
        self,
        stream: IO[bytes],
        *,
        process: subprocess.Popen[bytes] | None = None,
        poll_seconds: float = 0.1,
        after_cursor: str | None = None,
    ) -> None:
        self._stream = stream
        self._process = process
        self._after_cursor = after_cursor
        self.resumed = after_cursor is not None  # journalctl refusing it ends the reader
        self.last_time: float | None = None
        self._entries = 0
        self._poll = poll_seconds
        self._cursor: str | None = None
        self._partial = b""
        self.stats = SourceStats()
        self._untrusted_warning = WarnEvery()
        self._malformed_warning = WarnEvery()

    def prime(self) -> None:
        """journalctl's arguments fixed where reading starts."""

    def position(self) -> Position | None:
        return None if self._cursor is None else {"kind": "journal", "cursor": self._cursor}

    def read_available(self) -> Iterator[str]:
        """Everything until the stream ends (with --once, journalctl runs without -f and ends)."""
        for raw in self._stream:
            yield from self._entry_lines(raw)
        self._ended(following=False)

    def follow(self, *, stop: Callable[[], bool] = lambda: False, idle: Idle = _nothing) -> Iterator[str]:
        """Entries as journalctl writes them, until ``stop``; ``idle`` is called while none come.

        Reads the descriptor itself (select, then os.read) so that waiting never blocks ``stop``;
        the stream's own buffer is not used in this mode.
        """
        fd = self._stream.fileno()
        while not stop():
            readable, _, _ = select.select([fd], [], [], self._poll)
            if not readable:
                idle()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self._ended(following=True)
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            if len(self._partial) > MAX_LINE:
                self._partial = b""
            for raw in lines:
                yield from self._entry_lines(raw)

    def _entry_lines(self, raw: bytes) -> Iterator[str]:
        if not raw.strip():
            return
        self._entries += 1
        entry = parse_journal_entry(raw)
        if entry is None:
            self.stats.errors += 1
            self._malformed_warning.warn(f"journal: not a JSON entry, dropped: {raw[:80]!r}")
            return
        if not entry.from_kernel:
            self.stats.untrusted += 1
            self._untrusted_warning.warn(
                f"journal: dropped an entry with transport {entry.transport} and facility {entry.facility} "
                f"from {entry.identifier!r}, not the kernel: {(entry.message or '')[:80]!r}"
            )
        elif entry.message:
            self.last_time = entry.realtime
            *first, last = entry.message.splitlines() or [""]
            yield from first
            if entry.cursor is not None:
                # Set before the last line goes out: the position asked for once that line's
                # events are handled is this entry's, so a crash then does not repeat it.
                self._cursor = entry.cursor
            yield last
            return
        if entry.cursor is not None:
            self._cursor = entry.cursor

    def _ended(self, *, following: bool) -> None:
        if self._process is None:
            return  # a recorded stream simply ends
        code = self._process.wait()
        if code != 0 and self._after_cursor is not None and self._entries == 0:
            raise JournalCursorRejected(f"journalctl exited with code {code} when given the saved cursor")
        if following or code != 0:
            raise JournalctlExited(f"journalctl exited with code {code} (its own message, if any, is logged above)")

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._stream.close()


def journalctl_argv(journalctl: str, *, after_cursor: str | None, follow: bool) -> list[str]:
    """``-k``: kernel records of this boot only. Resuming: after the saved cursor (in this boot, so
    a cursor from an earlier boot reads this boot whole); first start: the whole of this boot."""
    argv = [journalctl, "-k", "-o", "json"]
    if follow:
        argv.append("-f")
    argv += ["--after-cursor", after_cursor] if after_cursor else ["-n", "all"]
    return argv


def open_journal(*, resume: Position | None, follow: bool) -> JournalReader:
    """Start journalctl and read its JSON output; JournalctlMissing when it is not installed."""
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        raise JournalctlMissing("--journal needs journalctl, which is not on PATH")
    cursor = resume.get("cursor") if resume is not None and resume.get("kind") == "journal" else None
    after = cursor if isinstance(cursor, str) else None
    argv = journalctl_argv(journalctl, after_cursor=after, follow=follow)
    log.info("journal: %s", " ".join(argv))
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert process.stdout is not None
    return JournalReader(process.stdout, process=process, after_cursor=after)


def open_source(path: Path, *, from_start: bool, resume: Position | None = None) -> LineReader:
    """The right reader for ``path``: /dev/kmsg, a pipe or standard input (``-``), or a log file.

    ``resume`` is the saved position to continue from, if any (a stream has none).
    """
    if str(path) == "-":
        return StreamReader(sys.stdin.buffer)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return LogFollower(path, from_start=from_start, resume=resume)
    if stat.S_ISCHR(mode):
        return KmsgReader(path, resume=resume)
    if stat.S_ISFIFO(mode):
        return StreamReader(open(path, "rb"))  # the reader owns the pipe until close()
    return LogFollower(path, from_start=from_start, resume=resume)
