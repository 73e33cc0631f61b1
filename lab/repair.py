"""The lab's stand-in for a repair Job's command (``nvidia-smi --gpu-reset``, a reboot).

The lab's nodes are names, so there is nothing to reset: it says what a real node would do and
succeeds, unless the lab was told to make repairs fail (a file ``repair-fails`` in
``$GPUFLEET_HOME``), to watch an incident escalate.

Run as ``python -m lab.repair reset --gpu GPU --node NODE`` or ``python -m lab.repair reboot --node NODE``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.repair", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["reset", "reboot"])
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpu", default="")
    args = parser.parse_args()
    if (Path(os.environ.get("GPUFLEET_HOME", ".gpufleet")) / "repair-fails").exists():
        print(f"{args.what} of {args.node} failed (the lab was told to fail repairs)", flush=True)
        sys.exit(1)
    done = f"GPU {args.gpu} reset" if args.what == "reset" else "rebooted"
    print(f"{args.node}: {done} (lab stand-in)", flush=True)


if __name__ == "__main__":
    main()
