"""A local Slack-compatible webhook receiver that records every notification.

POST any path: the JSON body is appended to the record file (JSON lines).
GET /messages: every notification received so far, as a JSON array.

Run it as ``python -m lab.webhook --port N --record FILE``.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    server: WebhookReceiver

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except json.JSONDecodeError:
            self.send_error(400, "body is not JSON")
            return
        if not isinstance(body, dict) or "text" not in body:
            self.send_error(400, 'expected a JSON object with "text"')
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


class WebhookReceiver(ThreadingHTTPServer):
    """Records what it receives, in memory and (optionally) in a JSON-lines file."""

    daemon_threads = True

    def __init__(self, port: int = 0, *, record_file: Path | None = None) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self._lock = threading.Lock()
        self._messages: list[dict[str, Any]] = []
        self._record_file = record_file

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
