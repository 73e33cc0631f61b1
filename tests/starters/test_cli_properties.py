"""Whatever a file or an argument holds, a command answers in one line: property-based.

The files a command reads (a cluster spec: ``gpufleet cluster create``; the policy file through
GPUFLEET_POLICY_FILE: ``gpufleet detect``, ``gpufleet worker``) are given arbitrary bytes,
arbitrary YAML shapes and valid files with one value changed to anything; arguments are given
arbitrary text. Each runs in this process through the entry point (as in test_cli_every_command),
with Temporal and slurmrestd where nothing listens: the answer is the command's output (exit 0),
one line of bad input (exit 2), or one line naming the server it could not reach (exit 1).
Never a traceback, never a second line.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lab.procs import free_port
from tests.starters.test_cli_every_command import REPO, Ran, gpufleet

# A guard, not a measure: a command that hangs fails its test here.
pytestmark = pytest.mark.timeout(180)

EXAMPLES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, 2**63, "", "-", "0", "1e999", "nan", "2-00:00:00"])
    | st.text(max_size=30)
)
SHAPES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12) | st.integers(), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def changed(draw: st.DrawFn, document: Any) -> Any:
    """``document`` with one value somewhere in it replaced by anything (or its key dropped)."""
    document = copy.deepcopy(document)
    parent: Any = None
    key: Any = None
    node = document
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    if parent is None:
        return draw(SHAPES)
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(SHAPES)
    return document


def _dump(value: Any) -> bytes:
    return yaml.safe_dump(value, allow_unicode=True).encode()


EXAMPLE_SPEC = yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text())
EXAMPLE_POLICY = {
    "xids": {79: "REPLACE_NODE", 48: "RESET_GPU"},
    "remediation": {"grace_seconds": 30, "owner_drained": "ask"},
}


def file_contents(valid: Any) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(str.encode),
        SHAPES.map(_dump),
        changed(valid).map(_dump),
    )


@pytest.fixture(scope="module")
def servers_stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("stopped")
    token = folder / "slurm-token"
    token.write_text("a-token")
    return {
        "TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
        "GPUFLEET_HOME": str(folder / "home"),
        "GPUFLEET_CLUSTER": "research",
        "GPUFLEET_SLURM_BACKEND": "rest",
        "GPUFLEET_SLURMRESTD_URL": f"http://127.0.0.1:{free_port()}",
        "GPUFLEET_SLURMRESTD_TOKEN_FILE": str(token),
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inputs")


def answered(ran: Ran, env: dict[str, str], *, ok: bool) -> None:
    """The command's output (exit 0, when ``ok``), bad input (2) or an unreachable server (1), in one line."""
    assert "Traceback" not in ran.err, ran.err
    if ran.code == 0 and ok:
        assert not ran.err.strip(), ran.err
        return
    line = ran.error_line()
    if ran.code == 1:
        assert env["TEMPORAL_ADDRESS"] in line or env["GPUFLEET_SLURMRESTD_URL"] in line, line
    else:
        assert ran.code == 2, line


@EXAMPLES
@given(content=file_contents(EXAMPLE_SPEC))
@example(content=_dump(EXAMPLE_SPEC))
def test_any_cluster_spec_is_planned_or_refused_in_one_line(
    content: bytes, folder: Path, servers_stopped: dict[str, str]
) -> None:
    spec = folder / "cluster.yaml"
    spec.write_bytes(content)
    ran = gpufleet("cluster", "create", str(spec), "--dry-run", "--backend", "slinky", env=servers_stopped)
    answered(ran, servers_stopped, ok=True)
    if content == _dump(EXAMPLE_SPEC):
        assert ran.code == 0, ran.err
    if ran.code == 0:
        assert ran.out.startswith("# gpufleet cluster create --dry-run")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=file_contents(EXAMPLE_SPEC))
@example(content=_dump(EXAMPLE_SPEC))
def test_any_cluster_spec_is_refused_before_temporal_is_contacted(
    content: bytes, folder: Path, servers_stopped: dict[str, str]
) -> None:
    """Without --dry-run: a spec that is wrong is refused (2) before the creation would start;
    one that is right gets as far as Temporal, which is not there (1)."""
    spec = folder / "cluster-create.yaml"
    spec.write_bytes(content)
    ran = gpufleet("cluster", "create", str(spec), "--backend", "slinky", env=servers_stopped)
    answered(ran, servers_stopped, ok=False)


@EXAMPLES
@given(content=file_contents(EXAMPLE_POLICY))
@example(content=_dump(EXAMPLE_POLICY))
@example(content=b'"\\v": 1')  # a key that is a line break of its own: the error quotes it
def test_any_policy_file_is_used_or_refused_in_one_line(
    content: bytes, folder: Path, servers_stopped: dict[str, str]
) -> None:
    policy = folder / "policy.yaml"
    policy.write_bytes(content)
    empty = folder / "empty.log"
    empty.write_text("")
    env = {**servers_stopped, "GPUFLEET_POLICY_FILE": str(policy)}
    detected = gpufleet("detect", "--once", "--dry-run", "--kmsg", str(empty), env=env)
    answered(detected, env, ok=True)
    if content == _dump(EXAMPLE_POLICY):
        assert detected.code == 0, detected.err
    worked = gpufleet("worker", env=env)  # the policy is read first; then its Slurm is not there
    answered(worked, env, ok=False)
    assert (detected.code == 2) == (worked.code == 2), (detected.err, worked.err)


ARGUMENT = st.text(max_size=40) | st.sampled_from(["-1", "nan", "inf", "1e999", "gpu1", "--", "-", "", "a" * 300])


@EXAMPLES
@given(
    command=st.sampled_from(
        [
            ["remediate", "{0}", "--xid", "{1}"],
            ["remediate", "gpu1", "--xid", "79", "--cluster", "{0}", "--timeout", "{1}"],
            ["incidents", "show", "{0}", "--cluster", "{1}"],
            ["approve", "{0}", "--reason", "{1}"],
            ["checkpoint-done", "{0}", "--node", "{1}"],
            ["nodes", "return", "{0}", "--as", "{1}"],
            ["nodes", "release", "{0}", "--cluster", "{1}"],
            ["breaker", "status", "--cluster", "{0}"],
            ["pause", "--cluster", "{0}", "--reason", "{1}"],
            ["pool", "set-demand", "{0}", "--name", "{1}"],
            ["pool", "start", "--interval", "{0}", "--per-node", "{1}"],
            ["pool", "rebalance", "--to-inference", "{0}", "--name", "{1}"],
            ["cluster", "show", "{0}"],
            ["cluster", "delete", "{0}", "--deadline", "{1}"],
            ["cluster", "create", "--resume", "{0}"],
        ]
    ),
    first=ARGUMENT,
    second=ARGUMENT,
)
def test_any_argument_is_taken_or_refused_in_one_line(
    command: list[str], first: str, second: str, servers_stopped: dict[str, str]
) -> None:
    args = [part.format(first, second) for part in command]
    ran = gpufleet(*args, env=servers_stopped)
    answered(ran, servers_stopped, ok=False)
