"""The lab's stand-in for the kubelet and the Job controller, for gpufleet's repair Jobs only.

A real cluster runs a Job labelled ``gpufleet.io/repair`` on the node it is pinned to, in a
privileged container (``nvidia-smi --gpu-reset``, or a reboot). The lab's nodes are names, so
here each such Job's container command runs as a local process (with ``GPUFLEET_LAB_NODE`` set
to the node it stands for, and ``GPUFLEET_LAB_API`` to the emulated API, where a reboot
writes the node's new boot ID) if, and only if, it is one of the lab's stand-ins ``python -m
lab.repair`` or ``python -m lab.validate`` (anything else would act on this machine: such a Job
fails, saying so), and the Job's status is written back as the Job controller would: ``Complete``
or ``Failed``, with the command's last line of output as the message. A validation rung's Job
(``gpufleet.io/repair=validate``) gets its pod too, ended as the kubelet writes it: the exit
status, and the output as the termination message (what a rung's command writes to
/dev/termination-log).

Run it as ``python -m lab.jobrunner --api URL [--ready-file F]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx

from models.constants import REPAIR_LABEL

POLL_SECONDS = 0.5


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def stand_in(argv: list[str]) -> bool:
    """Whether the command is one of the lab's stand-ins (``python -m lab.repair|lab.validate ...``):
    nothing else is ever run here, since a real repair command (a GPU reset, ``/proc/sysrq-trigger``)
    would act on this machine, not on a lab node."""
    return (
        len(argv) >= 3
        and Path(argv[0]).name.startswith("python")
        and argv[1] == "-m"
        and argv[2] in ("lab.repair", "lab.validate")
    )


def run_job(api: str, job: dict[str, Any]) -> None:
    """Run the Job's command to its end (or its deadline) and record the outcome on the Job."""
    meta, spec = job["metadata"], job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    argv = [*container.get("command", []), *container.get("args", [])]
    deadline = float(spec.get("activeDeadlineSeconds") or 600)
    started = _now()
    if not stand_in(argv):
        ok, message = (
            False,
            (
                f"the lab runs only its stand-ins (python -m lab.repair, lab.validate), not {' '.join(argv)!r}: "
                "set the lab policy file's repair: and validation: commands (a fresh lab writes them)"
            ),
        )
        _record(api, meta, started, ok, message)
        return
    output, code = "", None
    try:
        done = subprocess.run(
            argv,
            env={**os.environ, "GPUFLEET_LAB_NODE": pod.get("nodeName", ""), "GPUFLEET_LAB_API": api},
            capture_output=True,
            text=True,
            timeout=deadline,
            check=False,
        )
        output, code = (done.stdout + done.stderr).strip(), done.returncode
        lines = output.splitlines()
        ok, message = done.returncode == 0, (lines[-1] if lines else f"exit status {done.returncode}")
    except subprocess.TimeoutExpired:
        ok, message = False, f"past its deadline of {deadline:g}s"
    except OSError as exc:
        ok, message = False, f"could not run {argv[:1]}: {exc.strerror or exc}"
    if code is not None and meta.get("labels", {}).get(REPAIR_LABEL) == "validate":
        _record_pod(api, job, started, code, output)
    _record(api, meta, started, ok, message)


def _record_pod(api: str, job: dict[str, Any], started: str, code: int, output: str) -> None:
    """The Job's pod, ended as the kubelet writes it: its exit status and its termination message
    (the kubelet keeps at most 4096 bytes of it)."""
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    template = job["spec"]["template"]
    container = template["spec"]["containers"][0]
    terminated = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "message": output[-4096:],
        "startedAt": started,
        "finishedAt": _now(),
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-lab"[:63],
            "namespace": namespace,
            "labels": {
                **template["metadata"].get("labels", {}),
                "job-name": name,
                "batch.kubernetes.io/job-name": name,
            },
        },
        "spec": template["spec"],
        "status": {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": f"lab://{container['image']}",
                    "containerID": f"lab://{name}",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        },
    }
    httpx.post(f"{api}/api/v1/namespaces/{namespace}/pods", json=pod, timeout=10).raise_for_status()


def _record(api: str, meta: dict[str, Any], started: str, ok: bool, message: str) -> None:
    """The Job's outcome as the Job controller writes it."""
    condition = {"type": "Complete" if ok else "Failed", "status": "True", "message": message}
    condition["lastTransitionTime"] = _now()
    status = {"startTime": started, "conditions": [condition], ("succeeded" if ok else "failed"): 1}
    if ok:
        status["completionTime"] = _now()
    url = f"{api}/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}/status"
    httpx.patch(
        url,
        json={"status": status},
        headers={"Content-Type": "application/merge-patch+json"},
        timeout=10,
    ).raise_for_status()


def serve(api: str, stop: threading.Event) -> None:
    seen: set[str] = set()
    while not stop.is_set():
        try:
            listed = httpx.get(f"{api}/apis/batch/v1/jobs", params={"labelSelector": REPAIR_LABEL}, timeout=10)
            listed.raise_for_status()
            jobs = listed.json().get("items", [])
        except httpx.HTTPError:
            jobs = []  # the API is restarting: look again
        for job in jobs:
            uid = job["metadata"].get("uid") or job["metadata"]["name"]
            if uid in seen or (job.get("status") or {}).get("conditions"):
                continue
            seen.add(uid)
            threading.Thread(target=run_job, args=(api, job), daemon=True).start()
        stop.wait(POLL_SECONDS)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.jobrunner", description=__doc__.splitlines()[0])
    parser.add_argument("--api", required=True, help="the emulated Kubernetes API's URL")
    parser.add_argument("--ready-file", type=Path, help="written once it polls")
    args = parser.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file is not None:
        args.ready_file.write_text(args.api, encoding="utf-8")
    print(f"running repair Jobs from {args.api} as local processes", flush=True)
    serve(args.api.rstrip("/"), stop)


if __name__ == "__main__":
    main()
