"""The lab as a user drives it: lab up (twice), lab drill with the PyTorch DDP job, lab status, lab down.

Also: the incident is found by its search attributes, a drill on an unknown node changes
nothing, and a port already in use makes lab up pick another and say so.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from clients.kube import KubernetesApi
from clients.kubeauth import KubeAuth
from lab.fleet import FleetLab, LabConfig
from lab.procs import alive, free_port, pids_with_env, stop
from models.constants import PROBATION_LABEL, QUARANTINE_PROBATION, guard_workflow_id
from tests.conftest import gpufleet_cli
from workflows.guard import FleetGuardWorkflow

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, busy_port: int) -> Iterator[tuple[FleetLab, list[str]]]:
    # The drills' lab without Slurm's hooks: the prolog's own lab is tests/e2e/test_lab_hooks.py.
    config = LabConfig(
        training=["gpu1", "gpu2", "gpu3"], spares=["spare1"], temporal_port=busy_port, ui_port=0, health_checks=False
    )
    fleet = FleetLab(tmp_path_factory.mktemp("lab"), config)
    said: list[str] = []
    fleet.up(say=said.append)
    yield fleet, said
    fleet.down()


def gpufleet(fleet: FleetLab, *args: str) -> subprocess.CompletedProcess[str]:
    return gpufleet_cli(*args, env=fleet.env(), timeout=400)


def lab_cli(fleet: FleetLab, *args: str) -> subprocess.CompletedProcess[str]:
    """A `gpufleet lab` command as a user types it: only GPUFLEET_HOME says which lab (no TEMPORAL_ADDRESS)."""
    return gpufleet_cli("lab", *args, env={"GPUFLEET_HOME": str(fleet.home)}, unset=("TEMPORAL_ADDRESS",), timeout=400)


def test_a_port_in_use_is_replaced_and_named(lab: tuple[FleetLab, list[str]], busy_port: int) -> None:
    fleet, said = lab
    assert any(f"port {busy_port}" in line and "in use" in line for line in said)
    assert fleet.state()["services"]["temporal"]["address"] != f"127.0.0.1:{busy_port}"


def test_lab_up_again_reuses_what_runs(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    before = sorted(fleet.recorded_pids())
    done = lab_cli(fleet, "up")
    assert done.returncode == 0, done.stderr
    assert "already running" in done.stdout
    assert sorted(fleet.recorded_pids()) == before


def test_drill_on_an_unknown_node_changes_nothing(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    slurm = fleet.slurm.client()
    jobs_before = slurm.jobs()
    done = lab_cli(fleet, "drill", "--node", "nosuch")
    assert done.returncode == 1
    assert "no node 'nosuch'" in done.stdout + done.stderr
    assert slurm.jobs() == jobs_before
    listed = json.loads(gpufleet(fleet, "incidents", "list", "--json").stdout)
    assert listed == []


def test_inject_xid_refuses_an_unknown_node(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    done = lab_cli(fleet, "inject-xid", "nosuch", "--xid", "79")
    assert done.returncode == 1
    assert "no lab node 'nosuch'" in done.stderr
    assert not fleet.kmsg_file("nosuch").exists()


def test_drill_recovers_the_ddp_job(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    done = lab_cli(fleet, "drill", "--job", "ddp")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "resolved"
    assert result["xid"] == 79 and result["node"] == "gpu1"
    assert result["job_restarts"] >= 1
    assert result["resumed_from_step"] > 0
    assert result["replacement_node"] == "spare1"
    t = result["timings_s"]
    assert set(t) == {
        "detect_to_workflow",
        "detect_to_drained",
        "detect_to_requeued",
        "detect_to_replaced",
        "detect_to_resumed",
    }
    assert 0 <= t["detect_to_workflow"] <= t["detect_to_drained"] <= t["detect_to_requeued"]
    assert t["detect_to_requeued"] <= t["detect_to_replaced"] <= t["detect_to_resumed"]
    names = [step["name"] for step in result["steps"]]
    # As a real Xid 79 does, the rank on gpu1 died with a CUDA error and srun cancelled the step
    # (whether before the incident listed the node's jobs or during its grace, it runs again).
    assert result["effect"] == "crash" and "crash on gpu1" in result["gpu_fault_hits"]
    assert names[:4] == ["classify", "notify", "drain_slurm", "requeue_ended"]
    assert all(step["end"] is None or step["end"] >= step["start"] for step in result["steps"])
    assert "Temporal UI" in done.stdout and "drain_slurm" in done.stdout
    # The Xid went through gpu1's detector: its kernel log holds the driver line.
    assert "NVRM: Xid (PCI:0000:3b:00): 79" in fleet.kmsg_file("gpu1").read_text()
    # And through the intake, with gpu1's pod-bound token: never from the detector to Temporal.
    intake = fleet.state()["services"]["intake"]
    metrics = httpx.get(intake["metrics"], timeout=10).text
    assert re.search(r'^gpufleet_intake_events_total\{result="accepted"[^}]*\} [1-9]', metrics, re.M), metrics
    assert (
        " on gpu1 (system:serviceaccount:gpufleet:gpufleet-detector) -> incident remediate-lab-gpu1"
        in (fleet.home / "logs" / "intake.log").read_text()
    )


def test_a_drill_without_a_free_spare_says_so_and_injects_nothing(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    logs = {node: fleet.kmsg_file(node).read_text() for node in fleet.all_nodes}
    done = lab_cli(fleet, "drill", "--job", "ddp")
    assert done.returncode == 1
    assert "no free spare" in done.stderr
    assert {node: fleet.kmsg_file(node).read_text() for node in fleet.all_nodes} == logs


def test_an_xid_48_drill_resets_the_gpu_in_place_and_a_second_escalates(lab: tuple[FleetLab, list[str]]) -> None:
    """RESET_GPU by default: drained, the job (which Xid 48 crashed) requeued, the reset Job run
    (in the lab, a local process standing for the node), settled, back in service, the job
    resumed on the same node; no spare needed. The same node reporting again soon after starts at
    REBOOT_NODE."""
    fleet, _ = lab
    slurm = fleet.slurm.client()
    # A second node of this three-node partition within ten minutes would trip the breaker.
    assert gpufleet(fleet, "breaker", "reset", "--reason", "the next drill").returncode == 0
    first = lab_cli(fleet, "drill", "--xid", "48")
    assert first.returncode == 0, first.stdout + first.stderr
    reset = json.loads(first.stdout.strip().splitlines()[-1])
    assert reset["outcome"] == "resolved" and reset["action"] == "RESET_GPU"
    assert reset["replacement_node"] is None and reset["resumed_from_step"] > 0
    names = [step["name"] for step in reset["steps"]]
    # Whether the crash ended the job before the incident looked (requeued at once) or during its
    # grace (requeued after it), every requeue comes before the repair.
    assert names.index("requeue_ended") < names.index("repair") < names.index("settle") < names.index("resume")
    assert "requeue" not in names or names.index("requeue") < names.index("repair")
    node = reset["node"]
    assert not slurm.node(node).drained and node in slurm.partition_nodes("train")  # back in service
    again = lab_cli(fleet, "drill", "--xid", "48", "--node", node)
    assert again.returncode == 0, again.stdout + again.stderr
    reboot = json.loads(again.stdout.strip().splitlines()[-1])
    assert reboot["outcome"] == "resolved" and reboot["action"] == "REBOOT_NODE"


def test_incident_chart(lab: tuple[FleetLab, list[str]], tmp_path_factory: pytest.TempPathFactory) -> None:
    fleet, _ = lab
    picture = tmp_path_factory.mktemp("chart") / "incident.png"
    done = gpufleet(fleet, "incidents", "show", "remediate-lab-gpu1", "--chart", str(picture))
    assert done.returncode == 0, done.stderr
    assert picture.read_bytes()[:4] == b"\x89PNG"


def test_the_incident_is_found_by_its_search_attributes(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab

    async def search(query: str) -> list[str]:
        client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"])
        return [w.id async for w in client.list_workflows(query)]

    for query in ('GpuNode="gpu1"', "Xid=79", 'Cluster="lab" AND RemediationStep="closed" AND Xid=79'):
        found: list[str] = []
        for _ in range(50):  # visibility is eventually consistent
            found = asyncio.run(search(query))
            if found:
                break
            asyncio.run(asyncio.sleep(0.2))
        assert found == ["remediate-lab-gpu1"], query


def test_lab_status_shows_both_sides(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    status = json.loads(lab_cli(fleet, "status", "--json").stdout)
    nodes = {node["name"]: node for node in status["nodes"]}
    assert nodes["gpu1"]["reason"].startswith("gpufleet:")
    assert nodes["gpu1"]["kubernetes"] == "cordoned"
    assert nodes["gpu1"]["pool"] == "retired"
    assert nodes["spare1"]["pool"] == "training" and "train" in nodes["spare1"]["partitions"]
    assert nodes["gpu2"]["kubernetes"] == "schedulable"
    assert any(job["restarts"] >= 1 for job in status["jobs"])
    assert status["incidents"] == []
    # Where the lab's `gpufleet` commands go (the operator's by default), and whom one may act as.
    api, env = status["api"], fleet.env()
    assert (api["address"], api["ca"]) == (env["GPUFLEET_API_ADDRESS"], env["GPUFLEET_API_CA_FILE"])
    assert set(api["users"]) == {"lab-viewer", "lab-approver", "lab-operator"}
    assert env["GPUFLEET_API_KUBECONFIG"] == api["users"]["lab-operator"]
    assert all(Path(kubeconfig).stat().st_mode & 0o777 == 0o600 for kubeconfig in api["users"].values())
    shown = lab_cli(fleet, "status").stdout
    assert f"gpufleet API: {api['address']}" in shown and api["users"]["lab-viewer"] in shown
    lines = lab_cli(fleet, "env", "--user", "lab-viewer").stdout.splitlines()
    assert f"export GPUFLEET_API_KUBECONFIG={api['users']['lab-viewer']}" in lines


def test_a_viewer_sees_a_nodes_rack_and_leaf_switch(lab: tuple[FleetLab, list[str]]) -> None:
    """`gpufleet nodes show` through the lab's gpufleet API as lab-viewer: the rack from the
    Kubernetes label the lab sets, the leaf switch from the lab's Slurm topology."""
    fleet, _ = lab
    viewer = {**fleet.env(), "GPUFLEET_API_KUBECONFIG": str(fleet.user_kubeconfig("lab-viewer"))}
    done = gpufleet_cli("nodes", "show", "gpu1", "--json", env=viewer, timeout=400)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["domains"] == [{"kind": "rack", "name": "a"}, {"kind": "switch", "name": "leaf-a"}]
    assert shown["sources"] == {"rack/a": "label gpufleet.io/rack", "switch/leaf-a": "slurm topology"}
    unknown = gpufleet_cli("nodes", "show", "gpu99", env=viewer, timeout=400)
    assert unknown.returncode == 1
    assert "no node gpu99: neither Kubernetes nor Slurm knows it" in unknown.stderr


def test_the_detectors_tokens_outlive_a_restart_of_the_kubernetes_api(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    token = (fleet.token_folder / "gpu2").read_text()
    before = fleet.state()["services"]["kubeapi"]["pid"]
    url = fleet.state()["services"]["kubeapi"]["url"]
    stop([before])
    fleet.up(keep_slurm=True)
    assert fleet.state()["services"]["kubeapi"]["pid"] != before
    # The token the detector held across the restart is still the detector's, bound to its pod.
    identity = KubeAuth(kubeconfig=fleet.home / "kubeconfig").review_token(token, audiences=["gpufleet"])
    assert identity.name == "system:serviceaccount:gpufleet:gpufleet-detector"
    assert identity.pod_uid == "lab-detector-gpu2" and identity.node == "gpu2"
    # Back on its port, with the users' tokens and roles: the gpufleet API, which read its address
    # at its start, still lets a user in (one it has not seen before: no review of theirs cached).
    assert fleet.state()["services"]["kubeapi"]["url"] == url
    approver = {**fleet.env(), "GPUFLEET_API_KUBECONFIG": str(fleet.user_kubeconfig("lab-approver"))}
    listed = gpufleet_cli("incidents", "list", "--json", env=approver, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "remediate-lab-gpu1" in [row["id"] for row in json.loads(listed.stdout)]


def test_the_validation_ladder_keeps_a_failing_node_out_and_probation_quarantines(
    lab: tuple[FleetLab, list[str]],
) -> None:
    """With validation on (the lab policy's stand-in rungs): `nodes return` of the retired gpu1
    fails at each rung its knob fails (NCCL under the floor included), naming it, and gpu1 stays
    out; then every rung passes and gpu1 comes back as a spare. A GPU reset that holds puts its
    node on probation; an Xid there replaces the node and quarantines it at once."""
    fleet, _ = lab
    policy = fleet.policy_file.read_text(encoding="utf-8")
    fleet.policy_file.write_text(policy.replace("validation:\n  enabled: false", "validation:\n  enabled: true"))
    fails, busbw = fleet.home / "validate-fails", fleet.home / "nccl-busbw"
    for rung, says in [
        ("quick", "rung quick: failed"),
        ("dcgm", "rung dcgm: failed"),
        ("nccl", "rung nccl: failed 40 GB/s (threshold 100)"),
        ("site", "rung site: failed"),
    ]:
        if rung == "nccl":
            fails.unlink()
            busbw.write_text("40\n")
        else:
            fails.write_text(f"{rung}\n")
        kept = gpufleet(fleet, "nodes", "return", "gpu1")
        assert kept.returncode == 1, kept.stdout + kept.stderr
        assert f"gpu1 failed validation at {says}" in " ".join((kept.stdout + kept.stderr).split()), kept.stderr
        busbw.unlink(missing_ok=True)
    fails.unlink()
    assert fleet.slurm.client().node("gpu1").drained  # kept out
    back = gpufleet(fleet, "nodes", "return", "gpu1")
    assert back.returncode == 0, back.stdout + back.stderr
    said = " ".join(back.stdout.split())
    assert "gpu1 returned as spare; gpu1 passed validation: quick: passed" in said
    assert "nccl: passed 180 GB/s (threshold 100)" in said and "on probation until" in said
    kube = KubernetesApi(kubeconfig=fleet.home / "kubeconfig")
    assert kube.get_node("gpu1").labels.get(PROBATION_LABEL) == "true"

    async def recorded() -> set[str]:
        client = await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)
        status = await client.get_workflow_handle(guard_workflow_id("lab")).query(FleetGuardWorkflow.status)
        return set(status.state.nodes)

    # A node with no record at the guard (no repair to escalate from): reset, validated, on probation.
    partition = fleet.slurm.client().partition_nodes("train")
    node = sorted(set(partition) - asyncio.run(recorded()) - {"gpu1"})[0]
    assert gpufleet(fleet, "breaker", "reset", "--reason", "the validation drill").returncode == 0
    first = lab_cli(fleet, "drill", "--xid", "48", "--node", node)
    assert first.returncode == 0, first.stdout + first.stderr
    reset = json.loads(first.stdout.strip().splitlines()[-1])
    assert reset["outcome"] == "resolved" and reset["action"] == "RESET_GPU"
    assert [s["name"] for s in reset["steps"]].index("validate") < [s["name"] for s in reset["steps"]].index("resume")
    assert kube.get_node(node).labels.get(PROBATION_LABEL) == "true"
    assert gpufleet(fleet, "breaker", "reset", "--reason", "the probation drill").returncode == 0
    again = lab_cli(fleet, "drill", "--xid", "48", "--node", node)
    assert again.returncode == 0, again.stdout + again.stderr
    replaced = json.loads(again.stdout.strip().splitlines()[-1])
    assert replaced["action"] == "REPLACE_NODE" and replaced["replacement_node"] == "gpu1"
    quarantined = json.loads(gpufleet(fleet, "nodes", "quarantined", "--json").stdout)
    assert {"node": node, "code": QUARANTINE_PROBATION} in [{"node": q["node"], "code": q["code"]} for q in quarantined]
    fleet.policy_file.write_text(policy)


def test_lab_down_leaves_no_process(lab: tuple[FleetLab, list[str]]) -> None:
    fleet, _ = lab
    pids = fleet.recorded_pids()
    assert len(pids) >= 9
    done = lab_cli(fleet, "down")
    assert done.returncode == 0, done.stderr
    assert not [pid for pid in pids if alive(pid)]
    # Job steps and training processes carry the lab's SLURM_CONF: none may outlive it.
    assert pids_with_env("SLURM_CONF", str(fleet.slurm.conf)) == []
