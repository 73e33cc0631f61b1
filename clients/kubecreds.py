"""The credentials of a kubeconfig's current user, as the official client's loader reads them
(tokens, token files, exec and OIDC providers where the loader supports them, client certificates)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from kubernetes import client as k8s
from kubernetes import config as k8s_config


class UserCredentials(NamedTuple):
    """A bearer token, or a client certificate and its key (PEM); None where the user has none."""

    token: str | None
    cert: bytes | None
    key: bytes | None


def user_credentials(kubeconfig: Path) -> UserCredentials:
    """The current user's credentials in ``kubeconfig``.

    Raises:
        kubernetes.config.ConfigException: the kubeconfig or its user cannot be read.
        OSError: a file it names cannot be read.
    """
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration, persist_config=False)
    refresh = getattr(configuration, "refresh_api_key_hook", None)
    if callable(refresh):  # an exec or OIDC provider whose token has expired gives a fresh one
        refresh(configuration)
    # "BearerToken" in the client's recent releases, "authorization" before.
    header = str(configuration.api_key.get("BearerToken") or configuration.api_key.get("authorization") or "")
    token = header.removeprefix("Bearer").strip() or None
    cert = Path(configuration.cert_file).read_bytes() if configuration.cert_file else None
    key = Path(configuration.key_file).read_bytes() if configuration.key_file else None
    return UserCredentials(token=token, cert=cert, key=key)
