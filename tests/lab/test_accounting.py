"""lab/accounting.py without daemons: what a cluster on a root's Slurm needs for accounting, said
when it is missing, and the slurm.conf lines that turn accounting on and off."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.accounting import IN_ROOT, accounting_unavailable, conf_value, with_accounting, without_accounting
from lab.slurmroots import SlurmInstall, release

CONF = "ClusterName=research\nSlurmctldPort=6817\nAccountingStorageType=accounting_storage/none\nKillWait=5\n"


def _root(tmp_path: Path, *, slurmdbd: bool) -> SlurmInstall:
    for path in IN_ROOT if slurmdbd else ():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    return SlurmInstall(release("26.05"), "26.05.5", tmp_path)


def test_a_machine_without_mariadb_is_told_what_to_install(tmp_path: Path) -> None:
    install = _root(tmp_path, slurmdbd=True)
    said = accounting_unavailable(
        install, which=lambda tool: None if tool.startswith("mariadb") else f"/usr/bin/{tool}"
    )
    assert said == (
        "accounting on Slurm 26.05.5 keeps its records in this machine's MariaDB, which is not installed "
        "(no mariadbd, mariadb-install-db, mariadb): apt-get install mariadb-server (or run make test as root)"
    )


def test_one_missing_mariadb_command_is_named_alone(tmp_path: Path) -> None:
    install = _root(tmp_path, slurmdbd=True)
    said = accounting_unavailable(install, which=lambda tool: None if tool == "mariadbd" else f"/usr/bin/{tool}")
    assert "(no mariadbd)" in said


def test_a_root_without_slurmdbd_is_said_to_be_made_again(tmp_path: Path) -> None:
    install = _root(tmp_path, slurmdbd=False)
    said = accounting_unavailable(install, which=lambda tool: f"/usr/bin/{tool}")
    assert said.startswith(f"slurmdbd is missing from the Slurm 26.05.5 root {tmp_path} (no /usr/sbin/slurmdbd, ")
    assert said.endswith("make slurm-roots makes it again")


def test_nothing_is_missing_where_mariadb_and_the_roots_slurmdbd_are_there(tmp_path: Path) -> None:
    assert accounting_unavailable(_root(tmp_path, slurmdbd=True), which=lambda tool: f"/usr/bin/{tool}") == ""


def test_accounting_on_a_root_release_points_at_slurmdbd_without_munge() -> None:
    conf = with_accounting(CONF, None)
    assert conf_value(conf, "AccountingStorageType") == "accounting_storage/slurmdbd"
    assert conf_value(conf, "AccountingStorageHost") == "localhost"
    assert int(conf_value(conf, "AccountingStoragePort")) > 0
    assert conf_value(conf, "AccountingStoragePass") == ""  # the munge socket, on the host's Slurm only
    assert conf.count("AccountingStorageType=") == 1
    assert with_accounting(conf, None) == conf  # once


def test_accounting_on_the_hosts_release_names_the_munge_socket() -> None:
    conf = with_accounting(CONF, Path("/lab/munge/munge.socket"))
    assert conf_value(conf, "AccountingStoragePass") == "/lab/munge/munge.socket"


def test_accounting_off_leaves_the_rest_of_slurm_conf_as_it_was() -> None:
    conf = without_accounting(with_accounting(CONF, Path("/lab/munge/munge.socket")))
    assert sorted(conf.splitlines()) == sorted(CONF.splitlines())
    assert without_accounting(conf) == conf
    assert not [line for line in conf.splitlines() if line.startswith("AccountingStorage") and "none" not in line]


@pytest.mark.parametrize("value", ["", "accounting_storage/none"])
def test_a_slurm_conf_without_accounting_is_left_alone(value: str) -> None:
    conf = "ClusterName=research\n" + (f"AccountingStorageType={value}\n" if value else "")
    assert without_accounting(conf) == conf
