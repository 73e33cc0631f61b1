"""Slurm's REST API (``slurmrestd``) over httpx, for clusters gpufleet reaches only that way
(a Slinky cluster's ``RestApi``).

Each request carries a JSON Web Token that gpufleet signs itself with the cluster's HS256 key
(the file behind ``AuthAltParameters=jwt_key=``; on Slinky the Secret ``<name>-jwt-key``), for
the user the request acts as: Slurm's ``auth/jwt`` trusts the token's ``sun`` claim, so a job
submitted for ``alice`` runs as ``alice``. Tokens live five minutes and are never logged.

Two shapes of the API are spoken, chosen by the version in the path:

- ``v0.0.38`` (Slurm 22.05 and 23.02): the script beside the job, the environment an object,
  states plain strings. Tested against Debian's ``slurmrestd`` 22.05.
- ``v0.0.40`` to ``v0.0.45`` (Slurm 23.11 to 26.05, what Slinky runs): the script inside the
  job, the environment a list of ``KEY=value``, states lists of flags. Tested against the real
  slurmrestd of Slurm 24.11 (v0.0.40-v0.0.42) and 26.05 (v0.0.42-v0.0.45) through the Slurm
  Protocol client (``tests/clients/test_slurmrest_protocol.py``); v0.0.43 and v0.0.44 are the
  versions 25.05 and 25.11 bring, tested as 26.05 serves them. v0.0.45's ping says
  ``responding`` rather than ``pinged``. Their accounting API (accounts, users, associations)
  is tested against 26.05's slurmrestd with slurmdbd (``tests/lab/test_slinky_accounting.py``).

``detect_version`` asks the server, newest first, which one it serves.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

import httpx

from clients.errors import redact

VERSIONS = ("v0.0.45", "v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40", "v0.0.38")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
TOKEN_SECONDS = 300


class SlurmRestError(Exception):
    """slurmrestd refused or could not be reached; the message says which and what to check."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def jwt_token(key: bytes, user: str, *, lifetime: int = TOKEN_SECONDS, now: float | None = None) -> str:
    """An HS256 token for ``user``, as ``scontrol token`` makes them."""
    issued = int(time.time() if now is None else now)
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    claims = _b64(json.dumps({"iat": issued, "exp": issued + lifetime, "sun": user}, separators=(",", ":")).encode())
    signature = hmac.new(key, f"{header}.{claims}".encode(), hashlib.sha256).digest()
    return f"{header}.{claims}.{_b64(signature)}"


def _state(value: Any) -> str:
    """A job or node state in either shape: ``"idle"`` or ``["IDLE", "DRAIN"]``."""
    if isinstance(value, list):
        return "+".join(str(v).upper() for v in value) or "?"
    return str(value).upper() if value else "?"


def _up(ping: Any) -> bool:
    """One controller of a ping reply answers: ``"pinged": "UP"`` (to v0.0.44) or
    ``"responding": true`` (v0.0.45, which no longer says ``pinged``)."""
    if not isinstance(ping, dict):
        return False
    said = ping.get("ping", ping.get("pinged"))
    return str(said).upper() == "UP" if said is not None else ping.get("responding") is True


def _error(entry: Any) -> str:
    """One entry of a reply's ``errors``, as Slurm words it (description, then where)."""
    if not isinstance(entry, dict):
        return str(entry)
    said = str(entry.get("description") or entry.get("error") or entry)
    return f"{said} ({entry['source']})" if entry.get("source") else said


class SlurmRestClient:
    def __init__(
        self,
        base_url: str,
        key: bytes,
        *,
        version: str = "v0.0.38",
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if version not in VERSIONS:
            raise ValueError(f"unknown slurmrestd API version {version!r}; gpufleet speaks {', '.join(VERSIONS)}")
        self.base_url = base_url.rstrip("/")
        self.version = version
        self._key = key
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    @property
    def _old(self) -> bool:
        return self.version == "v0.0.38"

    def _request(
        self,
        method: str,
        path: str,
        *,
        user: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        token = jwt_token(self._key, user)
        headers = {"X-SLURM-USER-NAME": user, "X-SLURM-USER-TOKEN": token}
        what = f"{method} {path}"
        try:
            reply = self._http.request(method, path, headers=headers, json=body, params=params)
        except httpx.HTTPError as exc:
            raise SlurmRestError(
                f"slurmrestd at {self.base_url} did not answer {what}: {type(exc).__name__} {exc}; "
                "is the cluster's RestApi up, and is its address right?"
            ) from None
        if reply.status_code in (401, 403):
            raise SlurmRestError(
                f"slurmrestd at {self.base_url} refused the token for {user!r} ({reply.status_code}): the key "
                "gpufleet signs with must be the cluster's jwt_key, and the user must exist on the controller"
            )
        try:
            data: dict[str, Any] = reply.json()
        except ValueError:
            data = {}
        errors = [_error(e) for e in data.get("errors") or []]
        if reply.status_code >= 400 or errors:
            # What the server said, never the token (a proxy or a server may echo the request's headers).
            said = redact("; ".join(errors) or reply.text.strip(), token)
            hint = ""
            if reply.status_code >= 500:
                # What Slurm 22.05 answers when the controller refuses the token.
                hint = (
                    f"; if every call fails so, the controller refuses the token for {user!r}: the key gpufleet "
                    "signs with must be the cluster's jwt_key, and the user must exist on the controller"
                )
            raise SlurmRestError(f"slurmrestd refused {what} ({reply.status_code}): {said}{hint}")
        return data

    def detect_version(self, *, user: str = "root") -> str:
        """The newest API version the server serves; this client uses it from now on."""
        for version in VERSIONS:
            try:
                reply = self._http.get(
                    f"/slurm/{version}/ping",
                    headers={"X-SLURM-USER-NAME": user, "X-SLURM-USER-TOKEN": jwt_token(self._key, user)},
                )
            except httpx.HTTPError as exc:
                raise SlurmRestError(f"slurmrestd at {self.base_url} did not answer: {exc}") from None
            if reply.status_code != 404:
                self.version = version
                return version
        raise SlurmRestError(f"slurmrestd at {self.base_url} serves none of {', '.join(VERSIONS)}")

    def ping(self, *, user: str = "root") -> str:
        """The controller's Slurm release, once it answers through slurmrestd."""
        data = self._request("GET", f"/slurm/{self.version}/ping", user=user)
        pings = data.get("pings") or []
        if not pings or not all(_up(p) for p in pings):
            raise SlurmRestError(f"slurmrestd answers but the controller does not: {redact(str(pings))}")
        release = (data.get("meta") or {}).get("Slurm", (data.get("meta") or {}).get("slurm", {})).get("release", "?")
        return str(release)

    def nodes(self, *, user: str = "root") -> dict[str, tuple[str, list[str]]]:
        """Each node's state and partitions."""
        data = self._request("GET", f"/slurm/{self.version}/nodes", user=user)
        return {
            str(n["name"]): (_state(n.get("state")), [str(p) for p in n.get("partitions") or []])
            for n in data.get("nodes") or []
        }

    def submit(
        self, script: str, *, user: str, partition: str, name: str, cwd: str = "/tmp", output: str = "/dev/null"
    ) -> int:
        """Submit a batch script as ``user``; returns the job ID."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
        job: dict[str, Any] = {
            "partition": partition,
            "name": name,
            "current_working_directory": cwd,
            "standard_output": output,
            "nodes": "1",
        }
        if self._old:
            job["nodes"] = 1
            body: dict[str, Any] = {"script": script, "job": {**job, "environment": env}}
        else:
            body = {"job": {**job, "script": script, "environment": [f"{k}={v}" for k, v in env.items()]}}
        data = self._request("POST", f"/slurm/{self.version}/job/submit", user=user, body=body)
        job_id = data.get("job_id")
        if not isinstance(job_id, int):
            raise SlurmRestError(f"slurmrestd accepted the job but named no job ID: {redact(str(data))}")
        return job_id

    def job_state(self, job_id: int, *, user: str = "root") -> str:
        data = self._request("GET", f"/slurm/{self.version}/job/{int(job_id)}", user=user)
        jobs = data.get("jobs") or []
        if not jobs:
            raise SlurmRestError(f"slurmrestd knows no job {job_id}")
        return _state(jobs[0].get("job_state"))

    def jobs(self, *, user: str = "root") -> dict[int, str]:
        """Every job the controller still holds, with its state."""
        data = self._request("GET", f"/slurm/{self.version}/jobs", user=user)
        return {int(j["job_id"]): _state(j.get("job_state")) for j in data.get("jobs") or []}

    def cancel(self, job_id: int, *, user: str = "root") -> None:
        self._request("DELETE", f"/slurm/{self.version}/job/{int(job_id)}", user=user)

    # -- accounting (the slurmdb API: where the cluster has slurmdbd) ------------------------------

    def associations(self, cluster: str, *, user: str = "root") -> set[tuple[str, str]]:
        """(account, user) of each association on ``cluster`` ('' for an account's own)."""
        data = self._request("GET", f"/slurmdb/{self.version}/associations", user=user)
        return {
            (str(a.get("account") or ""), str(a.get("user") or ""))
            for a in data.get("associations") or []
            if a.get("cluster") == cluster
        }

    def add_account(self, account: str, *, cluster: str, user: str = "root") -> None:
        """The account, and its association on ``cluster`` (under ``root``), which a user's
        association needs first."""
        if self._old:
            accounts = {"accounts": [{"name": account, "description": account, "organization": account}]}
            self._request("POST", f"/slurmdb/{self.version}/accounts", user=user, body=accounts)
            association = {"account": account, "cluster": cluster, "parent_account": "root"}
            try:
                self._request(
                    "POST", f"/slurmdb/{self.version}/associations", user=user, body={"associations": [association]}
                )
            except SlurmRestError as exc:
                # Slurm 22.05 adds an account's association yet complains that it names no user;
                # what counts is whether the association is there.
                if "Missing required field 'user'" not in str(exc):
                    raise
        else:
            # From v0.0.40 (read on Slurm 24.11 and 26.05) an association must name a user, and
            # one without is refused and not added; an empty user makes a user association of no
            # one, under which every account so added shares one lineage (removing one removes
            # them all). So the account goes in as sacctmgr adds it, with its association.
            body: dict[str, Any] = {
                "association_condition": {"accounts": [account], "clusters": [cluster]},
                "account": {"description": account, "organization": account},
            }
            self._request("POST", f"/slurmdb/{self.version}/accounts_association", user=user, body=body)
        if (account, "") not in self.associations(cluster, user=user):
            raise SlurmRestError(f"slurmrestd took account {account} but it has no association on {cluster}")

    def add_user(self, name: str, *, account: str, cluster: str, admin: bool, user: str = "root") -> None:
        """The user, with ``account`` as default, and its association on ``cluster``."""
        level = "Administrator" if admin else "None"
        if self._old:
            entry = {"name": name, "default": {"account": account}, "administrator_level": level}
            self._request("POST", f"/slurmdb/{self.version}/users", user=user, body={"users": [entry]})
            association = {"account": account, "cluster": cluster, "user": name}
            self._request(
                "POST", f"/slurmdb/{self.version}/associations", user=user, body={"associations": [association]}
            )
            return
        # The user with its association, as sacctmgr adds them (the account its default when the
        # user is new); then the user's record, which that leaves as it was for a user known
        # before, with the admin level and default account asked for.
        body = {
            "association_condition": {"users": [name], "accounts": [account], "clusters": [cluster]},
            "user": {"adminlevel": [level], "defaultaccount": account},
        }
        self._request("POST", f"/slurmdb/{self.version}/users_association", user=user, body=body)
        entry = {"name": name, "default": {"account": account}, "administrator_level": [level]}
        self._request("POST", f"/slurmdb/{self.version}/users", user=user, body={"users": [entry]})

    def remove_association(self, cluster: str, account: str, name: str = "", *, user: str = "root") -> None:
        """Remove ``name``'s association with ``account`` on ``cluster`` (no name: the account's
        own). Users and accounts themselves stay: other clusters may know them."""
        params = {"cluster": cluster, "account": account, **({"user": name} if name else {})}
        self._request("DELETE", f"/slurmdb/{self.version}/association", user=user, params=params)

    def wait_job(self, job_id: int, *, user: str, timeout: float, interval: float = 1.0) -> str:
        """The job's state once it ends (or ``"<state> after <timeout>s"``)."""
        deadline = time.monotonic() + timeout
        state = "PENDING"
        while time.monotonic() < deadline:
            state = self.job_state(job_id, user=user)
            if state.split("+")[0] in TERMINAL:
                return state.split("+")[0]
            time.sleep(interval)
        return f"{state} after {timeout:g}s"
