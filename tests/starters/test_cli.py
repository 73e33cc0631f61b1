"""The gpufleet command without a server: help, bad input and an unreachable Temporal."""

from __future__ import annotations

from lab.procs import free_port
from tests.conftest import gpufleet_cli


def test_every_command_has_help() -> None:
    for command in (
        ["--help"],
        ["remediate", "--help"],
        ["incidents", "list", "--help"],
        ["incidents", "show", "--help"],
        ["server", "--help"],
        ["worker", "--help"],
        ["checkpoint-done", "--help"],
        ["lab", "--help"],
    ):
        done = gpufleet_cli(*command)
        assert done.returncode == 0, (command, done.stderr)
        assert "Usage" in done.stdout


def test_unreachable_temporal_names_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    done = gpufleet_cli("remediate", "gpu1", "--xid", "79", env={"TEMPORAL_ADDRESS": address})
    assert done.returncode == 1
    assert address in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_node_name_exits_2_without_contacting_anything() -> None:
    done = gpufleet_cli("remediate", "$(reboot)", "--xid", "79", env={"TEMPORAL_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 2
    assert "invalid node name" in done.stderr
