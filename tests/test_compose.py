"""docker-compose.temporal.yml: Temporal on PostgreSQL, its schema, the UI, and a gpufleet worker."""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from models.constants import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = "docker-compose.temporal.yml"
SCHEMA_DIR = "/etc/temporal/schema/postgresql/v12"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / COMPOSE_FILE).read_text())
    return loaded


def service(name: str) -> dict[str, Any]:
    found: dict[str, Any] = compose()["services"][name]
    return found


def script(name: str) -> str:
    """The shell script a one-shot service runs (entrypoint ``sh -c``, the script as its command)."""
    svc = service(name)
    assert svc["entrypoint"] == ["/bin/sh", "-c"], name
    [text] = svc["command"]
    assert isinstance(text, str)
    return text


def lines(text: str) -> list[str]:
    """The script's commands, continuation lines joined."""
    return [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    result = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def test_compose_registers_every_search_attribute() -> None:
    commands = lines(script("temporal-setup"))
    [create] = [c for c in commands if "search-attribute create" in c]
    registered = dict(re.findall(r"--name (\w+) --type (\w+)", create))
    expected = {key.name: key.indexed_value_type.name.removeprefix("INDEXED_VALUE_TYPE_") for key in SEARCH_ATTRIBUTES}
    assert {name: kind.upper() for name, kind in registered.items()} == expected
    assert "--namespace default" in create
    # Idempotent by the CLI itself (same name, same type: left as it is); a real failure fails the step.
    assert "|| true" not in create and commands[0] == "set -eu"
    # The namespace exists first: the server (unlike the old auto-setup image) creates none.
    assert any("namespace create --namespace default" in c for c in commands[: commands.index(create)])
    # The worker starts only once the attributes are there.
    assert service("gpufleet-worker")["depends_on"]["temporal-setup"] == {"condition": "service_completed_successfully"}


def test_docker_compose_config_accepts_the_file() -> None:
    """What Debian's docker-compose 1.29 accepts (`make test` installs it): no engine is needed for this."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not on PATH: scripts/system-deps.sh installs Debian's (1.29) as root")
    # The defaults, not whatever this shell exports for its own Temporal or Slurm.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "GPUFLEET_", "COMPOSE_"))}
    result = subprocess.run(
        [binary, "-f", str(ROOT / COMPOSE_FILE), "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    # It kept what it was given rather than dropping what it did not know.
    services = rendered["services"]
    assert services["temporal"]["depends_on"]["temporal-schema"]["condition"] == "service_completed_successfully"
    assert {s["source"] for s in services["gpufleet-worker"]["secrets"]} >= {"slurm_conf", "munge_key", "kubeconfig"}
    assert rendered["secrets"]["slurm_conf"]["file"] == str(ROOT / "secrets" / "slurm.conf")
    assert services["gpufleet-worker"]["environment"]["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert services["gpufleet-worker"]["build"]["args"] == {"SLURM_CLIENT": "22.05"}


def test_every_image_is_pinned() -> None:
    for name, svc in compose()["services"].items():
        if "build" in svc:
            continue
        tag = svc["image"].partition(":")[2]
        assert re.fullmatch(r"\d+(\.\d+)+", tag), f"{name}: {svc['image']} is not pinned to a version"


def test_server_is_temporalio_server_started_after_the_schema_step() -> None:
    text = (ROOT / COMPOSE_FILE).read_text()
    assert "temporalio/auto-setup" not in text
    server = service("temporal")
    image, _, version = server["image"].partition(":")
    assert image == "temporalio/server"
    assert service("temporal-schema")["image"] == f"temporalio/admin-tools:{version}"
    assert server["depends_on"] == {"temporal-schema": {"condition": "service_completed_successfully"}}
    # Its config template's variables: PostgreSQL 12+ at the postgresql service.
    env = server["environment"]
    assert env["DB"] == "postgres12" and env["POSTGRES_SEEDS"] == "postgresql"
    assert env["DB_PORT"] == "5432" and env["POSTGRES_USER"] == "temporal"
    # The image ships no dynamic config and the server refuses to start without the file it names.
    assert f"> {env['DYNAMIC_CONFIG_FILE_PATH']}" in script("temporal")
    assert lines(script("temporal"))[-1] == "exec /etc/temporal/entrypoint.sh"


def test_every_healthy_dependency_has_a_healthcheck() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        for dependency, condition in svc.get("depends_on", {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}, which has none"
    assert "healthcheck" in services["gpufleet-worker"]


def test_schema_step_creates_sets_up_and_updates_both_databases() -> None:
    commands = lines(script("temporal-schema"))
    assert commands[0] == "set -eu"
    env = service("temporal-schema")["environment"]
    assert env["SQL_HOST"] == "postgresql" and env["SQL_PLUGIN"] == "postgres12"
    schema = next(c.split("=", 1)[1] for c in commands if c.startswith("schema="))
    assert schema == SCHEMA_DIR
    for database, versioned in (("temporal", "temporal"), ("temporal_visibility", "visibility")):
        tool = f"temporal-sql-tool --plugin postgres12 --db {database}"
        steps = [
            f"{tool} create",
            f"{tool} setup-schema -v 0.0",
            f'{tool} update-schema -d "$$schema/{versioned}/versioned"',
        ]
        positions = [commands.index(step) for step in steps]
        assert positions == sorted(positions), f"{database}: create, then setup-schema, then update-schema"


def test_worker_is_built_from_the_dockerfile_and_runs_gpufleet_worker() -> None:
    worker = service("gpufleet-worker")
    # With the Slurm client of the cluster's release (tests/test_image_slurm_client.py): the
    # Dockerfile's default unless GPUFLEET_SLURM_CLIENT names another.
    default = next(rest for keyword, rest in dockerfile_instructions() if keyword == "ARG").partition("=")[2]
    assert worker["build"] == {
        "context": ".",
        "dockerfile": "Dockerfile",
        "args": {"SLURM_CLIENT": f"${{GPUFLEET_SLURM_CLIENT:-{default}}}"},
    }
    commands = lines(script("gpufleet-worker"))
    assert commands[-1] == "exec gpufleet worker"
    munged = next(i for i, c in enumerate(commands) if c.startswith("munged "))
    assert munged < len(commands) - 1, "munged runs before the worker"
    env = worker["environment"]
    assert env["TEMPORAL_ADDRESS"] == "${TEMPORAL_ADDRESS:-temporal:7233}"
    assert env["GPUFLEET_CLUSTER"].startswith("${GPUFLEET_CLUSTER:-")
    assert worker["depends_on"]["temporal"] == {"condition": "service_healthy"}


def test_dockerfile_runs_as_a_numeric_non_root_user_with_the_slurm_client() -> None:
    instructions = dockerfile_instructions()
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users, "the Dockerfile sets no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: not a numeric non-root UID"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    # The Slurm client and munge (scripts/image-slurm-client.sh) of the compose file's release.
    assert ("ARG", "SLURM_CLIENT=22.05") in instructions
    script = (ROOT / "scripts" / "image-slurm-client.sh").read_text()
    packages = set(re.findall(r"apt-get install -y --no-install-recommends ([^&;\n]*)", script)[0].split())
    assert packages == {"slurm-client", "munge"}
    installs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert f"-o {uid} " in installs and "/run/munge" in installs, "the MUNGE socket directory is the user's"
    assert instructions[-1] == ("ENTRYPOINT", '["gpufleet"]')


def test_worker_secrets_are_mounted_not_in_environment() -> None:
    worker = service("gpufleet-worker")
    mounts = {s["source"]: s["target"] for s in worker["secrets"]}
    assert mounts["slurm_conf"] == "/etc/slurm/slurm.conf"
    assert {"munge_key", "kubeconfig"} <= mounts.keys()
    secrets = compose()["secrets"]
    for name in mounts:
        # A file on the host, its path from an environment variable with a default.
        # (Temporal's certificates: a file of the folder that variable names.)
        assert re.fullmatch(r"\$\{[A-Z_]+:-[^}]+\}(/[\w.-]+)?", secrets[name]["file"]), f"{name}: {secrets[name]}"
    env = worker["environment"]
    assert env["GPUFLEET_SLURM_CONF"] == mounts["slurm_conf"]
    assert env["GPUFLEET_KUBECONFIG"] == f"/run/secrets/{mounts['kubeconfig']}"
    assert env["TEMPORAL_CONFIG_FILE"] == f"/run/secrets/{mounts['temporal_config']}"
    for forbidden in ("GPUFLEET_WEBHOOK_URL", "TEMPORAL_API_KEY", "MUNGE_KEY"):
        assert forbidden not in env
    for name, value in env.items():
        if name.endswith("_PATH") and str(value).startswith("/run/secrets/"):
            continue  # where a secret is mounted, not the secret
        assert not re.search(r"KEY|PASSWORD|TOKEN|SECRET", name), f"{name} belongs in a secret"
        assert "BEGIN" not in str(value)
    assert "volumes" not in worker
    commands = lines(script("gpufleet-worker"))
    assert f"install -m 0400 /run/secrets/{mounts['munge_key']} /home/gpufleet/munge.key" in commands
    # Nothing of the secrets goes into the image.
    copied = [rest for keyword, rest in dockerfile_instructions() if keyword in ("COPY", "ADD")]
    assert not [c for c in copied if "secret" in c or "munge" in c or "slurm.conf" in c]


# -- Temporal held by gpufleet: mutual TLS, a read-only UI (docs/threat-model.md) -----------------


def mounted(name: str) -> dict[str, str]:
    """A service's secrets: the path each is mounted at, by the secret's name."""
    return {s["source"]: f"/run/secrets/{s['target']}" for s in service(name)["secrets"]}


def test_the_frontend_requires_a_client_certificate_of_the_local_ca() -> None:
    env = service("temporal")["environment"]
    paths = mounted("temporal")
    assert env["TEMPORAL_TLS_REQUIRE_CLIENT_AUTH"] == "true"
    assert env["TEMPORAL_TLS_CLIENT1_CA_CERT"] == env["TEMPORAL_TLS_SERVER_CA_CERT"] == paths["temporal_ca"]
    assert env["TEMPORAL_TLS_FRONTEND_CERT"] == env["TEMPORAL_TLS_SERVER_CERT"] == paths["temporal_server_cert"]
    assert env["TEMPORAL_TLS_FRONTEND_KEY"] == env["TEMPORAL_TLS_SERVER_KEY"] == paths["temporal_server_key"]
    assert env["TEMPORAL_TLS_FRONTEND_SERVER_NAME"] == "temporal"
    # Every certificate comes from the script's folder; the CA's key is mounted nowhere.
    for name, secret in compose()["secrets"].items():
        if name.startswith("temporal_") and name != "temporal_config":
            assert secret["file"].startswith("${TEMPORAL_TLS_DIR:-./secrets/temporal-tls}/"), name
            assert not secret["file"].endswith("ca.key"), name


def test_every_client_of_temporal_presents_its_own_certificate() -> None:
    worker = service("gpufleet-worker")["environment"]
    paths = mounted("gpufleet-worker")
    # temporalio's env-config names (temporalio.envconfig).
    assert worker["TEMPORAL_TLS_CLIENT_CERT_PATH"] == paths["temporal_client_cert"]
    assert worker["TEMPORAL_TLS_CLIENT_KEY_PATH"] == paths["temporal_client_key"]
    assert worker["TEMPORAL_TLS_SERVER_CA_CERT_PATH"] == paths["temporal_ca"]
    assert compose()["secrets"]["temporal_client_cert"]["file"].endswith("/gpufleet.crt")
    # The setup step: each temporal command goes through the function that adds its certificate.
    commands = lines(script("temporal-setup"))
    wrapper = next(i for i, c in enumerate(commands) if c.startswith("temporal() {"))
    paths = mounted("temporal-setup")
    flags = commands[wrapper + 1]
    assert f"--tls-cert-path {paths['temporal_admin_cert']}" in flags
    assert f"--tls-key-path {paths['temporal_admin_key']}" in flags
    assert f"--tls-ca-path {paths['temporal_ca']}" in flags
    assert flags.startswith('command temporal "$$@"')
    first_call = next(i for i, c in enumerate(commands) if re.search(r"(^|\s)temporal operator", c))
    assert wrapper < first_call


def test_the_ui_is_read_only_and_reaches_temporal_over_tls() -> None:
    env = service("temporal-ui")["environment"]
    paths = mounted("temporal-ui")
    assert env["TEMPORAL_DISABLE_WRITE_ACTIONS"] == "true"
    assert env["TEMPORAL_TLS_CA"] == paths["temporal_ca"]
    assert env["TEMPORAL_TLS_CERT"] == paths["temporal_ui_cert"]
    assert env["TEMPORAL_TLS_KEY"] == paths["temporal_ui_key"]
    assert env["TEMPORAL_TLS_ENABLE_HOST_VERIFICATION"] == "true" and env["TEMPORAL_TLS_SERVER_NAME"] == "temporal"
    assert service("temporal-ui")["ports"] == ["127.0.0.1:8233:8080"]


def _certificates(directory: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH: scripts/temporal-certs.sh makes the certificates with it")
    subprocess.run(
        ["sh", str(ROOT / "scripts" / "temporal-certs.sh"), str(directory)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return directory


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> str:
    """A TLS handshake over a socket pair; '' when both ends accepted it, else the server's error."""
    left, right = socket.socketpair()
    error: list[str] = []

    def serve() -> None:
        try:
            with server.wrap_socket(left, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError) as exc:
            error.append(str(exc))
            left.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(right, server_hostname="temporal") as tls:
            tls.recv(2)
    except (ssl.SSLError, OSError):
        pass
    thread.join(timeout=30)
    right.close()
    return error[0] if error else ""


def test_the_certificate_script_makes_what_the_frontend_accepts_and_nothing_else(tmp_path: Path) -> None:
    certs = _certificates(tmp_path / "tls")
    other = _certificates(tmp_path / "other")  # another CA: another host's certificates
    assert stat.S_IMODE((certs / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    # Each file the compose file mounts is one the script makes.
    for name, secret in compose()["secrets"].items():
        if secret["file"].startswith("${TEMPORAL_TLS_DIR"):
            assert (certs / secret["file"].rpartition("/")[2]).is_file(), name
    # The frontend as TEMPORAL_TLS_REQUIRE_CLIENT_AUTH makes it: a client certificate of the CA, required.
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs / "server.crt", certs / "server.key")
    server.load_verify_locations(certs / "ca.crt")
    server.verify_mode = ssl.CERT_REQUIRED

    def client(directory: Path, name: str | None) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(certs / "ca.crt")  # the client checks the server's name too
        if name:
            context.load_cert_chain(directory / f"{name}.crt", directory / f"{name}.key")
        return context

    for name in ("gpufleet", "temporal-ui", "temporal-admin"):
        assert _handshake(server, client(certs, name)) == "", name
    assert "certificate" in _handshake(server, client(certs, None)).lower()  # no certificate: refused
    assert _handshake(server, client(other, "gpufleet")) != ""  # another CA's: refused
    # The script keeps what exists: a second run changes nothing.
    before = {p.name: p.read_bytes() for p in certs.iterdir()}
    _certificates(certs)
    assert {p.name: p.read_bytes() for p in certs.iterdir()} == before
