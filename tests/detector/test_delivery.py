"""With Temporal down, events wait in the spool; when it comes back they arrive in order, as one incident."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiohttp.web
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from detector.daemon import Delivery
from detector.intake import IntakePoster
from detector.spool import Spool, SpoolFull
from lab.certs import ServerCertificate, make_server_certificate
from lab.procs import free_port, port_in_use, stop, wait_for
from models.intake import EVENTS_PATH
from models.xid import XidEvent
from starters.server import dev_server_argv
from tests.conftest import REPO


def test_spool_is_ordered_bounded_and_loud(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    spool = Spool(tmp_path, max_events=2)
    spool.put(XidEvent(node="gpu1", xid=79))
    spool.put(XidEvent(node="gpu1", xid=48))
    try:
        spool.put(XidEvent(node="gpu1", xid=13))
        raise AssertionError("a full spool must refuse")
    except SpoolFull:
        pass
    assert "SPOOL FULL" in caplog.text and "Xid 13 on gpu1 NOT KEPT" in caplog.text
    assert [event.xid for _, event in Spool(tmp_path).pending()] == [79, 48]  # survives a restart


def test_spool_files_without_an_event_are_set_aside(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    spool = Spool(tmp_path)
    paths = [spool.put(XidEvent(node="gpu1", xid=xid)) for xid in (79, 31, 48, 13, 64, 43)]
    paths[1].write_bytes(paths[1].read_bytes()[:25])  # cut short by a crash on a file system without fsync
    paths[3].write_bytes(b"")  # empty
    paths[5].write_text('{"node": "gpu1", "xid": "seventy-nine"}')  # JSON, but no event
    (tmp_path / "000000000006.json.tmp").write_text('{"node": "gp')  # a put that never finished

    restarted = Spool(tmp_path)
    assert [event.xid for _, event in restarted.pending()] == [79, 48, 64]
    assert len(restarted) == 3
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == [f"{p.name}.corrupt" for p in paths[1::2]]
    assert not list(tmp_path.glob("*.tmp"))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 3 and all("\n" not in error for error in errors)
    assert f"spool file {paths[3]} holds no event (file: Invalid JSON: EOF while parsing" in errors[1]
    assert errors[2].endswith(
        f"xid: Input should be a valid integer, unable to parse string as an integer); "
        f"set aside as {paths[5].name}.corrupt"
    )
    assert restarted.put(XidEvent(node="gpu1", xid=74)).name == "000000000006.json"


def test_temporal_down_then_back(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "kern.log"
    log.write_text("")
    ready = tmp_path / "detector.ready"
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
        "GPUFLEET_HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(REPO),
    }
    detector = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.entry",
            "detect",
            "--kmsg",
            str(log),
            "--node",
            "gpu1",
            "--cluster",
            "lab",
            "--ready-file",
            str(ready),
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "detector.err", "w"),  # noqa: SIM115
        start_new_session=True,
    )
    server = None
    try:
        wait_for(ready.exists, timeout=60, what="the detector to follow its log")
        with open(log, "a") as out:
            out.write("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n")
            out.write("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error\n")
            out.write("NVRM: Xid (PCI:0000:5e:00): 64, pid=1, name=x, Row remapping failure\n")
            out.write("NVRM: Xid (PCI:0000:5e:00): 13, pid=1, name=x, Graphics Exception\n")  # OBSERVE: not sent
        spool = tmp_path / "home" / "spool" / "gpu1"
        wait_for(lambda: len(list(spool.glob("*.json"))) == 3, timeout=60, what="three spooled events")
        wait_for(
            lambda: "Temporal unreachable" in (tmp_path / "detector.err").read_text(), timeout=60, what="a warning"
        )

        server = subprocess.Popen(
            dev_server_argv(db_file=tmp_path / "t.db", port=port, ui_port=free_port()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(lambda: port_in_use(port), timeout=60, what="the dev server")
        wait_for(lambda: not list(spool.glob("*.json")), timeout=60, what="the spool to drain")

        async def signals() -> tuple[list[str], list[int]]:
            client = await Client.connect(f"127.0.0.1:{port}", data_converter=pydantic_data_converter)
            ids = [w.id async for w in client.list_workflows()]
            history = await client.get_workflow_handle("remediate-lab-gpu1").fetch_history()
            xids = []
            for event in history.events:
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                    payload = event.workflow_execution_signaled_event_attributes.input.payloads[0]
                    xids.append(XidEvent.model_validate_json(payload.data).xid)
            return ids, xids

        ids, xids = asyncio.run(signals())
        for _ in range(50):  # list_workflows reads visibility, which may lag a moment
            if ids:
                break
            time.sleep(0.1)
            ids, xids = asyncio.run(signals())
        assert ids == ["remediate-lab-gpu1"]
        assert xids == [79, 48, 64]
    finally:
        stop([detector.pid])
        if server is not None:
            stop([server.pid])


def test_a_backlog_goes_out_in_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an outage the spool drains a slice per turn of the main loop (liveness, new events
    and SIGTERM are seen between slices), oldest first, and nothing is lost."""
    from detector.daemon import Delivery

    port = free_port()
    spool = Spool(tmp_path / "spool")
    for index in range(7):
        spool.put(XidEvent(node=f"gpu{index}", xid=79, source="test"))
    server = subprocess.Popen(
        dev_server_argv(db_file=tmp_path / "t.db", port=port, ui_port=free_port()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: port_in_use(port), timeout=60, what="the dev server")
        monkeypatch.setenv("TEMPORAL_ADDRESS", f"127.0.0.1:{port}")
        delivery = Delivery(cluster="lab", spool=spool, connect_timeout=30)

        async def drain() -> list[int]:
            slices = []
            while len(spool):
                sent = await delivery.flush(max_events=3, max_seconds=120)
                if sent:
                    slices.append(sent)
                else:  # the server still starting: the delivery waits out its back-off
                    await asyncio.sleep(0.1)
            return slices

        assert asyncio.run(drain()) == [3, 3, 1]
        assert delivery.delivered == 7
    finally:
        stop([server.pid])


async def _an_intake_of_another_version(cert: ServerCertificate, port: int, seen: list[int]) -> aiohttp.web.AppRunner:
    """An intake that cannot read an Xid 79 (400) and takes any other event (202)."""

    async def events(request: aiohttp.web.Request) -> aiohttp.web.Response:
        xid = (await request.json())["event"]["xid"]
        seen.append(xid)
        if xid == 79:  # what the intake answers for an event it cannot take
            return aiohttp.web.json_response(
                {"error": "not an event: event.xid: not one this intake knows"}, status=400
            )
        if xid == 13:  # a 400 of something else on the way (a proxy): not the event's fault
            return aiohttp.web.json_response({"error": "request header too large"}, status=400)
        return aiohttp.web.json_response({"incident": f"remediate-lab-gpu1-{xid}"}, status=202)

    app = aiohttp.web.Application()
    app.router.add_post(EVENTS_PATH, events)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert.cert, cert.key)
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    return runner


def test_an_event_the_intake_cannot_read_is_set_aside_and_never_holds_back_the_next(tmp_path: Path) -> None:
    cert = make_server_certificate(tmp_path / "tls")
    token = tmp_path / "token"
    token.write_text("a-token")
    spool = Spool(tmp_path / "spool")
    first = spool.put(XidEvent(node="gpu1", xid=79))
    spool.put(XidEvent(node="gpu1", xid=48))
    port = free_port()
    seen: list[int] = []

    async def run() -> int:
        runner = await _an_intake_of_another_version(cert, port, seen)
        poster = IntakePoster(f"https://127.0.0.1:{port}", token_file=token, ca_file=cert.ca)
        delivery = Delivery(cluster="lab", spool=spool, intake=poster)
        try:
            return await delivery.flush()
        finally:
            await poster.close()
            await runner.cleanup()

    assert asyncio.run(run()) == 1
    assert seen == [79, 48]  # the unreadable one first, then the next one, in the same pass
    assert len(spool) == 0 and spool.set_aside == 1
    assert first.with_name(first.name + ".refused").exists()  # kept for a person to post again
    assert Spool(tmp_path / "spool").pending() == []  # and not read back as pending after a restart
    # Another 400 (not the intake saying "not an event") is no reason to give the event up: kept.
    spool.put(XidEvent(node="gpu1", xid=13))
    spool.put(XidEvent(node="gpu1", xid=31))
    assert asyncio.run(run()) == 0
    assert seen[2:] == [13] and [e.gpu_xid for _, e in spool.pending()] == [13, 31] and spool.set_aside == 1
