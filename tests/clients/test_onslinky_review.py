# ruff: noqa: F811 - the fixtures of test_onslinky.py, imported
"""An incident that took a node over from a pool move after the move scaled its NodeSet in, while
the pool's next move (same batch) scales the same NodeSet in for another node's pod: the claim
still knows that the first pod is gone for good (clients/onslinky.py ``SlinkyPool._scaled_in``)."""

from __future__ import annotations

import pytest

from clients.errors import Unavailable
from clients.kube import KubernetesApi
from clients.onslinky import SCALED_IN_ANNOTATION, SlinkyPool
from tests.clients.test_onslinky import (  # noqa: F401 - fixtures
    INC,
    NODESET,
    NS,
    api,
    drained_out,
    idle,
    kube,
    on_slinky,
    recreate,
)
from tests.conftest import KubeApiProcess


def scale_in_for(client: KubernetesApi, pod_name: str, uid: str, replicas: int) -> None:
    found = client.get_nodeset(NS, NODESET)
    body = {
        "metadata": {"annotations": {SCALED_IN_ANNOTATION: f"{pod_name}/{uid}"}},
        "spec": {"replicas": replicas},
    }
    body["metadata"]["resourceVersion"] = found["metadata"]["resourceVersion"]  # type: ignore[index]
    client.patch_nodeset(NS, NODESET, body)


def test_a_claim_waits_for_no_pod_scaled_in_though_a_later_move_scaled_the_nodeset_in_again(
    api: KubeApiProcess,
    kube: KubernetesApi,
) -> None:
    first = kube.find_pod(NS, "research-train-0")
    other = kube.find_pod(NS, "research-train-2")  # gpu2's: the batch's next node
    assert first is not None and other is not None
    scale_in_for(kube, "research-train-0", first.uid, 2)  # the move of gpu1
    drained_out(kube, "gpu1", INC)  # the incident takes gpu1 over: both its pods recorded, evicted
    scale_in_for(kube, "research-train-2", other.uid, 1)  # the pool's next move, of gpu2
    slinky, _ = on_slinky(kube, {"train-b1": idle("train-b1")})
    pool = SlinkyPool(
        kube=kube, slurm=slinky, partition=NODESET, cluster="research", back_wait_seconds=0.3, poll_seconds=0.05
    )
    with pytest.raises(Unavailable) as waiting:
        pool.claim(INC, node="gpu1")
    assert "research-train-0" not in str(waiting.value)  # gone for good: not waited for
    recreate(api, "research-train-1", "spare1", hostname="train-b1")
    assert pool.claim(INC, node="gpu1", retry=True) == "spare1"
