"""Entry points: one whose package is not installed is skipped (and said to be missing when named);
any other failure to import one is raised. The lab's, in this checkout, are found."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from models import plugins
from models.plugins import CLI_DEFAULTS, CLUSTER_BACKENDS, COMMANDS, PluginNotInstalled
from models.settings import ClusterNotSet, Settings, cluster_backend_names

GROUP = "gpufleet.test"


def entry(name: str, value: str) -> EntryPoint:
    return EntryPoint(name, value, GROUP)


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, EntryPoint]:
    """What the test group (and the CLI defaults' group) declares: the test fills it in. Beside it,
    modules to name: one that loads, one that imports a package that is absent, one that fails
    otherwise."""
    (tmp_path / "plugin_here.py").write_text("VALUE = {'cluster': 'here'}\n")
    (tmp_path / "plugin_elsewhere.py").write_text("VALUE = {'cluster': 'elsewhere'}\n")
    (tmp_path / "plugin_dependency.py").write_text("import no_such_dependency_xyz\nVALUE = 1\n")
    (tmp_path / "plugin_broken.py").write_text("raise ImportError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    declared: dict[str, EntryPoint] = {}

    def entry_points(*, group: str) -> list[EntryPoint]:
        return list(declared.values()) if group in (GROUP, CLI_DEFAULTS) else []

    monkeypatch.setattr(plugins, "entry_points", entry_points)
    return declared


ABSENT = entry("absent", "no_such_package_xyz.sub:VALUE")
HERE = entry("here", "plugin_here:VALUE")


def test_an_entry_point_whose_package_is_absent_is_skipped_and_named_when_loaded(
    group: dict[str, EntryPoint],
) -> None:
    group.update(here=HERE, absent=ABSENT)
    assert set(plugins.declared(GROUP)) == {"here", "absent"}
    assert plugins.installed(GROUP) == {"here": {"cluster": "here"}}
    with pytest.raises(PluginNotInstalled, match=r"'absent' \(gpufleet.test\) is not installed here") as caught:
        plugins.load(ABSENT)
    assert caught.value.missing == "no_such_package_xyz"
    assert not plugins.present(ABSENT) and plugins.present(HERE)


@pytest.mark.parametrize(
    ("value", "error", "said"),
    [
        ("plugin_dependency:VALUE", ModuleNotFoundError, "no_such_dependency_xyz"),
        ("plugin_broken:VALUE", ImportError, "half-installed"),
    ],
)
def test_any_other_failure_to_import_an_entry_point_is_raised(
    group: dict[str, EntryPoint], value: str, error: type[Exception], said: str
) -> None:
    group.update(here=HERE, absent=ABSENT, broken=entry("broken", value))
    with pytest.raises(error, match=said):
        plugins.load(group["broken"])
    with pytest.raises(error, match=said):
        plugins.installed(GROUP)


def test_defaults_come_from_installed_packages_and_must_agree(
    group: dict[str, EntryPoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUFLEET_CLUSTER", raising=False)
    group.update(here=HERE, absent=ABSENT)
    assert plugins.cli_default("cluster") == "here"
    assert plugins.cli_default("cluster_backend") is None
    assert Settings().command_cluster() == "here"
    assert Settings(cluster="prod").command_cluster() == "prod"
    assert Settings(cluster="prod").command_cluster("given") == "given"
    group["elsewhere"] = entry("elsewhere", "plugin_elsewhere:VALUE")
    with pytest.raises(ValueError, match="installed packages give different defaults for cluster"):
        plugins.cli_default("cluster")
    group.clear()
    group["absent"] = ABSENT
    with pytest.raises(ClusterNotSet, match="no cluster named"):
        Settings().command_cluster()


def test_the_labs_entry_points_are_found_in_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "lab" in plugins.installed(COMMANDS)
    assert "lab" in plugins.declared(CLUSTER_BACKENDS) and "lab" in cluster_backend_names()
    assert plugins.cli_default("cluster") == "lab" and plugins.cli_default("cluster_backend") == "lab"
    monkeypatch.delenv("GPUFLEET_CLUSTER", raising=False)
    assert Settings().cluster == ""  # no default in the settings themselves: the worker needs one named
    assert Settings().command_cluster() == "lab"
