"""clients/slurmrest.py without a server: the token it signs, the shapes it sends to the slurmdb
API of v0.0.40+, and how it words what a server refuses. Against real servers: Debian's 22.05
(v0.0.38) in test_slurmrest.py, Slurm 24.11 (v0.0.40-v0.0.42) and 26.05 (v0.0.42-v0.0.45) in
test_slurmrest_protocol.py (detecting the version, ping, submitting, reading jobs and nodes), and
26.05's accounting API (v0.0.42-v0.0.45, with slurmdbd) in tests/lab/test_slinky_accounting.py."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import httpx
import pytest

from clients.slurmrest import SlurmRestClient, SlurmRestError, jwt_token

KEY = b"k" * 32


def _claims(token: str) -> dict[str, Any]:
    part = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    return claims


def test_the_token_is_hs256_for_the_user_and_short_lived() -> None:
    token = jwt_token(KEY, "alice", lifetime=300, now=1_700_000_000)
    header, claims, signature = token.split(".")
    assert json.loads(base64.urlsafe_b64decode(header + "==")) == {"alg": "HS256", "typ": "JWT"}
    assert _claims(token) == {"iat": 1_700_000_000, "exp": 1_700_000_300, "sun": "alice"}
    expected = hmac.new(KEY, f"{header}.{claims}".encode(), hashlib.sha256).digest()
    assert base64.urlsafe_b64decode(signature + "=") == expected


class Recorder:
    """A server of one API version, answering as Slurm's OpenAPI documents describe."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if not path.startswith(f"/slurm/{self.version}/"):
            return httpx.Response(404, text="Not Found")
        if path.endswith("/ping"):
            return httpx.Response(
                200,
                json={
                    "meta": {"slurm": {"release": "25.11.0"}},
                    "pings": [{"hostname": "ctld", "pinged": "UP", "responding": True, "mode": "primary"}],
                    "errors": [],
                },
            )
        if path.endswith("/job/submit"):
            return httpx.Response(200, json={"job_id": 42, "step_id": "batch", "errors": [], "warnings": []})
        if path.endswith("/job/42"):
            return httpx.Response(200, json={"jobs": [{"job_id": 42, "job_state": ["COMPLETED"]}], "errors": []})
        if path.endswith("/nodes"):
            return httpx.Response(
                200,
                json={
                    "nodes": [
                        {"name": "research-train-0", "state": ["IDLE"], "partitions": ["train"]},
                        {"name": "research-train-1", "state": ["IDLE", "DRAIN"], "partitions": ["train"]},
                    ],
                    "errors": [],
                },
            )
        return httpx.Response(500, json={"errors": [{"description": "Nothing found", "source": "test"}]})


def test_the_oldest_shape_puts_the_script_beside_the_job() -> None:
    server = Recorder("v0.0.38")

    def old(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/job/submit"):
            server.requests.append(request)
            return httpx.Response(200, json={"job_id": 7, "errors": []})
        return server(request)

    client = SlurmRestClient("http://restapi:6820", KEY, transport=httpx.MockTransport(old))
    assert client.detect_version() == "v0.0.38"
    client.submit("#!/bin/sh\ntrue\n", user="bob", partition="debug", name="x")
    body = json.loads(server.requests[-1].content)
    assert body["script"] == "#!/bin/sh\ntrue\n" and body["job"]["environment"] == {
        "PATH": "/usr/local/bin:/usr/bin:/bin"
    }


def test_a_server_that_serves_no_known_version_is_named() -> None:
    client = SlurmRestClient("http://restapi:6820", KEY, transport=httpx.MockTransport(Recorder("v0.0.36")))
    with pytest.raises(SlurmRestError, match=r"serves none of v0\.0\.45"):
        client.detect_version()


def test_an_unknown_version_is_refused_before_any_call() -> None:
    with pytest.raises(ValueError, match=r"unknown slurmrestd API version .v0\.0\.39."):
        SlurmRestClient("http://restapi:6820", KEY, version="v0.0.39")


def test_slurms_errors_are_quoted_with_their_source() -> None:
    client = SlurmRestClient(
        "http://restapi:6820", KEY, version="v0.0.42", transport=httpx.MockTransport(Recorder("v0.0.42"))
    )
    with pytest.raises(SlurmRestError, match=r"refused GET /slurm/v0.0.42/jobs \(500\): Nothing found \(test\)"):
        client.jobs()


def test_a_newer_server_gets_the_user_with_its_association_then_its_record() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content or b"{}")))
        return httpx.Response(200, json={"errors": []})

    client = SlurmRestClient("http://restapi:6820", KEY, version="v0.0.42", transport=httpx.MockTransport(server))
    client.add_user("alice", account="vision", cluster="research", admin=True)
    assert sent == [
        (
            "/slurmdb/v0.0.42/users_association",
            {
                "association_condition": {"users": ["alice"], "accounts": ["vision"], "clusters": ["research"]},
                "user": {"adminlevel": ["Administrator"], "defaultaccount": "vision"},
            },
        ),
        (
            "/slurmdb/v0.0.42/users",
            {"users": [{"name": "alice", "default": {"account": "vision"}, "administrator_level": ["Administrator"]}]},
        ),
    ]


def test_accounts_on_a_newer_server_are_checked_by_their_association_and_removed_per_cluster() -> None:
    sent: list[tuple[str, str, dict[str, Any], dict[str, str]]] = []
    associations = [{"cluster": "research", "account": "root", "user": ""}]

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        sent.append((request.method, request.url.path, body, dict(request.url.params)))
        if request.method == "GET":
            return httpx.Response(200, json={"associations": associations, "errors": []})
        if request.url.path.endswith("/accounts_association"):
            condition = body["association_condition"]
            associations.extend(
                {"cluster": cluster, "account": account, "user": ""}
                for account in condition["accounts"]
                for cluster in condition["clusters"]
            )
        return httpx.Response(200, json={"errors": []})

    client = SlurmRestClient("http://restapi:6820", KEY, version="v0.0.43", transport=httpx.MockTransport(server))
    client.add_account("vision", cluster="research")
    assert client.associations("research") == {("root", ""), ("vision", "")}
    # One request, as sacctmgr adds an account: never an association naming no user.
    assert sent[0][1:3] == (
        "/slurmdb/v0.0.43/accounts_association",
        {
            "association_condition": {"accounts": ["vision"], "clusters": ["research"]},
            "account": {"description": "vision", "organization": "vision"},
        },
    )
    client.remove_association("research", "vision", "alice")
    assert sent[-1][:2] == ("DELETE", "/slurmdb/v0.0.43/association")
    assert sent[-1][3] == {"cluster": "research", "account": "vision", "user": "alice"}


def test_an_account_whose_association_never_appears_is_an_error() -> None:
    def server(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"associations": [], "errors": []})
        return httpx.Response(200, json={"errors": []})

    client = SlurmRestClient("http://restapi:6820", KEY, version="v0.0.42", transport=httpx.MockTransport(server))
    with pytest.raises(SlurmRestError, match="took account vision but it has no association on research"):
        client.add_account("vision", cluster="research")
