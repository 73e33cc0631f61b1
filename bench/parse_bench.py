"""The detector's own figures for ``make bench``: parse throughput and idle CPU.

Throughput is measured on one core over a large log of realistic kernel chatter (network,
filesystem, audit, USB, systemd lines behind dmesg, syslog, journald and kmsg prefixes), once
with no driver record at all and once with one driver line in a thousand (Xids, SXids,
bus losses, the driver's ordinary NVRM lines). Building the log is not timed. Two figures: the
parser alone, and the detector's whole kernel-log source (the file read from disk, decoded,
split, parsed, its cursor kept). Idle CPU is a real ``gpufleet detect`` process following an
empty kernel log, measured from ``/proc``.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from detector.cursor import CursorFile
from detector.daemon import KernelLogSource
from detector.follow import LogFollower
from detector.parse import KernelLogParser
from lab.procs import spawn, stop, wait_for

_PREFIXES = [
    "[{up:>12.6f}] ",
    "6,{seq},{usec},-;",
    "Dec  3 06:{m:02d}:{s:02d} gpu-node-{n} kernel: [{up:>12.6f}] ",
    "2026-12-03T06:{m:02d}:{s:02d}.{us:06d}+00:00 gpu-node-{n} kernel: ",
    "kern  :info  : 2026-12-03T06:{m:02d}:{s:02d},{us:06d}+00:00 ",
]
_CHATTER = [
    "mlx5_core 0000:{b:02x}:00.0: mlx5e_cmd_out_err: port {n} link is up, 400Gbps",
    "EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
    'audit: type=1400 audit({up:.3f}:{seq}): apparmor="STATUS" operation="profile_load" name="runc"',
    "IPv6: ADDRCONF(NETDEV_CHANGE): veth{seq:x}: link becomes ready",
    "cni0: port {n}(veth{seq:x}) entered forwarding state",
    "usb 1-{n}: new high-speed USB device number {seq} using xhci_hcd",
    "systemd[1]: Started session-{seq}.scope - Session {seq} of User slurm.",
    "nvme nvme{n}: I/O {seq} QID {n} timeout, completion polled",
    "Out of memory: Killed process {seq} (python) total-vm:{usec}kB",
    "perf: interrupt took too long ({n}501 > {n}500), lowering kernel.perf_event_max_sample_rate",
]
_DRIVER = [
    "NVRM: Xid (PCI:0000:{b:02x}:00): 79, pid={seq}, name=python, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:{b:02x}:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception",
    "NVRM: Xid (PCI:0000:{b:02x}:00 GPU-I:0{n}): 31, pid={seq}, name=train, MMU Fault: ENGINE GRAPHICS",
    "nvidia-nvswitch{n}: SXid (PCI:0000:{b:02x}:00.0): 12028, Non-fatal, Link {n} egress non-posted PRIV error",
    "NVRM: GPU 0000:{b:02x}:00.0: GPU has fallen off the bus.",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "NVRM: GPU at PCI:0000:{b:02x}:00: GPU-1f2e3d4c-aaaa-bbbb-cccc-0123456789ab",
]
_EVENT_TEMPLATES = 5  # the first five _DRIVER lines are events; the last two are ordinary lines


def mixed_log(lines: int, *, driver_every: int = 0, seed: int = 7) -> tuple[list[str], int]:
    """``lines`` kernel-log lines and how many events they hold (a driver line every
    ``driver_every`` lines; 0: none). Each driver event names a different bus, so none is a
    companion of another."""
    rng = random.Random(seed)
    out: list[str] = []
    events = 0
    for index in range(lines):
        fields = {
            "up": index * 0.0137,
            "seq": index,
            "usec": index * 13_700,
            "m": index // 60 % 60,
            "s": index % 60,
            "us": index % 1_000_000,
            "n": index % 8,
            "b": (index // max(driver_every, 1)) % 256,
        }
        prefix = rng.choice(_PREFIXES).format(**fields)
        if driver_every and index % driver_every == driver_every - 1:
            template = (index // driver_every) % len(_DRIVER)
            out.append(prefix + _DRIVER[template].format(**fields))
            events += template < _EVENT_TEMPLATES
        else:
            out.append(prefix + rng.choice(_CHATTER).format(**fields))
    return out, events


def parse_throughput(lines: int) -> dict[str, Any]:
    """Lines per second through the parser on this core, without and with driver lines."""
    result: dict[str, Any] = {"lines": lines}
    for name, every in (("non_driver", 0), ("mixed_1_in_1000", 1000)):
        log, expected = mixed_log(lines, driver_every=every)
        parser = KernelLogParser()
        feed = parser.feed
        found = 0
        started = time.process_time()
        for line in log:
            if feed(line):
                found += 1
        seconds = time.process_time() - started
        result[name] = {
            "lines_per_second": round(lines / seconds) if seconds else None,
            "cpu_seconds": round(seconds, 3),
            "events": found,
            "events_expected": expected,
        }
    result["target_non_driver_lines_per_second"] = 1_000_000
    return result


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def detector_idle_cpu(seconds: float, *, home: Path) -> dict[str, Any]:
    """CPU a real detector uses while its kernel log is quiet (percent of one core)."""
    log = home / "idle-kern.log"
    log.write_text("")
    ready = home / "idle-detector.ready"
    argv = [sys.executable, "-m", "workers.entry", "detect", "--kmsg", str(log), "--node", "idle1", "--dry-run"]
    env = {**os.environ, "GPUFLEET_HOME": str(home)}
    detector = spawn([*argv, "--ready-file", str(ready)], log=home / "idle-detector.log", env=env)
    try:
        wait_for(ready.exists, timeout=60, what="the detector")
        before, started = _cpu_seconds(detector), time.monotonic()
        time.sleep(seconds)  # the measurement itself: the detector left alone
        used, elapsed = _cpu_seconds(detector) - before, time.monotonic() - started
    finally:
        stop([detector])
    return {"seconds": round(elapsed, 1), "cpu_percent_of_one_core": round(100 * used / elapsed, 2)}


def main() -> None:
    """``python -m bench.parse_bench``: the two figures alone, as JSON."""
    import json

    with tempfile.TemporaryDirectory(prefix="gpufleet-parse-bench-") as tmp:
        home = Path(tmp)
        figures = {
            "parse": parse_throughput(1_000_000),
            "source": source_throughput(1_000_000, home=home),
            "idle": detector_idle_cpu(10, home=home),
        }
        print(json.dumps(figures))


if __name__ == "__main__":
    main()


def source_throughput(lines: int, *, home: Path) -> dict[str, Any]:
    """Lines per second through the detector's whole kernel-log source on one core: the file
    read from disk, decoded, split, parsed, and its cursor kept (CPU time, start-up excluded)."""
    log, _ = mixed_log(lines)
    path = home / "source-kern.log"
    path.write_text("\n".join(log) + "\n")
    source = KernelLogSource(
        LogFollower(path, from_start=True), once=True, cursor=CursorFile(home / "source-state", "kmsg")
    )
    started = time.process_time()
    source.run(lambda report, name: None, threading.Event(), lambda: None)
    seconds = time.process_time() - started
    return {"lines": lines, "cpu_seconds": round(seconds, 3), "lines_per_second": round(lines / seconds)}
