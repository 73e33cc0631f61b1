"""The slurmrestd token never reaches an error or the log, whatever the server quotes back: a
server (or a proxy before it) that echoes the request's headers in its refusal, as JSON errors
or as plain text longer than what an error keeps. Needs no Slurm: a local HTTP server answers."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clients.errors import redact
from clients.slurmrest import SlurmRestClient, SlurmRestError

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdW4iOiJyb290In0.c2lnbmF0dXJlLXRoYXQtbXVzdC1zdGF5LXNlY3JldA"


def test_redact_leaves_no_part_of_a_secret() -> None:
    assert redact(f"refused {JWT} for root", JWT) == "refused [token] for root"
    # A secret across the cut: redacted before it is cut, so none of it is left.
    said = redact("x" * 290 + "secret-abcdefghijkl", "secret-abcdefghijkl")
    assert said == "x" * 290 + "[token]"[:10] and "secret" not in said
    # A JWT it was not told of, cut short by the server, and a token header quoted back.
    assert redact(f"saw {JWT[:40]}") == "saw [token]"
    assert redact('{"X-SLURM-USER-TOKEN": "opaque-token-1"}') == '{"X-SLURM-USER-TOKEN": "[token]"}'
    assert redact("nothing secret here", "") == "nothing secret here"  # an empty secret is no secret


class Echo:
    """An HTTP server that refuses every request with 500, quoting its headers back, as JSON
    errors or as plain text whose first 300 characters end inside the token."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.plain = False
        echo = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                echo.tokens.append(self.headers["X-SLURM-USER-TOKEN"])
                token = self.headers["X-SLURM-USER-TOKEN"]
                quoted = f"bad request, headers {dict(self.headers)}"
                if echo.plain:  # padded so that an error's 300 characters end inside the token's signature
                    said = f"bad request, your token was {token}"
                    pad = "." * (300 - (len(token) - 20) - said.index(token))
                    body, kind = (pad + said).encode(), "text/plain"
                else:
                    body, kind = json.dumps({"errors": [{"description": quoted}]}).encode(), "application/json"
                self.send_response(500)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    server = Echo()
    yield server
    server.stop()


@pytest.mark.parametrize("plain", [False, True], ids=["json", "plain-text"])
def test_a_refusal_that_echoes_the_token_is_told_without_it(
    echo: Echo, caplog: pytest.LogCaptureFixture, plain: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    echo.plain = plain
    client = SlurmRestClient(echo.url, b"k" * 32, timeout=10)
    try:
        with pytest.raises(SlurmRestError, match=r"refused GET /slurm/v0.0.38/ping \(500\): .*bad request") as refused:
            client.ping()
    finally:
        client.close()
    assert echo.tokens
    for token in echo.tokens:
        for part in (token, token.rsplit(".", 1)[-1][:12]):  # the token, or its signature's start
            assert part not in str(refused.value) and part not in caplog.text
