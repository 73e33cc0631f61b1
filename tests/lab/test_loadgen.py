"""The lab's inference load through a real Prometheus: the load generator's vLLM metrics are
scraped, and the vLLM preset's query over Prometheus' HTTP API (gpufleet's own client) follows
the load as `lab demand` changes it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.prometheus import PrometheusApi
from lab.loadgen import metrics, read_load, serve, write_load
from lab.procs import free_port, wait_for
from lab.prometheus import Prometheus, prometheus_installed, start_prometheus
from models.rebalance import PRESETS, inference_nodes


def test_the_metrics_carry_vllms_names_and_add_up_to_the_load() -> None:
    text = metrics(80)
    assert "# TYPE vllm:num_requests_waiting gauge" in text
    running = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
    waiting = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_waiting"))
    assert (running, waiting) == (64, 16)


def test_the_load_file_is_written_whole_and_a_bad_value_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    assert read_load(path) == 0.0  # none yet
    write_load(path, 64)
    with pytest.raises(ValueError, match="a number of requests"):
        write_load(path, -1)
    assert read_load(path) == 64


@pytest.fixture
def scraped(tmp_path: Path) -> Iterator[tuple[Path, Prometheus]]:
    if prometheus_installed():
        pytest.skip(prometheus_installed())
    load = tmp_path / "load.json"
    port = free_port()
    server = serve(port, load)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prometheus = start_prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"])
    yield load, prometheus
    prometheus.stop()
    server.shutdown()


def test_prometheus_scrapes_the_load_and_the_preset_follows_it(scraped: tuple[Path, Prometheus]) -> None:
    load, prometheus = scraped
    query, per_node = PRESETS["vllm"]
    api = PrometheusApi(prometheus.url)
    write_load(load, 64)
    wait_for(lambda: api.query(query) == 64, timeout=60, what="Prometheus to see a load of 64")
    assert inference_nodes(64, per_node) == 2  # two nodes' worth for the pool
    write_load(load, 16)
    wait_for(lambda: api.query(query) == 16, timeout=60, what="Prometheus to see the load fall to 16")
