"""Settings read from the environment (prefix ``GPUFLEET_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Where the outside world is, and how patient to be with it.

    Temporal's own address, namespace and TLS come from Temporal's env-config
    (``TEMPORAL_ADDRESS``, profiles), not from here.
    """

    model_config = SettingsConfigDict(env_prefix="GPUFLEET_", extra="ignore")

    cluster: str = "lab"
    home: Path = Path(".gpufleet")
    partition: str = "train"
    slurm_conf: Path | None = None
    slurm_bin_dir: Path | None = None
    slurm_timeout_seconds: float = 30.0
    kubeconfig: Path | None = None
    webhook_url: str | None = None
    policy_file: Path | None = None
    grace_seconds: float = Field(default=120.0, ge=0)
    spare_recheck_seconds: float = Field(default=60.0, gt=0)
    resume_timeout_seconds: float = Field(default=1800.0, gt=0)
    eviction_timeout_seconds: float = Field(default=60.0, ge=0)
    poll_seconds: float = Field(default=0.5, gt=0)
