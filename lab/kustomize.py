"""A small kustomize in Python: renders gpufleet's own ``deploy/`` where no recent kubectl is.

``kubectl kustomize`` (kubectl 1.21 or newer) is the renderer of record; ``make test`` uses this
one only on a machine whose kubectl is missing or older (Debian's ``kubernetes-client`` is
1.20), and a test renders every kustomization both ways where kubectl is recent and compares
them. It knows what ``deploy/`` uses and refuses everything else by name:

- ``resources`` (files, several documents each, and directories holding a kustomization),
- ``components`` (``kind: Component``: their resources and patches),
- ``patches``: strategic merge, from a ``path`` or inline ``patch``, with or without ``target``,
- ``namePrefix`` (the Namespace object keeps its name; references among the rendered objects
  follow: role bindings, service accounts, ConfigMaps and Secrets a pod names),
- ``labels`` with ``pairs`` (on each object's metadata; not selectors or templates),
- ``images`` (``newName``, ``newTag``, ``digest``).

Anything else (other kustomization fields, patch directives, a patch's labels) is refused.

    python -m lab.kustomize deploy/overlays/example
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "namePrefix", "labels", "images"}
# kustomize's legacy output order: these kinds first, in this order; the rest after, by kind.
ORDER_FIRST = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
# Strategic merge: the key that identifies an item of these lists (others are replaced whole).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",  # a Service's ports by "port" (below)
    "imagePullSecrets": "name",
}
NOT_PREFIXED = {"Namespace", "CustomResourceDefinition", "APIService"}
IMAGE_FIELDS = {"name", "newName", "newTag", "digest"}
PATCH_FIELDS = {"path", "patch", "target"}
POD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "Pod"}


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render, saying what and where."""


def render(directory: Path) -> list[Obj]:
    """The objects the kustomization in ``directory`` makes, in kustomize's output order."""
    objects = _build(directory.resolve(), component=False)
    return sorted(objects, key=_order)


def _order(obj: Obj) -> tuple[int, str, str, str]:
    """kustomize's legacy order: ORDER_FIRST's kinds, the others by group, version and kind,
    ORDER_LAST's; then by namespace (none after any) and name."""
    kind = obj.get("kind", "")
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    meta = obj.get("metadata", {})
    return rank, f"{group}_{version}_{kind}", meta.get("namespace") or "~X", meta.get("name", "")


def _kustomization(directory: Path) -> Obj:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            if not isinstance(loaded, dict):
                raise KustomizeError(f"{path}: not a kustomization (a mapping)")
            unknown = sorted(set(loaded) - KNOWN_FIELDS)
            if unknown:
                raise KustomizeError(
                    f"{path}: {', '.join(unknown)} not supported here; "
                    "render it with `kubectl kustomize` (kubectl 1.21+)"
                )
            return loaded
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _documents(path: Path) -> Iterator[Obj]:
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if doc is None:
            continue
        if not isinstance(doc, dict) or "kind" not in doc:
            raise KustomizeError(f"{path}: a document that is not a Kubernetes object")
        yield doc


def _build(directory: Path, *, component: bool, into: list[Obj] | None = None) -> list[Obj]:
    spec = _kustomization(directory)
    is_component = spec.get("kind") == "Component"
    if is_component != component:
        raise KustomizeError(f"{directory}: a {'Component' if component else 'Kustomization'} was expected here")
    objects = into if into is not None else []
    for entry in spec.get("resources") or []:
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(_build(path, component=False))
        elif path.is_file():
            objects.extend(_documents(path))
        else:
            raise KustomizeError(f"{directory}: resource {entry} does not exist")
    for entry in spec.get("components") or []:
        _build((directory / entry).resolve(), component=True, into=objects)
    for patch in spec.get("patches") or []:
        _patch(directory, objects, patch)
    prefix = spec.get("namePrefix") or ""
    if prefix:
        _prefix(objects, prefix)
    for label in spec.get("labels") or []:
        if set(label) != {"pairs"}:
            raise KustomizeError(f"{directory}: labels other than plain pairs are not supported: {label}")
        if not all(isinstance(value, str) for value in label["pairs"].values()):
            raise KustomizeError(f"{directory}: a label's value must be a string: {label['pairs']}")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for image in spec.get("images") or []:
        if "name" not in image or set(image) - IMAGE_FIELDS:
            raise KustomizeError(f"{directory}: an image entry needs name and only {', '.join(sorted(IMAGE_FIELDS))}")
        _image(objects, image)
    return objects


def _patch(directory: Path, objects: list[Obj], entry: Obj) -> None:
    if set(entry) - PATCH_FIELDS:
        raise KustomizeError(f"{directory}: patch fields {', '.join(sorted(set(entry) - PATCH_FIELDS))} not supported")
    if "path" in entry:
        patches = list(_documents(directory / entry["path"]))
    elif "patch" in entry:
        patches = [doc for doc in yaml.safe_load_all(entry["patch"]) if doc]
    else:
        raise KustomizeError(f"{directory}: a patch with neither path nor patch")
    target = entry.get("target")
    for patch in patches:
        if isinstance(patch, list) or "op" in patch:
            raise KustomizeError(f"{directory}: JSON 6902 patches are not supported")
        if set(patch.get("metadata", {})) - {"name", "namespace"}:
            raise KustomizeError(f"{directory}: a patch's metadata beyond name and namespace is not supported")
        if _directives(patch):
            raise KustomizeError(f"{directory}: patch directives ($patch, $setElementOrder...) are not supported")
        matched = [obj for obj in objects if _targets(obj, patch, target)]
        if not matched:
            name = (target or patch.get("metadata", {})).get("name")
            raise KustomizeError(f"{directory}: the patch of {patch.get('kind')} {name} matches no resource")
        for obj in matched:
            merged = _merge(obj, {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")})
            obj.clear()
            obj.update(merged)


def _directives(value: Any) -> bool:
    if isinstance(value, dict):
        return any(str(key).startswith("$") or _directives(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_directives(item) for item in value)
    return False


def _targets(obj: Obj, patch: Obj, target: Obj | None) -> bool:
    if target is not None:
        group, _, version = obj.get("apiVersion", "").rpartition("/")
        wanted = {
            "group": group,
            "version": version,
            "kind": obj.get("kind"),
            "name": obj.get("metadata", {}).get("name"),
            "namespace": obj.get("metadata", {}).get("namespace"),
        }
        if set(target) - set(wanted):
            raise KustomizeError(f"patch target fields {', '.join(sorted(set(target) - set(wanted)))} not supported")
        return all(wanted[key] == value for key, value in target.items())
    meta = patch.get("metadata", {})
    return (
        obj.get("kind") == patch.get("kind")
        and obj.get("metadata", {}).get("name") == meta.get("name")
        and ("namespace" not in meta or obj.get("metadata", {}).get("namespace") == meta["namespace"])
    )


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """A strategic merge of ``patch`` into ``base`` (lists of MERGE_KEYS merged by their key)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            elif name in merged:
                merged[name] = _merge(merged[name], value, name)
            else:
                merged[name] = copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        # As kustomize orders them: the patch's items first (each merged into its match), then
        # the items it did not name, in their order.
        field = MERGE_KEYS[key]
        if key == "ports" and not all(isinstance(item, dict) and "containerPort" in item for item in patch):
            field = "port"  # a Service's
        named = {item.get(field) for item in patch if isinstance(item, dict)}
        first = []
        for item in patch:
            match = next((old for old in base if isinstance(old, dict) and old.get(field) == item.get(field)), None)
            first.append(copy.deepcopy(item) if match is None else _merge(match, item))
        rest = [copy.deepcopy(old) for old in base if not (isinstance(old, dict) and old.get(field) in named)]
        return first + rest
    return copy.deepcopy(patch)


def _prefix(objects: list[Obj], prefix: str) -> None:
    renamed: dict[tuple[str, str], str] = {}
    for obj in objects:
        if obj.get("kind") in NOT_PREFIXED:
            continue
        meta = obj.setdefault("metadata", {})
        renamed[(obj["kind"], meta["name"])] = prefix + meta["name"]
        meta["name"] = prefix + meta["name"]

    def follow(kind: str, name: str) -> str:
        return renamed.get((kind, name), name)

    for obj in objects:
        if obj.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
            ref = obj.get("roleRef", {})
            ref["name"] = follow(ref.get("kind", ""), ref.get("name", ""))
            for subject in obj.get("subjects") or []:
                subject["name"] = follow(subject.get("kind", ""), subject.get("name", ""))
        for pod in _pod_specs(obj):
            if "serviceAccountName" in pod:
                pod["serviceAccountName"] = follow("ServiceAccount", pod["serviceAccountName"])
            for secret in pod.get("imagePullSecrets") or []:
                secret["name"] = follow("Secret", secret["name"])
            for volume in pod.get("volumes") or []:
                if "configMap" in volume:
                    volume["configMap"]["name"] = follow("ConfigMap", volume["configMap"]["name"])
                if "secret" in volume:
                    volume["secret"]["secretName"] = follow("Secret", volume["secret"]["secretName"])
                for source in (volume.get("projected") or {}).get("sources") or []:
                    for field, kind in (("configMap", "ConfigMap"), ("secret", "Secret")):
                        if field in source:
                            source[field]["name"] = follow(kind, source[field]["name"])
            for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                for env in container.get("env") or []:
                    source = env.get("valueFrom") or {}
                    for field, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                        if field in source:
                            source[field]["name"] = follow(kind, source[field]["name"])
                for env_from in container.get("envFrom") or []:
                    for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                        if field in env_from:
                            env_from[field]["name"] = follow(kind, env_from[field]["name"])


def _pod_specs(obj: Obj) -> Iterator[Obj]:
    if obj.get("kind") == "Pod":
        yield obj.get("spec", {})
    elif obj.get("kind") in POD_KINDS:
        yield obj.get("spec", {}).get("template", {}).get("spec", {})
    elif obj.get("kind") == "CronJob":
        yield obj.get("spec", {}).get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec", {})


def _image(objects: list[Obj], image: Obj) -> None:
    name = image["name"]
    for obj in objects:
        for pod in _pod_specs(obj):
            for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                current = container.get("image", "")
                repository, tag = _split_image(current)
                if repository != name:
                    continue
                container["image"] = f"{image.get('newName', repository)}{_tag(image, tag)}"


def _split_image(image: str) -> tuple[str, str]:
    """``repository`` and what follows it (``:tag``, ``@digest``, ``:tag@digest``, or nothing)."""
    image, at, digest = image.partition("@")
    if at:
        repository, tag = _split_image(image)
        return repository, f"{tag}@{digest}"
    head, _, last = image.rpartition("/")
    if ":" in last:
        bare, tag = last.split(":", 1)
        return (f"{head}/{bare}" if head else bare), ":" + tag
    return image, ""


def _tag(image: Obj, current: str) -> str:
    if "digest" in image:
        return "@" + str(image["digest"])
    if "newTag" in image:
        return ":" + str(image["newTag"])
    return current


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.kustomize", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a directory holding a kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        objects = render(args.directory)
    except (KustomizeError, OSError, yaml.YAMLError) as exc:
        print(f"lab.kustomize: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
