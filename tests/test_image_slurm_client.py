"""The image's Slurm client (the Dockerfile's SLURM_CLIENT, scripts/image-slurm-client.sh): each
release comes from a Debian suite that carries it, `none` installs neither Slurm nor munge, and
anything else fails the build naming the choices.

No Docker engine is needed: the script writes apt's sources and pin into a scratch directory
(``--config-only``), and apt resolves the image's install from them against Debian's archive
(``apt-get --simulate``), as the build's own apt would on the image's suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lab.slurmroots import MIRROR, RELEASES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "image-slurm-client.sh"
DOCKERFILE = ROOT / "Dockerfile"
CHOICES = ("22.05", "24.11", "26.05", "none")


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions (keyword, the rest), continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def base_suite() -> str:
    """The Debian suite of the image's base (python:X-slim-SUITE)."""
    [base] = [rest for keyword, rest in dockerfile() if keyword == "FROM"]
    found = re.fullmatch(r"python:[\d.]+-slim-([a-z]+)", base)
    assert found, f"FROM {base}: not a python slim image of a named Debian suite"
    return found.group(1)


def stubs(tmp_path: Path) -> Path:
    """A PATH directory whose apt-get and dpkg-query record that they were called, and fail."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("apt-get", "dpkg-query"):
        stub = folder / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/called"\nexit 1\n')
        stub.chmod(0o755)
    return folder


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The script as the build runs it, with apt's configuration in tmp_path/etc/apt and apt-get
    and dpkg-query stubbed: nothing of this machine's apt is touched."""
    folder = tmp_path / "bin" if (tmp_path / "bin").exists() else stubs(tmp_path)
    env = {
        "PATH": f"{folder}:/usr/bin:/bin",
        "APT_ETC": str(tmp_path / "etc" / "apt"),
        "BASE_SUITE": base_suite(),
    }
    return subprocess.run(
        ["/bin/sh", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def written(tmp_path: Path) -> list[str]:
    apt = tmp_path / "etc" / "apt"
    return sorted(str(p.relative_to(apt)) for p in apt.rglob("*") if p.is_file()) if apt.exists() else []


def test_the_dockerfile_installs_the_client_its_build_argument_names() -> None:
    instructions = dockerfile()
    assert ("ARG", "SLURM_CLIENT=22.05") in instructions  # the default: what the image had before
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    assert any(rest.startswith('/usr/local/sbin/image-slurm-client.sh "${SLURM_CLIENT}"') for rest in runs), runs
    assert ("COPY", "scripts/image-slurm-client.sh /usr/local/sbin/image-slurm-client.sh") in instructions
    # Its one base is a suite the table knows, and the release of that suite needs no other.
    assert base_suite() == RELEASES["24.11"].suite
    # No /run/munge in an image without munge.
    [user] = [rest for rest in runs if "useradd" in rest]
    assert 'if [ "${SLURM_CLIENT}" != none ]; then install -d -o 10001 -g 10001 -m 0755 /run/munge; fi' in user


@pytest.mark.parametrize("value", ["27.11", "", "latest", "22.05.8", "None", "24.11; rm -rf /", "--config-only"])
def test_an_unknown_value_fails_the_build_naming_the_choices(tmp_path: Path, value: str) -> None:
    done = run(tmp_path, value, "--config-only")
    assert done.returncode == 2
    said = " ".join(done.stderr.split())
    assert said.startswith(f"SLURM_CLIENT={value or '(empty)'} is not a Slurm client this image can carry: use 22.05")
    assert all(choice in said for choice in CHOICES), said
    assert written(tmp_path) == [] and not (tmp_path / "called").exists()


def test_none_installs_no_slurm_and_no_munge(tmp_path: Path) -> None:
    done = run(tmp_path, "none")  # not --config-only: the build's own call
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "SLURM_CLIENT=none: no Slurm client, no munge"
    assert written(tmp_path) == [] and not (tmp_path / "called").exists()  # apt never ran


@pytest.mark.parametrize("release", ["22.05", "24.11", "26.05"])
def test_each_release_comes_from_the_suite_the_lab_runs_it_from(tmp_path: Path, release: str) -> None:
    """lab/slurmroots.py's table (each suite proven by the roots made from it) says where each
    release is; the script takes it from there, and from nowhere else."""
    done = run(tmp_path, release, "--config-only")
    assert done.returncode == 0, done.stderr
    suite = RELEASES[release].suite
    if suite == base_suite():
        assert written(tmp_path) == []  # the image's own suite: nothing added
        return
    assert written(tmp_path) == [f"preferences.d/slurm-{suite}", f"sources.list.d/slurm-{suite}.sources"]
    sources = (tmp_path / "etc" / "apt" / "sources.list.d" / f"slurm-{suite}.sources").read_text()
    assert f"Suites: {suite}\n" in sources and f"URIs: {MIRROR}\n" in sources
    pin = (tmp_path / "etc" / "apt" / "preferences.d" / f"slurm-{suite}").read_text()
    records = [dict(line.split(": ", 1) for line in block.splitlines()) for block in pin.strip().split("\n\n")]
    assert [(r["Package"], r["Pin"], r["Pin-Priority"]) for r in records] == [
        ("*", f"release n={suite}", "100"),
        ("slurm-client slurm-wlm-basic-plugins", f"release n={suite}", "990"),
    ]


# -- against Debian's archive ----------------------------------------------------------------------


def _apt(config: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    options = [
        f"-oDir::Etc::sourcelist={config / 'sources.list'}",
        f"-oDir::Etc::sourceparts={config / 'sources.list.d'}",
        f"-oDir::Etc::preferences={config / 'preferences'}",
        f"-oDir::Etc::preferencesparts={config / 'preferences.d'}",
        f"-oDir::State::Lists={config / 'lists'}",
        f"-oDir::Cache={config / 'cache'}",
        "-oDir::State::status=/dev/null",  # nothing installed: the whole closure is resolved
        "-oAcquire::Languages=none",
        "-oAPT::Sandbox::User=root",
        f"-oAPT::Architecture={_architecture()}",
    ]
    return subprocess.run(
        [args[0], *options, *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "LC_ALL": "C"},
    )


def _architecture() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("release", ["22.05", "24.11", "26.05"])
def test_each_release_installs_on_the_images_suite_from_debians_archive(tmp_path: Path, release: str) -> None:
    """apt, given the image's suite and what the script adds, installs `slurm-client munge` at
    that release; another suite gives Slurm's two packages and nothing the image's suite has."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("apt-get is not here: Debian's archive cannot be asked")
    done = run(tmp_path, release, "--config-only")
    assert done.returncode == 0, done.stderr
    config = tmp_path / "etc" / "apt"
    for folder in ("sources.list.d", "preferences.d", "lists/partial", "cache/archives/partial"):
        (config / folder).mkdir(parents=True, exist_ok=True)
    base = base_suite()
    # The python image's own sources (deb.debian.org; its security suite is left out here).
    (config / "sources.list").write_text(f"deb {MIRROR} {base} main\ndeb {MIRROR} {base}-updates main\n")
    update = _apt(config, "apt-get", "update")
    if update.returncode != 0 or "Err:" in update.stdout:
        pytest.skip(f"Debian's archive did not answer: {(update.stdout + update.stderr).strip()[-300:]}")
    simulated = _apt(config, "apt-get", "--simulate", "install", "--no-install-recommends", "slurm-client", "munge")
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr
    installs = dict(re.findall(r"^Inst (\S+) \((\S+) ", simulated.stdout, flags=re.MULTILINE))
    assert installs["slurm-client"].startswith(f"{release}."), installs["slurm-client"]
    assert "munge" in installs
    suite = RELEASES[release].suite
    if suite == base:
        return
    # What comes from the release's suite: Slurm's two packages, and only what the base lacks.
    policy = _apt(config, "apt-cache", "policy", *installs).stdout
    from_suite = set()
    for block in re.split(r"^(?=\S)", policy, flags=re.MULTILINE):
        name = block.split(":", 1)[0].strip()
        if name not in installs:
            continue
        chosen = re.search(rf"^ (?:\*\*\*)? +{re.escape(installs[name])} \d+\n((?:^ {{8}}.*\n)+)", block, re.MULTILINE)
        assert chosen, block
        if f" {suite}/main " in chosen.group(1) and f" {base}/main " not in chosen.group(1):
            from_suite.add(name)
    assert {"slurm-client", "slurm-wlm-basic-plugins"} <= from_suite
    for name in from_suite - {"slurm-client", "slurm-wlm-basic-plugins"}:
        versions = _apt(config, "apt-cache", "madison", name).stdout
        assert f" {base}/main " not in versions and f" {base}-updates/main " not in versions, (name, versions)
