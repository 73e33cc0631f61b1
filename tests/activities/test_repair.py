"""Repairs in place against the emulated API, with the lab's Job runner standing for the kubelet.

A reset holds when its Job completes; a reboot when the node is Ready on a new boot ID, whatever
its Job says (the pod dies with the node); then the GPU must answer. A Job past its deadline
is deleted; a retry of an attempt finds its own Jobs and the boot ID from before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.repair import RepairActivities, repair_job
from clients.errors import NotFound
from clients.kube import KubernetesApi
from models.constants import BOOT_ID_ANNOTATION
from models.policy import Action, RepairSettings
from models.requests import RepairRequest, RepairResult
from tests.conftest import REPO, KubeApiProcess

STAND_IN = [sys.executable, "-m", "lab.repair"]
LAB_REPAIRS = RepairSettings(
    reset_command=[*STAND_IN, "reset", "--gpu", "{gpu}", "--node", "{node}"],
    reboot_command=[*STAND_IN, "reboot", "--node", "{node}", "--boot-id", "{boot_id}"],
    check_command=[*STAND_IN, "check", "--gpu", "{gpu}", "--node", "{node}"],
    node_check_command=[*STAND_IN, "check", "--node", "{node}"],
    job_timeout_seconds=60,
    reboot_grace_seconds=1,
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def runner(kube_api: KubeApiProcess, home: Path, tmp_path: Path) -> Iterator[None]:
    """The lab's Job runner, started only where a test wants Jobs to run."""
    home.mkdir(exist_ok=True)
    ready = tmp_path / "jobrunner.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lab.jobrunner", "--api", kube_api.url, "--ready-file", str(ready)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "GPUFLEET_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the Job runner did not start"
        time.sleep(0.05)
    yield
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def kube(kube_api: KubeApiProcess) -> KubernetesApi:
    return KubernetesApi(kubeconfig=kube_api.kubeconfig, poll_seconds=0.05)


def repair(
    kube: KubernetesApi, action: Action, *, gpu: str = "GPU-1", attempt: int = 1, **settings: object
) -> RepairResult:
    request = RepairRequest(
        node="gpu1",
        action=action,
        incident_id="lab-gpu1-1",
        attempt=attempt,
        gpu=gpu,
        settings=LAB_REPAIRS.model_copy(update=settings),
    )
    result: RepairResult = ActivityEnvironment().run(RepairActivities(kube, poll_seconds=0.05).repair, request)
    return result


@pytest.mark.usefixtures("runner")
def test_a_reset_holds_once_its_job_completes_and_the_gpu_answers(kube: KubernetesApi) -> None:
    before = kube.get_node("gpu1").boot_id
    result = repair(kube, Action.RESET_GPU)
    assert result.succeeded, result.detail
    assert "gpu1: GPU GPU-1 reset" in result.detail and "the GPU answers" in result.detail
    assert kube.get_node("gpu1").boot_id == before  # a reset reboots nothing


@pytest.mark.usefixtures("runner")
def test_a_reboot_holds_on_a_new_boot_id_though_its_job_failed(kube: KubernetesApi) -> None:
    before = kube.get_node("gpu1").boot_id
    result = repair(kube, Action.REBOOT_NODE, gpu="")  # an event that named no GPU: the node-wide check
    after = kube.get_node("gpu1")
    assert result.succeeded, result.detail
    assert after.boot_id != before and after.ready
    assert f"Ready on boot ID {after.boot_id[:8]} (was {before[:8]})" in result.detail
    assert "GPU (all) answers" in result.detail
    assert kube.job_state("gpufleet", result.job).finished and not kube.job_state("gpufleet", result.job).succeeded
    # A retry of the same attempt (the worker died after the reboot) does not wait for another.
    again = repair(kube, Action.REBOOT_NODE, gpu="")
    assert again.succeeded and kube.get_node("gpu1").boot_id == after.boot_id
    assert kube.job_annotations("gpufleet", result.job)[BOOT_ID_ANNOTATION] == before


@pytest.mark.usefixtures("runner")
def test_a_reboot_started_first_is_waited_for_by_the_repair_once(kube: KubernetesApi) -> None:
    """As an incident does since v0.3.0: it starts the reboot (and gives its guard slot back),
    then waits for the node to come back; the wait finds the Job the start made, with the boot ID
    from before, and makes no second one."""
    before = kube.get_node("gpu1").boot_id
    request = RepairRequest(
        node="gpu1", action=Action.REBOOT_NODE, incident_id="lab-gpu1-2", attempt=1, settings=LAB_REPAIRS
    )
    acts = RepairActivities(kube, poll_seconds=0.05)
    name = ActivityEnvironment().run(acts.start_reboot, request)
    assert ActivityEnvironment().run(acts.start_reboot, request) == name  # a retry: the same Job
    assert kube.job_annotations("gpufleet", name)[BOOT_ID_ANNOTATION] == before
    result: RepairResult = ActivityEnvironment().run(acts.repair, request)
    assert result.succeeded and result.job == name, result.detail
    assert kube.get_node("gpu1").boot_id != before


@pytest.mark.usefixtures("runner")
def test_a_reboot_job_that_fails_with_the_node_still_up_fails_the_repair(kube: KubernetesApi, home: Path) -> None:
    (home / "repair-fails").touch()
    before = kube.get_node("gpu1").boot_id
    result = repair(kube, Action.REBOOT_NODE)
    assert not result.succeeded
    assert f"still up on boot ID {before[:8]}" in result.detail and "did not reboot" in result.detail
    assert kube.get_node("gpu1").boot_id == before


@pytest.mark.usefixtures("runner")
def test_a_gpu_that_does_not_answer_after_the_reset_fails_the_repair(kube: KubernetesApi, home: Path) -> None:
    (home / "check-fails").touch()
    result = repair(kube, Action.RESET_GPU)
    assert not result.succeeded
    assert "reset" in result.detail and "but the GPU does not answer" in result.detail
    assert result.job.startswith("gpufleet-check-gpu1-")


def test_a_job_past_its_deadline_is_stopped_and_a_retry_reads_its_verdict(kube: KubernetesApi) -> None:
    # No Job runner: the reset Job never starts, as on a node whose kubelet is gone.
    result = repair(kube, Action.RESET_GPU, job_timeout_seconds=1)
    assert not result.succeeded and "did not finish within 1s; Job stopped" in result.detail
    assert kube.job_annotations("gpufleet", result.job)["gpufleet.io/verdict"] == result.detail
    # The worker died after the stop: the retry runs nothing and says the same.
    again = repair(kube, Action.RESET_GPU, job_timeout_seconds=1)
    assert not again.succeeded and again.detail == result.detail and again.job == result.job


@pytest.mark.usefixtures("runner")
def test_a_reboot_job_started_again_after_its_reboot_reboots_nothing(kube: KubernetesApi, home: Path) -> None:
    first = repair(kube, Action.REBOOT_NODE, gpu="")
    after = kube.get_node("gpu1").boot_id
    # The kubelet runs the pod again after the crash (restartPolicy Never is at-least-once):
    # the command is given the boot it was made for, and this node has moved on.
    done = subprocess.run(
        [
            *STAND_IN,
            "reboot",
            "--node",
            "gpu1",
            "--boot-id",
            kube.job_annotations("gpufleet", first.job)[BOOT_ID_ANNOTATION],
        ],
        env={**os.environ, "GPUFLEET_HOME": str(home), "GPUFLEET_LAB_API": kube.host},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1 and "already rebooted, nothing done" in done.stdout
    assert kube.get_node("gpu1").boot_id == after


def test_a_node_back_on_a_new_boot_but_not_ready_is_not_repaired_yet(
    kube: KubernetesApi, kube_api: KubeApiProcess
) -> None:
    # No Job runner: the test plays the node. It comes back on a new boot but NotReady, and
    # stays so: the reboot times out, and its Job is stopped.
    def come_back_not_ready() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                kube.job_annotations("gpufleet", job_name)
                break
            except NotFound:
                time.sleep(0.05)
        httpx.patch(
            f"{kube_api.url}/api/v1/nodes/gpu1/status",
            json={"status": {"conditions": [{"type": "Ready", "status": "False"}], "nodeInfo": {"bootID": "new-boot"}}},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        ).raise_for_status()

    request = RepairRequest(node="gpu1", action=Action.REBOOT_NODE, incident_id="lab-gpu1-1")
    job_name = repair_job(request)["metadata"]["name"]
    player = threading.Thread(target=come_back_not_ready)
    player.start()
    result = repair(kube, Action.REBOOT_NODE, reboot_timeout_seconds=3)
    player.join()
    assert kube.get_node("gpu1").boot_id == "new-boot"
    assert not result.succeeded and "did not come back Ready on a new boot ID within 3s" in result.detail
    assert "Ready=False" in result.detail


def test_a_node_that_reports_no_boot_id_is_not_rebooted(kube: KubernetesApi, kube_api: KubeApiProcess) -> None:
    httpx.patch(
        f"{kube_api.url}/api/v1/nodes/gpu1/status",
        json=[{"op": "remove", "path": "/status/nodeInfo"}],
        headers={"Content-Type": "application/json-patch+json"},
    ).raise_for_status()
    with pytest.raises(ApplicationError, match="reports no boot ID") as caught:
        repair(kube, Action.REBOOT_NODE)
    assert caught.value.type == "InvalidInput" and caught.value.non_retryable  # escalates, never loops
    name = repair_job(RepairRequest(node="gpu1", action=Action.REBOOT_NODE, incident_id="lab-gpu1-1"))["metadata"]
    with pytest.raises(NotFound):  # nothing was created
        kube.job_state("gpufleet", name["name"])


@pytest.mark.usefixtures("runner")
def test_without_a_check_the_result_says_so(kube: KubernetesApi) -> None:
    result = repair(kube, Action.RESET_GPU, check_command=[])
    assert result.succeeded and result.detail.endswith("; no GPU check is configured")
    with pytest.raises(ValueError, match="cannot use"):
        RepairSettings(node_check_command=["nvidia-smi", "-i", "{gpu}"])


def test_a_runtime_class_reaches_every_repair_pod() -> None:
    settings = LAB_REPAIRS.model_copy(update={"runtime_class": "nvidia"})
    request = RepairRequest(node="gpu1", action=Action.RESET_GPU, incident_id="i", gpu="GPU-1", settings=settings)
    for kind in ("reset", "check"):
        assert repair_job(request, kind)["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert (
        "runtimeClassName"
        not in repair_job(request.model_copy(update={"settings": LAB_REPAIRS}))["spec"]["template"]["spec"]
    )


@pytest.mark.usefixtures("runner")
def test_a_validation_runs_the_check_alone(kube: KubernetesApi, home: Path) -> None:
    """DRAIN_AFTER_JOBS once the node's jobs have ended: the GPU is checked, nothing reset."""
    result = repair(kube, Action.DRAIN_AFTER_JOBS, attempt=0)
    assert result.succeeded and result.detail.startswith("the GPU answers"), result.detail
    assert result.job.startswith("gpufleet-check-gpu1-") and "reset" not in result.detail
    (home / "check-fails").touch()
    # A retry of the attempt finds its Job (completed); the reset's check after it is its own.
    assert repair(kube, Action.DRAIN_AFTER_JOBS, attempt=0).job == result.job
    failed = repair(kube, Action.RESET_GPU, attempt=1)
    assert not failed.succeeded and failed.job != result.job
    assert repair(kube, Action.DRAIN_AFTER_JOBS, check_command=[], node_check_command=[]).succeeded
