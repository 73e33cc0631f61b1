"""The lab's Slurm releases (lab/slurmroots.py, lab/inroot.py): which install serves a release, a
cached root's pinned version, a remade root when its packages moved or it broke, and commands run
in a root leaving no mount behind on the host."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lab import slurmroots
from lab.procs import pids_holding, wait_for
from lab.slurm import SlurmLab, SlurmLabSpec
from lab.slurmroots import (
    PACKAGES,
    RELEASES,
    Release,
    RootError,
    Roots,
    SlurmInstall,
    host_install,
    release,
    root_unavailable,
)

NEWEST = "26.05"
LIVE = pytest.mark.skipif(bool(root_unavailable(NEWEST)), reason=root_unavailable(NEWEST) or "")


def _fake_root(folder: Path, versions: dict[str, str]) -> Path:
    """A folder whose package database says these packages are installed."""
    status = folder / "var" / "lib" / "dpkg" / "status"
    status.parent.mkdir(parents=True, exist_ok=True)
    stanzas = [
        f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\nVersion: {version}\n"
        for name, version in versions.items()
    ]
    status.write_text("\n".join(stanzas))
    return folder


def _all_packages(slurm: str) -> dict[str, str]:
    return {name: (slurm if name.startswith("slurm") else "3.13.5-1") for name in PACKAGES}


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Roots:
    """Roots cached in a folder of the test's own, the host taken as having no Slurm of its own
    and every tool a root needs (nothing here runs debootstrap for real)."""
    monkeypatch.setattr(slurmroots, "host_install", lambda: None)
    monkeypatch.setattr(slurmroots, "_missing_for_roots", lambda making=True: "")
    return Roots(tmp_path / "cache")


def test_an_unknown_release_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(RootError, match=r"no Slurm release '23\.02'.*22\.05, 24\.11, 26\.05"):
        release("23.02")


def test_the_hosts_own_slurm_serves_its_release_without_a_root() -> None:
    host = host_install()
    if host is None:
        pytest.skip("the host has no Slurm of its own")
    assert host.on_host and host.version.startswith(host.release.version + ".")
    assert Roots(Path("/nonexistent")).install(host.release.version) == host
    assert host.argv(["scontrol", "ping"]) == ["scontrol", "ping"]


def test_a_cached_root_at_its_pinned_version_is_used_as_it_is(roots: Roots, monkeypatch: pytest.MonkeyPatch) -> None:
    item = RELEASES["24.11"]
    _fake_root(roots.path(item), _all_packages("24.11.5-4+deb13u1"))
    roots.folder.mkdir(parents=True, exist_ok=True)
    roots.manifest_path(item).write_text(json.dumps({"checked_at": time.time()}))
    made: list[str] = []
    monkeypatch.setattr(Roots, "_make", lambda self, item, say: made.append(item.version))
    install = roots.install("24.11")
    assert (install.version, install.root, made) == ("24.11.5", roots.path(item), [])
    assert install.argv(["scontrol", "ping"])[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert install.argv(["scontrol", "ping"])[-3:] == ["--", "scontrol", "ping"]


@pytest.mark.parametrize(
    "versions",
    [
        _all_packages("26.05.5-1"),  # another release in the folder
        {name: version for name, version in _all_packages("24.11.5-4").items() if name != "slurmrestd"},  # half made
        {},  # no package database at all
    ],
    ids=["other-release", "package-missing", "empty"],
)
def test_a_root_not_at_its_pin_is_made_again(
    roots: Roots, monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]
) -> None:
    item = RELEASES["24.11"]
    _fake_root(roots.path(item), versions)

    def make(self: Roots, item: Release, say: object) -> None:
        _fake_root(self.path(item), _all_packages("24.11.5-4+deb13u1"))

    monkeypatch.setattr(Roots, "_make", make)
    said: list[str] = []
    assert roots.install("24.11", say=said.append).version == "24.11.5"
    assert any("making it again" in line for line in said)


def test_a_root_whose_packages_moved_is_made_again_and_one_unchanged_is_kept(
    roots: Roots, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = RELEASES["26.05"]
    _fake_root(roots.path(item), _all_packages("26.05.4-1"))
    archive = {"version": "26.05.4-1"}
    monkeypatch.setattr(Roots, "_candidate", lambda self, item: archive["version"])
    made: list[str] = []

    def make(self: Roots, item: Release, say: object) -> None:
        made.append(item.version)
        _fake_root(self.path(item), _all_packages(archive["version"]))

    monkeypatch.setattr(Roots, "_make", make)
    assert roots.install("26.05", refresh=True).version == "26.05.4" and made == []
    archive["version"] = "26.05.5-1"
    said: list[str] = []
    assert roots.install("26.05", refresh=True, say=said.append).version == "26.05.5"
    assert made == ["26.05"] and any("26.05.4-1 -> 26.05.5-1" in line for line in said)
    # Checked just now: the next start does not ask the archive again.
    monkeypatch.setattr(Roots, "_candidate", lambda self, item: pytest.fail("asked the archive again"))
    assert roots.install("26.05", check=True).version == "26.05.5"


def test_an_archive_out_of_reach_keeps_the_root(roots: Roots, monkeypatch: pytest.MonkeyPatch) -> None:
    item = RELEASES["26.05"]
    _fake_root(roots.path(item), _all_packages("26.05.5-1"))

    def unreachable(self: Roots, item: Release) -> str:
        raise subprocess.CalledProcessError(100, ["apt-get", "update"])

    monkeypatch.setattr(Roots, "_candidate", unreachable)
    monkeypatch.setattr(Roots, "_make", lambda self, item, say: pytest.fail("remade without an archive"))
    said: list[str] = []
    assert roots.install("26.05", refresh=True, say=said.append).version == "26.05.5"
    assert any("keeping the cached root" in line for line in said)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("debootstrap"), reason="needs root and debootstrap")
def test_a_failed_debootstrap_says_why_and_leaves_no_half_made_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurmroots, "host_install", lambda: None)
    monkeypatch.setattr(slurmroots, "_missing_for_roots", lambda making=True: "")
    # Nothing listens on port 9: the archive is out of reach at once.
    roots = Roots(tmp_path / "cache", mirror="http://127.0.0.1:9/debian")
    with pytest.raises(RootError, match=r"debootstrap of Debian trixie for Slurm 24\.11 failed .*debootstrap\.log"):
        roots.install("24.11")
    assert not roots.path(RELEASES["24.11"]).exists()
    assert not list(roots.folder.glob(".slurm-24.11.building*"))


def test_a_root_in_use_is_never_made_again_under_its_processes(roots: Roots, monkeypatch: pytest.MonkeyPatch) -> None:
    item = RELEASES["26.05"]
    _fake_root(roots.path(item), _all_packages("26.05.4-1"))
    monkeypatch.setattr(slurmroots, "users_of", lambda root: [4242])
    monkeypatch.setattr(Roots, "_candidate", lambda self, item: "26.05.5-1")
    monkeypatch.setattr(Roots, "_make", lambda self, item, say: pytest.fail("remade under a running lab"))
    said: list[str] = []
    assert roots.install("26.05", refresh=True, say=said.append).version == "26.05.4"
    assert any("the root is in use: kept" in line for line in said)
    _fake_root(roots.path(item), _all_packages("24.11.5-4"))  # broken: must be remade, but it runs
    with pytest.raises(RootError, match=r"processes run in it \(PIDs 4242\): stop its labs first"):
        roots.install("26.05")


def test_a_suite_that_moved_to_another_release_keeps_the_root(roots: Roots, monkeypatch: pytest.MonkeyPatch) -> None:
    item = RELEASES["26.05"]
    _fake_root(roots.path(item), _all_packages("26.05.5-1"))
    monkeypatch.setattr(Roots, "_candidate", lambda self, item: "26.11.1-1")
    monkeypatch.setattr(Roots, "_make", lambda self, item, say: pytest.fail("made a root of another release"))
    said: list[str] = []
    assert roots.install("26.05", refresh=True, say=said.append).version == "26.05.5"
    assert any("now carries Slurm 26.11.1, not 26.05: keeping the cached 26.05.5 root" in line for line in said)


def test_22_05_is_the_hosts_own_or_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(slurmroots, "host_install", lambda: None)
    assert root_unavailable("22.05") == (
        "Slurm 22.05 runs in the lab only as the host's own: apt-get install slurm-wlm munge"
    )
    with pytest.raises(RootError, match="only as the host's own"):
        Roots(tmp_path).install("22.05")


def test_without_root_a_newer_release_says_what_it_needs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(slurmroots, "host_install", lambda: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in root_unavailable("26.05")
    with pytest.raises(RootError, match=r"Slurm 26\.05 runs here only in a Debian root: .*needs root"):
        Roots(tmp_path).install("26.05")


# -- a real root -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def newest() -> SlurmInstall:
    return slurmroots.install_for(NEWEST)


def _host_mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


@LIVE
def test_a_command_runs_in_the_root_and_leaves_no_mount_on_the_host(newest: SlurmInstall, tmp_path: Path) -> None:
    assert newest.root is not None and newest.version.startswith("26.05.")
    (tmp_path / "note").write_text("from the host\n")
    done = subprocess.run(
        newest.argv(["cat", "/etc/os-release", str(tmp_path / "note"), "/proc/self/comm"]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    )
    *release_lines, note, comm = done.stdout.splitlines()
    assert "VERSION_CODENAME=forky" in release_lines  # the root's Debian
    assert (note, comm) == ("from the host", "cat")  # the host's /tmp and /proc, bound
    assert str(newest.root) not in _host_mounts()


@LIVE
def test_the_wrappers_run_the_roots_commands(newest: SlurmInstall, tmp_path: Path) -> None:
    folder = newest.write_wrappers(tmp_path / "bin")
    assert folder is not None
    conf = tmp_path / "slurm.conf"  # a newer sinfo wants a configuration even to say its version
    conf.write_text("ClusterName=wrappers\nSlurmctldHost=localhost\n")
    done = subprocess.run(
        [str(folder / "sinfo"), "--version"],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split() == ["slurm-wlm", newest.version]  # Debian names its build so


@LIVE
def test_a_command_the_root_lacks_is_named(newest: SlurmInstall) -> None:
    done = subprocess.run(newest.argv(["no-such-command"]), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 127
    assert f"no-such-command is not in the Slurm root {newest.root}" in done.stderr


@LIVE
def test_stopping_a_cluster_spares_the_hosts_readers_and_uses_the_release_it_started_on(tmp_path: Path) -> None:
    slurm = SlurmLab(tmp_path / "c", SlurmLabSpec(nodes=["n1"], spares=[]), release=NEWEST)
    slurm.start(timeout=30)
    reader = subprocess.Popen(["tail", "-f", str(slurm.logs / "slurmctld.log")], stdout=subprocess.DEVNULL)
    try:
        script = tmp_path / "sleep.sh"
        script.write_text("#!/bin/sh\necho started\nsleep 300\n")
        out = tmp_path / "job.out"
        job = slurm.sbatch(script, "-o", str(out))
        # Running on its node: its step wrote its first line (its slurmstepd is up, files open).
        wait_for(lambda: out.exists() and "started" in out.read_text(), timeout=30, what=f"job {job} to start")
        # Stopped by a process whose default is another release: the cluster's own file says 26.05.
        SlurmLab(tmp_path / "c", release="22.05").stop()
        assert reader.poll() is None  # a reader of its log on the host is not the cluster's
        root = slurm.install.root
        assert root is not None
        left = [pid for pid in slurmroots.users_of(root) if str(tmp_path).encode() in _cmdline(pid)]
        assert left == [] and pids_holding(tmp_path / "c", [root]) == []
    finally:
        reader.kill()
        reader.wait()
        slurm.stop()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@LIVE
def test_two_clusters_on_one_root_each_sign_with_their_own_key(tmp_path: Path) -> None:
    """Slurm 23.11+'s commands have their credentials signed through a socket under /run: each
    cluster has its own, or the second cluster's commands would be refused by its controller."""
    first = SlurmLab(tmp_path / "first", SlurmLabSpec(nodes=["a1"], spares=[]), release=NEWEST)
    second = SlurmLab(tmp_path / "second", SlurmLabSpec(nodes=["b1"], spares=[]), release=NEWEST)
    try:
        first.start(timeout=30)
        second.start(timeout=30)
        assert [node.name for node in first.client().nodes()] == ["a1"]
        assert [node.name for node in second.client().nodes()] == ["b1"]
    finally:
        second.stop()
        first.stop()
