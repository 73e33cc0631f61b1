"""A local Slack-compatible webhook receiver that records every notification.

POST any path: the JSON body is appended to the record file (JSON lines).
GET /messages: every notification received so far, as a JSON array.
PUT /behaviour with {"status": 200|4xx|5xx, "retry_after": S, "hang_seconds": S}: how to
answer the next notifications (a bad day for the notifier, on purpose); {} restores 200.

Run it as ``python -m lab.webhook --port N --record FILE``.
"""

from __future__ import annotations

import argparse
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    server: WebhookReceiver

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length", "0"))
        return json.loads(self.rfile.read(length) or b"null")

    def do_PUT(self) -> None:
        if self.path.rstrip("/") != "/behaviour":
            self.send_error(404)
            return
        try:
            self.server.behaviour = Behaviour(**(self._body() or {}))
        except (json.JSONDecodeError, TypeError) as exc:
            self.send_error(400, f"bad behaviour: {exc}")
            return
        self.send_response(204)
        self.end_headers()

    def do_POST(self) -> None:
        try:
            body = self._body()
        except json.JSONDecodeError:
            self.send_error(400, "body is not JSON")
            return
        if not isinstance(body, dict) or "text" not in body:
            self.send_error(400, 'expected a JSON object with "text"')
            return
        behaviour = self.server.behaviour
        self.server.attempts += 1
        if behaviour.hang_seconds:
            self.server.hung.wait(behaviour.hang_seconds)  # set on shutdown, so a test never waits it out
        if behaviour.status != 200:
            self.send_response(behaviour.status)
            if behaviour.retry_after is not None:
                self.send_header("Retry-After", str(behaviour.retry_after))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.record(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/messages":
            self.send_error(404)
            return
        payload = json.dumps(self.server.messages()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        return


@dataclass
class Behaviour:
    status: int = 200
    retry_after: float | None = None
    hang_seconds: float = 0.0


class WebhookReceiver(ThreadingHTTPServer):
    """Records what it receives, in memory and (optionally) in a JSON-lines file."""

    daemon_threads = True

    def __init__(self, port: int = 0, *, record_file: Path | None = None) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self._lock = threading.Lock()
        self._messages: list[dict[str, Any]] = []
        self._record_file = record_file
        self.behaviour = Behaviour()
        self.attempts = 0  # POSTs received, answered or not
        self.hung = threading.Event()

    def shutdown(self) -> None:
        self.hung.set()
        super().shutdown()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def record(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._messages.append(body)
            if self._record_file is not None:
                with open(self._record_file, "a", encoding="utf-8") as out:
                    out.write(json.dumps(body) + "\n")

    def messages(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._messages)

    def start_background(self) -> WebhookReceiver:
        threading.Thread(target=self.serve_forever, name="webhook", daemon=True).start()
        return self


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.webhook", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--record", type=Path, help="append every notification to this JSON-lines file")
    parser.add_argument("--ready-file", type=Path, help="write the webhook URL here once listening")
    args = parser.parse_args()
    receiver = WebhookReceiver(args.port, record_file=args.record)
    if args.ready_file:
        args.ready_file.write_text(receiver.url, encoding="utf-8")
    print(f"webhook receiver on {receiver.url}", flush=True)
    receiver.serve_forever()


if __name__ == "__main__":
    main()
