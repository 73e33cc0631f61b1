"""The detector's heartbeat in /metrics: a quiet node's detector still beats, a stopped one does not."""

from __future__ import annotations

import time

from detector.daemon import Detector
from detector.health import render_metrics
from models.policy import Policy


def heartbeat(detector: Detector) -> float:
    [line] = [line for line in render_metrics(detector).splitlines() if line.startswith("gpufleet_detector_heartbeat")]
    return float(line.rsplit(" ", 1)[1])


def test_the_heartbeat_is_the_unix_time_the_main_loop_last_came_round() -> None:
    detector = Detector(node="gpu7", policy=Policy(), delivery=None, out=lambda line: None)
    assert heartbeat(detector) == 0  # not started
    detector.last_tick = time.monotonic() - 30  # the loop stopped 30 s ago
    assert abs(heartbeat(detector) - (time.time() - 30)) < 2
    detector.last_tick = time.monotonic()
    assert abs(heartbeat(detector) - time.time()) < 2
    assert "# TYPE gpufleet_detector_heartbeat_timestamp_seconds gauge" in render_metrics(detector)
