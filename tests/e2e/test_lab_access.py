"""Who may do what in the lab: every `gpufleet` command goes through gpufleet's API as one of the
lab's users (docs/lab.md). The viewer's changes are refused and change nothing; the operator's go
through, and Temporal's history names the authenticated user, never the name the OS gives.

One lab for the module: gpu1 drained by someone else, then reported by the operator, so that its
incident waits for an approval; the fleet guard running (paused and resumed by the operator).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from lab.drill import reset_breaker
from lab.fleet import FleetLab, LabConfig
from models.guard import GuardCommand
from models.incident import Approval, IncidentStatus
from tests.conftest import gpufleet_cli, gpufleet_cli_each
from workflows.remediation import NodeRemediationWorkflow

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

INCIDENT = "remediate-lab-gpu1"
GUARD = "guard-lab"
OWNER_REASON = "firmware update by the platform team"
# What getpass.getuser() says in every command here: a name anyone sets, never the one recorded.
SHELL_USER = {"USER": "mallory", "LOGNAME": "mallory"}


def as_user(fleet: FleetLab, name: str) -> dict[str, str]:
    """The lab's environment with `gpufleet` acting as lab user ``name``."""
    return {**fleet.env(), **SHELL_USER, "GPUFLEET_API_KUBECONFIG": str(fleet.user_kubeconfig(name))}


def operator(fleet: FleetLab, *args: str) -> subprocess.CompletedProcess[str]:
    done = gpufleet_cli(*args, env=as_user(fleet, "lab-operator"), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


async def _temporal(fleet: FleetLab) -> Client:
    """Temporal itself, as gpufleet's services reach it (never through the API)."""
    return await Client.connect(fleet.env()["TEMPORAL_ADDRESS"], data_converter=pydantic_data_converter)


def incident_status(fleet: FleetLab) -> IncidentStatus:
    async def query() -> IncidentStatus:
        handle = (await _temporal(fleet)).get_workflow_handle(INCIDENT)
        status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
        return status

    return asyncio.run(query())


def signals(fleet: FleetLab, workflow_id: str) -> list[tuple[str, str, Any]]:
    """Each signal in the workflow's history: its name, the identity that sent it, its first argument."""

    async def read() -> list[tuple[str, str, Any]]:
        history = await (await _temporal(fleet)).get_workflow_handle(workflow_id).fetch_history()
        found = []
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                attributes = event.workflow_execution_signaled_event_attributes
                payloads = list(attributes.input.payloads)
                argument = (
                    pydantic_data_converter.payload_converter.from_payloads(payloads[:1])[0] if payloads else None
                )
                found.append((attributes.signal_name, attributes.identity, argument))
        return found

    return asyncio.run(read())


def workflow_ids(fleet: FleetLab) -> list[str]:
    async def listed() -> list[str]:
        return [execution.id async for execution in (await _temporal(fleet)).list_workflows("")]

    return asyncio.run(listed())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetLab]:
    config = LabConfig(training=["gpu1", "gpu2"], spares=["spare1"], temporal_port=0, ui_port=0)
    lab = FleetLab(tmp_path_factory.mktemp("access"), config)
    lab.up()
    try:
        subprocess.run(
            ["scontrol", "update", "NodeName=gpu1", "State=DRAIN", f"Reason={OWNER_REASON}"],
            env=lab.env(),
            check=True,
            capture_output=True,
        )
        operator(lab, "pause", "--reason", "the access drill")
        operator(lab, "resume", "--reason", "the access drill")
        operator(lab, "remediate", "gpu1", "--xid", "79")

        async def waiting() -> None:
            handle = (await _temporal(lab)).get_workflow_handle(INCIDENT)
            for _ in range(300):
                try:
                    status: IncidentStatus = await handle.query(NodeRemediationWorkflow.status)
                    if status.waiting_for_approval is not None:
                        return
                except RPCError:  # not started yet
                    pass
                await asyncio.sleep(0.2)
            raise AssertionError(f"{INCIDENT} never waited for an approval")

        asyncio.run(waiting())
        yield lab
    finally:
        lab.down()


def test_the_viewer_may_change_nothing(fleet: FleetLab) -> None:
    guard_before = signals(fleet, GUARD)
    before = incident_status(fleet)
    approve, reset, returned = gpufleet_cli_each(
        [
            ["approve", "gpu1", "--reason", "looks fine"],
            ["breaker", "reset", "--reason", "no reason"],
            ["nodes", "return", "gpu2", "--as", "spare"],
        ],
        env=as_user(fleet, "lab-viewer"),
    )
    for done, verb in ((approve, "approve gpufleet.io/incidents"), (reset, "reset gpufleet.io/breaker lab")):
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"lab-viewer may not {verb}" in done.stderr
    assert returned.returncode == 1, returned.stdout + returned.stderr
    assert "lab-viewer may not return gpufleet.io/nodes gpu2" in returned.stderr
    # Nothing reached Temporal: the incident still waits, the guard heard no reset, no return ran.
    after = incident_status(fleet)
    assert after.waiting_for_approval is not None and after.approval_wait == before.approval_wait
    assert signals(fleet, GUARD) == guard_before
    assert not [found for found in workflow_ids(fleet) if found.startswith("return-")]
    node = fleet.slurm.client().node("gpu1")
    assert node.drained and node.reason == OWNER_REASON


def test_the_operator_lists_and_decides_and_the_history_names_them(fleet: FleetLab) -> None:
    listed: list[dict[str, Any]] = []
    for _ in range(10):  # Temporal's listing is eventually consistent
        listed = json.loads(operator(fleet, "incidents", "list", "--json").stdout)
        if listed:
            break
    assert [(row["id"], row["status"]) for row in listed] == [(INCIDENT, "RUNNING")]
    operator(fleet, "reject", "gpu1", "--reason", "the platform team keeps it")
    decisions = [(identity, argument) for name, identity, argument in signals(fleet, INCIDENT) if name == "decide"]
    assert len(decisions) == 1
    identity, answer = decisions[0]
    assert identity == "lab-operator"
    assert Approval.model_validate(answer).by == "lab-operator"  # not mallory, the shell's name
    # The breaker's pause and resume, and the report that opened the incident, name them too.
    assert {identity for name, identity, _ in signals(fleet, GUARD) if name in ("pause", "resume")} == {"lab-operator"}
    assert {identity for name, identity, _ in signals(fleet, INCIDENT) if name == "report_xid"} == {"lab-operator"}


def test_the_labs_own_breaker_reset_goes_through_the_api_as_its_operator(fleet: FleetLab) -> None:
    """What the lab does in a person's name (the drill's breaker reset between drills) is the
    operator's, through the API: the guard's history names lab-operator, whatever the lab wrote."""
    before = len(signals(fleet, GUARD))
    assert asyncio.run(reset_breaker(fleet, reason="the next drill"))
    resets = [(identity, argument) for name, identity, argument in signals(fleet, GUARD)[before:] if name == "reset"]
    assert len(resets) == 1
    identity, command = resets[0]
    assert identity == "lab-operator"
    assert GuardCommand.model_validate(command).by == "lab-operator"
