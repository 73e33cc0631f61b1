"""Authentication and authorization as kube-apiserver does them, for the emulated API (lab.kubeapi).

- ServiceAccount tokens (TokenRequest): JWTs signed with HMAC-SHA256 under a key the server holds
  (a real server signs with RS256 or ES256; nothing outside the server checks the signature),
  carrying the claims a real server writes: ``iss``, ``sub``, ``aud``, ``exp``, ``iat``, ``nbf``,
  ``jti`` and ``kubernetes.io`` (namespace, ServiceAccount, and for a pod-bound token the pod and
  its node).
- Static tokens as ``--token-auth-file`` reads them: ``token,user,uid,"group1,group2"``.
- RBAC (ClusterRoles, ClusterRoleBindings, Roles, RoleBindings of rbac.authorization.k8s.io/v1)
  evaluated as the RBAC authorizer evaluates them, with its reasons.

The request handling (which objects exist, what is answered) is lab.kubeapi's; here are the rules.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The issuer, and the API's own audience (kube-apiserver's --api-audiences defaults to its
# --service-account-issuer), of the lab's cluster.
ISSUER = "https://kubernetes.default.svc.cluster.local"
API_AUDIENCES = (ISSUER,)
# A TokenRequest's expirationSeconds when it names none, as on a real server.
DEFAULT_EXPIRATION = 3600
# Extra keys a TokenReview of a pod-bound ServiceAccount token answers, as a real server does.
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_UID = "authentication.kubernetes.io/node-uid"
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
AUTHENTICATED = "system:authenticated"
SERVICE_ACCOUNTS = "system:serviceaccounts"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


class TokenInvalid(Exception):
    """A bearer token that does not authenticate; the message is what the API would say why."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signing_key(path: Path | None) -> bytes:
    """The key tokens are signed with: read from ``path``, or made there (0600) when it is absent,
    so that tokens outlive a restart of the server; a fresh one per start when no path is given."""
    if path is None:
        return secrets.token_bytes(32)
    if path.exists():
        key = path.read_bytes()
        if len(key) < 32:
            raise ValueError(f"{path}: a signing key of at least 32 bytes is expected; delete it to make a new one")
        return key
    key = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(key)
    return key


def sign(claims: dict[str, Any], key: bytes) -> str:
    """A JWT (JWS compact form, HS256) of ``claims``."""
    header = {"alg": "HS256", "kid": hashlib.sha256(key).hexdigest()[:16], "typ": "JWT"}
    signing_input = _b64(json.dumps(header, separators=(",", ":")).encode()) + "."
    signing_input += _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


def verify(token: str, key: bytes, *, now: float) -> dict[str, Any]:
    """The claims of a token this server signed, still valid at ``now``; TokenInvalid when its
    form, signature, issuer or times are wrong. No leeway: a real server allows 60 s past ``exp``."""
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenInvalid("token lookup failed")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
    except (ValueError, binascii.Error):
        raise TokenInvalid("token lookup failed") from None
    if not isinstance(header, dict) or header.get("alg") != "HS256" or not isinstance(claims, dict):
        raise TokenInvalid("token lookup failed")
    expected = hmac.new(key, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(signature, expected):
        raise TokenInvalid("square/go-jose: error in cryptographic primitive")
    if claims.get("iss") != ISSUER:
        raise TokenInvalid("token lookup failed")  # another issuer's token: not ours to judge
    for name in ("exp", "iat", "nbf"):
        if not isinstance(claims.get(name), int | float):
            raise TokenInvalid(f"service account token has no {name!r} claim")
    if now >= claims["exp"]:
        raise TokenInvalid("service account token has expired")
    if now < claims["nbf"] or now < claims["iat"]:
        raise TokenInvalid("service account token is not valid yet")
    return claims


def token_audiences(claims: dict[str, Any]) -> list[str]:
    aud = claims.get("aud")
    if isinstance(aud, str):
        return [aud]
    return [str(a) for a in aud] if isinstance(aud, list) else []


@dataclass(frozen=True)
class StaticUser:
    """A user of the static token file."""

    name: str
    uid: str
    groups: tuple[str, ...]


def read_token_file(path: Path) -> dict[str, StaticUser]:
    """Tokens by value, from a file in kube-apiserver's ``--token-auth-file`` format: CSV lines
    ``token,user,uid[,"group1,group2"]`` (a later line for the same token wins, as there)."""
    users: dict[str, StaticUser] = {}
    with path.open(encoding="utf-8", newline="") as lines:
        for number, record in enumerate(csv.reader(lines, skipinitialspace=True), start=1):
            if not record or not any(part.strip() for part in record):
                continue
            if len(record) < 3:
                raise ValueError(f"{path}:{number}: token file record must have at least 3 columns: token,user,uid")
            token, name, uid = (part.strip() for part in record[:3])
            if not token or not name:
                raise ValueError(f"{path}:{number}: a token and a user name are required")
            groups = tuple(g.strip() for g in record[3].split(",") if g.strip()) if len(record) > 3 else ()
            users[token] = StaticUser(name=name, uid=uid, groups=groups)
    return users


# -- RBAC ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attributes:
    """What a SubjectAccessReview asks: who, and a resource request or a non-resource one."""

    user: str
    groups: tuple[str, ...]
    verb: str
    resource_request: bool
    group: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    namespace: str = ""
    path: str = ""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""
    errors: list[str] = field(default_factory=list)


def _matches_any(wanted: str, allowed: Iterable[str]) -> bool:
    return any(item in ("*", wanted) for item in allowed)


def rule_allows(attrs: Attributes, rule: dict[str, Any]) -> bool:
    """Whether one PolicyRule allows the request (kubernetes' rbac.RuleAllows)."""
    if not _matches_any(attrs.verb, rule.get("verbs") or []):
        return False
    if not attrs.resource_request:
        for url in rule.get("nonResourceURLs") or []:
            if url in ("*", attrs.path) or (url.endswith("*") and attrs.path.startswith(url[:-1])):
                return True
        return False
    if not _matches_any(attrs.group, rule.get("apiGroups") or []):
        return False
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    resources = rule.get("resources") or []
    if not any(r in ("*", combined) or (attrs.subresource and r == f"*/{attrs.subresource}") for r in resources):
        return False
    names = rule.get("resourceNames") or []
    return not names or attrs.name in names


def _applies(attrs: Attributes, subject: dict[str, Any], namespace: str) -> bool:
    """Whether a binding's subject is the requester (kubernetes' rbac appliesToUser)."""
    kind, name = subject.get("kind"), subject.get("name", "")
    if kind == "User":
        return bool(attrs.user == name)
    if kind == "Group":
        return name in attrs.groups
    if kind == "ServiceAccount":
        sa_namespace = subject.get("namespace") or namespace
        return bool(sa_namespace) and attrs.user == f"{SERVICE_ACCOUNT_PREFIX}{sa_namespace}:{name}"
    return False


def _describe(subject: dict[str, Any], namespace: str) -> str:
    kind, name = subject.get("kind", ""), subject.get("name", "")
    if kind == "ServiceAccount":
        return f'{kind} "{name}/{subject.get("namespace") or namespace}"'
    return f'{kind} "{name}"'


def _labels_match(labels: dict[str, str], selector: dict[str, Any]) -> bool:
    """A label selector's matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist); an
    expression with another operator matches nothing (a real server refuses such a selector)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression.get("key", ""), expression.get("operator"), expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def cluster_role_rules(role: dict[str, Any], cluster_roles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ClusterRole's rules; for one with an aggregationRule, the rules of every other ClusterRole
    its selectors match, computed now, and none of its own: a real cluster's controller writes
    that union over whatever rules the role was applied with."""
    aggregation = role.get("aggregationRule")
    if aggregation is None:
        return list(role.get("rules") or [])
    rules: list[dict[str, Any]] = []
    selectors = aggregation.get("clusterRoleSelectors") or []
    if selectors:
        own = role.get("metadata", {}).get("name")
        for other in cluster_roles:
            labels = other.get("metadata", {}).get("labels") or {}
            if other.get("metadata", {}).get("name") != own and any(_labels_match(labels, s) for s in selectors):
                rules += other.get("rules") or []
    return rules


def authorize(
    attrs: Attributes,
    *,
    cluster_roles: list[dict[str, Any]],
    cluster_role_bindings: list[dict[str, Any]],
    roles: Callable[[str], list[dict[str, Any]]],
    role_bindings: Callable[[str], list[dict[str, Any]]],
) -> Decision:
    """The RBAC authorizer's answer: ClusterRoleBindings first, then (for a request in a
    namespace) that namespace's RoleBindings; allowed with the binding, role and subject that
    allowed it, else not allowed (RBAC gives no reason for a refusal), with the roles it could not
    find as errors. ``roles`` and ``role_bindings`` give a namespace's Roles and RoleBindings."""
    by_name = {r.get("metadata", {}).get("name"): r for r in cluster_roles}
    errors: list[str] = []

    def rules_of(ref: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
        kind, name = ref.get("kind"), ref.get("name")
        if kind == "ClusterRole":
            role = by_name.get(name)
            if role is None:
                errors.append(f'clusterrole.rbac.authorization.k8s.io "{name}" not found')
                return []
            return cluster_role_rules(role, cluster_roles)
        if kind == "Role" and namespace:
            found = next((r for r in roles(namespace) if r.get("metadata", {}).get("name") == name), None)
            if found is None:
                errors.append(f'role.rbac.authorization.k8s.io "{name}" not found')
                return []
            return list(found.get("rules") or [])
        return []

    for binding in sorted(cluster_role_bindings, key=lambda b: str(b.get("metadata", {}).get("name"))):
        subject = next((s for s in binding.get("subjects") or [] if _applies(attrs, s, "")), None)
        if subject is None:
            continue
        ref = binding.get("roleRef") or {}
        if any(rule_allows(attrs, rule) for rule in rules_of(ref, "")):
            name = binding.get("metadata", {}).get("name")
            reason = f'ClusterRoleBinding "{name}" of {ref.get("kind")} "{ref.get("name")}" to {_describe(subject, "")}'
            return Decision(True, f"RBAC: allowed by {reason}")
    if attrs.namespace:
        for binding in sorted(role_bindings(attrs.namespace), key=lambda b: str(b.get("metadata", {}).get("name"))):
            namespace = attrs.namespace
            subject = next((s for s in binding.get("subjects") or [] if _applies(attrs, s, namespace)), None)
            if subject is None:
                continue
            ref = binding.get("roleRef") or {}
            if any(rule_allows(attrs, rule) for rule in rules_of(ref, namespace)):
                name = f"{binding.get('metadata', {}).get('name')}/{namespace}"
                reason = (
                    f'RoleBinding "{name}" of {ref.get("kind")} "{ref.get("name")}" to {_describe(subject, namespace)}'
                )
                return Decision(True, f"RBAC: allowed by {reason}")
    return Decision(False, "", errors)
