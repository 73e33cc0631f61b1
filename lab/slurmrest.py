"""A real slurmrestd beside a lab cluster, for what gpufleet does through Slurm's REST API.

The cluster's slurm.conf takes ``jwt_lines`` (slurmctld then accepts tokens signed with the
key, as well as munge or auth/slurm); slurmrestd authenticates requests by those tokens and must
not run as root or as the SlurmUser, so as root it drops to ``nobody`` once its socket is open.

On the host's Slurm (22.05) it is the host's slurmrestd serving ``openapi/v0.0.38``; on a newer
release (lab/slurmroots.py) it is the root's, run inside the root like the cluster's daemons,
serving ``openapi/slurmctld`` (every data parser the release has: 24.11 v0.0.40-v0.0.42, 26.05
v0.0.42-v0.0.45). Where the cluster has slurmdbd (lab/accounting.py) it serves the accounting API
too: ``openapi/dbv0.0.38`` on 22.05, ``openapi/slurmdbd`` on the newer releases.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.accounting import conf_value
from lab.procs import free_port, port_in_use, spawn, stop, wait_for
from lab.slurm import SlurmLab
from lab.slurmroots import SlurmInstall

PLUGIN_FOLDERS = ("usr/lib/x86_64-linux-gnu/slurm-wlm", "usr/lib/slurm", "usr/lib64/slurm")


def slurmrestd_installed(install: SlurmInstall | None = None) -> str:
    """'' when slurmrestd and its JWT plugin are installed (on the host, or in ``install``'s
    root when it has one), else what to install."""
    if install is not None and install.root is not None:
        root = install.root
        if not (root / "usr" / "sbin" / "slurmrestd").exists():
            return f"slurmrestd is missing from the Slurm {install.version} root {root}: python -m lab.slurmroots"
        if not any((root / folder / "rest_auth_jwt.so").exists() for folder in PLUGIN_FOLDERS):
            return f"the JWT plugin is missing from the Slurm {install.version} root {root}: python -m lab.slurmroots"
        return ""
    if not shutil.which("slurmrestd"):
        return "slurmrestd is missing: apt-get install slurmrestd slurm-wlm-jwt-plugin"
    if not any((Path("/") / folder / "auth_jwt.so").exists() for folder in PLUGIN_FOLDERS):
        return "Slurm's JWT plugin is missing: apt-get install slurm-wlm-jwt-plugin"
    return ""


def jwt_lines(key: Path) -> list[str]:
    """slurm.conf lines for tokens signed with ``key`` (a file of at least 32 bytes, mode 600)."""
    return ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={key}"]


def default_plugins(slurm: SlurmLab) -> str:
    """The OpenAPI plugins of the cluster's release: 22.05 names one per version, newer releases
    name one plugin that serves every version of their data parsers; and the accounting API too
    where the cluster has slurmdbd (its slurm.conf asks for it)."""
    accounting = conf_value(slurm.conf.read_text(), "AccountingStorageType") == "accounting_storage/slurmdbd"
    if slurm.install.release.version == "22.05":
        return "openapi/v0.0.38,openapi/dbv0.0.38" if accounting else "openapi/v0.0.38"
    return "openapi/slurmctld,openapi/slurmdbd" if accounting else "openapi/slurmctld"


@dataclass
class Slurmrestd:
    pid: int
    url: str
    folder: Path  # its copy of slurm.conf

    def stop(self) -> None:
        stop([self.pid])
        shutil.rmtree(self.folder, ignore_errors=True)


def start_slurmrestd(
    slurm: SlurmLab,
    *,
    plugins: str | None = None,
    port: int | None = None,
    timeout: float = 30.0,
    users: Path | None = None,
) -> Slurmrestd:
    """slurmrestd for ``slurm`` on ``port`` (default: a free one), serving ``plugins`` (default:
    ``default_plugins``, the release's controller API, and its accounting API, ``openapi/dbv0.0.38``
    or ``openapi/slurmdbd``, where the cluster has slurmdbd). A slurmrestd started again on its
    old port is found again by whoever was given its URL. It reads slurm.conf as it is when it
    starts: one started before the cluster's accounting must be started again to serve it.

    As ``nobody`` it cannot read the cluster's folder, so it reads a copy of slurm.conf in a
    folder of its own under /tmp (which a root's commands see), as Slinky's slurmrestd reads a
    slurm.conf of its own. The copy holds no secret and nothing else is beside it: the JWT key
    stays with slurmctld, and on auth/slurm slurmrestd needs no slurm.key (it speaks to the
    controller with each request's token, through auth/jwt).

    ``users``: a folder with the cluster's ``passwd`` and ``group`` (a Slinky cluster of the lab),
    copied beside that slurm.conf as ``etc/`` so that lab/inroot.py gives them to slurmrestd too.
    """
    folder = Path(tempfile.mkdtemp(prefix="gpufleet-slurmrestd-", dir="/tmp"))
    folder.chmod(0o755)
    conf = folder / "slurm.conf"
    shutil.copyfile(slurm.conf, conf)
    conf.chmod(0o644)
    if users is not None:
        (folder / "etc").mkdir(mode=0o755)
        for name in ("passwd", "group"):
            shutil.copyfile(users / name, folder / "etc" / name)
            (folder / "etc" / name).chmod(0o644)
    port = port or free_port()
    as_user = ["-u", "65534"] if os.geteuid() == 0 else []
    command = ["slurmrestd", "-a", "rest_auth/jwt", "-s", plugins or default_plugins(slurm), *as_user]
    pid = spawn(
        slurm.argv([*command, "-f", str(conf), f"127.0.0.1:{port}"]),
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
