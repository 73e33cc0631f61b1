"""A real slurmrestd beside a lab cluster, for what gpufleet does through Slurm's REST API.

The cluster's slurm.conf takes ``jwt_lines`` (slurmctld then accepts tokens signed with the
key, as well as munge); slurmrestd authenticates requests by those tokens and must not run as
root or as the SlurmUser, so as root it drops to ``nobody`` once its socket is open.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.procs import free_port, port_in_use, spawn, stop, wait_for
from lab.slurm import SlurmLab


def slurmrestd_installed() -> str:
    """'' when slurmrestd and its JWT plugin are installed, else what to install."""
    if not shutil.which("slurmrestd"):
        return "slurmrestd is missing: apt-get install slurmrestd slurm-wlm-jwt-plugin"
    plugins = [Path(p) for p in ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/slurm", "/usr/lib64/slurm")]
    if not any((folder / "auth_jwt.so").exists() for folder in plugins):
        return "Slurm's JWT plugin is missing: apt-get install slurm-wlm-jwt-plugin"
    return ""


def jwt_lines(key: Path) -> list[str]:
    """slurm.conf lines for tokens signed with ``key`` (a file of at least 32 bytes, mode 600)."""
    return ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={key}"]


@dataclass
class Slurmrestd:
    pid: int
    url: str
    folder: Path  # its copy of slurm.conf

    def stop(self) -> None:
        stop([self.pid])
        shutil.rmtree(self.folder, ignore_errors=True)


def start_slurmrestd(slurm: SlurmLab, *, plugins: str = "openapi/v0.0.38", timeout: float = 30.0) -> Slurmrestd:
    """slurmrestd for ``slurm`` on a free port, serving ``plugins`` (the accounting ones,
    ``openapi/dbv0.0.38``, only where the cluster has slurmdbd).

    As ``nobody`` it cannot read the cluster's folder, so it reads a copy of slurm.conf in a
    folder of its own (the copy holds no secret: the JWT key stays with slurmctld), as Slinky's
    slurmrestd reads a slurm.conf of its own.
    """
    folder = Path(tempfile.mkdtemp(prefix="gpufleet-slurmrestd-"))
    folder.chmod(0o755)
    conf = folder / "slurm.conf"
    shutil.copyfile(slurm.conf, conf)
    conf.chmod(0o644)
    port = free_port()
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    pid = spawn(
        ["slurmrestd", "-a", "rest_auth/jwt", "-s", plugins, *as_user, f"127.0.0.1:{port}"],
        log=slurm.logs / "slurmrestd.out",
        env={**slurm.env, "SLURM_CONF": str(conf), "SLURM_JWT": "daemon"},
    )
    restd = Slurmrestd(pid, f"http://127.0.0.1:{port}", folder)
    try:
        wait_for(lambda: port_in_use(port), timeout=timeout, what=f"slurmrestd to listen (log: {slurm.logs})")
    except TimeoutError:
        restd.stop()
        raise
    return restd
