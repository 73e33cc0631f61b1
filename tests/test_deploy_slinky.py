"""deploy/overlays/slinky, rendered as `kubectl apply -k` would apply it (tests/test_deploy.py's
renderer): a worker that reaches Slurm through the Slinky cluster's slurmrestd with the
cluster's JWT key (or a token), remediates in the slinky mode, mounts nothing of MUNGE, and runs
the image without a Slurm client; and docs/slinky.md says what the overlay does."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from models.settings import Settings
from tests.test_deploy import DEPLOY, ROOT, Objects, invalid, render, rendered, the

SLINKY = DEPLOY / "overlays" / "slinky"
DOC = ROOT / "docs" / "slinky.md"
# slurm-operator's RestApi Service: <RestApi name>-restapi in the cluster's namespace, port 6820.
RESTAPI_URL = re.compile(r"http://(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-restapi\.(?P<namespace>[a-z0-9-]+):6820")


def worker(objects: Objects) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker's pod spec and its one container."""
    pod: dict[str, Any] = the(objects, "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def mounted(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mount that holds the file ``path``, and its volume."""
    [mount] = [m for m in container["volumeMounts"] if Path(path).parent == Path(m["mountPath"])]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def with_token(tmp_path: Path) -> Objects:
    """The overlay as docs/slinky.md turns it to a token: token.yaml in place of jwt-key.yaml."""
    copy = tmp_path / "overlays" / "slinky"
    shutil.copytree(SLINKY, copy)
    shutil.copytree(DEPLOY / "base", tmp_path / "base")
    shutil.copytree(DEPLOY / "components", tmp_path / "components")
    kustomization = copy / "kustomization.yaml"
    text = kustomization.read_text()
    assert "  - path: jwt-key.yaml\n" in text and "  # - path: token.yaml\n" in text
    text = text.replace("  - path: jwt-key.yaml\n", "").replace("  # - path: token.yaml\n", "  - path: token.yaml\n")
    kustomization.write_text(text)
    return render(copy)


def test_the_overlay_renders_valid_objects() -> None:
    objects = rendered("overlays/slinky")
    assert invalid(objects) == []
    assert {obj["kind"] for obj in objects} >= {"Namespace", "ClusterRole", "Deployment", "DaemonSet"}


def test_the_worker_reaches_slurm_through_the_clusters_restapi_in_the_slinky_mode() -> None:
    _, container = worker(rendered("overlays/slinky"))
    env = env_of(container)
    assert env["GPUFLEET_SLURM_BACKEND"] == "rest"
    assert env["GPUFLEET_REMEDIATION_MODE"] == "slinky"  # of auto | slurm | slinky
    assert RESTAPI_URL.fullmatch(env["GPUFLEET_SLURMRESTD_URL"]), env["GPUFLEET_SLURMRESTD_URL"]
    assert env["GPUFLEET_CLUSTER"] and env["GPUFLEET_SLURMRESTD_USER"]
    # Nothing that only Slurm's commands read.
    assert "GPUFLEET_SLURM_CONF" not in env and "GPUFLEET_SLURM_BIN_DIR" not in env


def test_the_worker_takes_these_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _, container = worker(rendered("overlays/slinky"))
    for name in [name for name in os.environ if name.startswith("GPUFLEET_")]:
        monkeypatch.delenv(name)
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.slurm_backend == "rest"
    assert settings.slurmrestd_url == env_of(container)["GPUFLEET_SLURMRESTD_URL"]
    assert settings.slurmrestd_jwt_key_file is not None and settings.slurmrestd_token_file is None


def test_the_jwt_key_is_the_clusters_mounted_read_only_for_the_worker_alone() -> None:
    pod, container = worker(rendered("overlays/slinky"))
    env = env_of(container)
    key_file = env["GPUFLEET_SLURMRESTD_JWT_KEY_FILE"]
    assert "GPUFLEET_SLURMRESTD_TOKEN_FILE" not in env  # exactly one of the two
    mount, volume = mounted(pod, container, key_file)
    assert mount["readOnly"] is True and "subPath" not in mount
    name = RESTAPI_URL.fullmatch(env["GPUFLEET_SLURMRESTD_URL"])["name"]  # type: ignore[index]
    assert volume["secret"]["secretName"] == f"{name}-jwt-key"
    assert volume["secret"]["items"] == [{"key": "jwt_hs256.key", "path": Path(key_file).name}]
    # Root's file, readable by the worker's group and no one else.
    assert volume["secret"]["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"] == 10001
    # No key in the environment (the webhook's URL is its one Secret there), and the detector,
    # which makes no Slurm request, mounts none.
    assert [e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})] == ["GPUFLEET_WEBHOOK_URL"]
    detector = the(rendered("overlays/slinky"), "DaemonSet")["spec"]["template"]["spec"]
    assert not [v for v in detector["volumes"] if "secret" in v]


def test_the_token_in_place_of_the_key(tmp_path: Path) -> None:
    objects = with_token(tmp_path)
    assert invalid(objects) == []
    pod, container = worker(objects)
    env = env_of(container)
    assert "GPUFLEET_SLURMRESTD_JWT_KEY_FILE" not in env
    token_file = env["GPUFLEET_SLURMRESTD_TOKEN_FILE"]
    mount, volume = mounted(pod, container, token_file)
    # A directory mount, not subPath: the kubelet puts a rotated token in place.
    assert mount["readOnly"] is True and "subPath" not in mount
    assert volume["secret"]["items"] == [{"key": "token", "path": Path(token_file).name}]
    assert volume["secret"]["defaultMode"] == 0o440
    assert not [v for v in pod["volumes"] if "jwt" in v["name"]]


def test_nothing_of_munge_or_the_host_is_mounted_into_the_worker() -> None:
    pod, container = worker(rendered("overlays/slinky"))
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert not [v for v in pod["volumes"] if v["name"] in ("munge", "slurm-conf")]
    assert not [m for m in container["volumeMounts"] if m["mountPath"].startswith(("/run/munge", "/etc/slurm"))]


def test_the_image_is_the_one_built_without_a_slurm_client() -> None:
    objects = rendered("overlays/slinky")
    _, container = worker(objects)
    detector = the(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == detector["image"]
    repository, _, tag = container["image"].rpartition(":")
    assert tag.endswith("-slurm-none")
    # docs/slinky.md builds that tag with SLURM_CLIENT=none.
    builds = re.findall(r"docker build --build-arg SLURM_CLIENT=(\S+) -t \S+:(\S+) \.", DOC.read_text())
    assert ("none", tag) in builds, builds
    assert repository == "ghcr.io/gpufleet/gpufleet"


def test_the_worker_reads_nodesets_patches_them_only_and_never_reads_a_secret() -> None:
    role = the(rendered("overlays/slinky"), "ClusterRole")
    verbs = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    # Patched (the shared pool's scale in and out by one), never created, replaced or deleted.
    assert verbs[("slinky.slurm.net", "nodesets")] == {"get", "list", "patch"}
    assert verbs[("", "nodes")] == {"get", "list", "patch"}
    assert verbs[("", "pods/eviction")] == {"create"}
    assert ("", "secrets") not in verbs  # the key is mounted, never read through the API
    assert not [key for key in verbs if key[0] == "slinky.slurm.net" and key[1] != "nodesets"]


def _documented_rights(text: str) -> dict[str, set[str]]:
    """The rights table of docs/slinky.md: `resource` (apiGroup) | verbs | why."""
    section = text.split(". The worker's rights\n", 1)[1].split("\n## ", 1)[0]
    rights = {}
    for row in re.findall(r"^\| `([^`]+)`[^|]*\| ([a-z, ]+) \|", section, flags=re.MULTILINE):
        rights[row[0]] = {verb.strip() for verb in row[1].split(",")}
    return rights


def test_the_docs_name_every_right_the_overlay_grants() -> None:
    objects = rendered("overlays/slinky")
    granted: dict[str, set[str]] = {}
    for role in (the(objects, "ClusterRole"), the(objects, "Role")):
        for rule in role["rules"]:
            for resource in rule["resources"]:
                granted.setdefault(resource, set()).update(rule["verbs"])
    assert _documented_rights(DOC.read_text()) == granted


def test_the_overlay_is_its_own_and_the_docs_walk_through_it() -> None:
    text = DOC.read_text()
    kustomization = yaml.safe_load((SLINKY / "kustomization.yaml").read_text())
    assert "../../base" in kustomization["resources"]
    assert "kubectl apply -k deploy/overlays/slinky" in text
    # The cluster's key Secret, copied into the worker's namespace under the name the overlay mounts.
    pod, container = worker(rendered("overlays/slinky"))
    _, volume = mounted(pod, container, env_of(container)["GPUFLEET_SLURMRESTD_JWT_KEY_FILE"])
    assert f"create secret generic {volume['secret']['secretName']}" in text
