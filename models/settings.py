"""Settings read from the environment (prefix ``GPUFLEET_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.clusterops import BUILTIN_BACKENDS
from models.names import InvalidName, validate_cluster_name
from models.numbers import Finite, Whole
from models.plugins import CLUSTER_BACKENDS, cli_default, declared
from models.policy import OwnerDrained, RemediationSettings, load_policy
from models.requests import WorkerConfig
from models.slinky import RESTAPI_FROM_SERVICE


class ClusterNotSet(ValueError):
    """No cluster is named: GPUFLEET_CLUSTER is unset and nothing else gives one."""


# The --cluster option of every command that takes one (Settings.command_cluster).
CLUSTER_HELP = "Cluster name (default: $GPUFLEET_CLUSTER; where the lab is installed and that is unset, 'lab')."


def cluster_backend_names() -> list[str]:
    """The cluster-creation backends a worker may name: the built-in ones and every one an
    entry point declares (installed here or not: a worker naming one that is not is told so)."""
    return sorted({*BUILTIN_BACKENDS, *declared(CLUSTER_BACKENDS)})


class Settings(BaseSettings):
    """Where the outside world is, and how patient to be with it.

    Temporal's own address, namespace and TLS come from Temporal's env-config
    (``TEMPORAL_ADDRESS``, profiles), not from here.
    """

    model_config = SettingsConfigDict(env_prefix="GPUFLEET_", extra="ignore")

    # The cluster this process serves or acts on (its task queue: gpufleet-NAME). No default: the
    # worker refuses to start without it (the lab sets it for its own); a command takes --cluster,
    # then this, then what an installed package gives (command_cluster: in a checkout, the lab's).
    cluster: str = ""
    home: Path = Path(".gpufleet")
    partition: str = "train"
    slurm_conf: Path | None = None
    slurm_bin_dir: Path | None = None
    slurm_timeout_seconds: Finite = Field(default=30.0, gt=0, le=3600)
    # How long one request to the Kubernetes API may take before it fails (the activity retries).
    kube_timeout_seconds: Finite = Field(default=15.0, gt=0, le=3600)
    # How the worker reaches Slurm: its commands (cli), or slurmrestd (rest: clusters reached only
    # through Slurm's REST API). A backend lacking a method the worker needs stops it at start.
    slurm_backend: Literal["cli", "rest"] = "cli"
    slurmrestd_url: str = ""
    slurmrestd_version: str = ""  # empty: the newest the server answers
    slurmrestd_user: str = "root"
    # The JWT: signed here with the key in this file, or read as a token from this one (never
    # the key or the token itself in the environment). Exactly one of the two.
    slurmrestd_jwt_key_file: Path | None = None
    slurmrestd_token_file: Path | None = None
    # How a failed node is remediated: "slurm" (its Slurm node is named after it; a spare joins
    # the partition by an edit) or "slinky" (slurm-operator: its Slurm nodes are NodeSet pods on
    # it; a spare is made eligible for their NodeSet, no partition is edited). "auto": slinky when
    # the cluster's namespace (slinky_namespace) holds NodeSets, read once at the worker's start.
    remediation_mode: Literal["auto", "slurm", "slinky"] = "auto"
    # The namespace of the cluster's slurm-operator objects; empty: slurm-<cluster>.
    slinky_namespace: str = ""
    kubeconfig: Path | None = None
    # Where gpufleet keeps its Leases (one per Slurm partition, serialising membership edits).
    namespace: str = "gpufleet"
    webhook_url: str | None = None
    policy_file: Path | None = None
    # These five default to the policy file's `remediation:` section; set here, they win over it.
    grace_seconds: Finite = Field(default=120.0, ge=0, le=86400)
    spare_recheck_seconds: Finite = Field(default=60.0, gt=0, le=86400)
    resume_timeout_seconds: Finite = Field(default=1800.0, gt=0, le=7 * 86400)
    eviction_timeout_seconds: Finite = Field(default=60.0, ge=0, le=86400)
    owner_drained: OwnerDrained = OwnerDrained.ASK
    poll_seconds: Finite = Field(default=0.5, gt=0, le=60)
    # The detector, starting without a cursor it can resume from (lost, unreadable, refused by
    # journalctl), skips events whose records are older than its start less this many seconds:
    # they were most likely handled before. Newer ones, a boot's own failures among them, count.
    detector_replay_cutoff_seconds: Finite = Field(default=300.0, ge=0, le=3650 * 86400)
    # How long a workflow task waits on this worker's own (sticky) queue before the server hands
    # it to the cluster's queue, where any worker takes it and replays the workflow's history.
    # Short: a killed worker's incidents move on within seconds. A worker busy with many
    # incidents at once can need longer, or every late task is replayed in full (docs/performance.md).
    sticky_timeout_seconds: Finite = Field(default=3.0, gt=0, le=600)
    # Incidents the worker keeps in memory between their steps (the SDK's workflow cache). One
    # left out is replayed from its history at its next step: fewer is less memory, more CPU.
    max_cached_workflows: Whole = Field(default=1000, ge=0, le=100_000)
    # How the worker loads gpufleet's workflow code for each workflow run. "shared": the workflows
    # package is imported once and every run uses it; each run still has its own sandbox and its
    # own state. "isolated" (the SDK's default): the sandbox imports the package again for every
    # run, so its checks on what workflow code imports (the clock through datetime or time,
    # random, os, threads) cover gpufleet's own code too; shared keeps only its checks on builtins
    # (open, input). Isolated costs about 170 KB and 14 ms of CPU more per run: 170 MB more held by
    # a worker with 1,000 incidents open. The workflow tests (tests/workflows) and the replay
    # check (tests/replay) run the workflows isolated, and every workflow a worker registers is
    # loaded isolated in a test: the code is checked there.
    workflow_sandbox: Literal["shared", "isolated"] = "shared"
    # Every incident the detectors and `gpufleet remediate` open is a dry run: each step recorded
    # as it would be done, nothing changed, nobody notified (workflow ID dryrun-{cluster}-{node}).
    dry_run: bool = False
    # How often the cluster's reaper looks for leases, spare claims and repair Jobs that incidents
    # no longer running still hold (a terminated incident runs no cleanup of its own).
    reaper_seconds: Finite = Field(default=300.0, gt=0, le=86400)
    # Where this worker may create Slurm clusters (comma-separated: slinky, or a backend an
    # installed package adds, such as the lab's); empty: it does not serve cluster creation
    # (task queue gpufleet-clusters) at all.
    cluster_backends: str = ""
    # Where pool rebalancing reads inference demand (the Prometheus HTTP API); unset: demand
    # comes from `gpufleet pool set-demand` only.
    prometheus_url: str | None = None
    # Where a Slinky cluster's slurmrestd answers, `{name}` standing for the cluster's name;
    # empty: the operator's Service <name>-restapi, for a worker inside the Kubernetes cluster;
    # `service`: the address that Service holds (its clusterIP and port), read through the API.
    slinky_restapi_url: str = ""
    # The worker's Prometheus endpoint (GET /metrics): the Temporal SDK's temporal_* metrics and
    # gpufleet's own (models/metrics.py). 0 or empty turns it off; the address it listens on.
    metrics_port: Whole = Field(default=9464, ge=0, le=65535)
    metrics_bind: str = "0.0.0.0"  # noqa: S104 (a pod's own address: Prometheus scrapes it from outside)

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _metrics_port(cls, value: object) -> object:
        return 0 if isinstance(value, str) and not value.strip() else value

    @field_validator("slinky_restapi_url")
    @classmethod
    def _restapi(cls, value: str) -> str:
        if not value or value == RESTAPI_FROM_SERVICE:
            return value
        try:
            filled = value.format(name="x")
        except (KeyError, IndexError, ValueError):
            raise ValueError("only {name} may stand in it (the cluster's name)") from None
        if not filled.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL, e.g. http://{name}-restapi.slurm-{name}:6820, or service")
        return value

    @field_validator("cluster_backends")
    @classmethod
    def _backends(cls, value: str) -> str:
        known = cluster_backend_names()
        unknown = sorted({b.strip() for b in value.split(",") if b.strip()} - set(known))
        if unknown:
            raise ValueError(f"unknown backend(s) {', '.join(unknown)}: use {', '.join(known)}")
        return value

    @property
    def backends(self) -> list[str]:
        return sorted({b.strip() for b in self.cluster_backends.split(",") if b.strip()})

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        if not value:
            return value  # unset: the worker refuses to start, a command asks for --cluster
        try:
            return validate_cluster_name(value)
        except InvalidName as exc:
            raise ValueError(str(exc)) from None

    def command_cluster(self, given: str | None = None) -> str:
        """The cluster a command acts on: ``given`` (its --cluster), else GPUFLEET_CLUSTER, else the
        default an installed package gives the command (the lab's "lab", in a checkout).

        Raises:
            InvalidName: the name is not a cluster name.
            ClusterNotSet: nothing names one (the production image has no default).
            ValueError: installed packages disagree on the default.
        """
        chosen = given or self.cluster or cli_default("cluster")
        if not chosen:
            raise ClusterNotSet("no cluster named (GPUFLEET_CLUSTER is unset, and nothing installed gives a default)")
        return validate_cluster_name(chosen)

    def worker_config(self) -> WorkerConfig:
        """The policy file (one file for the detector and the worker) with GPUFLEET_* overrides on top.

        Raises:
            PolicyError: the policy file is missing or wrong, or is not UTF-8 text.
        """
        policy = load_policy(self.policy_file)
        overrides = {
            name: getattr(self, name) for name in RemediationSettings.model_fields if name in self.model_fields_set
        }
        remediation = RemediationSettings.model_validate({**policy.remediation.model_dump(), **overrides})
        return WorkerConfig(
            cluster=self.cluster,
            settings=remediation,
            policy=policy.model_copy(update={"remediation": remediation}),
            policy_file=str(self.policy_file) if self.policy_file else None,
        )


def settings_error(exc: ValidationError) -> str:
    """One line naming each GPUFLEET_* variable that is wrong and why."""
    problems = "; ".join(
        f"GPUFLEET_{'_'.join(str(part) for part in error['loc']).upper()}: {error['msg']}" for error in exc.errors()
    )
    return f"invalid settings: {problems}"
