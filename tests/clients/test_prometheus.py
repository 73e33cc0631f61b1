"""The Prometheus client over real HTTP: a small server answering /api/v1/query as Prometheus
does. Numbers are summed; nothing is None, never zero; a down server, an HTTP error or a refused
query is an error that says so."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from clients.errors import InvalidInput, Unavailable
from clients.prometheus import PrometheusApi
from lab.procs import free_port

ANSWERS: dict[str, tuple[int, Any]] = {
    "sum(vllm:num_requests_waiting)": (
        200,
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "7"]}]}},
    ),
    "vllm:num_requests_running": (
        200,
        {
            "status": "success",
            "data": {
                "resultType": "vector",
                "result": [{"metric": {"pod": "a"}, "value": [1, "3"]}, {"metric": {"pod": "b"}, "value": [1, "4.5"]}],
            },
        },
    ),
    "absent_metric": (200, {"status": "success", "data": {"resultType": "vector", "result": []}}),
    "scalar(0/0)": (200, {"status": "success", "data": {"resultType": "scalar", "result": [1, "NaN"]}}),
    "bad(": (400, {"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}),
    "slow": (503, {"status": "error", "error": "query timed out"}),
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query).get("query", [""])[0]
        status, body = ANSWERS.get(query, (404, {"status": "error", "error": "unknown"}))
        data = json.dumps(body).encode()
        self.send_response(status if url.path == "/api/v1/query" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[PrometheusApi]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield PrometheusApi(f"http://127.0.0.1:{server.server_address[1]}/")
    server.shutdown()


def test_a_vector_is_summed(prometheus: PrometheusApi) -> None:
    assert prometheus.query("sum(vllm:num_requests_waiting)") == 7
    assert prometheus.query("vllm:num_requests_running") == 7.5


def test_nothing_is_none_never_zero(prometheus: PrometheusApi) -> None:
    assert prometheus.query("absent_metric") is None
    assert prometheus.query("scalar(0/0)") is None


def test_a_refused_query_and_a_failing_server_say_which(prometheus: PrometheusApi) -> None:
    with pytest.raises(InvalidInput, match="refused the query 'bad\\(': parse error"):
        prometheus.query("bad(")
    with pytest.raises(Unavailable, match="query timed out"):
        prometheus.query("slow")


def test_an_unreachable_server_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="unreachable"):
        PrometheusApi(f"http://127.0.0.1:{free_port()}", timeout_seconds=2).query("up")
    with pytest.raises(InvalidInput, match="http"):
        PrometheusApi("localhost:9090")
