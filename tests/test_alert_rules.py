"""The example alert rules (deploy/base/prometheus-rules.yaml): valid for Prometheus, firing (and
staying quiet) as intended, and reading only metrics that gpufleet or the Temporal SDK export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from models import metrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "base" / "prometheus-rules.yaml"
RULE_TESTS = ROOT / "tests" / "data" / "prometheus-rules-test.yaml"
DETECTOR = ROOT / "detector" / "health.py"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip(
            "promtool is missing: the alert rules are checked with it (Debian: apt-get install prometheus; "
            "`make test` installs it as root)"
        )
    return found


def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_alerts_fire_and_stay_quiet_as_intended() -> None:
    done = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _exported() -> set[str]:
    """Every gpufleet_* name the worker (models/metrics.py) and the detector (detector/health.py) export."""
    worker = {value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)}
    detector = set(re.findall(r'"(gpufleet_detector_[a-z_]+)"', DETECTOR.read_text()))
    return {name for name in worker | detector if name.startswith("gpufleet_")}


def test_every_alert_reads_metrics_that_are_exported() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    exported = _exported()
    read = {
        name
        for rule in rules
        for name in re.findall(r"\b((?:gpufleet|temporal)[a-z_:]*)\b", rule["expr"])
        if not name.startswith("gpufleet.io")
    }
    unknown = {name for name in read if name.startswith("gpufleet_") and name not in exported}
    assert not unknown, f"the rules read metrics nobody exports: {sorted(unknown)}"
    assert {name for name in read if ":" in name} <= recorded
    # The SDK's metric the rules read is checked against a live endpoint in tests/workers/test_metrics.py.
    assert {name for name in read if name.startswith("temporal_")} == {"temporal_activity_execution_failed"}
    alerts = {rule["alert"] for rule in rules if "alert" in rule}
    assert {
        "GpufleetIncidentStuckInStep",
        "GpufleetNoSpareFree",
        "GpufleetBreakerTripped",
        "GpufleetDetectorSilent",
        "GpufleetConfigRefused",
    } <= alerts
