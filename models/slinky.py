"""A cluster spec as the Kubernetes objects Slinky's slurm-operator runs Slurm from.

Rendered for slurm-operator 1.x (API ``slinky.slurm.net/v1beta1``) and Slurm 25.11 (the
``25.11-ubuntu24.04`` images). Slinky authenticates with Slurm's own ``auth/slurm`` key (not
munge) and JWTs for slurmrestd: both keys are Secrets. The objects, in the order they are
created (and deleted in reverse):

- the Namespace ``slurm-<name>``;
- Secrets: the Slurm key and the JWT key (generated when the Secret is first created; a dry run
  shows a placeholder), the sssd configuration, and the user database (``passwd``, ``group``
  and each user's ``authorized_keys``);
- a PersistentVolumeClaim for the shared storage, when the spec asks for it;
- a ConfigMap with the cluster's remediation defaults (read by its gpufleet worker);
- ``Accounting`` when accounting is on, the ``Controller``, one ``NodeSet`` per partition (its
  pods pinned to the reserved nodes by the labels the reservation wrote, their slurmd seeing the
  shared storage at the spec's mount path), a ``LoginSet`` (sshd letting in each user of the user
  database with their keys only, never root; the storage mounted as on the nodes; its Service
  ``<name>-login`` a LoadBalancer on port 22), and a
  ``RestApi`` (slurmrestd), through which gpufleet waits for the cluster and smoke-tests it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from models.cluster import ClusterSpec, SecretRef, job_requeue, kill_wait
from models.constants import POOL_LABEL
from models.policy import PolicyError, RemediationSettings

API = "slinky.slurm.net/v1beta1"
SLURM_VERSION = "25.11"
IMAGE_TAG = f"{SLURM_VERSION}-ubuntu24.04"
IMAGES = {
    "slurmctld": f"ghcr.io/slinkyproject/slurmctld:{IMAGE_TAG}",
    "slurmd": f"ghcr.io/slinkyproject/slurmd:{IMAGE_TAG}",
    "login": f"ghcr.io/slinkyproject/login:{IMAGE_TAG}",
    "slurmdbd": f"ghcr.io/slinkyproject/slurmdbd:{IMAGE_TAG}",
    "slurmrestd": f"ghcr.io/slinkyproject/slurmrestd:{IMAGE_TAG}",
}
RESTAPI_PORT = 6820  # the operator's Service <name>-restapi listens here
# GPUFLEET_SLINKY_RESTAPI_URL=service: slurmrestd at the address its Service holds, read through the API.
RESTAPI_FROM_SERVICE = "service"
GENERATED = "<generated when the Secret is first created>"
_COPIED = "<copied from Secret {namespace}/{name}, key {key}, when first created>"
COPIED = re.compile(r"^<copied from Secret ([a-z0-9.-]+)/([a-z0-9.-]+), key ([-._a-zA-Z0-9]+), when first created>$")


# A Secret gpufleet may copy from carries this label: a spec cannot name just any Secret.
COPY_LABEL = "gpufleet.io/copy-to-clusters"


def copied(ref: SecretRef) -> str:
    """The placeholder for a value copied from another Secret when the object is created."""
    placeholder = _COPIED.format(namespace=ref.namespace, name=ref.name, key=ref.key)
    if not COPIED.match(placeholder):  # the validators and the pattern must agree
        raise ValueError(f"cannot copy from Secret {ref.namespace}/{ref.name} key {ref.key}")
    return placeholder


CLUSTER_LABEL = "gpufleet.io/cluster"
PARTITION_LABEL = "gpufleet.io/partition"
REMEDIATION_CONFIGMAP = "gpufleet-remediation"
USERS_MOUNT = "/etc/gpufleet/users"
# The login image's sshd_config ends with the LoginSet's extraSshdConfig, and sshd keeps the first
# value it reads of each keyword: the operator's own lines set none of these. Each user logs in
# with the keys of the user database Secret (its files are root's, hence no StrictModes), by key
# only; nobody logs in as root.
LOGIN_SSHD_CONFIG = (
    f"AuthorizedKeysFile {USERS_MOUNT}/authorized_keys.%u\n"
    "PubkeyAuthentication yes\n"
    "PasswordAuthentication no\n"
    "KbdInteractiveAuthentication no\n"
    "PermitRootLogin no\n"
    "StrictModes no\n"
)
LOGIN_PORT = 22  # the operator's login Service (named after the LoginSet) listens here
LOGIN_SERVICE_TYPE = "LoadBalancer"


def cluster_namespace(name: str) -> str:
    """Where a cluster made by gpufleet keeps its objects."""
    return f"slurm-{name}"


# The keys `gpufleet cluster create` writes into the REMEDIATION_CONFIGMAP (objects below): the grace
# is what the cluster's worker takes over its policy file; requeue went into slurm.conf
# (JobRequeue) and task_queue is there for people to read.
REMEDIATION_CONFIGMAP_KEYS = ("grace_seconds", "requeue", "task_queue")


def configmap_remediation(data: Mapping[str, Any], base: RemediationSettings, *, origin: str) -> RemediationSettings:
    """``base`` (the worker's remediation settings) with the cluster's ConfigMap over it, checked
    as the policy file's ``remediation:`` is (a finite grace within its bounds).

    Raises:
        PolicyError: one line naming ``origin`` (``ConfigMap NAMESPACE/NAME``) and each wrong key.
    """
    problems = [
        f"{key}: not a key of this ConfigMap (it holds {', '.join(REMEDIATION_CONFIGMAP_KEYS)})"
        for key in sorted(map(str, data))
        if key not in REMEDIATION_CONFIGMAP_KEYS
    ]
    if "requeue" in data and data["requeue"] not in ("true", "false"):
        problems.append(f"requeue: {data['requeue']!r} is not 'true' or 'false'")
    overrides = {key: data[key] for key in ("grace_seconds",) if key in data}
    settings = base
    try:
        settings = RemediationSettings.model_validate({**base.model_dump(), **overrides})
    except ValidationError as exc:
        problems += [f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors()]
    if problems:
        raise PolicyError(f"{origin}: {'; '.join(problems)}")
    return settings


def namespace(spec: ClusterSpec) -> str:
    return cluster_namespace(spec.name)


def _meta(spec: ClusterSpec, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace(spec),
        "labels": {CLUSTER_LABEL: spec.name, "app.kubernetes.io/managed-by": "gpufleet"},
        **extra,
    }


def sssd_conf() -> str:
    """sssd reading the users from files (the user database Secret, mounted over /etc)."""
    return (
        "[sssd]\nservices = nss,pam\ndomains = DEFAULT\n\n"
        "[nss]\nfilter_groups = root,slurm\nfilter_users = root,slurm\n\n[pam]\n\n"
        "[domain/DEFAULT]\nid_provider = proxy\nproxy_lib_name = files\n"
        "auth_provider = proxy\nproxy_pam_target = sssd-shadowutils\n"
    )


def user_database(spec: ClusterSpec) -> dict[str, str]:
    """``passwd`` and ``group`` lines for the spec's users (a group per user, ``admin``
    membership for admins), and ``authorized_keys.<user>`` for each."""
    passwd = [f"{u.name}:x:{u.uid}:{u.uid}:{u.name}:/home/{u.name}:/bin/bash" for u in spec.users]
    groups = [f"{u.name}:x:{u.uid}:" for u in spec.users]
    admins = ",".join(u.name for u in spec.users if u.admin)
    if admins:
        groups.append(f"slurm-admins:x:{min(u.uid for u in spec.users) - 1}:{admins}")
    data = {"passwd": "\n".join(passwd) + "\n", "group": "\n".join(groups) + "\n"}
    for user in spec.users:
        data[f"authorized_keys.{user.name}"] = "\n".join(user.ssh_keys) + "\n"
    return data


def _container(image: str) -> dict[str, Any]:
    return {"image": image}


def slinky_objects(spec: ClusterSpec, placement: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Every object for the spec, in creation order (``placement``: partition: node names)."""
    ns = namespace(spec)
    name = spec.name
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": ns, "labels": {CLUSTER_LABEL: name, "app.kubernetes.io/managed-by": "gpufleet"}},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(spec, f"{name}-slurm-key"),
            "type": "Opaque",
            "immutable": True,
            "stringData": {"slurm.key": GENERATED},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(spec, f"{name}-jwt-key"),
            "type": "Opaque",
            "immutable": True,
            "stringData": {"jwt_hs256.key": GENERATED},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(spec, f"{name}-sssd"),
            "type": "Opaque",
            "stringData": {"sssd.conf": sssd_conf()},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(spec, f"{name}-users"),
            "type": "Opaque",
            "stringData": user_database(spec),
        },
    ]
    if spec.storage is not None:
        pvc: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": spec.storage.size}},
        }
        if spec.storage.storage_class:
            pvc["storageClassName"] = spec.storage.storage_class
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": _meta(
                    spec, f"{name}-shared", annotations={"gpufleet.io/mount-path": spec.storage.mount_path}
                ),
                "spec": pvc,
            }
        )
    objects.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(spec, REMEDIATION_CONFIGMAP),
            "data": {
                "grace_seconds": f"{spec.remediation.grace_seconds:g}",
                "requeue": "true" if spec.remediation.requeue else "false",
                "task_queue": f"gpufleet-{name}",
            },
        }
    )
    keys = {
        "slurmKeyRef": {"name": f"{name}-slurm-key", "key": "slurm.key"},
        "jwtKeyRef": {"name": f"{name}-jwt-key", "key": "jwt_hs256.key"},
    }
    if spec.accounting:
        accounting: dict[str, Any] = {**keys, "slurmdbd": _container(IMAGES["slurmdbd"])}
        storage = spec.accounting_storage
        if storage is not None:
            objects.append(
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": _meta(spec, f"{name}-db-password"),
                    "type": "Opaque",
                    "stringData": {"password": copied(storage.password_secret)},
                }
            )
            accounting["storageConfig"] = {
                "host": storage.host,
                "port": storage.port,
                "database": storage.database,
                "username": storage.username,
                "passwordKeyRef": {"name": f"{name}-db-password", "key": "password"},
            }
        objects.append({"apiVersion": API, "kind": "Accounting", "metadata": _meta(spec, name), "spec": accounting})
    extra = [
        f"JobRequeue={job_requeue(spec)}",
        f"KillWait={kill_wait(spec)}",
        *(["GresTypes=gpu"] if any(p.gpus_per_node for p in spec.partitions) else []),
        *spec.slurm_conf,
    ]
    controller: dict[str, Any] = {
        "clusterName": name,
        **keys,
        "slurmctld": _container(IMAGES["slurmctld"]),
        "extraConf": "\n".join(extra),
        "persistence": {"enabled": True},
    }
    if spec.accounting:
        controller["accountingRef"] = {"name": name}
    objects.append({"apiVersion": API, "kind": "Controller", "metadata": _meta(spec, name), "spec": controller})
    default = spec.default_partition
    for partition in spec.partitions:
        options = {
            "Default": "YES" if partition.name == default else "NO",
            "MaxTime": partition.max_time,
            **partition.options,
        }
        pod: dict[str, Any] = {
            "nodeSelector": {CLUSTER_LABEL: name, PARTITION_LABEL: partition.name},
            # A node the shared pool gave to training carries this taint (docs/pool.md): it keeps
            # inference pods off, never training's own.
            "tolerations": [TRAINING_TOLERATION],
        }
        slurmd = _container(IMAGES["slurmd"])
        if spec.storage is not None:
            pod["volumes"] = [_shared_volume(name)]
            slurmd["volumeMounts"] = [_shared_mount(spec)]
        nodeset: dict[str, Any] = {
            "controllerRef": {"name": name},
            "replicas": len(placement.get(partition.name, [])),
            "slurmd": slurmd,
            "partition": {
                "enabled": True,
                "config": " ".join(f"{key}={value}" for key, value in options.items()),
            },
            "template": {"spec": pod},
        }
        if partition.gpus_per_node:
            nodeset["extraConf"] = f"Gres=gpu:{partition.gpus_per_node}"
        objects.append(
            {
                "apiVersion": API,
                "kind": "NodeSet",
                "metadata": _meta(spec, nodeset_name(name, partition.name)),
                "spec": nodeset,
            }
        )
    volumes: list[dict[str, Any]] = [{"name": "users", "secret": {"secretName": f"{name}-users"}}]
    mounts: list[dict[str, Any]] = [{"name": "users", "mountPath": USERS_MOUNT, "readOnly": True}]
    if spec.storage is not None:
        volumes.append(_shared_volume(name))
        mounts.append(_shared_mount(spec))
    login: dict[str, Any] = {
        "controllerRef": {"name": name},
        "replicas": 1,
        # The user database, where the login image's sssd (files provider) and sshd read it, and
        # the cluster's storage where its jobs see it.
        "login": {**_container(IMAGES["login"]), "volumeMounts": mounts},
        "sssdConfRef": {"name": f"{name}-sssd", "key": "sssd.conf"},
        "extraSshdConfig": LOGIN_SSHD_CONFIG,
        "template": {"spec": {"volumes": volumes}},
        # The operator's Service <name>-login: where researchers ssh to.
        "service": {"spec": {"type": LOGIN_SERVICE_TYPE}, "port": LOGIN_PORT},
    }
    objects.append({"apiVersion": API, "kind": "LoginSet", "metadata": _meta(spec, login_service(name)), "spec": login})
    # slurmrestd, through which gpufleet waits for the cluster, runs its smoke jobs and counts jobs.
    restapi = {"controllerRef": {"name": name}, "replicas": 1, "slurmrestd": _container(IMAGES["slurmrestd"])}
    objects.append({"apiVersion": API, "kind": "RestApi", "metadata": _meta(spec, name), "spec": restapi})
    return objects


# Training's own pods tolerate the taint the shared pool puts on its training nodes.
TRAINING_TOLERATION = {"key": POOL_LABEL, "operator": "Equal", "value": "training", "effect": "NoSchedule"}


def _shared_volume(cluster: str) -> dict[str, Any]:
    return {"name": "shared", "persistentVolumeClaim": {"claimName": f"{cluster}-shared"}}


def _shared_mount(spec: ClusterSpec) -> dict[str, Any]:
    assert spec.storage is not None
    return {"name": "shared", "mountPath": spec.storage.mount_path}


def login_service(name: str) -> str:
    """The Service slurm-operator makes for the cluster's LoginSet (named after the LoginSet)."""
    return f"{name}-login"


def nodeset_name(cluster: str, partition: str) -> str:
    """The NodeSet of a cluster's partition; slurm-operator names its Slurm partition after it."""
    return f"{cluster}-{partition}"


def restapi_service(name: str) -> str:
    """The Service slurm-operator makes for the cluster's RestApi (named after the cluster)."""
    return f"{name}-restapi"


def restapi_url(name: str) -> str:
    """Where a worker in the Kubernetes cluster reaches the cluster's slurmrestd."""
    return f"http://{name}-restapi.{cluster_namespace(name)}.svc.cluster.local:{RESTAPI_PORT}"
