"""A detector that stops listening says so: a failed source ends it, /healthz and /metrics show its state."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from detector.daemon import Delivery, Detector, Emit, KernelLogSource, Ready, Source, SourceFailed
from detector.follow import KmsgReader, LogFollower
from detector.health import HealthServer
from detector.spool import Spool
from lab.procs import free_port, stop, wait_for
from models.policy import Policy
from tests.conftest import gpufleet_daemon
from tests.detector.test_kmsg import BOOT, Ring, record

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
REPLACE_NODE_EVENTS = 'gpufleet_detector_events_total{kind="xid",action="REPLACE_NODE"} 1'


class Broken:
    """A source whose device goes away: it raises once ``fail`` is set."""

    name = "broken"

    def __init__(self) -> None:
        self.fail = threading.Event()

    def run(self, emit: Emit, stop: threading.Event, ready: Ready) -> None:
        ready()
        self.fail.wait(timeout=60)
        raise OSError(5, "Input/output error")


class Running:
    """A detector running in a thread of its own, with its own event loop, as in the daemon."""

    def __init__(self, detector: Detector, sources: list[Source], ready: Path) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None

        def main() -> None:
            try:
                asyncio.run(detector.run(sources, stop=self.stop, ready_file=ready))
            except BaseException as exc:
                self.error = exc

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        wait_for(lambda: ready.exists() or self.error, timeout=30, what="the detector's sources")

    def join(self) -> None:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()

    def end(self) -> None:
        self.stop.set()
        self.join()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Detector, httpx.Client]]:
    """A detector whose Temporal never answers (events stay spooled), served on an ephemeral port."""
    monkeypatch.setenv("TEMPORAL_ADDRESS", f"127.0.0.1:{free_port()}")
    delivery = Delivery(cluster="lab", spool=Spool(tmp_path / "spool"), connect_timeout=0.5)
    detector = Detector(node="gpu7", policy=Policy(), delivery=delivery, out=lambda line: None)
    health = HealthServer(detector, "127.0.0.1", 0).start()
    with httpx.Client(base_url=f"http://127.0.0.1:{health.port}", timeout=10) as client:
        yield detector, client
    health.stop()


def test_a_running_detector_is_healthy_and_counts_what_it_sees(
    served: tuple[Detector, httpx.Client], tmp_path: Path
) -> None:
    detector, http = served
    ring = Ring(
        record(1, "NVRM: Xid (PCI:0000:5e:00): 48, pid=1, name=x, An uncorrectable double bit error"),
        record(2, "NVRM: Xid (PCI:0000:86:00): 79, pid=0, GPU has fallen off the bus.", facility=1),
    )
    log = tmp_path / "kern.log"
    log.write_text("")
    sources: list[Source] = [
        KernelLogSource(KmsgReader(Path("/dev/kmsg"), read_record=ring.read, boot_id=BOOT), once=False),
        KernelLogSource(LogFollower(log), once=False, name="file"),
    ]
    running = Running(detector, sources, tmp_path / "ready")
    try:
        healthz = http.get("/healthz")
        assert (healthz.status_code, healthz.text) == (200, "ok\n")

        with open(log, "a") as out:
            out.write(XID_79)
        both = (REPLACE_NODE_EVENTS, 'gpufleet_detector_events_total{kind="xid",action="RESET_GPU"} 1')
        wait_for(lambda: all(s in http.get("/metrics").text for s in both), timeout=30, what="both Xids in /metrics")
        metrics = http.get("/metrics").text
        assert http.get("/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
        assert samples['gpufleet_detector_events_total{kind="xid",action="RESET_GPU"}'] == "1"
        assert samples["gpufleet_detector_spool_depth"] == "2"  # Temporal never answered
        assert samples["gpufleet_detector_delivered_total"] == "0"
        assert float(samples["gpufleet_detector_last_event_timestamp_seconds"]) > 1.7e9
        assert samples['gpufleet_detector_untrusted_records_total{source="kmsg"}'] == "1"
        assert samples['gpufleet_detector_untrusted_records_total{source="file"}'] == "0"
        assert samples['gpufleet_detector_source_errors_total{source="kmsg"}'] == "0"
        assert "# TYPE gpufleet_detector_events_total counter" in metrics
        assert http.get("/nothing").status_code == 404
    finally:
        running.end()


def test_a_failing_source_ends_the_detector_and_fails_healthz(
    served: tuple[Detector, httpx.Client], tmp_path: Path
) -> None:
    detector, http = served
    broken = Broken()
    log = tmp_path / "kern.log"
    log.write_text("")
    running = Running(
        detector, [broken, KernelLogSource(LogFollower(log), once=False, name="file")], tmp_path / "ready"
    )
    assert http.get("/healthz").status_code == 200
    broken.fail.set()
    running.join()
    assert isinstance(running.error, SourceFailed)
    assert str(running.error) == "source broken failed: OSError: [Errno 5] Input/output error"
    healthz = http.get("/healthz")
    assert (healthz.status_code, healthz.text) == (503, "source broken failed: OSError: [Errno 5] Input/output error\n")
    assert 'gpufleet_detector_source_errors_total{source="broken"} 1' in http.get("/metrics").text


def test_a_main_loop_that_does_not_come_round_fails_healthz(served: tuple[Detector, httpx.Client]) -> None:
    detector, http = served
    assert (http.get("/healthz").status_code, http.get("/healthz").text) == (503, "not started yet\n")
    detector.last_tick = 0.0  # as if the loop had last come round when the machine booted
    assert http.get("/healthz").status_code == 503
    assert "the main loop has not come round for" in http.get("/healthz").text


async def test_the_other_sources_events_are_handled_before_the_failure_ends_it(tmp_path: Path) -> None:
    broken = Broken()
    broken.fail.set()
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    printed: list[str] = []
    detector = Detector(node="gpu7", policy=Policy(), delivery=None, out=printed.append)
    with pytest.raises(SourceFailed, match=r"^source broken failed: OSError: \[Errno 5\] Input/output error$"):
        await detector.run([broken, KernelLogSource(LogFollower(log, from_start=True), once=True)], once=True)
    assert len(printed) == 1 and '"xid": 79' in printed[0]


def test_gpufleet_detect_serves_health_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "kern.log"
    log.write_text("")
    ready = tmp_path / "ready"
    state = tmp_path / "state"
    argv = ["detect", "--kmsg", str(log), "--node", "gpu7", "--dry-run", "--state-dir", str(state)]
    argv += ["--health-port", str(port), "--health-host", "127.0.0.1", "--ready-file", str(ready)]
    detector = gpufleet_daemon(*argv)
    try:
        wait_for(lambda: ready.exists() or detector.poll() is not None, timeout=60, what="the detector")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert http.get("/healthz").text == "ok\n"
            with open(log, "a") as out:
                out.write(XID_79)
            wait_for(lambda: REPLACE_NODE_EVENTS in http.get("/metrics").text, timeout=30, what="the event")
        detector.terminate()
        out, err = detector.communicate(timeout=30)
        assert detector.returncode == 0, err
        assert json.loads(out)["xid"] == 79
        assert json.loads((state / "kmsg.json").read_text())["offset"] == log.stat().st_size
    finally:
        stop([detector.pid])
