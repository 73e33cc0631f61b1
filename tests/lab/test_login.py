"""A lab cluster's users and login node (lab/login.py): the files its view is made of, and a real
sshd that lets in the listed users with their keys only, follows a change of users at once and
ends its sessions when stopped. No Slurm runs here (the end-to-end tests log in to real clusters)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import inroot
from lab.login import Account, ClusterUsers, LoginNode, closed_to_users, login_unavailable
from lab.procs import alive, port_in_use, wait_for
from lab.slurmroots import host_install
from tests.e2e.logins import make_key, ssh, ssh_argv

INSTALL = host_install()
needs_install = pytest.mark.skipif(INSTALL is None, reason="the host has no Slurm (apt-get install slurm-wlm)")


@pytest.fixture
def folder() -> Iterator[Path]:
    """A cluster's folder, in a place its users may pass through."""
    base = Path(tempfile.mkdtemp(prefix="gpufleet-login-", dir="/tmp"))
    base.chmod(0o755)
    yield base / "cluster"
    LoginNode(base / "cluster").stop()
    subprocess.run(["rm", "-rf", str(base)], check=False)


def _users(folder: Path) -> ClusterUsers:
    assert INSTALL is not None
    return ClusterUsers(folder, INSTALL)


@needs_install
@pytest.mark.skipif(os.geteuid() != 0, reason="homes are made for their users' uids, which needs root")
def test_the_files_hold_the_users_and_the_systems_accounts_only(folder: Path) -> None:
    folder.mkdir()
    users = _users(folder)
    changed = users.write([Account("alice", 20001, ("ssh-ed25519 AAAA alice",))], "/scratch")
    assert "passwd" in changed and "home of alice" in changed and "mounts" in changed
    passwd = (folder / "etc" / "passwd").read_text().splitlines()
    assert "alice:x:20001:20001:alice:/home/alice:/bin/bash" in passwd
    assert passwd[0].startswith("root:") and any(line.startswith("sshd:") for line in passwd)
    # No user of the host (uid 1000 and above, but nobody) is in the cluster's view.
    host = [line.split(":") for line in Path("/etc/passwd").read_text().splitlines()]
    strangers = {f[0] for f in host if f[2].isdigit() and 1000 <= int(f[2]) < 65534}
    assert not strangers & {line.split(":")[0] for line in passwd}
    assert "alice:x:20001:" in (folder / "etc" / "group").read_text().splitlines()
    home = folder / "home" / "alice"
    assert (home.stat().st_uid, home.stat().st_mode & 0o777) == (20001, 0o700)
    assert (folder / "storage").stat().st_mode & 0o7777 == 0o1777
    assert json.loads((folder / "mounts.json").read_text()) == [
        [str(folder / "home"), "/home"],
        [str(folder / "storage"), "/scratch"],
    ]
    assert (folder / "login" / "keys" / "alice").read_text() == "ssh-ed25519 AAAA alice\n"
    # What a change of users is checked against: the users and keys written, nothing else.
    assert users.uids() == {"alice": 20001}
    assert users.differs([Account("alice", 20001, ("ssh-ed25519 AAAA alice",))]) == ""
    assert "keys" in users.differs([Account("alice", 20001, ("ssh-ed25519 BBBB alice",))])
    assert "its users are alice" in users.differs([])
    # Again with the same users: nothing changes, and passwd is the same file (a bind sees it).
    inode = (folder / "etc" / "passwd").stat().st_ino
    assert users.write([Account("alice", 20001, ("ssh-ed25519 AAAA alice",))], "/scratch") == []
    # Alice leaves, bob comes: her keys go, her home stays for root, passwd is changed in place.
    changed = users.write([Account("bob", 20002, ("ssh-ed25519 BBBB bob",))], "/scratch")
    assert "keys of alice removed" in changed and "home of alice kept for root" in changed
    assert (folder / "etc" / "passwd").stat().st_ino == inode
    assert not (folder / "login" / "keys" / "alice").exists() and home.stat().st_uid == 0
    assert "alice" not in (folder / "etc" / "passwd").read_text()


@needs_install
def test_a_cluster_its_own_mounts_would_hide_is_refused(tmp_path: Path) -> None:
    for folder, mount_path in (
        (Path("/home/someone/.gpufleet/clusters/c"), "/shared"),
        (tmp_path / "c", str(tmp_path)),
    ):
        with pytest.raises(ValueError, match="set GPUFLEET_HOME to a folder outside it"):
            _users(folder).write([], mount_path)
        assert not (folder / "etc").exists()


@needs_install
def test_a_user_with_a_system_accounts_uid_is_refused(folder: Path) -> None:
    folder.mkdir()
    with pytest.raises(ValueError, match="clashes with the system account"):
        _users(folder).write([Account("eve", 0, ("ssh-ed25519 AAAA eve",))])
    assert not (folder / "etc" / "passwd").exists()


def test_a_folder_closed_to_others_is_named(folder: Path) -> None:
    assert closed_to_users(folder.parent) == ""
    closed = folder.parent / "closed"
    (closed / "inside").mkdir(parents=True)
    closed.chmod(0o700)
    try:
        assert closed_to_users(closed / "inside").startswith(f"{closed} (mode 700)")
    finally:
        closed.chmod(0o755)
    assert closed_to_users(Path("/usr/bin")) == ""


@needs_install
def test_sshd_lets_in_the_listed_users_by_their_keys_only(folder: Path) -> None:
    if why := login_unavailable():
        pytest.skip(f"no login node here: {why}")
    folder.mkdir()
    alice_key, alice_public = make_key(folder.parent / "keys")
    bob_key, bob_public = make_key(folder.parent / "keys")
    users = _users(folder)
    users.write([Account("alice", 20001, (alice_public,))])
    assert INSTALL is not None
    login = LoginNode(folder, INSTALL)
    address = login.start(["alice"])
    assert login.address() == address and address.startswith("127.0.0.1:")
    done = ssh(address, "alice", alice_key, "id -un; pwd; echo $SLURM_CONF; touch /shared/from-alice")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["alice", "/home/alice", str(folder / "slurm.conf")]
    assert (folder / "storage" / "from-alice").stat().st_uid == 20001
    assert ssh(address, "alice", bob_key, "true").returncode == 255  # not her key
    assert ssh(address, "bob", bob_key, "true").returncode == 255  # not a user yet
    # Alice keeps a session open; bob comes in with his key; she is told to use a new key only.
    session = subprocess.Popen(
        [*ssh_argv(address, "alice", alice_key), "echo open; sleep 300"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert session.stdout is not None and session.stdout.readline().strip() == "open"
        pid = login.running()
        new_key, new_public = make_key(folder.parent / "keys")
        users.write([Account("alice", 20001, (new_public,)), Account("bob", 20002, (bob_public,))])
        assert login.start(["alice", "bob"]) == address and login.running() == pid  # reloaded, not restarted
        wait_for(lambda: ssh(address, "bob", bob_key, "id -un").stdout.strip() == "bob", timeout=30, what="bob in")
        assert ssh(address, "alice", alice_key, "true").returncode == 255
        assert ssh(address, "alice", new_key, "id -un").stdout.strip() == "alice"
        assert session.poll() is None  # her open session outlived the reload
        # Stopped: the session ends with it, and nothing answers.
        assert login.stop() == "login node stopped, its sessions ended"
        session.wait(timeout=30)
        assert not alive(pid) and login.address() == ""
    finally:
        session.kill()


@needs_install
def test_a_taken_port_is_left_for_a_free_one(folder: Path) -> None:
    if why := login_unavailable():
        pytest.skip(f"no login node here: {why}")
    folder.mkdir()
    _users(folder).write([])
    assert INSTALL is not None
    login = LoginNode(folder, INSTALL)
    first = login.start([])
    login.stop()
    port = int(first.rpartition(":")[2])
    holder = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)"
    taken = subprocess.Popen(["python3", "-c", holder])
    try:
        wait_for(lambda: port_in_use(port), timeout=10, what="someone else on the login node's port")
        second = login.start([])
        assert second != first and login.running()
    finally:
        taken.kill()


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("/etc/cron.d", "system folder"),
        ("/usr", "system folder"),
        ("/./etc", "plain absolute path"),
        ("//etc", "plain absolute path"),
        ("shared", "plain absolute path"),
        ("/", "plain absolute path"),
    ],
)
def test_inroot_binds_a_clusters_folders_only_at_plain_paths_outside_the_system(
    tmp_path: Path, target: str, says: str
) -> None:
    """``mounts.json`` is read by root in every daemon's namespace: checked there again."""
    (tmp_path / "storage").mkdir()
    (tmp_path / "mounts.json").write_text(json.dumps([[str(tmp_path / "storage"), target]]))
    with pytest.raises(ValueError, match=says):
        inroot._cluster_mounts(str(tmp_path / "slurm.conf"), Path("/"))
    (tmp_path / "mounts.json").write_text(
        json.dumps([[str(tmp_path / "storage"), "/shared"], [str(tmp_path), "/home"]])
    )
    assert inroot._cluster_mounts(str(tmp_path / "slurm.conf"), Path("/")) == [
        (str(tmp_path / "storage"), "/shared"),
        (str(tmp_path), "/home"),
    ]
