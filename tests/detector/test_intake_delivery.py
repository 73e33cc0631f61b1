"""The detector posts to a real intake: the token read again at every post, a refusal said and the
events kept, and an intake down for a while loses nothing: every spooled event arrives, in order."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from lab.procs import free_port, stop, wait_for
from models.xid import XidEvent
from tests.conftest import REPO
from tests.gateway.world import Intake, World, start_world

pytestmark = pytest.mark.timeout(300)
# One Xid 79 per GPU: identical repeats (same Xid and GPU) within the fold window would be folded.
GPUS = ["18", "3b", "5e", "86", "af", "d8"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One emulated API, Temporal and intake for the module: the tests' events go to workflows of
    their own (remediate-lab-gpu1, dryrun-lab-gpu1)."""
    started = start_world(tmp_path_factory.mktemp("world"), rate=6000, burst=1000)
    yield started
    started.stop()


def xid_line(gpu: str) -> str:
    return f"NVRM: Xid (PCI:0000:{gpu}:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"


def signalled(world: World, workflow_id: str) -> list[str | None]:
    """The PCI addresses of the events signalled into ``workflow_id``, in the order they arrived."""

    async def history() -> list[str | None]:
        client = await Client.connect(world.temporal_address, data_converter=pydantic_data_converter)
        events = (await client.get_workflow_handle(workflow_id).fetch_history()).events
        return [
            XidEvent.model_validate_json(e.workflow_execution_signaled_event_attributes.input.payloads[0].data).pci
            for e in events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        ]

    return asyncio.run(history())


def test_delivery_through_the_intake(world: World, tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    token_file = tmp_path / "token"
    token_file.write_text(world.token("gpu1"))
    ready = tmp_path / "detector.ready"
    errors = tmp_path / "detector.err"
    health_port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GPUFLEET_HOME": str(tmp_path / "home"),
        "GPUFLEET_INTAKE_URL": world.intake.url,
        "GPUFLEET_INTAKE_TOKEN_FILE": str(token_file),
        "GPUFLEET_INTAKE_CA_FILE": str(world.intake.certs.ca),
        "TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",  # nothing there: the detector never goes to Temporal
    }
    argv = [sys.executable, "-m", "workers.entry", "detect", "--kmsg", str(log), "--node", "gpu1", "--cluster", "lab"]
    argv += ["--ready-file", str(ready), "--health-port", str(health_port), "--health-host", "127.0.0.1"]
    detector = subprocess.Popen(
        argv,
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(errors, "w"),  # noqa: SIM115
        start_new_session=True,
    )
    spool = tmp_path / "home" / "spool" / "gpu1"

    def spooled() -> int:
        return len(list(spool.glob("*.json")))

    def write(*gpus: str) -> None:
        with open(log, "a") as out:
            out.writelines(xid_line(gpu) for gpu in gpus)

    def health() -> str:
        return httpx.get(f"http://127.0.0.1:{health_port}/healthz", timeout=5).text

    try:
        wait_for(ready.exists, timeout=60, what="the detector to follow its log")
        write(GPUS[0])
        wait_for(lambda: signalled(world, "remediate-lab-gpu1") == [f"0000:{GPUS[0]}:00"], timeout=60, what="1st")
        assert spooled() == 0

        # The token rotates to one the intake refuses (another node's pod): the event stays spooled,
        # the log names the node and the fix, /healthz says so.
        token_file.write_text(world.token("gpu2"))
        write(GPUS[1])
        wait_for(lambda: "the intake refuses the events of node gpu1" in errors.read_text(), timeout=60, what="error")
        assert "this token does not speak for node gpu1" in errors.read_text()
        assert spooled() == 1
        assert "the intake refuses this node's events" in health()
        # And rotates again, to this node's: read at the next post, the event goes.
        token_file.write_text(world.token("gpu1"))
        wait_for(lambda: spooled() == 0, timeout=30, what="the spooled event to go with the new token")
        assert health() == "ok\n"

        # The intake goes away for a while: events wait in the spool, and all arrive once it is back.
        world.intake.stop()
        write(*GPUS[2:])
        wait_for(lambda: spooled() == 4, timeout=60, what="four spooled events")
        wait_for(lambda: "did not answer" in errors.read_text(), timeout=60, what="the intake missed")
        world.intake.start()
        wait_for(lambda: spooled() == 0, timeout=30, what="the spool to drain once the intake is back")
        assert signalled(world, "remediate-lab-gpu1") == [f"0000:{gpu}:00" for gpu in GPUS]
        assert "Temporal" not in errors.read_text()
    finally:
        stop([detector.pid])


def test_a_node_over_its_rate_waits_as_the_intake_says(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Told 429, the delivery waits the intake's Retry-After, then goes on in order: nothing lost."""
    from detector.daemon import Delivery
    from detector.intake import IntakePoster
    from detector.spool import Spool

    # An intake of its own, between the same API and Temporal, with a rate a burst goes over.
    rates = {"GPUFLEET_INTAKE_RATE": "60", "GPUFLEET_INTAKE_BURST": "2"}  # then one a second
    intake = Intake(tmp_path, {**world.intake.env, **rates}, world.intake.certs).start()
    try:
        token_file = tmp_path / "token"
        token_file.write_text(world.token("gpu1"))
        spool = Spool(tmp_path / "spool")
        for gpu in GPUS[:4]:
            spool.put(XidEvent(node="gpu1", xid=79, pci=f"0000:{gpu}:00", source="test"))
        poster = IntakePoster(intake.url, token_file=token_file, ca_file=intake.certs.ca)
        delivery = Delivery(cluster="lab", spool=spool, dry_run=True, intake=poster)

        async def drain() -> list[int]:
            slices = []
            while len(spool):
                slices.append(await delivery.flush(max_seconds=30))
                await asyncio.sleep(0.1)
            await delivery.close()
            return [n for n in slices if n]

        started = time.monotonic()
        assert asyncio.run(asyncio.wait_for(drain(), timeout=60)) == [2, 1, 1]
        assert time.monotonic() - started < 10
        assert "the intake answered 429: node gpu1 is over its rate of events" in caplog.text
        assert signalled(world, "dryrun-lab-gpu1") == [f"0000:{gpu}:00" for gpu in GPUS[:4]]
    finally:
        intake.stop()
