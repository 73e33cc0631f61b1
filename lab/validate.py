"""The lab's stand-ins for the validation ladder's rungs (docs/validation.md): the quick health
check, DCGM's diagnostics, NCCL's all-reduce and a site burn-in.

The lab's nodes are names, so nothing is measured: each rung says what a real one would, and
passes unless the lab is told otherwise by files in ``$GPUFLEET_HOME``:

- ``validate-fails``: rung names (quick, dcgm, nccl, site), one a line, that fail (a line
  ``NODE RUNG`` fails it on that node only);
- ``validate-missing``: rung names whose tool is not on the node (exit status 127: skipped);
- ``nccl-busbw``: the bus bandwidth (GB/s) the NCCL rung reports: a number for every node, or
  lines ``NODE GBPS`` (the number alone on a line is the rest's); 180 when there is no file.

The NCCL rung prints nccl-tests' summary line (``# Avg bus bandwidth : 180``), which the lab's
Job runner keeps as the container's termination message, as a real rung's command writes it.

Run as ``python -m lab.validate quick|dcgm|nccl|site --node NODE [--gpus N] [--level L]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_BUSBW = 180.0
TOOL_MISSING = 127


def _home() -> Path:
    return Path(os.environ.get("GPUFLEET_HOME", ".gpufleet"))


def _lines(name: str) -> list[list[str]]:
    path = _home() / name
    if not path.exists():
        return []
    return [line.split() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _named(name: str, node: str, rung: str) -> bool:
    """Whether the knob file ``name`` names this rung, for every node or for this one."""
    return any(words == [rung] or words == [node, rung] for words in _lines(name))


def _busbw(node: str) -> float:
    figure = DEFAULT_BUSBW
    for words in _lines("nccl-busbw"):
        if len(words) == 1:
            figure = float(words[0])
    for words in _lines("nccl-busbw"):
        if len(words) == 2 and words[0] == node:
            return float(words[1])
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.validate", description=__doc__.splitlines()[0])
    parser.add_argument("rung", choices=["quick", "dcgm", "nccl", "site"])
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--level", type=int, default=2)
    args = parser.parse_args()
    node, rung = args.node, args.rung
    if _named("validate-missing", node, rung):
        print(f"{node}: {rung}: command not found (the lab was told its tool is missing)", flush=True)
        sys.exit(TOOL_MISSING)
    if _named("validate-fails", node, rung):
        print(f"{node}: {rung} failed (the lab was told so)", flush=True)
        sys.exit(1)
    if rung == "nccl":
        print(f"# nccl-tests all_reduce_perf on {node}, {args.gpus} GPUs (lab stand-in)", flush=True)
        print(f"# Avg bus bandwidth    : {_busbw(node):g}", flush=True)
        return
    what = {"quick": "health check passed", "dcgm": f"dcgmi diag -r {args.level}: Pass", "site": "burn-in passed"}
    print(f"{node}: {what[rung]} (lab stand-in)", flush=True)


if __name__ == "__main__":
    main()
