"""The gpufleet command without a server: help, bad input and an unreachable Temporal.

Bad input of every kind (names, Xids, GPUFLEET_* values, the policy file) gets one line naming
what was wrong, exit code 2 and no traceback, before anything is contacted or changed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.procs import free_port
from tests.conftest import gpufleet_cli, gpufleet_cli_each

NOWHERE = {"TEMPORAL_ADDRESS": "127.0.0.1:1"}


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_every_command_has_help() -> None:
    commands = [
        ["--help"],
        ["remediate", "--help"],
        ["incidents", "list", "--help"],
        ["incidents", "show", "--help"],
        ["server", "--help"],
        ["worker", "--help"],
        ["checkpoint-done", "--help"],
        ["approve", "--help"],
        ["reject", "--help"],
        ["nodes", "return", "--help"],
        ["detect", "--help"],
        ["lab", "--help"],
    ]
    for command, done in zip(commands, gpufleet_cli_each(commands), strict=True):
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


@pytest.mark.parametrize(
    "args",
    [
        ["checkpoint-done", "7", "--node", "gpu1;rm"],
        ["spare-available", "../etc"],
        ["incidents", "show", "gpu 1"],
        ["approve", "$(reboot)"],
        ["reject", "gpu1`id`"],
        ["nodes", "return", "a/b"],
        ["remediate", "gpu1", "--xid", "79", "--cluster", "bad cluster"],
    ],
)
def test_bad_names_on_every_command_exit_2(args: list[str]) -> None:
    done = gpufleet_cli(*args, env=NOWHERE)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "invalid" in one_line_error(done.stderr)


@pytest.mark.parametrize("xid", ["-1", "65536", "1000000"])
def test_an_out_of_range_xid_exits_2(xid: str) -> None:
    done = gpufleet_cli("remediate", "gpu1", "--xid", xid, env=NOWHERE)
    assert done.returncode == 2
    assert f"--xid {xid} is not an Xid" in one_line_error(done.stderr)


def test_checkpoint_done_refuses_a_job_id_slurm_cannot_have() -> None:
    done = gpufleet_cli("checkpoint-done", "--node", "gpu1", "--", "-3", env=NOWHERE)
    assert done.returncode == 2
    assert "is not a Slurm job id" in one_line_error(done.stderr)


def test_checkpoint_done_refuses_a_step_its_mark_cannot_carry_before_slurm_is_asked() -> None:
    # 19 digits: the mark would be read back without its step, and left in the Comment by the next.
    done = gpufleet_cli("checkpoint-done", "42", "--step", str(10**18), env=NOWHERE)
    assert done.returncode == 2
    line = one_line_error(done.stderr)
    assert "--step" in line and "squeue" not in line


@pytest.mark.parametrize(
    "args",
    [
        ["approve", "gpu1", "--reason", "checked\napproved by root"],
        ["reject", "gpu1", "--reason", "bad\x1b[2J"],
        ["incidents", "cancel", "gpu1", "--reason", "r" * 1001],
    ],
)
def test_an_answer_the_incident_would_ignore_exits_2_before_it_is_sent(args: list[str]) -> None:
    # The workflow ignores such text (models/trust.py): saying "approved" and sending it would lie.
    done = gpufleet_cli(*args, "--cluster", "lab", env=NOWHERE)
    assert done.returncode == 2, done.stdout + done.stderr
    assert one_line_error(done.stderr).startswith("error: not ")


def test_nodes_return_refuses_an_unknown_role() -> None:
    done = gpufleet_cli("nodes", "return", "gpu1", "--as", "inference", env=NOWHERE)
    assert done.returncode == 2
    assert "expected 'spare' or 'training'" in one_line_error(done.stderr)


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("GPUFLEET_GRACE_SECONDS", "soon", "GPUFLEET_GRACE_SECONDS"),
        ("GPUFLEET_GRACE_SECONDS", "-5", "GPUFLEET_GRACE_SECONDS"),
        ("GPUFLEET_SPARE_RECHECK_SECONDS", "0", "GPUFLEET_SPARE_RECHECK_SECONDS"),
        ("GPUFLEET_OWNER_DRAINED", "always", "GPUFLEET_OWNER_DRAINED"),
        ("GPUFLEET_CLUSTER", "two words", "GPUFLEET_CLUSTER"),
    ],
)
def test_invalid_settings_exit_2_naming_the_variable(variable: str, value: str, named: str) -> None:
    for command in (["remediate", "gpu1", "--xid", "79"], ["worker"], ["detect", "--once", "--kmsg", "-"]):
        done = gpufleet_cli(*command, env={**NOWHERE, variable: value}, stdin="")
        assert done.returncode == 2, (command, done.stderr)
        line = one_line_error(done.stderr)
        assert named in line and "invalid settings" in line


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("xids: [79]", "xids: expected a mapping"),
        ("xids: {79: EXPLODE}", "xids.79"),
        ("remediation: {grace_seconds: forever}", "remediation.grace_seconds"),
        ("remediation: {grace: 5}", "remediation.grace"),
        ("- just\n- a list", "expected a mapping"),
        ("xids: {79: [", "not valid YAML"),
    ],
)
def test_a_malformed_policy_file_exits_2_naming_the_field(tmp_path: Path, text: str, named: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    for command in (["worker"], ["detect", "--once", "--kmsg", "-"]):
        done = gpufleet_cli(*command, env={**NOWHERE, "GPUFLEET_POLICY_FILE": str(policy)}, stdin="")
        assert done.returncode == 2, (command, done.stderr)
        assert named in one_line_error(done.stderr)


@pytest.mark.parametrize("job", ["", "abc", "²", "12x"])
def test_checkpoint_done_without_a_job_needs_a_job_id_in_slurm_job_id(job: str) -> None:
    done = gpufleet_cli("checkpoint-done", "--step", "3", env={**NOWHERE, "SLURM_JOB_ID": job})
    assert done.returncode == 2
    assert "$SLURM_JOB_ID is not set" in one_line_error(done.stderr)
