"""The part of gpufleet's package metadata decided when it is built: the lab's entry points.

The lab's commands (`gpufleet lab`), its cluster-creation backend and the defaults a command
falls back on in a checkout are declared only where the lab is built in. The production image
copies no lab/ (Dockerfile), so its installation declares none of them: nothing there names
a module it does not have. The gpufleet command is declared here too (setuptools takes a
project's entry points from one place only). Everything else is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

COMMAND = {"console_scripts": ["gpufleet = workers.command:main"]}
LAB_ENTRY_POINTS = {
    "gpufleet.commands": ["lab = lab.cli:lab_app"],
    "gpufleet.cluster_backends": ["lab = lab.cluster:cluster_backend"],
    "gpufleet.cli_defaults": ["lab = lab:CLI_DEFAULTS"],
}


def entry_points(root: Path) -> dict[str, list[str]]:
    """The entry points an installation built from ``root`` declares: the gpufleet command, and
    the lab's where it has one."""
    return {**COMMAND, **(LAB_ENTRY_POINTS if (root / "lab" / "__init__.py").is_file() else {})}


if __name__ == "__main__":
    from setuptools import setup

    setup(entry_points=entry_points(Path(__file__).resolve().parent))
