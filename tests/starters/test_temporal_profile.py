"""Temporal's env-config profiles reach the client: address, namespace, API key, TLS (mTLS included).

A worker pointed at Temporal Cloud or a TLS cluster gets all of it from a TOML profile
(TEMPORAL_CONFIG_FILE, TEMPORAL_PROFILE); nothing of it is gpufleet's own setting.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from starters.temporal import API_ADDRESS_VARIABLE, TemporalUnreachable, connect, connect_config, refusal
from tests.conftest import gpufleet_cli

TLS_HANDSHAKE = 0x16  # the first byte of a TLS record carrying a handshake (the ClientHello)


@pytest.fixture(autouse=True)
def no_temporal_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Only the profile file speaks: not whatever this shell exports for its own Temporal."""
    for name in list(os.environ):
        if name.startswith("TEMPORAL_"):
            monkeypatch.delenv(name)
    yield


def write_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str) -> Path:
    path = tmp_path / "temporal.toml"
    path.write_text(toml)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(path))
    return path


def throwaway_pem(tmp_path: Path, name: str, kind: str) -> Path:
    path = tmp_path / name
    path.write_bytes(f"-----BEGIN {kind}-----\n{name}\n-----END {kind}-----\n".encode())
    return path


def client_certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A real self-signed certificate and its key: the TLS stack parses both before it connects."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip(
            "openssl is not on PATH and the venv has no `cryptography`: no certificate and key the "
            "client's TLS stack would accept, so the mTLS handshake cannot be started"
        )
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=gpufleet-worker"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_api_key_profile_gives_address_namespace_key_and_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_profiles(
        tmp_path,
        monkeypatch,
        """
[profile.cloud]
address = "fleet.a1b2c.tmprl.cloud:7233"
namespace = "fleet.a1b2c"
api_key = "throwaway-api-key"
""",
    )
    # An API key without a [tls] table still means TLS: Temporal Cloud takes nothing else.
    assert connect_config("cloud") == {
        "target_host": "fleet.a1b2c.tmprl.cloud:7233",
        "namespace": "fleet.a1b2c",
        "api_key": "throwaway-api-key",
        "tls": True,
    }


def test_mtls_profile_reads_the_certificate_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert = throwaway_pem(tmp_path, "client.pem", "CERTIFICATE")
    key = throwaway_pem(tmp_path, "client.key", "PRIVATE KEY")
    ca = throwaway_pem(tmp_path, "ca.pem", "CERTIFICATE")
    write_profiles(
        tmp_path,
        monkeypatch,
        f"""
[profile.mtls]
address = "temporal.fleet.internal:7233"
namespace = "fleet"

[profile.mtls.tls]
client_cert_path = "{cert}"
client_key_path = "{key}"
server_ca_cert_path = "{ca}"
server_name = "temporal.fleet.internal"
""",
    )
    config = connect_config("mtls")
    assert config["target_host"] == "temporal.fleet.internal:7233"
    assert config["namespace"] == "fleet"
    assert "api_key" not in config
    tls = config["tls"]
    assert isinstance(tls, TLSConfig)
    assert tls.client_cert == cert.read_bytes()
    assert tls.client_private_key == key.read_bytes()
    assert tls.server_root_ca_cert == ca.read_bytes()
    assert tls.domain == "temporal.fleet.internal"


def test_mtls_profile_with_inline_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The certificate in the profile itself: one file (one secret) holds the whole client identity."""
    write_profiles(
        tmp_path,
        monkeypatch,
        '''
[profile.mtls]
address = "temporal.fleet.internal:7233"

[profile.mtls.tls]
client_cert_data = """-----BEGIN CERTIFICATE-----
inline
-----END CERTIFICATE-----
"""
client_key_data = """-----BEGIN PRIVATE KEY-----
inline
-----END PRIVATE KEY-----
"""
''',
    )
    tls = connect_config("mtls")["tls"]
    assert isinstance(tls, TLSConfig)
    assert tls.client_cert is not None and b"BEGIN CERTIFICATE-----\ninline" in tls.client_cert
    assert tls.client_private_key is not None and b"BEGIN PRIVATE KEY-----\ninline" in tls.client_private_key


def test_profile_is_chosen_by_temporal_profile_and_env_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_profiles(
        tmp_path,
        monkeypatch,
        """
[profile.default]
address = "localhost:7233"

[profile.cloud]
address = "fleet.a1b2c.tmprl.cloud:7233"
namespace = "fleet.a1b2c"
api_key = "throwaway-api-key"
""",
    )
    assert connect_config() == {"target_host": "localhost:7233"}
    monkeypatch.setenv("TEMPORAL_PROFILE", "cloud")
    assert connect_config()["namespace"] == "fleet.a1b2c"
    # What the compose file's worker relies on: TEMPORAL_ADDRESS / TEMPORAL_NAMESPACE win over the file.
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "default")
    config = connect_config()
    assert (config["target_host"], config["namespace"], config["api_key"]) == (
        "temporal:7233",
        "default",
        "throwaway-api-key",
    )


def test_no_profile_file_means_the_local_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compose file's default: an empty profile file (/dev/null) and no TEMPORAL_PROFILE."""
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", os.devnull)
    assert connect_config() == {"target_host": "localhost:7233"}


class HelloRecorder:
    """A plain TCP listener that keeps the first record each client sends, then hangs up."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await asyncio.wait_for(reader.readexactly(5), timeout=5)
            body = await asyncio.wait_for(reader.readexactly(int.from_bytes(header[3:5], "big")), timeout=5)
            self.records.append(header + body)
        except (asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            writer.close()


async def unreachable(profile: str) -> str:
    """connect() with the profile, against the recorder: the failure's message."""
    with pytest.raises(TemporalUnreachable) as failure:
        await connect(profile=profile, timeout_seconds=10)
    return str(failure.value)


def cloud_profile(address: str, api_key: str) -> str:
    """A Temporal Cloud profile (an API key, so TLS) named cloud, at ``address``."""
    return f"""
[profile.cloud]
address = "{address}"
namespace = "fleet.a1b2c"
api_key = "{api_key}"
"""


async def test_api_key_profile_connects_with_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = HelloRecorder()
    async with recorder as address:
        write_profiles(tmp_path, monkeypatch, cloud_profile(address, "throwaway-api-key"))
        message = await unreachable("cloud")
    assert address in message
    # A plain gRPC client would have opened with the HTTP/2 preface ("PRI * HTTP/2.0"), not a handshake.
    assert recorder.records and recorder.records[0][0] == TLS_HANDSHAKE, recorder.records
    assert b"throwaway-api-key" not in recorder.records[0]  # the key never goes out before TLS is up


async def test_mtls_profile_connects_with_tls_to_its_server_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = client_certificate(tmp_path)
    recorder = HelloRecorder()
    async with recorder as address:
        write_profiles(
            tmp_path,
            monkeypatch,
            f"""
[profile.mtls]
address = "{address}"
namespace = "fleet"

[profile.mtls.tls]
client_cert_path = "{cert}"
client_key_path = "{key}"
server_name = "temporal.fleet.internal"
""",
        )
        message = await unreachable("mtls")
    assert address in message
    assert recorder.records and recorder.records[0][0] == TLS_HANDSHAKE, recorder.records
    # The profile's server_name is the SNI of the ClientHello. (The client certificate itself is sent
    # only when a server asks for it, encrypted, so a listener that hangs up cannot see it.)
    assert b"temporal.fleet.internal" in recorder.records[0]


async def test_the_worker_connects_as_its_profile_says_and_never_shows_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpufleet worker` itself, started with TEMPORAL_PROFILE: it opens TLS to the profile's
    address, and when nothing answers there it stops, naming the address and not the API key."""
    recorder = HelloRecorder()
    async with recorder as address:
        write_profiles(tmp_path, monkeypatch, cloud_profile(address, "throwaway-api-key-7d2e"))
        env = {
            "TEMPORAL_PROFILE": "cloud",
            "GPUFLEET_METRICS_PORT": "0",
            "GPUFLEET_HOME": str(tmp_path),
            "GPUFLEET_CLUSTER": "prod",  # a worker names the cluster it serves; it has no default
        }
        done = await asyncio.to_thread(
            gpufleet_cli,
            "worker",
            env=env,
            # The worker's own defaults, not whatever this shell sets for another worker.
            unset=tuple(name for name in os.environ if name.startswith("GPUFLEET_") and name not in env),
            timeout=120,
        )
    said = done.stdout + done.stderr
    assert done.returncode != 0 and address in said, said
    assert recorder.records and recorder.records[0][0] == TLS_HANDSHAKE, recorder.records
    assert "throwaway-api-key-7d2e" not in said


def test_a_refusal_names_who_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = RPCError("alice may not approve gpufleet.io/incidents", RPCStatusCode.PERMISSION_DENIED, b"")
    monkeypatch.delenv(API_ADDRESS_VARIABLE, raising=False)
    assert refusal(denied) == "the Temporal server refused: alice may not approve gpufleet.io/incidents"
    monkeypatch.setenv(API_ADDRESS_VARIABLE, "gpufleet-api:7243")
    assert refusal(denied) == "the gpufleet API refused: alice may not approve gpufleet.io/incidents"
