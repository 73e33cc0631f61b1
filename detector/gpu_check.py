"""``make gpu-check``: the NVML source on this machine's real GPUs.

Lists each GPU's UUID and bus id, confirms Xid event registration, reads every GPU's
degradation state (PCIe link, utilisation, clock event reasons, remapped rows or retired
pages, NVLink error counters, fabric registration) and prints what it read, listens for
``--seconds`` (default 30), reads the GPUs again (so that rising NVLink counters show), and
reports every event and degradation seen: on a healthy machine, none.
Exit status: 0 when NVML answered and every GPU registered, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from detector.degradation import GpuReading, degradations, gpu_missing, read_gpu
from detector.nvml import NvmlSource
from models.degradation import DegradationSettings


def _read_all(source: NvmlSource) -> dict[int, GpuReading | str]:
    """Each GPU's reading, or why it could not be read."""
    pynvml = source.library
    readings: dict[int, GpuReading | str] = {}
    for gpu in source.gpus:
        try:
            readings[gpu.index] = read_gpu(pynvml, gpu.handle)
        except pynvml.NVMLError as exc:
            readings[gpu.index] = str(exc)
    return readings


def _degradation_report(
    source: NvmlSource, first: dict[int, GpuReading | str], last: dict[int, GpuReading | str], expect_gpus: int
) -> dict[str, Any]:
    settings = DegradationSettings()
    pynvml = source.library
    per_gpu = []
    for gpu in source.gpus:
        before, now = first.get(gpu.index), last.get(gpu.index)
        if not isinstance(now, GpuReading):
            per_gpu.append({"index": gpu.index, "uuid": gpu.uuid, "error": now})
            continue
        found = degradations(
            now,
            before if isinstance(before, GpuReading) else None,
            settings,
            error_text=lambda status: str(pynvml.nvmlErrorString(status)),
        )
        per_gpu.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "pci": gpu.pci,
                "read": now.as_dict(),
                "degradations": [{"kind": d.kind.value, "message": d.message} for d in found],
            }
        )
    missing = gpu_missing(len(source.gpus), expect_gpus)
    return {
        "gpu_count": len(source.gpus),
        "expected_gpus": expect_gpus or None,
        "node": [{"kind": missing.kind.value, "message": missing.message}] if missing else [],
        "gpus": per_gpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m detector.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--expect-gpus", type=int, default=0, help="the GPUs this node should have (0: unchecked)")
    args = parser.parse_args()
    source = NvmlSource(wait_ms=500)
    if not source.open():
        print(json.dumps({"nvml": False, "error": "NVML unavailable (no NVIDIA driver?)"}))
        sys.exit(1)
    events = []
    deadline = time.monotonic() + args.seconds
    try:
        first = _read_all(source)
        while time.monotonic() < deadline:
            events += [report.__dict__ for report in source.poll()]
        degradation = _degradation_report(source, first, _read_all(source), args.expect_gpus)
    finally:
        gpus = [{"index": g.index, "uuid": g.uuid, "pci": g.pci} for g in source.gpus]
        registered = list(source.registered)
        source.close()
    result = {
        "nvml": True,
        "gpus": gpus,
        "registered_for_xid_events": registered,
        "listened_seconds": args.seconds,
        "events": events,
        "degradation": degradation,
        "ok": bool(gpus) and len(registered) == len(gpus),
    }
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
