"""The lab's stand-in for Slinky's NodeSet controller (slurm-operator v1.2.1), between the emulated
Kubernetes API and a ``DynamicSlurmLab`` (one ``slurmd -Z`` per NodeSet pod).

Every half second, for each NodeSet in StatefulSet mode (the behaviours follow the operator's
``docs/concepts/nodeset-controller.md`` and ``docs/usage/nodeset-operations.md``; see docs/lab.md,
"The operator stand-in"):

- pods ``<nodeset>-<ordinal>`` up to ``spec.replicas``, each bound at creation to a Kubernetes node
  the pod may run on (Ready, not cordoned, its ``nodeSelector`` and required node affinity, taints
  tolerated), the node with the fewest pods first; a pod deleted or evicted comes back under its
  name. With ``spec.pinToNode`` a pod comes back to the node recorded in ``status.ordinalToNode``
  (Pending while that node is unavailable) until the node is gone or no longer matches the
  template (Node Identity, Node Pinning);
- each Running pod's slurmd started under the pod's name; a recreated pod's slurmd restarted
  through the preStop hook (the node DOWN with ``slurm-operator: Pod is terminating``), a pod gone
  for good stops its slurmd the same way;
- a cordoned Kubernetes node cordons its pods (``nodeset.slinky.slurm.net/pod-cordon``) and drains
  their Slurm nodes (reason ``slurm-operator: `` and the node's ``node-cordon-reason`` annotation
  or ``Node (<node>) was cordoned, Pod (<ns>/<pod>) must be cordoned``); a pod annotated
  ``pod-cordon=true`` drains its node; otherwise the operator's own drains are undone. A node whose
  reason lacks the prefix, or that is DOWN for not responding, is left as it is (Drain and Cordon
  Design, External Drain Preservation);
- Slurm's node state as ``SlurmNodeState*`` pod conditions, True only, the reason as each one's
  message (Slurm Node State Visibility);
- with ``spec.workloadDisruptionProtection`` (the default) a busy pod carries the label
  ``nodeset.slinky.slurm.net/pod-protect=true``, which the PodDisruptionBudget
  ``slurm-workers-pdb-<controller>`` (``maxUnavailable: 0``) selects (Workload Disruption Protection);
- fewer replicas: the pods first in the operator's scale-in order are cordoned, their nodes
  drained, and each deleted once its node is drained and not busy; its preStop hook sets its Slurm
  node DOWN (``slurm-operator: Pod is terminating``) and, as v1.2.1 does in StatefulSet mode, the
  Slurm node stays, DOWN, until a pod of its name registers again (Scale-in Lifecycle, Influencing
  Scale-in Order; ``syncSlurmNodeRecords`` prunes records in DaemonSet mode only).

The lab has no kubelet: a bound pod is Running and Ready at once. A pod-cordon the operator set
for a cordoned node or a scale-in is marked with ``lab.gpufleet.io/cordoned-by`` so that it
undoes only its own.

With ``--clusters DIR`` it also brings up every other Slinky cluster whose ``Controller`` appears
in the API (but ``--own``, the lab's own), each a ``DynamicSlurmLab`` of its own under
``DIR/<name>`` with its slurmrestd and Service, and the slurmdbd and MariaDB of the ``Accounting``
it references, and takes each down when its objects go
(lab/slinkyclusters.py); its NodeSets' pods are reconciled as above, against its Slurm.

Run it as ``python -m lab.operator --api URL --slurm-root DIR [--bind DIR] [--clusters DIR --own
NS/NAME] [--ready-file F]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from clients.slurm import parse_node_record
from lab.dynamic import RELEASE, DynamicSlurmLab
from lab.faults import GpuFaults
from lab.login import LoginNode, login_unavailable
from lab.scheduler import fits
from lab.slinkyclusters import (
    ClusterObjects,
    SlinkyCluster,
    accounts_in,
    clusters_under,
    controller_of,
    group_objects,
    jwt_ref,
    login_service,
    login_users_secret,
    nodesets_of,
    restapi_service,
    secret_texts,
    secret_value,
    service_name,
    users_secret,
)
from models.incident import NodeInfo

POLL_SECONDS = 0.5
API = "/apis/slinky.slurm.net/v1beta1"
PREFIX = "nodeset.slinky.slurm.net/"
POD_CORDON = PREFIX + "pod-cordon"
POD_DELETION_COST = PREFIX + "pod-deletion-cost"
POD_DEADLINE = PREFIX + "pod-deadline"
NODE_CORDON_REASON = PREFIX + "node-cordon-reason"
POD_PROTECT = PREFIX + "pod-protect"
POD_NAME_LABEL = PREFIX + "pod-name"
POD_INDEX_LABEL = PREFIX + "pod-index"
POD_HOSTNAME_LABEL = PREFIX + "pod-hostname"  # its Slurm node's name
CLUSTER_LABEL = "slinky.slurm.net/cluster"
# Which of the operator's own causes set a pod's pod-cordon (the lab's bookkeeping, see above).
CORDONED_BY = "lab.gpufleet.io/cordoned-by"
REASON_PREFIX = "slurm-operator: "
CONDITION_PREFIX = "SlurmNodeState"
MAX_REASON = 256
MERGE = {"Content-Type": "application/merge-patch+json"}

_BASE = {
    "allocated": "Allocated",
    "alloc": "Allocated",
    "down": "Down",
    "error": "Error",
    "future": "Future",
    "idle": "Idle",
    "mixed": "Mixed",
    "unknown": "Unknown",
}
_FLAGS = {
    "COMPLETING": "Completing",
    "DRAIN": "Drain",
    "FAIL": "Fail",
    "INVALID": "Invalid",
    "INVALID_REG": "InvalidReg",
    "MAINT": "Maintenance",
    "MAINTENANCE": "Maintenance",
    "NOT_RESPONDING": "NotResponding",
    "UNDRAIN": "Undrain",
}
BUSY = {"Allocated", "Mixed", "Completing"}


# -- pure decisions ------------------------------------------------------------------------------


def pod_name(nodeset: str, ordinal: int) -> str:
    return f"{nodeset}-{ordinal}"


def ordinal_of(pod: dict[str, Any]) -> int:
    match = re.search(r"-(\d+)$", pod["metadata"]["name"])
    return int(match.group(1)) if match else -1


def slurm_states(node: NodeInfo) -> list[str]:
    """The node's states as the operator names them (base first, then flags)."""
    states = [_BASE.get(node.state, "Unknown")]
    states += sorted({_FLAGS[flag] for flag in node.flags if flag in _FLAGS})
    return states


def slurm_conditions(node: NodeInfo | None) -> list[dict[str, str]]:
    """The ``SlurmNodeState*`` pod conditions for a Slurm node (none while Slurm has no such node):
    one per state that holds, True, with the node's reason as its message."""
    if node is None:
        return []
    return [
        {"type": CONDITION_PREFIX + state, "status": "True", "message": node.reason} for state in slurm_states(node)
    ]


def _true(conditions: Iterable[dict[str, Any]]) -> set[str]:
    return {
        c["type"].removeprefix(CONDITION_PREFIX)
        for c in conditions
        if c.get("type", "").startswith(CONDITION_PREFIX) and c.get("status") == "True"
    }


def is_busy(conditions: Iterable[dict[str, Any]]) -> bool:
    """Busy: Allocated, Mixed or Completing is True."""
    return bool(_true(conditions) & BUSY)


def is_drained(conditions: Iterable[dict[str, Any]]) -> bool:
    """Drained: Drain True, Undrain not, and not busy."""
    true = _true(conditions)
    return "Drain" in true and "Undrain" not in true and not true & BUSY


def with_slurm_conditions(current: list[dict[str, Any]], desired: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The pod's conditions with its Slurm ones replaced by ``desired`` (stale ones dropped)."""
    return [c for c in current if not c.get("type", "").startswith(CONDITION_PREFIX)] + desired


def ours(reason: str) -> bool:
    """Whether the operator set the reason (or there is none)."""
    return not reason or reason.startswith(REASON_PREFIX)


def sanitized(reason: str) -> str:
    """A reason from an annotation made safe for Slurm: printable, one line, bounded."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in reason).strip()
    return cleaned[:MAX_REASON].strip()


def cordon_action(*, node_cordoned: bool, pod_cordoned: bool, reason: str, unresponsive: bool) -> str:
    """What the Drain and Cordon Design's flowchart does for one pod: ``keep`` (external reason or
    unresponsive node), ``cordon`` (its Kubernetes node is cordoned: cordon the pod, drain the
    node), ``drain`` (the pod is cordoned) or ``undrain``."""
    if not ours(reason) or unresponsive:
        return "keep"
    if node_cordoned:
        return "cordon"
    if pod_cordoned:
        return "drain"
    return "undrain"


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def scale_in_key(pod: dict[str, Any]) -> tuple[Any, ...]:
    """The operator's scale-in order (utils/sort.go), first to go first: unassigned, Pending <
    Unknown < Running, not ready, lower pod-deletion-cost, earlier pod-deadline, cordoned, higher
    ordinal, then newer."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    phase = {"Pending": 0, "Unknown": 1, "Running": 2}.get(status.get("phase", ""), 0)
    deadline = annotations.get(POD_DEADLINE) or "9999"
    cordoned = annotations.get(POD_CORDON) == "true"
    created = meta.get("creationTimestamp") or ""
    return (
        bool(spec.get("nodeName")),
        phase,
        _ready(pod),
        _int(annotations.get(POD_DELETION_COST)),
        deadline,
        not cordoned,
        -ordinal_of(pod),
        "".join(chr(0x10FFFF - ord(ch)) for ch in created),  # newer (later timestamp) first
    )


def condemned(pods: list[dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """The pods to go when there are more than ``replicas``, in the order they go."""
    return sorted(pods, key=scale_in_key)[: max(0, len(pods) - replicas)]


def _expression_holds(expr: dict[str, Any], value: str | None) -> bool:
    operator, values = expr.get("operator"), expr.get("values") or []
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    return False


def affinity_allows(node: dict[str, Any], pod_spec: dict[str, Any]) -> bool:
    """The pod's required node affinity (matchExpressions on labels, matchFields on
    ``metadata.name``; terms ORed, expressions ANDed)."""
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    return any(
        all(_expression_holds(e, labels.get(e.get("key", ""))) for e in term.get("matchExpressions") or [])
        and all(_expression_holds(e, fields.get(e.get("key", ""))) for e in term.get("matchFields") or [])
        for term in terms
    )


def matches(node: dict[str, Any], pod_spec: dict[str, Any]) -> bool:
    """Whether the template selects the node at all (nodeSelector and affinity), whatever its state."""
    labels = node["metadata"].get("labels") or {}
    selector = pod_spec.get("nodeSelector") or {}
    return all(labels.get(k) == v for k, v in selector.items()) and affinity_allows(node, pod_spec)


def schedulable(node: dict[str, Any], pod_spec: dict[str, Any]) -> bool:
    """Whether a pod of ``pod_spec`` may be bound to ``node`` now."""
    return fits(node, pod_spec) and affinity_allows(node, pod_spec)


def pinned_node(pinned: str | None, nodes: list[dict[str, Any]], pod_spec: dict[str, Any]) -> str | None:
    """The node a pinned pod must go back to: None when there is no pin, the node is gone or the
    template no longer matches it (the pin is then reset)."""
    if not pinned:
        return None
    node = next((n for n in nodes if n["metadata"]["name"] == pinned), None)
    return pinned if node is not None and matches(node, pod_spec) else None


def pin_affinity(pod_spec: dict[str, Any], node: str) -> dict[str, Any]:
    """The pod spec with a required node affinity to ``node`` added to each term."""
    field = {"key": "metadata.name", "operator": "In", "values": [node]}
    affinity = dict(pod_spec.get("affinity") or {})
    node_affinity = dict(affinity.get("nodeAffinity") or {})
    required = dict(node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or []] or [{}]
    for term in terms:
        term["matchFields"] = [*(term.get("matchFields") or []), field]
    required["nodeSelectorTerms"] = terms
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = required
    affinity["nodeAffinity"] = node_affinity
    return {**pod_spec, "affinity": affinity}


def place(nodes: list[dict[str, Any]], pod_spec: dict[str, Any], load: dict[str, int]) -> str | None:
    """The node for one more pod: one it may be bound to, fewest pods first, then by name."""
    fitting = [n["metadata"]["name"] for n in nodes if schedulable(n, pod_spec)]
    return min(fitting, key=lambda n: (load.get(n, 0), n)) if fitting else None


def _running_status() -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "slurmd", "image": "", "imageID": "", "ready": True, "restartCount": 0}],
    }


def pod_body(nodeset: dict[str, Any], ordinal: int, node: str | None, pod_spec: dict[str, Any]) -> dict[str, Any]:
    """A NodeSet pod: ``<nodeset>-<ordinal>``, its hostname the pod's (the Slurm node's name)."""
    meta, spec = nodeset["metadata"], nodeset.get("spec") or {}
    name = pod_name(meta["name"], ordinal)
    template = spec.get("template") or {}
    template_meta = template.get("metadata") or {}
    controller = (spec.get("controllerRef") or {}).get("name", "")
    image = (spec.get("slurmd") or {}).get("image") or "ghcr.io/slinkyproject/slurmd"
    containers = pod_spec.get("containers") or [{"name": "slurmd", "image": image}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": {
                **(template_meta.get("labels") or {}),
                "app.kubernetes.io/name": "slurmd",
                "app.kubernetes.io/instance": meta["name"],
                CLUSTER_LABEL: controller,
                POD_NAME_LABEL: name,
                POD_INDEX_LABEL: str(ordinal),
                POD_HOSTNAME_LABEL: name,  # the lab's templates name no hostname: the pod's name
            },
            "annotations": dict(template_meta.get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": "slinky.slurm.net/v1beta1",
                    "kind": "NodeSet",
                    "name": meta["name"],
                    "uid": meta.get("uid", ""),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            **pod_spec,
            "containers": containers,
            "hostname": name,
            "subdomain": f"{meta['name']}-headless",
            **({"nodeName": node} if node else {}),
        },
        "status": _running_status() if node else {"phase": "Pending"},
    }


def template_hash(template: dict[str, Any]) -> str:
    """A short hash of the pod template (the NodeSet's ``status.nodeSetHash``)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def pdb_body(nodeset: dict[str, Any]) -> dict[str, Any]:
    """The PodDisruptionBudget over a Slurm cluster's busy worker pods (worker_pdb.go)."""
    controller = ((nodeset.get("spec") or {}).get("controllerRef") or {}).get("name", "")
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"slurm-workers-pdb-{controller}", "namespace": nodeset["metadata"]["namespace"]},
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {POD_PROTECT: "true", CLUSTER_LABEL: controller}},
        },
    }


# -- the loop ------------------------------------------------------------------------------------


class Operator:
    """One NodeSet controller over the emulated API and a dynamic Slurm cluster."""

    def __init__(
        self,
        http: httpx.Client,
        slurm: DynamicSlurmLab,
        *,
        log: Callable[[str], None] = print,
        faults: GpuFaults | None = None,
        clusters: Path | None = None,
        own: str = "",
        binds: list[Path] | None = None,
    ) -> None:
        """``slurm``: the lab's own cluster, whose NodeSets are those of its slurm.conf;
        ``clusters``: where the other Slinky clusters (one per Controller in the API, but ``own``,
        ``<namespace>/<name>`` of the lab's own Controller) are brought up (lab/slinkyclusters.py),
        their daemons seeing ``binds``; None: none are."""
        self.http = http
        self.slurm = slurm
        self.log = log
        self.clusters_home = clusters
        self.own = own
        self.binds = list(binds or [])
        # The clusters brought up here, by Controller (lab/slinkyclusters.py key_of).
        self.managed: dict[str, SlinkyCluster] = clusters_under(clusters, binds=self.binds) if clusters else {}
        # NodeSets seen for a Controller not yet up: it starts once they stay the same for a pass.
        self._settling: dict[str, list[str]] = {}
        self._said: set[str] = set()
        # The lab's GPU faults: told where each pod runs, so that a rank meets its node's fault.
        self.faults = faults
        # The pod (by UID) each running slurmd was started for: a new UID is a recreated pod.
        self.started: dict[str, str] = {}

    # Slurm side ----------------------------------------------------------------------------------

    def _slurm_nodes(self, slurm: DynamicSlurmLab) -> dict[str, NodeInfo]:
        out = slurm.scontrol("show", "-o", "node")
        records = (parse_node_record(line) for line in out.splitlines() if line.startswith("NodeName="))
        return {node.name: node for node in records}

    def _update(self, slurm: DynamicSlurmLab, name: str, *fields: str) -> None:
        try:
            slurm.scontrol("update", f"nodename={name}", *fields)
        except subprocess.CalledProcessError as exc:
            self.log(f"scontrol update {name} {' '.join(fields)}: {(exc.stderr or '').strip()}")

    def drain(
        self, node: NodeInfo, reason: str, *, override: bool = False, slurm: DynamicSlurmLab | None = None
    ) -> None:
        """MakeNodeDrain: an existing (our) reason stays unless ``override``."""
        wanted = REASON_PREFIX + (reason or "unknown")
        if not override and node.reason:
            wanted = node.reason
        if "DRAIN" in node.flags and node.reason == wanted:
            return
        self._update(slurm or self.slurm, node.name, "state=drain", f"reason={wanted}")
        self.log(f"drained {node.name}: {wanted}")

    def undrain(self, node: NodeInfo, *, slurm: DynamicSlurmLab | None = None) -> None:
        """MakeNodeUndrain: only a node that has the DRAIN flag."""
        if "DRAIN" not in node.flags or "UNDRAIN" in node.flags:
            return
        self._update(slurm or self.slurm, node.name, "state=undrain")
        self.log(f"undrained {node.name}")

    def _sync_slurmd(self, slurm: DynamicSlurmLab, nodeset: str, pods: list[dict[str, Any]]) -> None:
        """Each bound pod's slurmd runs, started for that very pod; a slurmd without a bound pod stops."""
        bound = {p["metadata"]["name"]: p for p in pods if (p.get("spec") or {}).get("nodeName")}
        for name, pod in sorted(bound.items()):
            uid = pod["metadata"].get("uid", "")
            # The pod's Kubernetes node, for gpufleet health-check in its Slurm hooks (its NODE_NAME).
            slurm.hook_node_file(name).parent.mkdir(parents=True, exist_ok=True)
            slurm.hook_node_file(name).write_text(pod["spec"]["nodeName"] + "\n")
            try:
                if not slurm.running(name):
                    slurm.add_node(name, nodeset)
                    self.log(f"started slurmd {name}")
                elif self.started.get(name) not in (None, uid):
                    slurm.move_node(name)  # recreated: preStop on the old one, then start again
                    self.log(f"restarted slurmd {name} for its recreated pod")
            except (RuntimeError, ValueError, TimeoutError, subprocess.SubprocessError) as exc:
                self.log(f"slurmd {name}: {exc}")
                continue
            self.started[name] = uid
        for name, known in sorted(slurm.pods().items()):
            if known.nodeset == nodeset and name not in bound and slurm.running(name):
                slurm.stop_node(name)
                self.started.pop(name, None)
                self.log(f"stopped slurmd {name}: its pod is gone")

    # Kubernetes side -----------------------------------------------------------------------------

    def _pods(self, nodeset: dict[str, Any]) -> list[dict[str, Any]]:
        meta = nodeset["metadata"]
        listed = self.http.get(f"/api/v1/namespaces/{meta['namespace']}/pods").raise_for_status().json()["items"]
        return [
            p
            for p in listed
            if any(
                o.get("kind") == "NodeSet" and o.get("name") == meta["name"]
                for o in p["metadata"].get("ownerReferences") or []
            )
            and not p["metadata"].get("deletionTimestamp")
        ]

    def _patch_pod(self, pod: dict[str, Any], body: dict[str, Any]) -> None:
        meta = pod["metadata"]
        response = self.http.patch(
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", json=body, headers=MERGE
        )
        if response.status_code != 404:
            response.raise_for_status()

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        response = self.http.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
        if response.status_code != 404:
            response.raise_for_status()

    def _set_cordon(self, pod: dict[str, Any], by: str | None) -> None:
        """pod-cordon=true marked as set for ``by``, or (None) both gone."""
        annotations = pod["metadata"].get("annotations") or {}
        if by is None:
            if POD_CORDON in annotations or CORDONED_BY in annotations:
                self._patch_pod(pod, {"metadata": {"annotations": {POD_CORDON: None, CORDONED_BY: None}}})
        elif annotations.get(POD_CORDON) != "true":
            self._patch_pod(pod, {"metadata": {"annotations": {POD_CORDON: "true", CORDONED_BY: by}}})

    def _ensure_pdb(self, nodeset: dict[str, Any]) -> None:
        body = pdb_body(nodeset)
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        path = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
        if self.http.get(f"{path}/{name}").status_code == 404:
            self.http.post(path, json=body).raise_for_status()
            self.log(f"created PodDisruptionBudget {namespace}/{name}")

    # One pass ------------------------------------------------------------------------------------

    def reconcile(self) -> None:
        nodesets = self.http.get(f"{API}/nodesets").raise_for_status().json()["items"]
        nodes = self.http.get("/api/v1/nodes").raise_for_status().json()["items"]
        if self.clusters_home is not None:
            self.reconcile_clusters(nodesets)
        for nodeset in sorted(nodesets, key=lambda n: (n["metadata"]["namespace"], n["metadata"]["name"])):
            if (nodeset.get("spec") or {}).get("scalingMode", "StatefulSet") != "StatefulSet":
                continue
            slurm = self.slurm_of(nodeset)
            if slurm is None:
                continue  # its cluster is not up (yet)
            try:
                self.reconcile_nodeset(nodeset, nodes, slurm)
            except httpx.HTTPStatusError as exc:
                self.log(f"NodeSet {nodeset['metadata']['name']}: {exc.response.status_code} {exc.response.text[:500]}")

    def slurm_of(self, nodeset: dict[str, Any]) -> DynamicSlurmLab | None:
        """The Slurm a NodeSet's pods join: its Controller's cluster brought up here, else the
        lab's own when its slurm.conf declares the NodeSet; None: no cluster of it runs."""
        name = nodeset["metadata"]["name"]
        cluster = self.managed.get(controller_of(nodeset))
        if cluster is not None:
            slurm = cluster.slurm()
            return slurm if cluster.running() and name in slurm.nodesets else None
        return self.slurm if name in self.slurm.nodesets else None

    # Other Slinky clusters -------------------------------------------------------------------------

    def _items(self, plural: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.http.get(f"{API}/{plural}").raise_for_status().json()["items"]
        return items

    def _secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        response = self.http.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        if response.status_code == 404:
            return None
        found: dict[str, Any] = response.raise_for_status().json()
        return found

    def reconcile_clusters(self, nodesets: list[dict[str, Any]]) -> None:
        """Bring up each Controller's cluster (but the lab's own) once its NodeSets are there,
        its slurmrestd and Service for a RestApi; take down what lost its objects."""
        groups = group_objects(
            self._items("controllers"),
            nodesets,
            self._items("restapis"),
            self._items("accountings"),
            self._items("loginsets"),
        )
        groups.pop(self.own, None)
        for key in sorted(set(self.managed) - set(groups)):
            self.take_down(key)
        for key, group in sorted(groups.items()):
            try:
                self.reconcile_cluster(key, group)
            except (OSError, RuntimeError, TimeoutError, ValueError, subprocess.SubprocessError) as exc:
                self._say_once(f"cluster {key}: {exc}")
        self._collect_orphans(nodesets)

    def reconcile_cluster(self, key: str, group: ClusterObjects) -> None:
        cluster = self.managed.get(key)
        names = group.nodeset_names
        if cluster is not None and cluster.running() and set(names) - set(cluster.nodesets()):
            # A NodeSet added to a running cluster: the lab starts its Slurm again with it.
            self.log(f"cluster {key}: NodeSets {', '.join(names)}: starting its Slurm again with them")
            self.take_down(key, objects=False)
            cluster = None
        if cluster is None or not cluster.running():
            if not names or self._settling.get(key) != names:
                self._settling[key] = names  # started once its NodeSets stay as they are for a pass
                return
            cluster = self.bring_up(key, group)
            if cluster is None:
                return
        self._settling.pop(key, None)
        # Accounting first: a slurmrestd started after it serves the accounting API too.
        if group.accountings and not cluster.accounting_runs() and (missing := cluster.accounting_missing()):
            self._say_once(f"cluster {key}: Accounting {group.accountings[0]['metadata']['name']} not run: {missing}")
        elif group.accountings:
            if said := cluster.start_accounting(group.accountings[0]):
                self.log(f"cluster {key}: {said}")
        elif said := cluster.stop_accounting():
            self.log(f"cluster {key}: {said}")
        for restapi in group.restapis:
            if not cluster.restapi_port():
                port = cluster.start_restapi()
                self.log(f"cluster {key}: slurmrestd on 127.0.0.1:{port}")
            self._ensure_service(restapi, cluster.restapi_port())
        if not group.restapis and cluster.restapi_port():
            cluster.stop_restapi()
            self.log(f"cluster {key}: slurmrestd stopped, its RestApi is gone")
        self.reconcile_login(key, group, cluster)

    def reconcile_login(self, key: str, group: ClusterObjects, cluster: SlinkyCluster) -> None:
        """The cluster's login node for its LoginSet: its users (the Secret it mounts, read again
        each pass), sshd started or reloaded, and its Service; none without a LoginSet. The lab
        runs one login node per cluster: a second LoginSet is said, not run."""
        loginsets = sorted(group.loginsets, key=lambda o: o["metadata"]["name"])
        wanted = loginsets[0] if loginsets else None
        if wanted is None:
            if LoginNode(cluster.folder).running():
                self.log(f"cluster {key}: {LoginNode(cluster.folder).stop()}: its LoginSet is gone")
        elif problem := login_unavailable():
            self._say_once(f"cluster {key}: LoginSet {wanted['metadata']['name']} has no login node here: {problem}")
        else:
            for other in loginsets[1:]:
                name = other["metadata"]["name"]
                self._say_once(f"cluster {key}: LoginSet {name} not run: the lab runs one login node")
            secret = login_users_secret(wanted)
            users = secret_texts(self._secret(group.namespace, secret))
            changed = cluster.write_users(group.nodesets, users)
            login = cluster.login()
            was = login.address()
            address = login.start([account.name for account in accounts_in(users)])
            if not was or changed:
                what = f" ({', '.join(changed)})" if changed else ""
                self.log(f"cluster {key}: login node on {address} for LoginSet {wanted['metadata']['name']}{what}")
            self._ensure_login_service(wanted, int(address.rsplit(":", 1)[1]))
        self._remove_login_services(group, [wanted] if wanted else [])

    def _ensure_login_service(self, loginset: dict[str, Any], port: int) -> None:
        namespace, name = loginset["metadata"]["namespace"], loginset["metadata"]["name"]
        path = f"/api/v1/namespaces/{namespace}/services"
        body = login_service(loginset, port)
        found = self.http.get(f"{path}/{name}")
        if found.status_code == 200:
            spec = found.json().get("spec") or {}
            if (spec.get("ports") or [{}])[0].get("port") == port and spec.get("type") == body["spec"]["type"]:
                return
            self.http.delete(f"{path}/{name}").raise_for_status()
        self.http.post(path, json=body).raise_for_status()
        self.log(f"created Service {namespace}/{name} ({body['spec']['type']}, 127.0.0.1:{port})")

    def _remove_login_services(self, group: ClusterObjects, kept: list[dict[str, Any]]) -> None:
        """The login Services of the cluster whose LoginSet is gone (the garbage collector's work)."""
        path = f"/api/v1/namespaces/{group.namespace}/services"
        keep = {o["metadata"]["name"] for o in kept}
        for service in self.http.get(path).raise_for_status().json()["items"]:
            labels = service["metadata"].get("labels") or {}
            if labels.get(CLUSTER_LABEL) != group.name or labels.get("app.kubernetes.io/name") != "login":
                continue
            if service["metadata"]["name"] not in keep:
                response = self.http.delete(f"{path}/{service['metadata']['name']}")
                if response.status_code != 404:
                    response.raise_for_status()
                self.log(f"deleted Service {group.namespace}/{service['metadata']['name']}: its LoginSet is gone")

    def bring_up(self, key: str, group: ClusterObjects) -> SlinkyCluster | None:
        """slurmctld for the Controller, with its JWT key and its users; None while a Secret it
        needs is not there yet."""
        assert self.clusters_home is not None
        secret_name, secret_key = jwt_ref(group.controller)
        secret = self._secret(group.namespace, secret_name)
        jwt = secret_value(secret, secret_key) if secret is not None else None
        if not jwt:
            self._say_once(f"cluster {key}: waiting for its JWT key (Secret {secret_name}, key {secret_key})")
            return None
        users = secret_texts(self._secret(group.namespace, users_secret(group.controller)))
        cluster = SlinkyCluster(self.clusters_home / group.name, binds=self.binds)
        if cluster.controller() not in ("", key):
            self._say_once(f"cluster {key}: {cluster.folder} is another cluster's")
            return None
        cluster.stop(restart=True)  # what a start cut short left; its database kept
        # Tracked before it starts: a start that fails halfway is stopped with its Controller.
        self.managed[key] = cluster
        cluster.start(group, jwt, users)
        partitions = ", ".join(group.nodeset_names)
        self.log(f"cluster {key}: slurmctld up (Slurm {RELEASE}), partitions {partitions}, in {cluster.folder}")
        return cluster

    def take_down(self, key: str, *, objects: bool = True) -> None:
        """Stop everything the cluster runs (slurmrestd, every slurmd, slurmctld, slurmdbd and
        MariaDB) and, with ``objects`` (its Controller gone), remove its folder and delete what
        the operator made for it in the API (its pods, Service, budget); without, its Slurm is to
        start again and its database is kept."""
        cluster = self.managed.pop(key)
        slurm = cluster.slurm()
        for name in slurm.pods():
            self.started.pop(name, None)
        cluster.stop(restart=not objects)
        if not objects:
            self.log(f"cluster {key}: Slurm stopped, its database kept in {cluster.folder}")
            return
        self.log(f"cluster {key}: Slurm stopped, {cluster.folder} removed")
        namespace, name = key.split("/", 1)
        pods = self.http.get(f"/api/v1/namespaces/{namespace}/pods").raise_for_status().json()["items"]
        for pod in pods:
            if (pod["metadata"].get("labels") or {}).get(CLUSTER_LABEL) == name:
                self._delete_pod(pod)
        for service in self.http.get(f"/api/v1/namespaces/{namespace}/services").raise_for_status().json()["items"]:
            labels = service["metadata"].get("labels") or {}
            if labels.get(CLUSTER_LABEL) == name and labels.get("app.kubernetes.io/name") == "login":
                response = self.http.delete(f"/api/v1/namespaces/{namespace}/services/{service['metadata']['name']}")
                if response.status_code != 404:
                    response.raise_for_status()
        for path in (
            f"/api/v1/namespaces/{namespace}/services/{name}-restapi",
            f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/slurm-workers-pdb-{name}",
        ):
            response = self.http.delete(path)
            if response.status_code != 404:
                response.raise_for_status()

    def _collect_orphans(self, nodesets: list[dict[str, Any]]) -> None:
        """The pods of a NodeSet that is gone, in a cluster brought up here: deleted, and their
        slurmd stopped and Slurm nodes deleted (the garbage collector's and the operator's work)."""
        there = {(n["metadata"]["namespace"], n["metadata"]["name"]) for n in nodesets}
        for key, cluster in sorted(self.managed.items()):
            namespace, name = key.split("/", 1)
            pods = self.http.get(f"/api/v1/namespaces/{namespace}/pods").raise_for_status().json()["items"]
            for pod in pods:
                owner = next(
                    (o["name"] for o in pod["metadata"].get("ownerReferences") or [] if o.get("kind") == "NodeSet"),
                    None,
                )
                labels = pod["metadata"].get("labels") or {}
                if owner is None or (namespace, owner) in there or labels.get(CLUSTER_LABEL) != name:
                    continue
                pod_name = pod["metadata"]["name"]
                if cluster.running() and pod_name in cluster.slurm().pods():
                    cluster.slurm().remove_node(pod_name)
                self.started.pop(pod_name, None)
                self._delete_pod(pod)
                self.log(f"deleted {namespace}/{pod_name}: its NodeSet {owner} is gone")

    def _ensure_service(self, restapi: dict[str, Any], port: int) -> None:
        namespace = restapi["metadata"]["namespace"]
        path = f"/api/v1/namespaces/{namespace}/services"
        found = self.http.get(f"{path}/{service_name(restapi)}")
        if found.status_code == 200:
            if ((found.json().get("spec") or {}).get("ports") or [{}])[0].get("port") == port:
                return
            self.http.delete(f"{path}/{service_name(restapi)}").raise_for_status()
        self.http.post(path, json=restapi_service(restapi, port)).raise_for_status()
        self.log(f"created Service {namespace}/{service_name(restapi)} (127.0.0.1:{port})")

    def _say_once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self.log(line)

    def reconcile_nodeset(
        self, nodeset: dict[str, Any], nodes: list[dict[str, Any]], slurm: DynamicSlurmLab | None = None
    ) -> None:
        slurm = slurm or self.slurm
        meta, spec = nodeset["metadata"], nodeset.get("spec") or {}
        namespace, name = meta["namespace"], meta["name"]
        pod_spec = (spec.get("template") or {}).get("spec") or {}
        replicas = int(spec.get("replicas", 1))
        pin = bool(spec.get("pinToNode"))
        ordinal_to_node: dict[str, str] = dict((nodeset.get("status") or {}).get("ordinalToNode") or {})
        by_name = {n["metadata"]["name"]: n for n in nodes}

        pods = self._pods(nodeset)
        for pod in [p for p in pods if (p.get("status") or {}).get("phase") in ("Failed", "Succeeded")]:
            self._delete_pod(pod)  # a new one comes at the next pass
            pods.remove(pod)
        load: dict[str, int] = {}
        for pod in pods:
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                load[bound] = load.get(bound, 0) + 1

        def spec_for(ordinal: int) -> dict[str, Any]:
            if not pin:
                return pod_spec
            target = pinned_node(ordinal_to_node.get(str(ordinal)), nodes, pod_spec)
            if target is None:
                ordinal_to_node.pop(str(ordinal), None)
                return pod_spec
            return pin_affinity(pod_spec, target)

        # Pending pods: bound once a node fits.
        for pod in pods:
            if (pod.get("spec") or {}).get("nodeName"):
                continue
            node = place(nodes, spec_for(ordinal_of(pod)), load)
            if node is not None:
                self._patch_pod(pod, {"spec": {"nodeName": node}, "status": _running_status()})
                pod.setdefault("spec", {})["nodeName"] = node
                load[node] = load.get(node, 0) + 1
                self.log(f"bound {namespace}/{pod['metadata']['name']} to {node}")
        # Up to replicas: the lowest free ordinals.
        taken = {ordinal_of(p) for p in pods}
        ordinal = 0
        while len(pods) < replicas:
            while ordinal in taken:
                ordinal += 1
            wanted = spec_for(ordinal)
            node = place(nodes, wanted, load)
            body = pod_body(nodeset, ordinal, node, wanted)
            created = self.http.post(f"/api/v1/namespaces/{namespace}/pods", json=body).raise_for_status().json()
            pods.append(created)
            taken.add(ordinal)
            if node:
                load[node] = load.get(node, 0) + 1
            self.log(f"created {namespace}/{body['metadata']['name']} " + (f"on {node}" if node else "(Pending)"))
        if pin:
            for pod in pods:
                bound = (pod.get("spec") or {}).get("nodeName")
                if bound:
                    ordinal_to_node[str(ordinal_of(pod))] = bound

        going = condemned(pods, replicas)
        keep = [p for p in pods if p not in going]
        self._sync_slurmd(slurm, name, pods)
        if self.faults is not None and slurm is self.slurm:
            self.faults.place(
                {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods if (p.get("spec") or {}).get("nodeName")}
            )
        records = self._slurm_nodes(slurm)

        # Drain and Cordon Design.
        for pod in keep:
            record = records.get(pod["metadata"]["name"])
            kube_node = by_name.get((pod.get("spec") or {}).get("nodeName") or "")
            if record is None or kube_node is None:
                continue
            annotations = pod["metadata"].get("annotations") or {}
            by = annotations.get(CORDONED_BY)
            node_cordoned = bool((kube_node.get("spec") or {}).get("unschedulable"))
            action = cordon_action(
                node_cordoned=node_cordoned,
                pod_cordoned=annotations.get(POD_CORDON) == "true" and by is None,
                reason=record.reason,
                unresponsive=record.state == "down" and "Not responding" in record.reason,
            )
            pod_ref = f"{namespace}/{pod['metadata']['name']}"
            if action == "cordon":
                node_annotations = kube_node["metadata"].get("annotations") or {}
                reason = f"Node ({kube_node['metadata']['name']}) was cordoned, Pod ({pod_ref}) must be cordoned"
                if NODE_CORDON_REASON in node_annotations:
                    reason = sanitized(node_annotations[NODE_CORDON_REASON])
                if by is None and annotations.get(POD_CORDON) != "true":
                    self._set_cordon(pod, "node")
                self.drain(record, reason, slurm=slurm)
            elif action == "drain":
                self.drain(record, f"Pod ({pod_ref}) was cordoned", slurm=slurm)
            elif action == "undrain":
                self._set_cordon(pod, None)
                self.undrain(record, slurm=slurm)

        # Scale-in Lifecycle: drained, then deleted.
        for pod in going:
            pod_ref = f"{namespace}/{pod['metadata']['name']}"
            record = records.get(pod["metadata"]["name"])
            if record is not None and not is_drained(slurm_conditions(record)):
                if (pod["metadata"].get("annotations") or {}).get(POD_CORDON) != "true":
                    self._set_cordon(pod, "scale-in")
                if ours(record.reason):
                    self.drain(
                        record, f"Pod ({pod_ref}) is pending termination for scale-in", override=True, slurm=slurm
                    )
                continue
            self._delete_pod(pod)
            self.log(f"deleted {pod_ref} (scale-in, its Slurm node drained)")
            if record is not None:
                # StatefulSet mode (v1.2.1): preStop sets the Slurm node DOWN and its record stays
                # (only DaemonSet mode prunes records); a pod of that name later registers under it.
                slurm.stop_node(pod["metadata"]["name"])
                self.started.pop(pod["metadata"]["name"], None)
                records.pop(pod["metadata"]["name"], None)
            pods.remove(pod)

        # Slurm Node State Visibility; Workload Disruption Protection.
        protect = bool(spec.get("workloadDisruptionProtection", True))
        if protect:
            self._ensure_pdb(nodeset)
        for pod in pods:
            desired = slurm_conditions(records.get(pod["metadata"]["name"]))
            current = (pod.get("status") or {}).get("conditions") or []
            conditions = with_slurm_conditions(current, desired)
            labels = pod["metadata"].get("labels") or {}
            protected = protect and is_busy(desired)
            patch: dict[str, Any] = {}
            if conditions != current:
                patch["status"] = {"conditions": conditions}
            if protected and labels.get(POD_PROTECT) != "true":
                patch["metadata"] = {"labels": {POD_PROTECT: "true"}}
            elif not protected and POD_PROTECT in labels:
                patch["metadata"] = {"labels": {POD_PROTECT: None}}
            if patch:
                self._patch_pod(pod, patch)

        current_status = nodeset.get("status") or {}
        status: dict[str, Any] = {
            "replicas": len(pods),
            "readyReplicas": sum(1 for p in pods if _ready(p)),
            "slurmIdle": sum(1 for p in pods if (n := records.get(p["metadata"]["name"])) and n.state == "idle"),
            "selector": f"app.kubernetes.io/instance={name},app.kubernetes.io/name=slurmd",
            "nodeSetHash": template_hash(spec.get("template") or {}),
        }
        if pin:
            status["ordinalToNode"] = ordinal_to_node
        if any(current_status.get(k) != v for k, v in status.items()):
            if pin:  # a merge patch drops a pin only when told to
                gone = set(current_status.get("ordinalToNode") or {}) - set(ordinal_to_node)
                status["ordinalToNode"] = {**ordinal_to_node, **dict.fromkeys(gone)}
            self.http.patch(
                f"{API}/namespaces/{namespace}/nodesets/{name}/status", json={"status": status}, headers=MERGE
            ).raise_for_status()


def start(api_url: str, cluster: DynamicSlurmLab, *, ready_file: Path, log: Path) -> subprocess.Popen[bytes]:
    """This stand-in as a process of its own for ``cluster``, its output in ``log``; it writes
    ``ready_file`` once it reconciles (the caller waits for it)."""
    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "lab.operator", "--api", api_url, "--slurm-root", str(cluster.root)]
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*argv, "--ready-file", str(ready_file)],
            cwd=repo,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**cluster.env, "PYTHONPATH": str(repo)},
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.operator", description=__doc__.splitlines()[0])
    parser.add_argument("--api", required=True, help="the emulated Kubernetes API's URL")
    parser.add_argument("--slurm-root", required=True, type=Path, help="the DynamicSlurmLab's root (started)")
    parser.add_argument("--ready-file", type=Path, help="written once it polls")
    parser.add_argument(
        "--bind", type=Path, action="append", default=[], help="a folder the slurmd see (the jobs' files), repeatable"
    )
    parser.add_argument(
        "--faults", type=Path, help="the lab's GPU faults folder: where each pod runs is recorded there"
    )
    parser.add_argument(
        "--clusters", type=Path, help="bring up every other Controller's Slinky cluster in a folder of this one"
    )
    parser.add_argument("--own", default="", help="NAMESPACE/NAME of the lab's own Controller (--slurm-root's)")
    args = parser.parse_args()
    slurm = DynamicSlurmLab(args.slurm_root, nodesets_of(args.slurm_root / "slurm.conf"), binds=args.bind)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with httpx.Client(base_url=args.api, timeout=10) as http:
        faults = GpuFaults(args.faults) if args.faults else None
        operator = Operator(
            http,
            slurm,
            log=lambda line: print(line, flush=True),
            faults=faults,
            clusters=args.clusters,
            own=args.own,
            binds=args.bind,
        )
        if args.ready_file is not None:
            args.ready_file.write_text(args.api, encoding="utf-8")
        while not stop.is_set():
            try:
                operator.reconcile()
            except (httpx.HTTPError, subprocess.SubprocessError, RuntimeError, TimeoutError) as exc:
                print(f"reconcile failed: {exc}", flush=True)
            stop.wait(POLL_SECONDS)


if __name__ == "__main__":
    main()
