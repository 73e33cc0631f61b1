"""The lab's intake: detectors post to ``gpufleet intake`` as in production, never to Temporal.

Each lab node has a detector pod in the emulated API (namespace ``gpufleet``, owned by the
DaemonSet ``gpufleet-detector``, so a drain leaves it), and its detector a token from the API's
TokenRequest bound to that pod, as the kubelet would project it. The intake serves HTTPS with a
certificate from the lab's own CA (lab/certs.py).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from clients.kubeauth import KubeAuth
from lab.certs import ServerCertificate, make_server_certificate
from models.auth import INTAKE_AUDIENCE

NAMESPACE = "gpufleet"
DETECTOR_ACCOUNT = "gpufleet-detector"
DETECTOR_DAEMONSET = "gpufleet-detector"
# What the intake believes (GPUFLEET_INTAKE_SERVICE_ACCOUNTS): the lab's detectors' account alone.
REPORTERS = f"{NAMESPACE}:{DETECTOR_ACCOUNT}"
# A lab runs for days at most; the detector reads its token at every post, so a new `lab up` renews it.
TOKEN_SECONDS = 7 * 86400


def detector_pod_name(node: str) -> str:
    return f"{DETECTOR_DAEMONSET}-{node}"


def detector_pod_uid(node: str) -> str:
    return f"lab-detector-{node}"


def detector_seed(nodes: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The detectors' namespace, ServiceAccount and one pod per node (bound to it by spec.nodeName)."""
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": DETECTOR_DAEMONSET, "uid": "lab-detector-ds"}
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": detector_pod_name(node),
                "namespace": NAMESPACE,
                "uid": detector_pod_uid(node),
                "labels": {"app.kubernetes.io/name": "gpufleet-detector"},
                "ownerReferences": [{**owner, "controller": True}],
            },
            "spec": {
                "nodeName": node,
                "serviceAccountName": DETECTOR_ACCOUNT,
                "containers": [{"name": "detector", "image": "gpufleet"}],
            },
            "status": {"phase": "Running"},
        }
        for node in nodes
    ]
    return {
        "namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}],
        "serviceaccounts": [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                # A fixed UID, as the pods' (its tokens name both): they outlive a restart of the API.
                "metadata": {"name": DETECTOR_ACCOUNT, "namespace": NAMESPACE, "uid": "lab-detector-account"},
            }
        ],
        "pods": pods,
    }


def certificate(home: Path) -> ServerCertificate:
    """The intake's certificate for localhost and 127.0.0.1, and the lab CA that signed it."""
    return make_server_certificate(home / "certs", name="intake")


def write_tokens(kubeconfig: Path, folder: Path, nodes: list[str]) -> dict[str, Path]:
    """Each node's detector token (audience gpufleet, bound to its pod) in ``folder/NODE``."""
    auth = KubeAuth(kubeconfig=kubeconfig)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for node in nodes:
        token = auth.request_token(
            NAMESPACE,
            DETECTOR_ACCOUNT,
            audiences=[INTAKE_AUDIENCE],
            expiration_seconds=TOKEN_SECONDS,
            pod=(detector_pod_name(node), detector_pod_uid(node)),
        )
        path = folder / node
        partial = path.with_name(f".{node}.partial")
        partial.write_text(token)
        partial.chmod(0o600)
        partial.replace(path)  # a detector reading it at that moment sees the old token or the new
        files[node] = path
    return files


def healthy(url: str, ca: Path) -> bool:
    """Whether the intake at ``url`` answers ``GET /healthz``."""
    context = ssl.create_default_context(cafile=str(ca))
    return httpx.get(f"{url}/healthz", verify=context, timeout=2).status_code == 200
