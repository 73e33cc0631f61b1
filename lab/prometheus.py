"""A real Prometheus server (Debian's ``prometheus`` package) for the lab: it scrapes the lab's
load generator every second and answers gpufleet's pool rebalancing over its HTTP API."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx

from lab.procs import free_port, spawn, stop, wait_for


def prometheus_installed() -> str:
    """'' when Prometheus is installed, else what to install."""
    return "" if shutil.which("prometheus") else "prometheus is missing: apt-get install prometheus"


def config(targets: list[str]) -> str:
    """prometheus.yml scraping ``targets`` (host:port) every second."""
    quoted = ", ".join(f'"{t}"' for t in targets)
    return (
        "# Written by gpufleet's lab.\n"
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: inference\n    static_configs:\n      - targets: [{quoted}]\n"
    )


@dataclass
class Prometheus:
    pid: int
    url: str

    def stop(self) -> None:
        stop([self.pid], timeout=15)


def start_prometheus(root: Path, targets: list[str], *, timeout: float = 60.0) -> Prometheus:
    """Prometheus with its data under ``root``, on a free port, ready to answer queries."""
    missing = prometheus_installed()
    if missing:
        raise RuntimeError(missing)
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "prometheus.yml"
    conf.write_text(config(targets))
    port = free_port()
    argv = [
        "prometheus",
        f"--config.file={conf}",
        f"--storage.tsdb.path={root / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
    ]
    pid = spawn(argv, log=root / "prometheus.log")
    url = f"http://127.0.0.1:{port}"
    server = Prometheus(pid, url)
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, timeout=timeout, what="Prometheus")
    except TimeoutError:
        server.stop()
        raise
    return server
