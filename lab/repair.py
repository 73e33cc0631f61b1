"""The lab's stand-in for a repair Job's command: a GPU reset, a reboot, the check afterwards.

The lab's nodes are names, so there is nothing to reset: each says what a real node would do.

- ``reset`` succeeds, and the GPU fault injected on the node is gone (lab/faults.py).
- ``reboot`` (of a node still on ``--boot-id``, when given) does what a real reboot shows the
  API: the node goes NotReady, then Ready again on a new boot ID (``status.nodeInfo.bootID``,
  written as its kubelet would), and the Job's pod dies with it (exit status 143, so the Job
  fails, as a real reboot Job's does). The node's GPU fault is gone too.
- ``check`` (does the GPU answer?) succeeds, unless a GPU fault that breaks the GPU still
  stands on the node (a GPU off the bus or stuck in its firmware does not answer).

Each fails instead when the lab is told so by a file in ``$GPUFLEET_HOME``: ``repair-fails``
(the reset or reboot fails; a reboot then leaves the node up on its old boot ID) or
``check-fails`` (the GPU does not answer), to watch an incident escalate.

Run as ``python -m lab.repair reset|reboot|check --node NODE [--gpu GPU] [--boot-id ID]``, with
``GPUFLEET_LAB_API`` set to the emulated API's URL for a reboot (the lab's Job runner sets it).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

import httpx

from lab.faults import FAULTS_ENV, GpuFaults

KILLED_BY_REBOOT = 143  # SIGTERM, as a container's exit status


def _told_to_fail(what: str) -> bool:
    return (Path(os.environ.get("GPUFLEET_HOME", ".gpufleet")) / what).exists()


def _faults() -> GpuFaults:
    """The lab's GPU faults: ``$GPUFLEET_LAB_FAULTS``, else under ``$GPUFLEET_HOME``."""
    folder = os.environ.get(FAULTS_ENV)
    if folder:
        return GpuFaults(Path(folder))
    return GpuFaults.of_home(Path(os.environ.get("GPUFLEET_HOME", ".gpufleet")))


def _gpu_works_again(node: str) -> str:
    """What the repair did to the node's injected GPU fault, for the Job's last line."""
    return "; its GPU fault is cleared" if _faults().clear(node) else ""


def _set_node(api: str, node: str, *, ready: bool, boot_id: str | None = None) -> None:
    """Write the node's status as its kubelet would: Ready or not, and its boot ID."""
    status: dict[str, object] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if boot_id is not None:
        status["nodeInfo"] = {"bootID": boot_id}
    httpx.patch(
        f"{api}/api/v1/nodes/{node}/status",
        json={"status": status},
        headers={"Content-Type": "application/strategic-merge-patch+json"},
        timeout=10,
    ).raise_for_status()


def _boot_id(api: str, node: str) -> str:
    answer = httpx.get(f"{api}/api/v1/nodes/{node}", timeout=10)
    answer.raise_for_status()
    return str(answer.json().get("status", {}).get("nodeInfo", {}).get("bootID", ""))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.repair", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["reset", "reboot", "check"])
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpu", default="")
    parser.add_argument("--boot-id", default="", help="reboot only a node still on this boot")
    args = parser.parse_args()
    if args.what == "check":
        if _told_to_fail("check-fails"):
            print(f"{args.node}: GPU {args.gpu or '(all)'} does not answer (the lab was told so)", flush=True)
            sys.exit(1)
        fault = _faults().get(args.node)
        if fault is not None and fault.until_repair:
            print(f"{args.node}: GPU {args.gpu or '(all)'} does not answer: {fault.describe()}", flush=True)
            sys.exit(1)
        print(f"{args.node}: GPU {args.gpu or '(all)'} answers (lab stand-in)", flush=True)
        return
    if _told_to_fail("repair-fails"):
        print(f"{args.what} of {args.node} failed (the lab was told to fail repairs)", flush=True)
        sys.exit(1)
    if args.what == "reset":
        print(f"{args.node}: GPU {args.gpu} reset (lab stand-in){_gpu_works_again(args.node)}", flush=True)
        return
    api = os.environ.get("GPUFLEET_LAB_API", "").rstrip("/")
    if not api:
        print("GPUFLEET_LAB_API is not set: the lab's Job runner sets it to the emulated API", flush=True)
        sys.exit(2)
    now = _boot_id(api, args.node)
    if args.boot_id and now != args.boot_id:
        # As the real command's test: this pod outlived the reboot it was made for.
        print(f"{args.node} runs boot {now[:8]}, not {args.boot_id[:8]}: already rebooted, nothing done", flush=True)
        sys.exit(1)
    boot_id = str(uuid.uuid4())
    _set_node(api, args.node, ready=False)
    cleared = _gpu_works_again(args.node)
    _set_node(api, args.node, ready=True, boot_id=boot_id)
    print(f"{args.node}: rebooted onto boot ID {boot_id[:8]} (lab stand-in){cleared}; the pod died with it", flush=True)
    sys.exit(KILLED_BY_REBOOT)


if __name__ == "__main__":
    main()
