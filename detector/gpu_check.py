"""``make gpu-check``: the NVML source on this machine's real GPUs.

Lists each GPU's UUID and bus id, confirms Xid event registration, listens for
``--seconds`` (default 30) and reports every event seen: on a healthy machine, none.
Exit status: 0 when NVML answered and every GPU registered, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from detector.nvml import NvmlSource


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m detector.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    source = NvmlSource(wait_ms=500)
    if not source.open():
        print(json.dumps({"nvml": False, "error": "NVML unavailable (no NVIDIA driver?)"}))
        sys.exit(1)
    events = []
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            events += [report.__dict__ for report in source.poll()]
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
        "ok": bool(gpus) and len(registered) == len(gpus),
    }
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
