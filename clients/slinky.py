"""Cluster objects in Kubernetes: the ones every backend makes (Namespace, Secrets, storage, the
remediation ConfigMap), and the Slinky backend, which adds slurm-operator's custom resources.

Keys are generated when their Secret is first created, never before: a retry finds the Secret
and keeps its key. Objects are created in order and deleted in reverse; each call is
idempotent (already there / already gone is fine).
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Sequence
from typing import Any

from clients.clusters import StepFailed, leaving
from clients.kube import KubernetesApi
from clients.slurmrest import TERMINAL, SlurmRestClient, SlurmRestError
from models.cluster import ClusterSpec, render_slurm_conf
from models.slinky import (
    COPIED,
    COPY_LABEL,
    GENERATED,
    RESTAPI_FROM_SERVICE,
    cluster_namespace,
    login_service,
    nodeset_name,
    restapi_service,
    restapi_url,
    slinky_objects,
    user_database,
)

CREATION_ANNOTATION = "gpufleet.io/creation"
JWT_KEY = "jwt_hs256.key"
SMOKE_TIMEOUT = 120.0  # per partition
SMOKE_TOTAL = 540.0  # in all: the step's limit is 10 minutes
ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"}
DOWN = {"DOWN", "FUTURE", "NOT_RESPONDING", "UNKNOWN", "FAIL", "DRAIN", "INVAL"}


def _short_partitions(spec: ClusterSpec, nodes: dict[str, tuple[str, list[str]]]) -> list[str]:
    """Each partition with fewer nodes up than the spec asks, said as 'train: 1 of 2 up' (its
    Slurm partition is its NodeSet's, named after it)."""
    short = []
    for partition in spec.partitions:
        slurm = nodeset_name(spec.name, partition.name)
        up = [n for n, (state, parts) in nodes.items() if slurm in parts and not set(state.split("+")) & DOWN]
        if len(up) < partition.nodes:
            short.append(f"{partition.name}: {len(up)} of {partition.nodes} node(s) up")
    return short


def with_keys(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with each generated key filled in (1024 random bytes, base64)."""
    data = obj.get("stringData") or {}
    if GENERATED not in data.values():
        return obj
    filled = {k: (base64.b64encode(os.urandom(1024)).decode() if v == GENERATED else v) for k, v in data.items()}
    return {**obj, "stringData": filled}


def copy_source(kube: KubernetesApi, namespace: str, name: str, key: str) -> bytes:
    """The value to copy; StepFailed naming what is wrong (never the value)."""
    found = kube.secret(namespace, name)
    if found is None:
        raise StepFailed(f"no Secret {namespace}/{name} (the database password to copy)")
    data, labels = found
    if labels.get(COPY_LABEL) != "true":
        raise StepFailed(
            f"Secret {namespace}/{name} is not labelled {COPY_LABEL}=true: gpufleet copies only Secrets "
            "labelled so by whoever owns them"
        )
    if key not in data:
        raise StepFailed(f"Secret {namespace}/{name} has no key {key!r} (the database password to copy)")
    return data[key]


def with_copies(kube: KubernetesApi, obj: dict[str, Any]) -> dict[str, Any]:
    """The object with each value copied from another Secret filled in (read only here, in the
    activity: never in the workflow's history), as raw bytes in ``data``."""
    strings = dict(obj.get("stringData") or {})
    copies = {}
    for key, value in list(strings.items()):
        if not (isinstance(value, str) and value.startswith("<copied from")):
            continue
        match = COPIED.match(value)
        if match is None:
            raise StepFailed(f"{obj['kind']}/{obj['metadata']['name']}: {key} names no Secret gpufleet can copy")
        copies[key] = base64.b64encode(copy_source(kube, *match.groups())).decode()
        del strings[key]
    if not copies:
        return obj
    return {**obj, "stringData": strings, "data": {**(obj.get("data") or {}), **copies}}


def core_objects(spec: ClusterSpec, placement: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The objects every backend makes: all but slurm-operator's own kinds (and the database
    password its Accounting reads: a backend with its own database needs none)."""
    return [
        o
        for o in slinky_objects(spec, placement)
        if o["apiVersion"] == "v1" and o["metadata"]["name"] != f"{spec.name}-db-password"
    ]


def _owned(obj: dict[str, Any], creation: str) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        **obj,
        "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), CREATION_ANNOTATION: creation}},
    }


def create_all(kube: KubernetesApi, objects: list[dict[str, Any]], creation: str) -> str:
    """Create each object marked with the creation that made it. One that exists already is
    this creation's (a retry) or refused: gpufleet never adopts what it did not make."""
    made = []
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if not kube.object_exists(obj) and kube.create_object(with_copies(kube, with_keys(_owned(obj, creation)))):
            made.append(name)
            continue
        annotations = kube.object_annotations(obj) or {}
        if annotations.get(CREATION_ANNOTATION) != creation:
            raise StepFailed(f"{name} exists and was not made by this creation: remove it, or choose another name")
    return f"created {len(made)} object(s)" + (f": {', '.join(made)}" if made else " (all there already)")


def delete_all(kube: KubernetesApi, objects: list[dict[str, Any]], creation: str) -> str:
    """Delete, in reverse, the objects this creation made; others of the same names stay."""
    gone, kept = [], []
    for obj in reversed(objects):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        annotations = kube.object_annotations(obj)
        if annotations is None:
            continue
        if annotations.get(CREATION_ANNOTATION) != creation:
            kept.append(name)
        elif kube.delete_object(obj):
            gone.append(name)
    said = f"deleted {len(gone)} object(s)" + (f": {', '.join(gone)}" if gone else " (none were there)")
    return said + (f"; left alone, not made by this creation: {', '.join(kept)}" if kept else "")


class SlinkyBackend:
    """Slurm run by Slinky's slurm-operator in the cluster the kubeconfig names.

    Creating and deleting its objects is done here; bringing the cluster up is the operator's
    work, which this backend waits for through the cluster's slurmrestd (its ``RestApi``), signing
    its tokens with the JWT key it generated; the smoke jobs and the job counts of a deletion go
    the same way.
    """

    name = "slinky"

    def __init__(
        self, kube: KubernetesApi, *, restapi: str = "", wait_seconds: float = 540.0, poll_seconds: float = 5.0
    ) -> None:
        """``restapi``: where slurmrestd answers, ``{name}`` standing for the cluster's name
        (default: the operator's Service, reached from inside the Kubernetes cluster), or
        ``service``: the address that Service holds, read through the API."""
        self._kube = kube
        self._restapi = restapi
        self._wait = wait_seconds
        self._poll = poll_seconds

    def _objects(self, spec: ClusterSpec, placement: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
        return slinky_objects(spec, placement or {p.name: [""] * p.nodes for p in spec.partitions})

    def _rest(self, spec: ClusterSpec, *, timeout: float = 10.0) -> SlurmRestClient:
        """A slurmrestd client signing with the JWT key this creation generated."""
        name = spec.name
        secret = self._kube.secret_data(cluster_namespace(name), f"{name}-jwt-key") or {}
        key = secret.get(JWT_KEY)
        if not key:
            where = f"Secret {name}-jwt-key of {cluster_namespace(name)}"
            raise StepFailed(f"no JWT key in {where}: were the cluster's objects made?")
        client = SlurmRestClient(self._url(name), key, timeout=timeout)
        try:
            client.detect_version()
        except SlurmRestError:
            client.close()
            raise
        return client

    def _url(self, name: str) -> str:
        """Where the cluster's slurmrestd answers."""
        if self._restapi != RESTAPI_FROM_SERVICE:
            return self._restapi.format(name=name) if self._restapi else restapi_url(name)
        service = restapi_service(name)
        address = self._kube.service_address(cluster_namespace(name), service)
        if address is None:
            raise SlurmRestError(f"no Service {cluster_namespace(name)}/{service} with an address yet")
        host, port = address
        return f"http://{host}:{port}"

    def login_address(self, spec: ClusterSpec, *, timeout: float = 60.0) -> str:
        """``host:port`` of the cluster's login node: its LoginSet's Service (a LoadBalancer's
        ingress, else its cluster IP), waited for up to ``timeout``; '' when it has no LoginSet."""
        loginset = next((o for o in self._objects(spec) if o["kind"] == "LoginSet"), None)
        if loginset is None:
            return ""
        namespace, service = cluster_namespace(spec.name), login_service(spec.name)
        deadline = time.monotonic() + timeout
        while (address := self._kube.service_address(namespace, service, external=True)) is None:
            if time.monotonic() >= deadline:
                raise StepFailed(
                    f"no Service {namespace}/{service} with an address after {timeout:g}s: "
                    f"the operator makes it for LoginSet {loginset['metadata']['name']}"
                )
            time.sleep(min(self._poll, max(0.1, deadline - time.monotonic())))
        host, port = address
        return f"{host}:{port}"

    def unsupported(self, spec: ClusterSpec) -> str:
        if not spec.accounting:
            return ""
        if spec.accounting_storage is None:
            return (
                "accounting on Slinky needs the database slurmdbd keeps its records in: set accounting_storage "
                "(host, and password_secret naming the Secret that holds its password)"
            )
        ref = spec.accounting_storage.password_secret
        try:
            copy_source(self._kube, ref.namespace, ref.name, ref.key)  # there and allowed: yes or no only
        except StepFailed as exc:
            return str(exc)
        return ""

    def exists(self, spec: ClusterSpec) -> str:
        for kind in ("Namespace", "Controller"):
            obj = next(o for o in self._objects(spec) if o["kind"] == kind)
            if self._kube.object_exists(obj):
                where = obj["metadata"].get("namespace")
                return f"{kind} {obj['metadata']['name']}" + (f" in {where}" if where else "")
        return ""

    def render_conf(self, spec: ClusterSpec, placement: dict[str, list[str]]) -> str:
        # The operator writes slurm.conf itself; this is what gpufleet asks of it, for the record.
        return render_slurm_conf(spec, {p.name: placement.get(p.name, []) for p in spec.partitions})

    def create_objects(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str, creation: str) -> str:
        return create_all(self._kube, self._objects(spec, placement), creation)

    def delete_objects(self, spec: ClusterSpec, creation: str) -> str:
        return delete_all(self._kube, self._objects(spec), creation)

    def bring_up(self, spec: ClusterSpec, placement: dict[str, list[str]], conf: str) -> str:
        """The operator starts Slurm from the objects; this waits until slurmrestd answers and
        every partition has its nodes up, and names what it saw last if they never do."""
        deadline = time.monotonic() + self._wait
        seen = "nothing yet"
        while True:
            try:
                # Each call bounded by what is left, so the step ends in time to say why.
                client = self._rest(spec, timeout=max(1.0, min(10.0, (deadline - time.monotonic()) / 8)))
                try:
                    release = client.ping()
                    nodes = client.nodes()
                finally:
                    client.close()
                short = _short_partitions(spec, nodes)
                if not short:
                    return f"Slurm {release} up through slurmrestd ({client.version}): {len(nodes)} node(s) ready"
                seen = "; ".join(short)
            except SlurmRestError as exc:
                seen = str(exc)
            if time.monotonic() >= deadline:
                raise StepFailed(f"the cluster was not up after {self._wait:g}s: {seen}")
            time.sleep(self._poll)

    def tear_down(self, spec: ClusterSpec) -> str:
        return "the operator tears down what its objects' deletion removes"

    def add_users(self, spec: ClusterSpec) -> str:
        """Linux users come from the sssd user database Secret; with accounting, each account and
        each user in its account go into slurmdbd through slurmrestd."""
        in_secret = f"{len(spec.users)} user(s) in the sssd user database Secret"
        if not spec.accounting:
            return in_secret
        added = []
        try:
            client = self._rest(spec)
            try:
                have = client.associations(spec.name)
                accounts = {account for account, _ in have}
                for account in sorted({user.account for user in spec.users} - accounts):
                    client.add_account(account, cluster=spec.name)
                    added.append(f"account {account}")
                for user in spec.users:
                    if (user.account, user.name) not in have:
                        client.add_user(user.name, account=user.account, cluster=spec.name, admin=user.admin)
                        added.append(f"user {user.name} in {user.account}")
            finally:
                client.close()
        except SlurmRestError as exc:
            raise StepFailed(f"adding accounts through slurmrestd: {exc}") from None
        return f"{in_secret}; slurmdbd: {', '.join(added) or 'every account and user was there already'}"

    def remove_users(self, spec: ClusterSpec, only: Sequence[str] | None = None) -> str:
        """The cluster's associations out of slurmdbd (its users and accounts stay, as other
        clusters may share the database); ``only``: just those users', and just the accounts no
        other user of the spec uses. slurmrestd not answering fails the step: the database
        outlives the cluster, so nothing may be assumed gone."""
        if not spec.accounting:
            return "users leave with the user database Secret"
        gone, accounts = leaving(spec, only)
        if not gone:
            return "no accounts to remove"
        restapi = next(o for o in self._objects(spec) if o["kind"] == "RestApi")
        if not self._kube.object_exists(restapi):
            # Its objects were deleted already (a deletion run again): nothing left to ask.
            return (
                f"the cluster's slurmrestd is gone: associations of {spec.name} still in slurmdbd stay there "
                f"(sacctmgr delete cluster {spec.name} removes them)"
            )
        removed = []
        try:
            client = self._rest(spec)
            try:
                have = client.associations(spec.name)
                for user in spec.users:
                    if user.name in gone and (user.account, user.name) in have:
                        client.remove_association(spec.name, user.account, user.name)
                        removed.append(f"user {user.name} from {user.account}")
                for account in sorted(accounts & {a for a, _ in have}):
                    client.remove_association(spec.name, account)
                    removed.append(f"account {account}")
            finally:
                client.close()
        except SlurmRestError as exc:
            raise StepFailed(f"removing the accounts through slurmrestd: {exc}") from None
        return f"slurmdbd: removed {', '.join(removed)} on {spec.name}" if removed else "no accounts to remove"

    def set_logins(self, spec: ClusterSpec) -> str:
        """The user database Secret the login node reads (``<name>-users``) rewritten from the
        spec: a user gone from it has no passwd line and no authorized_keys left."""
        secret = next(
            o for o in self._objects(spec) if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-users")
        )
        meta = secret["metadata"]
        data = {key: value.encode() for key, value in user_database(spec).items()}
        if not self._kube.replace_secret_data(meta["namespace"], meta["name"], data):
            raise StepFailed(f"no Secret {meta['namespace']}/{meta['name']}: were the cluster's objects made?")
        return f"Secret {meta['name']}: {len(spec.users)} user(s) can log in ({', '.join(u.name for u in spec.users)})"

    def logins_differ(self, spec: ClusterSpec) -> str:
        """'' when the user database Secret lets in exactly the spec's users (names, uids) with
        their keys, else what differs (a change of users read before another one ended). Other
        keys of the Secret, and how its lines are laid out, do not count."""
        secret = next(
            o for o in self._objects(spec) if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-users")
        )
        meta = secret["metadata"]
        found = self._kube.secret_data(meta["namespace"], meta["name"])
        if found is None:
            raise StepFailed(f"no Secret {meta['namespace']}/{meta['name']}: were the cluster's objects made?")
        wanted = {key: value.encode() for key, value in user_database(spec).items()}
        if _logins(found) == _logins(wanted):
            return ""
        return f"the Secret {meta['name']} lets in {', '.join(sorted(_logins(found))) or 'nobody'}"

    def smoke_test(self, spec: ClusterSpec) -> str:
        """A hello-world batch job on every partition, as the spec's first user; each must complete."""
        user = spec.users[0].name if spec.users else "root"
        try:
            client = self._rest(spec)
        except SlurmRestError as exc:
            raise StepFailed(str(exc)) from None
        ran: list[str] = []
        deadline = time.monotonic() + SMOKE_TOTAL
        try:
            for partition in spec.partitions:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepFailed(f"smoke jobs took over {SMOKE_TOTAL:g}s in all; done so far: {'; '.join(ran)}")
                script = '#!/bin/sh\necho "hello from $SLURMD_NODENAME"\n'
                try:
                    slurm = nodeset_name(spec.name, partition.name)  # the operator's name for it
                    job = client.submit(script, user=user, partition=slurm, name="gpufleet-smoke")
                    state = client.wait_job(job, user=user, timeout=min(SMOKE_TIMEOUT, left))
                except SlurmRestError as exc:
                    raise StepFailed(f"smoke job on partition {partition.name}: {exc}") from None
                if state != "COMPLETED":
                    raise StepFailed(f"smoke job {job} on partition {partition.name}, as {user}, ended {state}")
                ran.append(f"{partition.name}: job {job} as {user} COMPLETED")
        finally:
            client.close()
        return "; ".join(ran)

    def drain(self, spec: ClusterSpec) -> str:
        return "left to the operator, which drains a NodeSet's nodes before deleting its pods"

    def running_jobs(self, spec: ClusterSpec) -> int:
        try:
            client = self._rest(spec)
            try:
                jobs = client.jobs()
            finally:
                client.close()
        except SlurmRestError as exc:
            raise StepFailed(f"{exc}; delete with --force to leave the jobs to the operator") from None
        return sum(1 for state in jobs.values() if state.split("+")[0] in ACTIVE)

    def cancel_jobs(self, spec: ClusterSpec) -> int:
        """Cancel every job still held; a cluster whose slurmrestd is gone has none to cancel here
        (the operator drains before it deletes the pods)."""
        try:
            client = self._rest(spec)
        except SlurmRestError:
            return 0
        try:
            live = [job for job, state in client.jobs().items() if state.split("+")[0] not in TERMINAL]
            for job in live:
                client.cancel(job)
        except SlurmRestError as exc:
            raise StepFailed(f"cancelling the jobs: {exc}") from None
        finally:
            client.close()
        return len(live)

    def make_remediable(self, spec: ClusterSpec) -> str:
        return f"remediation defaults in ConfigMap gpufleet-remediation; run a worker with GPUFLEET_CLUSTER={spec.name}"

    def unmake_remediable(self, spec: ClusterSpec) -> str:
        return "the ConfigMap goes with the objects"


def _logins(data: dict[str, bytes]) -> dict[str, tuple[str, frozenset[str]]]:
    """Who a user database lets in: user -> (uid, their keys), from its passwd and authorized_keys."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for line in data.get("passwd", b"").decode(errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[0]:
            keys = data.get(f"authorized_keys.{fields[0]}", b"").decode(errors="replace").splitlines()
            found[fields[0]] = (fields[2], frozenset(key.strip() for key in keys if key.strip()))
    return found
