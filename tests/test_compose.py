"""docker-compose.temporal.yml: Temporal on PostgreSQL, its schema, the UI, and a gpufleet worker."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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
        assert re.fullmatch(r"\$\{[A-Z_]+:-[^}]+\}", secrets[name]["file"]), f"{name}: {secrets[name]}"
    env = worker["environment"]
    assert env["GPUFLEET_SLURM_CONF"] == mounts["slurm_conf"]
    assert env["GPUFLEET_KUBECONFIG"] == f"/run/secrets/{mounts['kubeconfig']}"
    assert env["TEMPORAL_CONFIG_FILE"] == f"/run/secrets/{mounts['temporal_config']}"
    for forbidden in ("GPUFLEET_WEBHOOK_URL", "TEMPORAL_API_KEY", "MUNGE_KEY"):
        assert forbidden not in env
    for name, value in env.items():
        assert not re.search(r"KEY|PASSWORD|TOKEN|SECRET", name), f"{name} belongs in a secret"
        assert "BEGIN" not in str(value)
    assert "volumes" not in worker
    commands = lines(script("gpufleet-worker"))
    assert f"install -m 0400 /run/secrets/{mounts['munge_key']} /home/gpufleet/munge.key" in commands
    # Nothing of the secrets goes into the image.
    copied = [rest for keyword, rest in dockerfile_instructions() if keyword in ("COPY", "ADD")]
    assert not [c for c in copied if "secret" in c or "munge" in c or "slurm.conf" in c]
