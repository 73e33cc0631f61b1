"""The lab's stand-in ``libnvidia-ml.so.1`` (``lab/stub_nvml.c``): built with gcc into a folder
that a process finds it in through ``LD_LIBRARY_PATH``, so that pynvml, gpufleet's NVML source
and ``gpufleet health-check`` run unchanged on a machine without GPUs. What it answers is set by
its environment (the ``STUB_NVML_*`` variables named at the top of the C file)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("stub_nvml.c")
LIBRARY = "libnvidia-ml.so.1"


class StubUnavailable(RuntimeError):
    """The stub cannot be built here (no gcc)."""


def build_stub(folder: Path) -> Path:
    """Build the stub into ``folder`` (again only when the source is newer); returns ``folder``.

    Raises:
        StubUnavailable: gcc is missing; the message says what to install.
    """
    library = folder / LIBRARY
    if library.exists() and library.stat().st_mtime >= SOURCE.stat().st_mtime:
        return folder
    gcc = shutil.which("gcc")
    if gcc is None:
        raise StubUnavailable("gcc is needed to build the lab's NVML stand-in: apt-get install gcc")
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{LIBRARY}.building"
    subprocess.run([gcc, "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(partial), str(SOURCE)], check=True)
    partial.replace(library)
    return folder
