"""The intake's wire format and settings: what a detector posts, and how both ends are configured.

A detector posts each event to ``POST /v1/events`` on the intake (gateway/intake.py) with its pod's
projected ServiceAccount token (audience ``gpufleet``); the intake checks the token, the node and the
cluster, limits each node's rate, and opens or joins the node's incident in Temporal.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.names import InvalidName, validate_cluster_name
from models.numbers import Finite, Whole
from models.xid import XidEvent

EVENTS_PATH = "/v1/events"
HEALTH_PATH = "/healthz"
DEFAULT_TOKEN_FILE = Path("/var/run/secrets/gpufleet/token")

# The intake's metrics (Prometheus, on its plain-HTTP metrics port).
EVENTS = "gpufleet_intake_events_total"
EVENTS_HELP = "Events posted to the intake, by result: accepted, refused, limited, malformed, unavailable."
REFUSED = "gpufleet_intake_refused_total"
REFUSED_HELP = (
    "Events the intake refused, by reason: no_token, unauthenticated, wrong_service_account, wrong_node, wrong_cluster."
)
# How the intake's 400 begins: the event itself cannot be taken (the detector sets it aside).
UNREADABLE_PREFIX = "not an event: "
RESULTS = ("accepted", "refused", "limited", "malformed", "unavailable")
REASONS = ("no_token", "unauthenticated", "wrong_service_account", "wrong_node", "wrong_cluster")
# The detectors' ServiceAccount (deploy/base/detector-serviceaccount.yaml), as NAMESPACE:NAME.
DEFAULT_SERVICE_ACCOUNTS = "gpufleet:gpufleet-detector"
SERVICE_ACCOUNT_USER = "system:serviceaccount:"
_DNS1123_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*$")


class IntakeEvent(BaseModel):
    """The body of ``POST /v1/events``: one event of one node, for one cluster.

    Fields this intake does not know are ignored, here as in the event: the DaemonSet and the
    intake's Deployment roll out separately, and a newer detector's event must still be taken.
    """

    model_config = ConfigDict(extra="ignore")

    cluster: str
    dry_run: bool = False
    event: XidEvent

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        try:
            return validate_cluster_name(value)
        except InvalidName as exc:
            raise ValueError(str(exc)) from None


class IntakeSettings(BaseSettings):
    """The intake's settings (``GPUFLEET_INTAKE_*``), and the detector's way to it.

    The intake's cluster is GPUFLEET_CLUSTER (models.settings.Settings); Temporal's address and
    credentials come from Temporal's env-config; the Kubernetes API from GPUFLEET_KUBECONFIG, else
    the pod's in-cluster configuration.
    """

    model_config = SettingsConfigDict(env_prefix="GPUFLEET_INTAKE_", extra="ignore")

    # The intake: HTTPS on this port, with this certificate and key (PEM files).
    port: Whole = Field(default=8443, ge=0, le=65535)
    bind: str = "0.0.0.0"  # noqa: S104 (a pod's own address: detectors reach it through its Service)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Prometheus text on plain HTTP (GET /metrics); 0: none.
    metrics_port: Whole = Field(default=9465, ge=0, le=65535)
    # Events per minute each node may post, and how many it may post at once after a quiet time.
    rate: Finite = Field(default=30.0, gt=0, le=60000)
    burst: Whole = Field(default=60, ge=1, le=100000)
    # The ServiceAccounts whose tokens may report (NAMESPACE:NAME, comma-separated): the
    # detectors'. Any pod may project a token of its own account for audience gpufleet; only
    # these are believed.
    service_accounts: str = DEFAULT_SERVICE_ACCOUNTS

    # The detector: where the intake answers (https://host:port; unset: the detector signals
    # Temporal itself, for development), the token it sends (read again at every post, as the
    # kubelet rotates it), and the CA that signed the intake's certificate (unset: the system's).
    url: str = ""
    token_file: Path = DEFAULT_TOKEN_FILE
    ca_file: Path | None = None

    @field_validator("service_accounts")
    @classmethod
    def _service_accounts(cls, value: str) -> str:
        accounts = [part.strip() for part in value.split(",") if part.strip()]
        if not accounts:
            raise ValueError(
                f"name at least one ServiceAccount as NAMESPACE:NAME (the detectors': {DEFAULT_SERVICE_ACCOUNTS})"
            )
        for account in accounts:
            namespace, _, name = account.partition(":")
            if not _DNS1123_LABEL.fullmatch(namespace) or not _DNS1123_SUBDOMAIN.fullmatch(name):
                raise ValueError(
                    f"{account!r}: give each ServiceAccount as NAMESPACE:NAME (e.g. {DEFAULT_SERVICE_ACCOUNTS}), "
                    "comma-separated"
                )
        return ",".join(accounts)

    @property
    def reporters(self) -> frozenset[str]:
        """The user names of the accepted ServiceAccounts' tokens (``system:serviceaccount:NS:NAME``)."""
        return frozenset(SERVICE_ACCOUNT_USER + account for account in self.service_accounts.split(","))

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and not value.startswith("https://"):
            raise ValueError(f"{value!r}: give the intake's https:// URL (https://host:port), or leave it unset")
        return value
