"""``gpufleet health-check``: the quick GPU checks for Slurm's Prolog, Epilog and HealthCheckProgram.

They ask NVML whether it answers, whether it sees as many GPUs as the node should have,
whether each of them answers (none lost), and whether one's memory repair (a row remapping, a
page retirement) waits for a GPU reset or failed. They take a few tens of milliseconds: this module
imports the standard library, pynvml and the detector's inbox writer only (no pydantic, no
Temporal, no Kubernetes client), and ``workers/command.py`` runs it before gpufleet's other
commands are imported.

A failure drops a ``health_check`` event naming the check into the node's detector inbox
(detector/inbox.py), which sends it on the detector's own way (the intake, or Temporal), so the
slurmd container needs no credential. Then, by mode:

- ``prolog``, ``epilog``: exit 1; Slurm drains the node ("Prolog error", "Epilog error") and
  requeues a prolog's job, and gpufleet's incident takes that drain as its own;
- ``healthcheck``: Slurm ignores a HealthCheckProgram's exit status, so the node is drained here
  (``scontrol update``, reason ``gpufleet: health_check ...``) and the exit status is 0.

docs/health-check.md has the slurm.conf lines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from detector.inbox import default_inbox, write_event

MODES = ("prolog", "epilog", "healthcheck")
# How many GPUs this node should have, when --gpus is not given (0: a node without GPUs).
GPUS_ENV = "GPUFLEET_NODE_GPUS"
SOURCE = "health-check"
# gpufleet's drain reasons start so (models.constants.DRAIN_REASON_PREFIX; not imported: it pulls
# in Temporal's search attribute types, too slow for a prolog).
DRAIN_REASON_PREFIX = "gpufleet:"
_NODE_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Failure:
    """One check that failed: its name, what it read, and the GPU where there is one."""

    check: str
    message: str
    gpu_uuid: str | None = None
    pci: str | None = None


# A further check: given pynvml and the GPUs' handles, the failures it finds. Checks added here
# (e.g. the degradation NVML reports) run after the built-in ones, within the same NVML session.
Check = Callable[[Any, list[Any]], list[Failure]]
EXTRA_CHECKS: list[Check] = []


@dataclass
class Result:
    """What the checks found: the failures (empty: healthy) and a line for the log."""

    failures: list[Failure]
    said: str


def run_checks(expected: int | None, *, extra: Sequence[Check] = ()) -> Result:
    """Run the checks against NVML.

    Args:
        expected: how many GPUs the node should have; None: unknown (the count is not checked, and
            a node where NVML cannot load passes, saying so); 0: a node without GPUs (nothing to
            check).
        extra: further checks (``EXTRA_CHECKS`` by default from the command).
    """
    if expected == 0:
        return Result([], "no GPUs configured on this node: nothing to check")
    try:
        import pynvml
    except ImportError:  # the image has it; a bare node may not
        return _no_nvml(expected, "pynvml is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return _no_nvml(expected, f"NVML does not answer ({exc}): no NVIDIA driver, or it is not loaded")
    try:
        return _with_nvml(pynvml, expected, extra)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _no_nvml(expected: int | None, why: str) -> Result:
    if expected is None:
        return Result([], f"{why}; the node's GPU count is unknown (--gpus, {GPUS_ENV}), so this is not a failure")
    return Result([Failure("nvml", f"{why}; the node should have {expected} GPU(s)")], why)


def _with_nvml(pynvml: Any, expected: int | None, extra: Sequence[Check]) -> Result:
    failures: list[Failure] = []
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        return Result([Failure("nvml", f"NVML cannot count the GPUs: {exc}")], "NVML cannot count the GPUs")
    if expected is not None and count != expected:
        failures.append(Failure("gpu_count", f"NVML sees {count} GPU(s), the node should have {expected}"))
    handles = []
    answered: list[tuple[int, str | None, Any]] = []
    for index in range(count):
        pci = None
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pci = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            _text(pynvml.nvmlDeviceGetUUID(handle))  # a GPU that fell off answers no UUID
        except pynvml.NVMLError as exc:
            lost = isinstance(exc, pynvml.NVMLError_GpuIsLost)
            failures.append(
                Failure(
                    "gpu_lost" if lost else "gpu_answers",
                    f"GPU {index}{f' ({pci})' if pci else ''} {'is lost' if lost else 'does not answer'}: {exc}",
                    pci=pci,
                )
            )
            continue
        handles.append(handle)
        answered.append((index, pci, handle))
    failures.extend(_memory(pynvml, answered))
    for check in extra:
        try:
            failures.extend(check(pynvml, handles))
        except pynvml.NVMLError as exc:
            failures.append(Failure(getattr(check, "__name__", "check"), f"NVML failed: {exc}"))
    said = f"{count} GPU(s) answer" if not failures else "; ".join(f"{f.check}: {f.message}" for f in failures)
    return Result(failures, said)


def _memory(pynvml: Any, answered: Sequence[tuple[int, str | None, Any]]) -> list[Failure]:
    """Each GPU's memory repair, as detector/degradation.py reads it: a row remapping (Ampere and
    later) or a page retirement (before) that waits for a GPU reset, or a remapping that failed.
    Until the reset, the GPU runs on with the bad memory; a job would meet it. A GPU or driver
    without either call, or whose NVML errs on it, passes this check (the others have judged it)."""
    failures = []
    for index, pci, handle in answered:
        where = f"GPU {index}{f' ({pci})' if pci else ''}"
        rows = _optional(pynvml, "nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            _corrected, _uncorrected, pending, failed = rows
            if failed:
                failures.append(Failure("row_remap", f"{where}: a row remapping failed (replace the GPU)", pci=pci))
            elif pending:
                failures.append(Failure("row_remap", f"{where}: a row remapping waits for a GPU reset", pci=pci))
            continue
        if _optional(pynvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle):
            failures.append(Failure("retired_pages", f"{where}: a page retirement waits for a GPU reset", pci=pci))
    return failures


def _optional(pynvml: Any, name: str, *args: Any) -> Any:
    """``pynvml.name(*args)``; None where the GPU, the driver or pynvml lacks it, or NVML errs."""
    function = getattr(pynvml, name, None)
    if function is None:
        return None
    try:
        return function(*args)
    except pynvml.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def event_for(node: str, mode: str, failures: Sequence[Failure]) -> dict[str, Any]:
    """The ``health_check`` event (an XidEvent's fields) for ``failures``: the message names each
    check and what it read; the GPU is named where one failure names one."""
    gpus = {(f.gpu_uuid, f.pci) for f in failures if f.gpu_uuid or f.pci}
    uuid, pci = next(iter(gpus)) if len(gpus) == 1 else (None, None)
    message = f"{mode}: " + "; ".join(f"{f.check}: {f.message}" for f in failures)
    return {
        "node": node,
        "kind": "health_check",
        "xid": None,
        "pci": pci,
        "gpu_uuid": uuid,
        "message": message[:1000],
        "source": SOURCE,
        "timestamp": datetime.now(UTC).isoformat(),
    }


def drain_reason(failures: Sequence[Failure]) -> str:
    """The drain reason of healthcheck mode: gpufleet's prefix, the kind and the checks."""
    return f"{DRAIN_REASON_PREFIX} health_check {','.join(dict.fromkeys(f.check for f in failures))}"


def drain(node: str, reason: str, *, scontrol: str = "scontrol", timeout: float = 10.0) -> str | None:
    """Drain ``node`` with ``reason``, unless it is out of service already; None when drained
    here, else what went wrong or why it was left alone.

    ``scontrol update State=DRAIN`` on a drained node replaces its reason, so a node that is
    drained, down or failed already keeps its reason: a person's (or Slurm's) stays theirs rather
    than becoming gpufleet's, which an incident would take as its own and resume; an incident's
    keeps the incident it names. The health_check event is reported all the same.
    """
    if not _NODE_NAME.fullmatch(node):
        return f"invalid node name {node!r}: not drained"
    binary = shutil.which(scontrol)
    if binary is None:
        return f"{scontrol} not found on PATH: the node is not drained"
    shown = _scontrol([binary, "--oneliner", "show", "node", node], timeout)
    if isinstance(shown, str):
        return f"cannot read the node's state, so it is not drained: {shown}"
    state = _STATE.search(shown.stdout)
    if state is None:
        return f"scontrol show node {node} names no State=, so it is not drained"
    if any(word in state.group(1).upper() for word in _OUT_OF_SERVICE):
        theirs = _REASON.search(shown.stdout)
        said = f" ({theirs.group(1).strip()[:200]})" if theirs else ""
        return f"{node} is {state.group(1)} already{said}: its reason is kept, not drained again"
    done = _scontrol([binary, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"], timeout)
    return done if isinstance(done, str) else None


_STATE = re.compile(r"(?:^|\s)State=(\S+)")
_REASON = re.compile(r"(?:^|\s)Reason=(.*?)(?=\s[A-Z][A-Za-z]*=|$)")
_OUT_OF_SERVICE = ("DRAIN", "DOWN", "FAIL")  # DRAIN also matches DRAINED and DRAINING


def _scontrol(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str] | str:
    """Run scontrol: what it answered, or what went wrong."""
    what = "scontrol " + next((a for a in argv[1:] if not a.startswith("-")), "")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{what} failed: {exc}"
    if done.returncode != 0:
        return f"{what} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[:300]}"
    return done


def this_node(explicit: str | None) -> str:
    """The node the event is for: --node, else NODE_NAME (a Slinky slurmd container's Kubernetes
    node, from the downward API), SLURMD_NODENAME (Slurm sets it for its hooks), the hostname."""
    return (
        explicit
        or os.environ.get("NODE_NAME")
        or os.environ.get("SLURMD_NODENAME")
        or socket.gethostname().split(".")[0]
    )


def _expected(gpus: int | None) -> int | None:
    if gpus is not None:
        return gpus
    value = os.environ.get(GPUS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise SystemExit(f"error: {GPUS_ENV}={value!r}: give the node's GPU count, a whole number (0: no GPUs)")
    return int(value)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as gpufleet's other commands say them."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    parse = _Parser(
        prog="gpufleet health-check",
        description="Quick GPU checks for Slurm's Prolog, Epilog and HealthCheckProgram (docs/health-check.md). "
        "A failure drops a health_check event into the node's detector inbox; prolog and epilog then exit 1 "
        "(Slurm drains the node), healthcheck drains the node itself and exits 0.",
    )
    parse.add_argument("--mode", choices=MODES, default="prolog", help="Which Slurm hook runs it (default: prolog).")
    parse.add_argument(
        "--gpus",
        type=int,
        default=None,
        help=f"How many GPUs the node should have (default: ${GPUS_ENV}; unset: the count is not checked, and a "
        "node without NVML passes; 0: a node without GPUs, nothing checked).",
    )
    parse.add_argument(
        "--node", default=None, help="The node the event is for (default: $NODE_NAME, $SLURMD_NODENAME, hostname)."
    )
    parse.add_argument(
        "--inbox",
        type=Path,
        default=None,
        help="The detector's inbox (default: $GPUFLEET_INBOX, else $GPUFLEET_HOME/inbox/NODE).",
    )
    parse.add_argument("--scontrol", default="scontrol", help="healthcheck mode: the scontrol to drain with.")
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks; the exit status Slurm should see (see the module's docstring)."""
    args = parser().parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        print("error: --gpus: give the node's GPU count, 0 or more", file=sys.stderr)
        return 2
    node = this_node(args.node)
    if not _NODE_NAME.fullmatch(node):
        print(f"error: invalid node name {node!r}: give --node", file=sys.stderr)
        return 2
    started = time.monotonic()
    result = run_checks(_expected(args.gpus), extra=EXTRA_CHECKS)
    took = f"{(time.monotonic() - started) * 1000:.0f} ms"
    if not result.failures:
        print(f"gpufleet health-check {args.mode} on {node}: ok ({result.said}; {took})")
        return 0
    print(f"gpufleet health-check {args.mode} on {node}: FAILED: {result.said} ({took})", file=sys.stderr)
    inbox = args.inbox or default_inbox(node)
    try:
        write_event(inbox, event_for(node, args.mode, result.failures))
    except OSError as exc:
        print(f"error: cannot drop the event into the detector's inbox {inbox}: {exc}", file=sys.stderr)
    if args.mode != "healthcheck":
        return 1  # Slurm drains the node (Prolog error / Epilog error); gpufleet takes that drain over
    # Slurm's name for the node: a Slinky pod's differs from its Kubernetes node (the event's).
    slurm_node = os.environ.get("SLURMD_NODENAME") or node
    problem = drain(slurm_node, drain_reason(result.failures), scontrol=args.scontrol)
    if problem:
        print(f"gpufleet health-check: {problem}", file=sys.stderr)
    return 0  # Slurm ignores a HealthCheckProgram's exit status


if __name__ == "__main__":
    sys.exit(main())
