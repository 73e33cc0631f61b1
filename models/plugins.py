"""What other installed packages add to gpufleet, found through entry points.

Production code never names the lab: the lab's commands, its cluster-creation backend and the
defaults the command falls back on in a checkout are entry points of gpufleet's distribution
(pyproject.toml), loaded here by group. The production image installs the same distribution
without the lab's package, so those entry points are declared there while their module is
absent: such an entry point is skipped as if it were not declared, and naming it says that it is
not installed. Any other failure to import one is raised: a broken plugin must not vanish quietly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

# Typer apps added to the gpufleet command, each under its entry point's name (the lab's: `gpufleet lab`).
COMMANDS = "gpufleet.commands"
# Cluster-creation backends beside the built-in ones: a callable (Settings, KubeClient) -> ClusterBackend,
# named as GPUFLEET_CLUSTER_BACKENDS and `gpufleet cluster create --backend` name it.
CLUSTER_BACKENDS = "gpufleet.cluster_backends"
# What a command falls back on where neither its option nor a GPUFLEET_* setting says: a mapping of
# names to values ("cluster", "cluster_backend"). The worker never takes these.
CLI_DEFAULTS = "gpufleet.cli_defaults"


class PluginNotInstalled(LookupError):
    """An entry point is declared but its module is not installed here (the lab, in the image)."""

    def __init__(self, entry: EntryPoint, missing: str) -> None:
        super().__init__(
            f"{entry.name!r} ({entry.group}) is not installed here: its package {missing!r} ({entry.value}) is missing"
        )
        self.entry = entry
        self.missing = missing


def declared(group: str) -> dict[str, EntryPoint]:
    """Every entry point of ``group`` by name, loaded or not."""
    return {entry.name: entry for entry in entry_points(group=group)}


def _module_absent(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether the missing module is the entry point's own, or a package above it: not one that
    its module imports (a missing dependency of an installed plugin is an error)."""
    missing = exc.name or ""
    return bool(missing) and (module == missing or module.startswith(f"{missing}."))


def load(entry: EntryPoint) -> Any:
    """The object an entry point names.

    Raises:
        PluginNotInstalled: its module is not installed here.
    """
    try:
        return entry.load()
    except ModuleNotFoundError as exc:
        if exc.name and _module_absent(exc, entry.module):
            raise PluginNotInstalled(entry, exc.name) from exc
        raise


def present(entry: EntryPoint) -> bool:
    """Whether the entry point's module is installed here (found without importing it)."""
    try:
        return importlib.util.find_spec(entry.module) is not None
    except ModuleNotFoundError:  # a package above it is missing
        return False


def installed(group: str, *, lacking: Callable[[str, ModuleNotFoundError], None] | None = None) -> dict[str, Any]:
    """The loaded object of every entry point of ``group`` whose module is installed, by name.

    ``lacking``: told of (and then skipping) one whose module is installed but needs a module that
    is not (a package installed without its extra's dependencies); without it, that is raised.
    """
    found: dict[str, Any] = {}
    for name, entry in sorted(declared(group).items()):
        try:
            found[name] = load(entry)
        except PluginNotInstalled:
            continue
        except ModuleNotFoundError as exc:
            if lacking is None:
                raise
            lacking(name, exc)
    return found


def cli_default(key: str) -> str | None:
    """The value the installed packages give ``key`` for the command (None: none gives one).

    Raises:
        ValueError: two of them give it different values, or one is not a mapping of strings.
    """
    given: dict[str, str] = {}
    for name, defaults in installed(CLI_DEFAULTS).items():
        if not isinstance(defaults, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in defaults.items()
        ):
            raise ValueError(f"the {CLI_DEFAULTS} entry point {name!r} is not a mapping of strings")
        if key in defaults:
            given[name] = defaults[key]
    if len(set(given.values())) > 1:
        said = ", ".join(f"{name}: {value!r}" for name, value in sorted(given.items()))
        raise ValueError(f"installed packages give different defaults for {key} ({said}): set it explicitly")
    return next(iter(given.values()), None)
