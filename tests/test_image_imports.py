"""What the production image holds imports without the lab and the benchmarks.

The Dockerfile copies some folders and runs `pip install .`: the lab and the benchmarks are not
there. Here the folders its COPY lines name (read from the Dockerfile itself, so this follows it)
are copied into a temporary directory, and each of their modules is imported in a fresh Python
process that sees that copy and the virtualenv's packages but not this checkout: the editable
install's finder is taken out, so an import of ``lab`` or ``bench`` fails as it would in the image.
The image's own metadata declares no entry point of the lab (setup.py declares them only where the
lab is built in; tested below). The virtualenv's does, as a checkout's: the gpufleet command seen
here must do without the lab even so, which is the harder case.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forked import forked_runs

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("lab", "bench")

# Runs first in every process: no editable finder, no checkout on the path, the copy first.
BOOT = textwrap.dedent(
    """
    import importlib.util, sys
    image = sys.argv.pop(1)
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
    sys.path[:] = [image] + [p for p in sys.path if "__editable__" not in p and p not in ("", {repo!r})]
    sys.path_importer_cache.clear()
    for name in {absent!r}:
        if importlib.util.find_spec(name) is not None:
            sys.exit(f"BOOT: {{name}} is importable: the test does not see what the image sees")
    """
).format(repo=str(REPO), absent=ABSENT)


def copied_packages(dockerfile: Path = REPO / "Dockerfile") -> list[str]:
    """The Python packages the Dockerfile's COPY lines bring into the image (folders with an __init__.py)."""
    packages = []
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if not words or words[0].upper() != "COPY":
            continue
        sources = [word for word in words[1:-1] if not word.startswith("--")]
        packages += [source.rstrip("/") for source in sources if (REPO / source / "__init__.py").is_file()]
    return packages


def modules_of(root: Path, packages: list[str]) -> list[str]:
    names = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image's Python packages, copied (no caches) where nothing else of the checkout is."""
    root = tmp_path_factory.mktemp("image")
    for package in copied_packages():
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    yield root


def image_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment less GPUFLEET_* and PYTHON*, with ``env`` added."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("GPUFLEET_", "PYTHON"))}
    environment.update({"COLUMNS": "200", "TEMPORAL_ADDRESS": "127.0.0.1:1", **(env or {})})
    return environment


def in_image(image: Path, code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` after BOOT in a fresh process, in the image's directory; ``args`` become sys.argv[1:]."""
    return subprocess.run(
        [sys.executable, "-I", "-c", BOOT + code, str(image), *args],
        cwd=image,
        env=image_environment(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def gpufleet(image: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return in_image(image, "sys.argv[0] = 'gpufleet'\nfrom workers.entry import main\nmain()\n", *args, env=env)


def test_the_dockerfile_copies_every_production_room_and_neither_lab_nor_bench() -> None:
    packages = copied_packages()
    assert set(packages) == {
        "models",
        "clients",
        "activities",
        "workflows",
        "workers",
        "starters",
        "detector",
        "gateway",
    }
    assert not set(packages) & set(ABSENT)


def third_party_imports(root: Path, packages: list[str]) -> list[str]:
    """The top-level modules the packages' modules import at their top level, less the packages
    themselves and the absent ones: what every module's process would import again."""
    names: set[str] = set()
    for package in packages:
        for path in (root / package).rglob("*.py"):
            for statement in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(statement, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in statement.names}
                elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                    names.add(statement.module.split(".")[0])
    return sorted(names - set(packages) - set(ABSENT) - {"__future__"})


def test_every_module_of_the_image_imports_without_the_lab(image: Path) -> None:
    """Each module is imported in a process of its own, forked (tests/forked.py) from one that ran
    BOOT and imported the third-party modules the image's code imports (never one of its own)."""
    packages = copied_packages()
    modules = modules_of(image, packages)
    assert "workers.entry" in modules and len(modules) > 50
    preload = "".join(
        f"try:\n    import {name}\nexcept Exception:\n    pass\n" for name in third_party_imports(image, packages)
    )
    runs = forked_runs(
        f"import sys\nsys.argv[1:] = [{str(image)!r}]\n{BOOT}\n{preload}",
        "import importlib, sys\nimportlib.import_module(sys.argv[1])\n",
        [[module] for module in modules],
        python_args=["-I"],
        env=image_environment(),
        cwd=image,
        parallel=os.cpu_count() or 2,
    )
    failed = {
        module: (done.stderr.strip().splitlines() or ["?"])[-1]
        for module, done in zip(modules, runs, strict=True)
        if done.returncode != 0
    }
    assert not failed, "modules the image cannot import:\n" + "\n".join(f"  {m}: {w}" for m, w in failed.items())


def test_the_image_has_no_lab_command(image: Path) -> None:
    done = gpufleet(image, "--help")
    assert done.returncode == 0, done.stderr
    commands = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("│ ") and line.split()[1:]}
    assert {"worker", "detect", "cluster", "remediate"} <= commands, done.stdout
    assert "lab" not in commands
    assert gpufleet(image, "lab", "--help").returncode == 2  # no such command


def test_a_worker_naming_the_lab_backend_in_the_image_is_told_it_is_not_installed(image: Path) -> None:
    done = gpufleet(image, "worker", env={"GPUFLEET_CLUSTER": "prod", "GPUFLEET_CLUSTER_BACKENDS": "lab"})
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "cluster backend 'lab', which is not installed here" in said and "Traceback" not in said
    assert "cannot reach the Temporal server" not in said  # refused before it tried


def test_the_image_has_no_default_cluster_and_says_what_to_set(image: Path) -> None:
    done = gpufleet(image, "remediate", "gpu1", "--xid", "79")
    assert done.returncode == 2
    said = " ".join(done.stderr.split())
    assert "no cluster named" in said and "give --cluster NAME or set GPUFLEET_CLUSTER" in said
    worker = gpufleet(image, "worker", env={"GPUFLEET_METRICS_PORT": "0"})
    assert worker.returncode == 2 and "GPUFLEET_CLUSTER is not set" in " ".join(worker.stderr.split())


def test_cluster_create_in_the_image_needs_a_backend_that_is_there(image: Path) -> None:
    spec = str(REPO / "examples" / "cluster.yaml")
    done = gpufleet(image, "cluster", "create", spec, "--dry-run")
    assert done.returncode == 2 and "no cluster backend named: give --backend" in " ".join(done.stderr.split())
    lab = gpufleet(image, "cluster", "create", spec, "--backend", "lab", "--dry-run")
    assert lab.returncode == 2 and "'lab' is not installed here" in " ".join(lab.stderr.split())
    slinky = gpufleet(image, "cluster", "create", spec, "--backend", "slinky", "--dry-run")
    assert slinky.returncode == 0, slinky.stderr
    assert slinky.stdout.startswith("# gpufleet cluster create --dry-run: research on slinky")


def test_an_installation_built_from_the_image_declares_no_entry_point_of_the_lab(image: Path) -> None:
    assert "setup.py" in next(line for line in (REPO / "Dockerfile").read_text().splitlines() if "pyproject" in line)
    shutil.copy(REPO / "setup.py", image / "setup.py")
    spec = importlib.util.spec_from_file_location("gpufleet_setup", image / "setup.py")
    assert spec is not None and spec.loader is not None
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # its setup() runs only as a build's __main__
    assert setup.entry_points(image) == {"console_scripts": ["gpufleet = workers.command:main"]}
    checkout = setup.entry_points(REPO)
    assert checkout["gpufleet.commands"] == ["lab = lab.cli:lab_app"]
    assert {"gpufleet.cluster_backends", "gpufleet.cli_defaults"} <= set(checkout)
