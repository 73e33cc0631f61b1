"""Node names that could reach a command line are validated first."""

from __future__ import annotations

import pytest

from models.names import InvalidName, validate_cluster_name, validate_node_name
from models.xid import XidEvent


@pytest.mark.parametrize("name", ["gpu1", "node-a.rack3", "a", "GPU_07"])
def test_ordinary_node_names_pass(name: str) -> None:
    assert validate_node_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "gpu1; rm -rf /", "$(reboot)", "gpu`id`", "-gpu1", "gpu1 gpu2", "a" * 64, "gpu[1-4]", "gpu1\n"]
)
def test_shell_metacharacters_and_odd_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_node_name(name)


def test_an_xid_event_refuses_an_unsafe_node() -> None:
    with pytest.raises(ValueError, match="invalid node name"):
        XidEvent(node="gpu1;reboot", xid=79)


@pytest.mark.parametrize("name", ["Lab", "lab_1", "", "-lab"])
def test_bad_cluster_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_cluster_name(name)
