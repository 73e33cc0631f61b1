"""The DaemonSet keeps the detector's cursor across restarts and lets the kubelet and Prometheus see it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.conftest import gpufleet_cli

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "base" / "detector-daemonset.yaml"


def pod() -> dict[str, Any]:
    [daemonset] = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return dict(daemonset["spec"]["template"])


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_cursor_and_the_spool_live_on_the_host() -> None:
    spec = pod()["spec"]
    [container] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    args = container["args"]
    assert option(args, "--kmsg") == "/host/dev/kmsg"  # the kernel's records, not a forgeable text log
    for flag in ("--state-dir", "--spool"):
        volume = volumes[mounts[option(args, flag)]]
        assert volume["hostPath"]["type"] == "DirectoryOrCreate", flag


def test_liveness_and_metrics_on_the_health_port() -> None:
    template = pod()
    [container] = template["spec"]["containers"]
    port = int(option(container["args"], "--health-port"))
    [declared] = container["ports"]
    assert declared["containerPort"] == port
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": declared["name"]}
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_every_option_the_daemonset_passes_exists() -> None:
    [container] = pod()["spec"]["containers"]
    done = gpufleet_cli(*container["args"][:1], "--help")
    assert done.returncode == 0, done.stderr
    for flag in (arg for arg in container["args"] if arg.startswith("--")):
        assert flag in done.stdout, flag
