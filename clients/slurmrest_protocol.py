"""The Slurm Protocol (``clients.slurm.SlurmClient``) over slurmrestd, for deployments that reach
Slurm only through its REST API (a Slinky cluster's ``RestApi``).

What each API version can serve, from the OpenAPI documents the real servers publish
(``GET /openapi/v3`` of Slurm 24.11's and 26.05's slurmrestd) and checked against real servers
(``tests/clients/test_slurmrest_protocol.py``): Slurm 22.05 (v0.0.38), 24.11 (v0.0.40 to
v0.0.42) and 26.05 (v0.0.42 to v0.0.45), each beside a real slurmctld and compared with the CLI
client on the same cluster.

=========================  ========  ===================  ======================================
method                     v0.0.38   v0.0.40 to v0.0.44   v0.0.45
=========================  ========  ===================  ======================================
reads (nodes, jobs, ...)   yes       yes                  yes
drain, down, resume        no        POST /node/{name}    POST /node/{name}
mark_job (admin_comment)   no        POST /job/{id}       POST /job/{id}
signal_job (steps only)    no        DELETE /job/{id}     DELETE /job/{id}
                                     ?flags=FULL_STEPS_ONLY
requeue                    no        no                   POST /jobs/requeue
add/remove_from_partition  no        no                   POST /partitions/ (nodes.configured)
=========================  ========  ===================  ======================================

- **v0.0.38** (Slurm 22.05, 23.02) reads nodes, partitions and jobs, and nothing else that
  gpufleet needs: it has no node update; its job update does not take ``admin_comment`` ("Unknown
  key"); and its ``DELETE /job/{id}?signal=`` signals the whole job, batch shell included, a
  SIGTERM cancelling it outright, so the tasks never get the time to save a checkpoint that
  ``signal_job`` promises.
- **v0.0.40 to v0.0.44** (Slurm 23.11 to 25.11) also update nodes (``state`` and ``reason``), job
  marks, and signal a job's steps and not its batch shell (what ``scancel --signal`` does). They
  have no requeue and no partition update: no such path in 24.11's document (v0.0.40-v0.0.42) nor
  in 26.05's (v0.0.42-v0.0.44).
- **v0.0.45** (Slurm 26.05) adds ``POST /jobs/requeue`` (and ``GET /job/{id}/requeue``, a write
  behind a GET, which gpufleet does not use) and ``POST /partitions/``, which creates or updates
  partitions: gpufleet checks that the partition exists first (an unknown name would be created)
  and sends only its name and node list (the rest of the partition is left as it is).

What the real servers answer, beyond the documents: one node read alone names the first
partition for a node in none (22.05 and 24.11, every version they serve; the partitions' node
lists are read instead); an unknown node read is ``200`` with the
error "Failure to query node" (error number 0); an unknown partition is a warning and no
partition (v0.0.45) or an error (before); a signal to an unknown or finished job is ``200``, with
the error in ``status`` (v0.0.42+) or nowhere (v0.0.40, v0.0.41): the job is read first.

What setting a node DOWN does to its jobs instead, measured on real Slurm 26.05 daemons and
slurmrestd (``tests/clients/test_slurmrest_requeue_by_down.py``; ``POST /node/{name}`` with
``state: [DOWN]`` on a node gpufleet drained first): a running batch job that may be requeued
(``--requeue``, or ``JobRequeue=1``, the default) is requeued at once (PENDING, restart count +1)
and runs again on another node; a ``--no-requeue`` one ends NODE_FAIL; a ``--no-kill`` job
spanning several nodes loses that node and keeps running on the others; ended and pending jobs
are not touched; the DRAIN flag and the reason stay (a slurmd that answers brings the node back
as IDLE+DRAIN, still out of service), and RESUME clears both. ``requeue_by_down`` does that for
the jobs of a node gpufleet drained. A job that has already ended cannot be requeued over
v0.0.42 to v0.0.44: every job update of an ended job (``requeue``, ``hold``, ``priority``,
``begin_time``) is refused ("Job update requested failed"), and the API has no requeue call;
``scontrol requeue`` (the CLI, e.g. through ``pods/exec`` in a Slinky controller pod) or v0.0.45's
``GET /job/{id}/requeue`` (Slurm 26.05) requeues one that allows it.

A method a version cannot serve raises ``Unsupported`` before anything is sent;
``unsupported_methods`` lists them, so that a worker refuses to start on a backend that lacks
what it needs (``require_methods``).

Node, partition and job names are validated before they reach a URL, as the CLI client
validates them before they reach a command line.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from clients.dryrun import refuse_writes
from clients.errors import (
    ClientError,
    Forbidden,
    InvalidInput,
    LastNodeOfPartition,
    NotFound,
    NotOwned,
    Unavailable,
    checked_node_name,
    redact,
)
from clients.slurm import (
    _ACTIVE_STATES,
    _MARK,
    _MARK_SAFE,
    _NOT_WAITING_FOR_NODES,
    ENDED_STATES,
    Pending,
    SlurmCli,
    SlurmClient,
    SlurmTopology,
    checked_job_id,
    completing_on,
    gpus_in,
    job_from_json,
    primary_state,
)
from clients.slurmrest import VERSIONS, jwt_token
from models.constants import owned_reason, takes_over
from models.incident import JobInfo, NodeInfo, with_checkpoint

# Every method of the Protocol, in its order.
PROTOCOL_METHODS = (
    "node",
    "nodes",
    "drain",
    "down",
    "resume",
    "jobs_on_node",
    "recent_jobs_on_node",
    "accounted_jobs",
    "pending",
    "partition_jobs",
    "hostnames",
    "jobs_by_id",
    "job",
    "signal_job",
    "requeue",
    "job_marks",
    "mark_job",
    "partition_nodes",
    "add_to_partition",
    "remove_from_partition",
    "topology",
)

# What the worker's activities and its spare pool and pool mover call (a test checks this
# against activities/ and clients/): ``down`` is in the Protocol but nothing calls it.
WORKER_METHODS = frozenset(PROTOCOL_METHODS) - {"down"}

_CLI = "the CLI backend (GPUFLEET_SLURM_BACKEND=cli)"
_NEWER = f"slurmrestd of Slurm 23.11 or later (API v0.0.40+), or {_CLI}"
# Method -> (what the API lacks, what would serve it), per API version.
_LACKING_IN_38 = {
    "drain": ("v0.0.38 has no node update (POST /node/{name} came with v0.0.40)", _NEWER),
    "down": ("v0.0.38 has no node update (POST /node/{name} came with v0.0.40)", _NEWER),
    "resume": ("v0.0.38 has no node update (POST /node/{name} came with v0.0.40)", _NEWER),
    "signal_job": (
        "v0.0.38 signals the whole job, batch shell included (a SIGTERM cancels it), "
        "not its steps alone (flags=FULL_STEPS_ONLY came with v0.0.40)",
        _NEWER,
    ),
    "mark_job": ("v0.0.38's job update does not take admin_comment", _NEWER),
}
_V45 = f"slurmrestd of Slurm 26.05 or later (API v0.0.45), or {_CLI}"
# Checked against the OpenAPI documents of the real 24.11 and 26.05 servers: v0.0.38 to v0.0.44
# have no path that requeues a job or changes a partition; v0.0.45 has both.
_LACKING_BEFORE_45 = {
    "requeue": ("slurmrestd has no requeue before API v0.0.45 (POST /jobs/requeue)", _V45),
    "add_to_partition": ("slurmrestd cannot change a partition before API v0.0.45 (POST /partitions/)", _V45),
    "remove_from_partition": ("slurmrestd cannot change a partition before API v0.0.45 (POST /partitions/)", _V45),
}

_SIGNALS = {"TERM", "INT", "USR1", "USR2", "HUP"}
_NODE_BASE_STATES = ("UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "ERROR", "MIXED", "FUTURE", "EXTERNAL")
_UNREACHABLE = ("unable to contact slurm controller", "connection refused", "socket timed out", "zero bytes")
_NOT_FOUND_NUMBERS = {2017, 2018}  # Slurm's "Invalid job id specified", "Invalid node name specified"
_NOT_FOUND_TEXT = ("invalid job id", "invalid node name", "invalid partition name", "unable to find")
_PENDING_ALREADY = ("pending execution",)  # requeue of a job that is pending again
_REFUSED = ("presently disabled", "not requeueable", "only batch jobs")  # requeue of a --no-requeue job
_FINISHED = ("already completing or completed", "already finished", "job has already completed")
_MAX_HOSTS = 65536

# What ``SlurmRest.requeue_by_down`` reports for each job.
REQUEUED = "requeued"  # back to PENDING (restart count +1), or already running again elsewhere
KILLED = "killed"  # ended NODE_FAIL: it did not allow requeue (--no-requeue), or was not a batch job
KEPT_RUNNING = "kept running"  # --no-kill: lost the node, runs on its other nodes
ENDED = "ended"  # had ended before: left alone (over REST it cannot be requeued before v0.0.45)
PENDING = "pending"  # had not started: left alone
_WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}


class Unsupported(ClientError):
    """The Protocol method cannot be served by this backend and API version (nothing was sent)."""

    retryable = False

    def __init__(self, method: str, version: str, why: str, served_by: str) -> None:
        super().__init__(f"{method} is not available through slurmrestd {version}: {why}; use {served_by}")
        self.method = method
        self.version = version
        self.why = why
        self.served_by = served_by


class MissingSlurmMethods(ClientError):
    """A worker needs Protocol methods its configured Slurm backend cannot serve."""

    retryable = False


# -- hostlists ------------------------------------------------------------------------------------


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise InvalidInput(f"invalid hostlist {text!r}: nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise InvalidInput(f"invalid hostlist {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise InvalidInput(f"invalid hostlist {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_ranges(body: str, whole: str) -> list[str]:
    """``1-3,05`` as ``["1", "2", "3", "05"]``; a range keeps the width of its zero-padded low end."""
    out: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise InvalidInput(f"invalid hostlist {whole!r}: bad range {item!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            out.append(low)
            continue
        if int(high) < int(low):
            raise InvalidInput(f"invalid hostlist {whole!r}: range {item!r} runs backwards")
        if int(high) - int(low) >= _MAX_HOSTS:
            raise InvalidInput(f"invalid hostlist {whole!r}: range {item!r} is too large")
        width = len(low) if low.startswith("0") else 0
        out.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """A Slurm hostlist as its names, in Slurm's order: ``gpu[1-3,5],cpu[01-02]`` is
    ``gpu1 gpu2 gpu3 gpu5 cpu01 cpu02``, ``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``.

    What ``scontrol show hostnames`` prints, without a controller: repeats kept, a range as wide
    as its zero-padded low end (``n[01-3]``: n01 n02 n03; ``n[9-010]``: n9 n10). InvalidInput for
    what is not a hostlist (unbalanced or nested brackets, backwards or huge ranges). Text after
    the last bracket (``node[1-2]-ib``), which 22.05's scontrol refuses, is kept as a suffix."""
    hostlist = hostlist.strip()
    if not hostlist:
        return []
    hosts: list[str] = []
    for part in _split_top(hostlist):
        part = part.strip()
        if not part:
            continue
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            if piece.startswith("["):
                ranges = _expand_ranges(piece[1:-1], hostlist)
                names = [name + number for name in names for number in ranges]
            else:
                names = [name + piece for name in names]
            if len(names) > _MAX_HOSTS:
                raise InvalidInput(f"invalid hostlist {hostlist!r}: more than {_MAX_HOSTS} names")
        hosts.extend(names)
        if len(hosts) > _MAX_HOSTS:
            raise InvalidInput(f"invalid hostlist {hostlist!r}: more than {_MAX_HOSTS} names")
    return hosts


# -- shapes ---------------------------------------------------------------------------------------


def node_from_rest(raw: dict[str, Any]) -> NodeInfo:
    """One node of ``GET /nodes``: v0.0.38's ``"state": "idle", "state_flags": ["DRAIN"]`` or
    v0.0.40+'s ``"state": ["IDLE", "DRAIN"]``, as the CLI client reads ``State=IDLE+DRAIN``."""
    state = raw.get("state")
    if isinstance(state, list):
        words = [str(word).upper() for word in state]
        base = next((word for word in words if word in _NODE_BASE_STATES), words[0] if words else "UNKNOWN")
        flags = [word for word in words if word != base]
    else:
        base = str(state or "UNKNOWN").upper()
        flags = [str(flag).upper() for flag in raw.get("state_flags") or []]
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ClientError(f"slurmrestd returned a node without a name: {raw!r:.200}")
    return NodeInfo(
        name=name,
        state=base.lower(),
        flags=flags,
        reason=str(raw.get("reason") or ""),
        partitions=[str(p) for p in raw.get("partitions") or [] if p],
    )


def _partitions_of(raw: dict[str, Any]) -> list[str]:
    return [p for p in str(raw.get("partition") or "").split(",") if p]


# -- the client -----------------------------------------------------------------------------------


class SlurmRest:
    """SlurmClient over slurmrestd: each request signed with a short-lived HS256 token for
    ``user`` (the cluster's ``jwt_key`` from ``key_file``), or carrying a token read from
    ``token_file`` at each request (so that it can be rotated). Neither is ever logged."""

    def __init__(
        self,
        base_url: str,
        *,
        version: str = "v0.0.38",
        user: str = "root",
        key_file: Path | None = None,
        token_file: Path | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        if version not in VERSIONS:
            raise ValueError(f"unknown slurmrestd API version {version!r}; gpufleet speaks {', '.join(VERSIONS)}")
        if (key_file is None) == (token_file is None):
            raise ValueError("give the slurmrestd client exactly one of a JWT key file or a token file")
        self.base_url = base_url.rstrip("/")
        self.version = version
        self.user = user
        self._key = key_file.read_bytes() if key_file is not None else None
        self._token_file = token_file
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_seconds)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _lacking_here(self) -> dict[str, tuple[str, str]]:
        lacking = {} if self.version == "v0.0.45" else dict(_LACKING_BEFORE_45)
        if self.version == "v0.0.38":
            lacking.update(_LACKING_IN_38)
        return lacking

    def unsupported(self) -> dict[str, str]:
        """Method name -> why this API version cannot serve it, and what would."""
        return {method: f"{why}; use {by}" for method, (why, by) in self._lacking_here().items()}

    def _lacking(self, method: str) -> Unsupported | None:
        lacking = self._lacking_here()
        if method not in lacking:
            return None
        why, served_by = lacking[method]
        return Unsupported(method, self.version, why, served_by)

    def _refuse_unsupported(self, method: str) -> None:
        """Unsupported, before anything is sent, when this API version cannot serve ``method``."""
        refused = self._lacking(method)
        if refused is not None:
            raise refused

    def _token(self) -> str:
        if self._key is not None:
            return jwt_token(self._key, self.user)
        assert self._token_file is not None
        try:
            token = self._token_file.read_text().strip()
        except OSError as exc:
            raise Unavailable(f"the slurmrestd token file {self._token_file} is unreadable: {exc.strerror}") from None
        if not token:
            raise Unavailable(f"the slurmrestd token file {self._token_file} is empty (is it being rotated?)")
        return token

    def _call(
        self, method: str, path: str, *, body: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> dict[str, Any]:
        what = f"{method} {path}"
        if method != "GET":
            refuse_writes(f"slurmrestd {what}")
        token = self._token()
        headers = {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": token}
        try:
            reply = self._http.request(method, path, headers=headers, json=body, params=params)
        except httpx.HTTPError as exc:
            raise Unavailable(f"slurmrestd at {self.base_url} did not answer {what}: {type(exc).__name__}") from None
        if reply.status_code in (401, 403):
            raise Forbidden(
                f"slurmrestd refused the token for {self.user!r} on {what} ({reply.status_code}): the key must be "
                "the cluster's jwt_key (or the token current), and the user must exist on the controller"
            )
        try:
            data = reply.json()
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        errors = [e for e in data.get("errors") or [] if e]
        if reply.status_code == 404 and not errors:
            raise ClientError(f"slurmrestd at {self.base_url} does not serve {what}: is its API {self.version}?")
        if reply.status_code < 400 and not errors:
            return data
        # What the server said, never the token (a proxy or a server may echo the request's headers).
        said = redact("; ".join(_said(e) for e in errors) or reply.text.strip(), token)
        message = f"slurmrestd refused {what} ({reply.status_code}): {said}"
        lowered = said.lower()
        numbers = {e.get("error_number", e.get("errno")) for e in errors if isinstance(e, dict)}
        if any(text in lowered for text in _UNREACHABLE) or reply.status_code in (502, 503, 504):
            raise Unavailable(message)
        if numbers & _NOT_FOUND_NUMBERS or any(text in lowered for text in _NOT_FOUND_TEXT):
            raise NotFound(message)
        # An unknown node, read alone: "Failure to query node" with error number 0 (24.11, 26.05).
        if "failure to query node" in lowered and numbers <= {0, None}:
            raise NotFound(message)
        raise ClientError(message)

    def _path(self, *parts: str) -> str:
        return "/".join(("", "slurm", self.version, *parts))

    # -- nodes ------------------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        data = self._call("GET", self._path("nodes"))
        return [node_from_rest(raw) for raw in data.get("nodes") or []]

    def node(self, name: str) -> NodeInfo:
        name = checked_node_name(name)
        try:
            data = self._call("GET", self._path("node", name))
        except NotFound:
            raise NotFound(f"Slurm has no node named {name!r}") from None
        found = [node_from_rest(raw) for raw in data.get("nodes") or []]
        if not found or found[0].name != name:
            raise NotFound(f"Slurm has no node named {name!r}")
        # 22.05 and 24.11 (every API version they serve) name the wrong partitions for one node
        # read alone: a node in no partition comes back in the first one (26.05 does not). The
        # partitions' own node lists are right, on every release.
        return found[0].model_copy(update={"partitions": self._partitions_holding(name)})

    def _partitions_holding(self, name: str) -> list[str]:
        partitions = self._call("GET", self._path("partitions")).get("partitions") or []
        return [str(p["name"]) for p in partitions if p.get("name") and name in expand_hostlist(_partition_nodes(p))]

    def _update_node(self, name: str, state: str, reason: str | None) -> None:
        body: dict[str, Any] = {"state": [state]}
        if reason is not None:
            body["reason"] = reason
        self._call("POST", self._path("node", checked_node_name(name)), body=body)

    def drain(self, name: str, *, reason: str) -> NodeInfo:
        """Drain with our reason; a node someone else drained keeps theirs. The node as it is after."""
        self._refuse_unsupported("drain")
        current = self.node(name)
        theirs = not owned_reason(current.reason) and not takes_over(current.reason, reason)
        if current.drained and (theirs or current.reason == reason):
            return current
        self._update_node(name, "DRAIN", reason)
        return self.node(name)

    def down(self, name: str, *, reason: str) -> None:
        self._refuse_unsupported("down")
        current = self.node(name)
        if current.reason and not owned_reason(current.reason):
            raise NotOwned(f"{name} is held by someone else ({current.reason!r}); leaving it as it is")
        if current.state == "down" and current.reason == reason:
            return
        self._update_node(name, "DOWN", reason)

    def resume(self, name: str) -> None:
        """Return a node to service, only when gpufleet took it out (or nobody did)."""
        self._refuse_unsupported("resume")
        current = self.node(name)
        if not current.drained and current.state not in {"down", "fail"}:
            return
        if current.reason and not owned_reason(current.reason):
            raise NotOwned(f"{name} was taken out by someone else ({current.reason!r}); not resuming it")
        self._update_node(name, "RESUME", None)

    # -- jobs -------------------------------------------------------------------------------------

    def _raw_jobs(self) -> list[dict[str, Any]]:
        """Every job slurmctld still holds (finished ones within MinJobAge): the API filters by nothing else."""
        jobs: list[dict[str, Any]] = self._call("GET", self._path("jobs")).get("jobs") or []
        return jobs

    def _on_node(self, name: str, *, completing_elsewhere: bool = False) -> list[JobInfo]:
        """The jobs whose nodes hold ``name``; with ``completing_elsewhere``, also the COMPLETING
        ones the node has finished its part of (clients/slurm.py ``completing_on``)."""
        name = checked_node_name(name)
        self.node(name)  # NotFound for a node Slurm does not know, as squeue -w says
        raw_jobs = self._raw_jobs()
        found = [job for job in map(job_from_json, raw_jobs) if job.nodes and name in expand_hostlist(job.nodes)]
        if completing_elsewhere:
            found += completing_on(name, raw_jobs, {job.job_id for job in found})
        return found

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        """The jobs running (or completing, suspended, ...) on the node."""
        return [job for job in self._on_node(name) if job.state in _ACTIVE_STATES]

    def recent_jobs_on_node(self, name: str) -> list[JobInfo]:
        """The jobs on the node, finished ones too (those slurmctld still keeps: MinJobAge), and
        those still completing on other nodes after this one finished its part."""
        return self._on_node(name, completing_elsewhere=True)

    def accounted_jobs(self, name: str, since: datetime) -> list[JobInfo] | None:
        """Not read over slurmrestd yet (its slurmdb endpoints): None, as without accounting."""
        checked_node_name(name)
        return None

    def pending(self, partition: str) -> Pending:
        """What the partition's pending jobs ask for; held or dependent jobs ask for nothing yet."""
        partition = checked_node_name(partition)
        demand = Pending()
        for raw in self._raw_jobs():
            if partition not in _partitions_of(raw) or primary_state(raw.get("job_state")) != "PENDING":
                continue
            if str(raw.get("state_reason") or "").startswith(_NOT_WAITING_FOR_NODES):
                continue
            nodes = _count(raw.get("node_count"))
            demand.jobs += 1
            demand.nodes += nodes
            demand.gpus += nodes * gpus_in(str(raw.get("tres_per_node") or ""))
        return demand

    def partition_jobs(self, partition: str) -> list[JobInfo]:
        """The partition's jobs that hold nodes now (running, completing, suspended...)."""
        partition = checked_node_name(partition)
        return [
            job
            for raw in self._raw_jobs()
            if partition in _partitions_of(raw) and (job := job_from_json(raw)).state in _ACTIVE_STATES
        ]

    def hostnames(self, hostlist: str) -> list[str]:
        """``gpu[1-2],spare1`` as ``["gpu1", "gpu2", "spare1"]``, expanded here."""
        return expand_hostlist(hostlist)

    def _one_job(self, job_id: int) -> dict[str, Any] | None:
        try:
            data = self._call("GET", self._path("job", str(checked_job_id(job_id))))
        except NotFound:
            return None
        # An array's base ID also returns its tasks: only the one asked for.
        return next((raw for raw in data.get("jobs") or [] if _count(raw.get("job_id")) == job_id), None)

    def jobs_by_id(self, job_ids: list[int]) -> dict[int, JobInfo]:
        """The given jobs, finished ones included (within MinJobAge); one request either way.
        A job Slurm no longer knows is absent from the result."""
        wanted = sorted({checked_job_id(job_id) for job_id in job_ids})
        if not wanted:
            return {}
        if len(wanted) == 1:
            raw = self._one_job(wanted[0])
            return {} if raw is None else {wanted[0]: job_from_json(raw)}
        jobs = (job_from_json(raw) for raw in self._raw_jobs())
        return {job.job_id: job for job in jobs if job.job_id in wanted}

    def job(self, job_id: int) -> JobInfo:
        found = self.jobs_by_id([job_id]).get(job_id)
        if found is None:
            raise NotFound(f"Slurm has no job {job_id}")
        return found

    def signal_job(self, job_id: int, *, signal: str = "TERM") -> None:
        """Signal every step of the job and not its batch shell (``flags=FULL_STEPS_ONLY``, what
        ``scancel --signal`` does), so that the tasks may save a checkpoint.

        The API lists no steps: a job whose program runs in the batch shell itself, with no
        ``srun``, gets no signal here (the CLI backend signals its batch shell)."""
        self._refuse_unsupported("signal_job")
        if signal not in _SIGNALS:
            raise InvalidInput(f"refusing to send signal {signal!r}")
        job_id = checked_job_id(job_id)
        refuse_writes(f"slurmrestd signal {signal} to job {job_id}")
        # v0.0.40 and v0.0.41 answer a signal to a job they do not know with no error at all.
        if self._one_job(job_id) is None:
            raise NotFound(f"Slurm has no job {job_id}")
        path = self._path("job", str(job_id))
        data = self._call("DELETE", path, params={"signal": signal, "flags": "FULL_STEPS_ONLY"})
        # v0.0.42+ answer 200 and say in ``status`` what each job made of it.
        for entry in data.get("status") or []:
            error = entry.get("error") if isinstance(entry, dict) else None
            if isinstance(error, dict) and error.get("code"):
                said = str(error.get("string") or error.get("message") or error)
                message = f"slurmrestd could not signal job {job_id}: {said}"
                if error.get("code") in _NOT_FOUND_NUMBERS:
                    raise NotFound(message)
                raise ClientError(message)

    def requeue(self, job_id: int) -> None:
        """Requeue a running (or finished) job, as ``scontrol requeue`` does (v0.0.45); a job
        already pending again is left as it is; one submitted with ``--no-requeue`` is refused."""
        job_id = checked_job_id(job_id)
        self._refuse_unsupported("requeue")
        job = self.job(job_id)
        if job.state in {"PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING"}:
            return
        if not job.requeue:
            raise InvalidInput(f"job {job_id} was submitted with --no-requeue")
        try:
            self._call("POST", self._path("jobs", "requeue"), body={"jobs": [str(job_id)]})
        except ClientError as exc:
            lowered = str(exc).lower()
            if any(text in lowered for text in _PENDING_ALREADY):
                return  # back to pending between the read and the requeue
            if any(text in lowered for text in _REFUSED):
                raise InvalidInput(str(exc)) from None
            raise

    def requeue_by_down(self, name: str, *, reason: str, job_ids: Iterable[int] = ()) -> dict[int, str]:
        """Requeue the running jobs of a node that gpufleet drained, by setting it DOWN with
        ``reason`` (slurmrestd has no requeue before v0.0.45): job ID -> what happened to it
        (REQUEUED, KILLED, KEPT_RUNNING, ENDED, PENDING), read from the jobs before and after.

        What Slurm does, and so what this reports: a running batch job that allows requeue is
        requeued; one that does not (``--no-requeue``) is killed, its owner to be told; a
        ``--no-kill`` job spanning other nodes keeps running on them; a job that had ended or
        not started is left alone. The node keeps its DRAIN flag and gpufleet's reason.

        The node must be drained (or down) with gpufleet's own reason: NotOwned when someone
        else's reason holds it, InvalidInput when it is not drained (a slurmd that answers
        would bring a node that is only DOWN back into service). The jobs reported are those
        Slurm lists on the node and ``job_ids`` (the jobs gpufleet saw there, so that a later
        call reports them after they left it); the node is set DOWN only while one of them
        still runs on it, so a second call sends nothing and touches no job twice."""
        self._refuse_unsupported("down")
        name = checked_node_name(name)
        if not owned_reason(reason):
            raise InvalidInput(f"refusing to set {name} DOWN with a reason that is not gpufleet's: {reason!r}")
        wanted = {checked_job_id(job_id) for job_id in job_ids}
        current = self.node(name)
        if current.reason and not owned_reason(current.reason):
            raise NotOwned(f"{name} is held by someone else ({current.reason!r}); not setting it DOWN")
        if not current.reason or not (current.drained or current.state == "down"):
            raise InvalidInput(f"{name} is not drained by gpufleet; drain it before requeueing its jobs")
        before = self._jobs_for(name, wanted)
        running = {job.job_id for job in before.values() if job.state in _ACTIVE_STATES and _on(job, name)}
        after = before
        if running:
            self._update_node(name, "DOWN", reason)
            after = self._jobs_for(name, set(before))
        return {job_id: _outcome(job, after.get(job_id), job_id in running) for job_id, job in sorted(before.items())}

    def _jobs_for(self, name: str, wanted: set[int]) -> dict[int, JobInfo]:
        """The jobs Slurm lists on the node, and those of ``wanted`` it still knows."""
        jobs = (job_from_json(raw) for raw in self._raw_jobs())
        return {job.job_id: job for job in jobs if job.job_id in wanted or _on(job, name)}

    # -- marks ------------------------------------------------------------------------------------

    def _admin_comment(self, job_id: int) -> str:
        raw = self._one_job(checked_job_id(job_id))
        if raw is None:
            raise NotFound(f"Slurm has no job {job_id}")
        return str(raw.get("admin_comment") or "")

    def job_marks(self, job_id: int) -> list[str]:
        """gpufleet's marks on the job (``gpufleet:signalled:<incident>``...), from its AdminComment."""
        return _MARK.findall(self._admin_comment(job_id))

    def mark_job(self, job_id: int, mark: str) -> bool:
        """Record ``mark`` in the job's AdminComment, keeping what else it holds; False when
        Slurm refuses because the job has finished."""
        self._refuse_unsupported("mark_job")
        if not _MARK_SAFE.match(mark):
            raise InvalidInput(f"refusing to write job mark {mark!r}")
        with self._lock:
            comment = self._admin_comment(job_id)
            if mark in _MARK.findall(comment):
                return True
            updated = f"{comment}; {mark}" if comment else mark
            try:
                self._call("POST", self._path("job", str(checked_job_id(job_id))), body={"admin_comment": updated})
            except ClientError as exc:
                if any(text in str(exc).lower() for text in _FINISHED):
                    return False
                raise
        return True

    def record_checkpoint(self, job_id: int, at: int, step: int | None = None) -> str:
        """Set the job's checkpoint mark in its Comment, replacing an earlier one and keeping the
        rest (docs/goodput.md). Returns the Comment as written."""
        job_id = checked_job_id(job_id)
        with self._lock:
            comment = self.job(job_id).comment
            updated = with_checkpoint(comment, at, step)
            if updated != comment:
                refuse_writes(f"slurmrestd comment on job {job_id}")
                self._call("POST", self._path("job", str(job_id)), body={"comment": updated})
        return updated

    # -- topology ---------------------------------------------------------------------------------

    def topology(self) -> SlurmTopology:
        """No switches: slurmrestd serves no topology in any version gpufleet speaks (v0.0.38 to
        v0.0.45 have no topology path), so Slurm's leaf switches are not read here, and said so."""
        return SlurmTopology(
            note=f"slurmrestd {self.version} serves no switch topology: Slurm switches are read only through "
            "the CLI backend (GPUFLEET_SLURM_BACKEND=cli); node labels still give racks, zones and NVLink domains"
        )

    # -- partitions -------------------------------------------------------------------------------

    def partition_nodes(self, partition: str) -> list[str]:
        partition = checked_node_name(partition)
        return [node.name for node in self.nodes() if partition in node.partitions]

    def _require_partition(self, partition: str) -> None:
        """NotFound unless the partition exists: ``POST /partitions/`` would create it."""
        try:
            data = self._call("GET", self._path("partition", partition))
        except NotFound:
            raise NotFound(f"Slurm has no partition named {partition!r}") from None
        if not any(p.get("name") == partition for p in data.get("partitions") or [] if isinstance(p, dict)):
            raise NotFound(f"Slurm has no partition named {partition!r}")

    def _set_partition(self, partition: str, nodes: list[str]) -> None:
        body = {"partitions": [{"name": partition, "nodes": {"configured": ",".join(nodes)}}]}
        self._call("POST", self._path("partitions", ""), body=body)

    def add_to_partition(self, partition: str, node: str) -> None:
        partition = checked_node_name(partition)
        node = checked_node_name(node)
        self._refuse_unsupported("add_to_partition")
        with self._lock:
            self._require_partition(partition)
            members = self.partition_nodes(partition)
            if node not in members:
                self._set_partition(partition, [*members, node])

    def remove_from_partition(self, partition: str, node: str) -> None:
        partition = checked_node_name(partition)
        node = checked_node_name(node)
        self._refuse_unsupported("remove_from_partition")
        with self._lock:
            self._require_partition(partition)
            members = self.partition_nodes(partition)
            if node in members:
                # slurmrestd would take an empty list (scontrol refuses one): the last node stays.
                remaining = [member for member in members if member != node]
                if not remaining:
                    raise LastNodeOfPartition(f"{node} is the last node of partition {partition}")
                self._set_partition(partition, remaining)


def _on(job: JobInfo, name: str) -> bool:
    return bool(job.nodes) and name in expand_hostlist(job.nodes)


def _outcome(before: JobInfo, after: JobInfo | None, was_running: bool) -> str:
    """What happened to a job of the node that was set DOWN (or, ``was_running`` False, what
    had happened to it before this call)."""
    if after is None:  # slurmctld forgot it (MinJobAge): it had ended
        return ENDED
    if was_running and after.restarts > before.restarts:
        return REQUEUED
    if after.state in ENDED_STATES:
        return KILLED if after.state == "NODE_FAIL" else ENDED
    if after.state in _WAITING:
        return REQUEUED if was_running or after.restarts > 0 else PENDING
    if was_running:
        return KEPT_RUNNING
    return REQUEUED if after.restarts > 0 else KEPT_RUNNING


def _said(entry: Any) -> str:
    """One entry of a reply's ``errors``: what failed and why (v0.0.40+ put the why in ``error``:
    "Job update requested failed: Job has already finished"), then where."""
    if not isinstance(entry, dict):
        return str(entry)
    description, error = str(entry.get("description") or ""), str(entry.get("error") or "")
    said = f"{description}: {error}" if description and error and error != "No error" else description or error
    said = said or str(entry)
    return f"{said} ({entry['source']})" if entry.get("source") else said


def _partition_nodes(raw: dict[str, Any]) -> str:
    """A partition's hostlist: v0.0.38's ``"nodes": "gpu[1-3]"``, v0.0.40+'s
    ``"nodes": {"configured": "gpu[1-3]", ...}``."""
    nodes = raw.get("nodes")
    if isinstance(nodes, dict):
        nodes = nodes.get("configured")
    return str(nodes or "")


def _count(value: object) -> int:
    """A count as v0.0.38 gives it (``3``) or v0.0.40+ may (``{"set": true, "number": 3}``)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite", False):
            return 0
        value = value.get("number")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- choosing a backend, and what it lacks --------------------------------------------------------


BACKENDS = ("cli", "rest")


def slurm_client(
    backend: str,
    *,
    slurm_conf: Path | None = None,
    bin_dir: Path | None = None,
    timeout_seconds: float = 30.0,
    restd_url: str = "",
    restd_version: str = "",
    restd_user: str = "root",
    restd_key_file: Path | None = None,
    restd_token_file: Path | None = None,
) -> SlurmClient:
    """The Slurm client a setting names: ``cli`` (the Slurm commands) or ``rest`` (slurmrestd).

    For ``rest`` without ``restd_version``, the server is asked which version it serves, newest
    first."""
    if backend == "cli":
        return SlurmCli(slurm_conf=slurm_conf, bin_dir=bin_dir, timeout_seconds=timeout_seconds)
    if backend != "rest":
        raise ValueError(f"unknown Slurm backend {backend!r}: use {' or '.join(BACKENDS)}")
    if not restd_url.startswith(("http://", "https://")):
        raise ValueError("the rest Slurm backend needs slurmrestd's http:// or https:// URL")
    client = SlurmRest(
        restd_url,
        version=restd_version or "v0.0.38",
        user=restd_user,
        key_file=restd_key_file,
        token_file=restd_token_file,
        timeout_seconds=timeout_seconds,
    )
    if not restd_version:
        client.version = detect_version(client)
    return client


def detect_version(client: SlurmRest) -> str:
    """The newest API version ``client``'s server serves (the paths of the others are 404)."""
    for version in VERSIONS:
        client.version = version
        try:
            client._call("GET", client._path("ping"))
        except (Forbidden, Unavailable):
            raise
        except ClientError as exc:
            if "does not serve" in str(exc):
                continue
            raise
        return version
    raise Unavailable(f"slurmrestd at {client.base_url} serves none of {', '.join(VERSIONS)}")


def unsupported_methods(client: object) -> dict[str, str]:
    """Protocol method -> why ``client`` cannot serve it (nothing for the CLI client)."""
    lacking = getattr(client, "unsupported", None)
    return dict(lacking()) if callable(lacking) else {}


def require_methods(client: object, needed: Iterable[str] = WORKER_METHODS) -> None:
    """MissingSlurmMethods naming each of ``needed`` that ``client`` cannot serve, and why."""
    lacking = unsupported_methods(client)
    missing = sorted(set(needed) & set(lacking))
    if missing:
        details = "; ".join(f"{method}: {lacking[method]}" for method in missing)
        raise MissingSlurmMethods(f"the Slurm backend lacks {len(missing)} method(s) this worker needs: {details}")
