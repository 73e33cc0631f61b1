"""The lab's Job runner runs only the lab's stand-in: a real repair command would act on this machine."""

from __future__ import annotations

import sys

import pytest

from lab.jobrunner import stand_in


def test_only_the_labs_stand_in_is_run() -> None:
    assert stand_in([sys.executable, "-m", "lab.repair", "reset", "--gpu", "0000:3b:00", "--node", "gpu1"])


@pytest.mark.parametrize(
    "argv",
    [
        ["sh", "-c", "echo b > /proc/sysrq-trigger"],  # the default reboot: never here
        ["nvidia-smi", "--gpu-reset", "-i", "0000:3b:00"],
        [sys.executable, "-c", "import lab.repair"],
        [sys.executable, "-m", "lab.repairs"],
        [],
    ],
)
def test_anything_else_is_refused(argv: list[str]) -> None:
    assert not stand_in(argv)
