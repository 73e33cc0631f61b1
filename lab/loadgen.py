"""The lab's inference load: a server that reports a vLLM deployment's metrics, by vLLM's own
names, at ``/metrics`` in Prometheus' text format, for a real Prometheus to scrape.

The load is a number of requests in flight, kept in a file (``gpufleet lab demand VALUE``
writes it; the server reads it at each scrape): up to ``RUNNING_PER_REPLICA`` per replica run,
the rest wait, and the KV-cache use follows the running share. With the ``vllm`` preset (32
requests a node), ``lab demand 64`` asks for two inference nodes.

Run it as ``python -m lab.loadgen --load-file F [--port N] [--ready-file F]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RUNNING_PER_REPLICA = 32
REPLICAS = 2  # the replicas the figures are spread over (labels only: the total is what counts)


def read_load(path: Path) -> float:
    """The requests in flight the file says (0 when there is none or it cannot be read)."""
    try:
        value = float(json.loads(path.read_text())["requests"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return max(value, 0.0)


def write_load(path: Path, requests: float) -> None:
    if not requests >= 0:
        raise ValueError(f"the load is a number of requests, 0 or more, not {requests!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"requests": requests}))
    tmp.replace(path)  # a scrape never reads half a file


def metrics(requests: float) -> str:
    """The vLLM gauges for ``requests`` in flight, spread over the replicas."""
    lines = []
    share = requests / REPLICAS
    for name, help_text in (
        ("vllm:num_requests_running", "Number of requests currently running on GPU."),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for replica in range(REPLICAS):
            running = min(share, RUNNING_PER_REPLICA)
            value = {
                "vllm:num_requests_running": running,
                "vllm:num_requests_waiting": share - running,
                "vllm:kv_cache_usage_perc": running / RUNNING_PER_REPLICA,
            }[name]
            lines.append(f'{name}{{model_name="lab-model",replica="{replica}"}} {value:g}')
    return "\n".join(lines) + "\n"


def serve(port: int, load_file: Path) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            body = metrics(read_load(load_file)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # a scrape a second: not worth a line each

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--load-file", type=Path, required=True)
    parser.add_argument("--ready-file", type=Path, help="its URL, written once it listens")
    args = parser.parse_args()
    server = serve(args.port, args.load_file)
    if args.ready_file is not None:
        args.ready_file.write_text(f"127.0.0.1:{server.server_address[1]}", encoding="utf-8")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"vLLM metrics on http://127.0.0.1:{server.server_address[1]}/metrics (load: {args.load_file})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
