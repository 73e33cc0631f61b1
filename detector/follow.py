"""Following a kernel log: a file that grows, rotates or is truncated, or ``/dev/kmsg`` itself."""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

MAX_LINE = 64 * 1024  # a line longer than this is not a kernel record; drop it rather than grow forever


class LogFollower:
    """Yields complete lines appended to ``path``; a partial last line waits for its newline.

    Rotation (the path now names another file) finishes the old file, then starts the new
    one from its beginning; truncation starts over from the beginning.
    """

    def __init__(self, path: Path, *, from_start: bool = False, poll_seconds: float = 0.05) -> None:
        self.path = path
        self._poll = poll_seconds
        self._from_start = from_start
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._offset = 0
        self._partial = b""

    def _open(self, *, at_end: bool) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        info = os.fstat(fd)
        self._fd = fd
        self._inode = (info.st_dev, info.st_ino)
        self._offset = info.st_size if at_end else 0
        self._partial = b""
        return True

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
            *lines, self._partial = data.split(b"\n")
            if len(self._partial) > MAX_LINE:
                self._partial = b""
            for raw in lines:
                yield raw.decode("utf-8", errors="replace")

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
            self._offset = 0  # truncated: start over
            self._partial = b""
            yield from self._drain()

    def follow(self, *, stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        while not stop():
            yield from self.read_available()
            time.sleep(self._poll)

    def close(self) -> None:
        self._close()


class KmsgReader:
    """Records from ``/dev/kmsg``: one record per read; old records skipped unless ``from_start``."""

    def __init__(self, path: Path = Path("/dev/kmsg"), *, from_start: bool = False, poll_seconds: float = 0.05):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if not from_start:
            os.lseek(self._fd, 0, os.SEEK_END)
        self._poll = poll_seconds

    def prime(self) -> None:
        """Already open: the read position was fixed when the device was opened."""

    def read_available(self) -> Iterator[str]:
        while True:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring buffer overwrote records we had not read
                    continue
                raise
            if not record:
                return
            yield record.decode("utf-8", errors="replace").rstrip("\n")

    def follow(self, *, stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        while not stop():
            yield from self.read_available()
            time.sleep(self._poll)

    def close(self) -> None:
        os.close(self._fd)


class StreamReader:
    """Lines from a stream: standard input (``-``) or a named pipe, e.g. ``journalctl -k -f`` piped in."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream

    def prime(self) -> None:
        """A stream has no position to fix: what is written to it from now on is read."""

    def read_available(self) -> Iterator[str]:
        """With --once: everything until the stream ends."""
        for raw in self._stream:
            yield raw[:MAX_LINE].decode("utf-8", errors="replace").rstrip("\n")

    def follow(self, *, stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        for line in self.read_available():
            yield line
            if stop():
                return

    def close(self) -> None:
        self._stream.close()


def open_source(path: Path, *, from_start: bool) -> LogFollower | KmsgReader | StreamReader:
    """The right reader for ``path``: /dev/kmsg, a pipe or standard input (``-``), or a log file."""
    if str(path) == "-":
        return StreamReader(sys.stdin.buffer)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return LogFollower(path, from_start=from_start)
    if stat.S_ISCHR(mode):
        return KmsgReader(path, from_start=from_start)
    if stat.S_ISFIFO(mode):
        return StreamReader(open(path, "rb"))  # the reader owns the pipe until close()
    return LogFollower(path, from_start=from_start)
