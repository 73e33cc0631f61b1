"""Liveness and metrics over HTTP: ``GET /healthz`` for the kubelet, ``GET /metrics`` for Prometheus.

A detector that stops listening looks exactly like a quiet node; these make the difference visible.
"""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from detector.daemon import Detector

log = logging.getLogger("gpufleet.detector")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        rendered = ",".join(f'{key}="{_label(val)}"' for key, val in labels.items())
        number = str(value) if isinstance(value, int) else repr(float(value))  # never rounded, unlike :g
        lines.append(f"{name}{{{rendered}}} {number}" if rendered else f"{name} {number}")
    return lines


def render_metrics(detector: Detector) -> str:
    """The detector's metrics in the Prometheus text format, version 0.0.4."""
    events = sorted(detector.events_reported().items())
    delivery = detector.delivery
    sources = sorted(detector.stats.items())
    tick = detector.last_tick
    # The main loop comes round every 50 ms or so while the detector listens, events or not.
    heartbeat = time.time() - (time.monotonic() - tick) if tick is not None else 0
    lines = [
        *_family(
            "gpufleet_detector_events_total",
            "counter",
            "GPU events reported (folded repeats not counted), by kind and the action the policy chose.",
            [({"kind": kind, "action": action}, count) for (kind, action), count in events],
        ),
        *_family(
            "gpufleet_detector_spool_depth",
            "gauge",
            "Events waiting in the spool for the intake (or Temporal).",
            [({}, len(delivery.spool) if delivery is not None else 0)],
        ),
        *_family(
            "gpufleet_detector_last_event_timestamp_seconds",
            "gauge",
            "Unix time of the last event reported; 0 before the first.",
            [({}, detector.last_event_at or 0)],
        ),
        *_family(
            "gpufleet_detector_heartbeat_timestamp_seconds",
            "gauge",
            "Unix time the detector's main loop last came round (a quiet node still beats); 0 before it starts.",
            [({}, heartbeat)],
        ),
        *_family(
            "gpufleet_detector_delivered_total",
            "counter",
            "Events delivered to the intake (or Temporal).",
            [({}, delivery.delivered if delivery is not None else 0)],
        ),
        *_family(
            "gpufleet_detector_intake_refused",
            "gauge",
            "1 while the intake refuses this node's token (401, 403): events stay spooled until it is fixed.",
            [({}, 1 if delivery is not None and delivery.refused else 0)],
        ),
        *_family(
            "gpufleet_detector_source_errors_total",
            "counter",
            "Records a source lost or could not read, and the failure that ends a source.",
            [({"source": name}, stats.errors) for name, stats in sources],
        ),
        *_family(
            "gpufleet_detector_untrusted_records_total",
            "counter",
            "Records dropped because the kernel did not write them (forged kernel lines).",
            [({"source": name}, stats.untrusted) for name, stats in sources],
        ),
        *_family(
            "gpufleet_detector_spool_dropped_total",
            "counter",
            "Events NOT kept because the spool was full (alert on any).",
            [({}, delivery.spool.dropped if delivery is not None else 0)],
        ),
        *_family(
            "gpufleet_detector_spool_set_aside_total",
            "counter",
            "Spool files that held no event, renamed NAME.corrupt.",
            [({}, delivery.spool.set_aside if delivery is not None else 0)],
        ),
        *_family(
            "gpufleet_detector_folded_total",
            "counter",
            "Identical repeats folded into the event before them.",
            [({}, detector.folder.folded)],
        ),
    ]
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server: HealthServer

    def do_GET(self) -> None:
        detector = self.server.detector
        if self.path == "/healthz":
            healthy, reason = detector.health()
            self._reply(200 if healthy else 503, "text/plain; charset=utf-8", reason + "\n")
        elif self.path == "/metrics":
            self._reply(200, PROMETHEUS_TEXT, render_metrics(detector))
        else:
            self._reply(404, "text/plain; charset=utf-8", "not found: try /healthz or /metrics\n")

    def _reply(self, status: int, content_type: str, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds would flood the log: say nothing per request."""


class HealthServer(ThreadingHTTPServer):
    """``/healthz`` and ``/metrics`` of ``detector``, served from a thread of its own."""

    daemon_threads = True

    def __init__(self, detector: Detector, host: str, port: int) -> None:
        super().__init__((host, port), _Handler)
        self.detector = detector
        self._thread = threading.Thread(target=self.serve_forever, name="health", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.shutdown()  # waits for serve_forever to return: only once it runs
        self.server_close()
