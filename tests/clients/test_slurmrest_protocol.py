"""The Slurm Protocol over slurmrestd (clients/slurmrest_protocol.py).

Against a real slurmrestd (Debian's 22.05, API v0.0.38) in front of a real slurmctld: every
read gives what the CLI client gives on the same cluster, and every method v0.0.38 cannot serve
raises Unsupported before anything is sent. The shapes of v0.0.40 to v0.0.44, where no server
of those versions can run, against a stand-in server over real HTTP, answering in the shapes of
SchedMD's OpenAPI documents. Hostlists are expanded as ``scontrol show hostnames`` expands them.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

from clients.dryrun import DryRunViolation, dry_run
from clients.errors import ClientError, InvalidInput, NotFound, Unavailable
from clients.slurm import SlurmCli
from clients.slurmrest import VERSIONS, jwt_token
from clients.slurmrest_protocol import (
    PROTOCOL_METHODS,
    WORKER_METHODS,
    MissingSlurmMethods,
    SlurmRest,
    Unsupported,
    expand_hostlist,
    require_methods,
    slurm_client,
    unsupported_methods,
)
from lab.procs import free_port, wait_for
from lab.slurm import SlurmLab, slurm_installed
from lab.slurmrest import jwt_lines, slurmrestd_installed, start_slurmrestd
from models.incident import JobInfo, NodeInfo

REPO = Path(__file__).resolve().parents[2]
NEWER = [v for v in VERSIONS if v != "v0.0.38"]
LIVE = pytest.mark.skipif(
    not slurm_installed() or bool(slurmrestd_installed()), reason=slurmrestd_installed() or "Slurm is not installed"
)
DRAIN_REASON = "gpufleet: xid 79 REPLACE_NODE incident lab-gpu1-20261202T000000Z"


# -- what no server is needed for -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("gpu[1-3,5],cpu[01-02]", ["gpu1", "gpu2", "gpu3", "gpu5", "cpu01", "cpu02"]),
        ("gpu1,gpu2", ["gpu1", "gpu2"]),
        ("spare1", ["spare1"]),
        ("", []),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node[001-002]-ib,login", ["node001-ib", "node002-ib", "login"]),
        ("a[3],b", ["a3", "b"]),
        ("n[9-010]", ["n9", "n10"]),  # the low end's width: none
        ("n[01-3]", ["n01", "n02", "n03"]),
        ("n[1-2],n[2-3]", ["n1", "n2", "n2", "n3"]),  # repeats kept, as scontrol keeps them
        ("a[1-2]-b[3]", ["a1-b3", "a2-b3"]),
    ],
)
def test_hostlists_expand_in_slurms_order(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("hostlist", ["gpu[1-3", "gpu1-3]", "gpu[[1-2]]", "gpu[3-1]", "gpu[a-b]", "gpu[1-999999]"])
def test_what_is_not_a_hostlist_is_refused(hostlist: str) -> None:
    with pytest.raises(InvalidInput, match="invalid hostlist"):
        expand_hostlist(hostlist)


def test_the_worker_methods_are_what_the_worker_calls() -> None:
    """WORKER_METHODS (what a worker refuses to start without) against the Protocol methods
    the activities, the spare pool and the pool mover call."""
    called: set[str] = set()
    for folder in ("activities", "clients"):
        for path in (REPO / folder).glob("*.py"):
            if folder == "clients" and path.name.startswith("slurm"):
                continue
            called |= set(re.findall(r"slurm\.(\w+)\(", path.read_text()))
    assert called & set(PROTOCOL_METHODS) == WORKER_METHODS


def test_the_cli_backend_lacks_nothing() -> None:
    cli = slurm_client("cli")
    assert isinstance(cli, SlurmCli) and unsupported_methods(cli) == {}
    require_methods(cli)


def test_a_client_is_given_one_credential_and_a_known_backend(tmp_path: Path) -> None:
    key = tmp_path / "jwt.key"
    key.write_bytes(b"k" * 32)
    with pytest.raises(ValueError, match="exactly one"):
        SlurmRest("http://restapi:6820", key_file=key, token_file=key)
    with pytest.raises(ValueError, match="exactly one"):
        SlurmRest("http://restapi:6820")
    with pytest.raises(ValueError, match="unknown Slurm backend 'grpc'"):
        slurm_client("grpc")
    with pytest.raises(ValueError, match="slurmrestd's http"):
        slurm_client("rest", restd_key_file=key)


# -- against a real slurmrestd 22.05 (v0.0.38) ---------------------------------------------------


@dataclass
class Live:
    slurm: SlurmLab
    url: str
    key_file: Path
    cli: SlurmCli
    jobs: dict[str, int] = field(default_factory=dict)

    def rest(self) -> SlurmRest:
        return SlurmRest(self.url, version="v0.0.38", key_file=self.key_file)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    root = Path(tempfile.mkdtemp(prefix="gpufleet-restproto-"))
    root.chmod(0o755)
    key_file = root / "jwt.key"
    key_file.write_bytes(b"gpufleet-test-key-" + b"0" * 32)
    key_file.chmod(0o600)
    nodes = ["gpu1", "gpu2", "gpu3", "spare1"]
    site = SlurmLab(root)
    conf = [
        "ClusterName=restproto",
        *site.site_lines(),
        *jwt_lines(key_file),
        "AccountingStorageType=accounting_storage/none",
        *(f"NodeName={node} {site.node_options()} State=UNKNOWN" for node in nodes),
        "PartitionName=train Nodes=gpu1,gpu2,gpu3 Default=YES MaxTime=INFINITE State=UP",
    ]
    slurm = SlurmLab(root, conf="\n".join(conf) + "\n", nodes=nodes)
    restd = None
    try:
        slurm.start()
        restd = start_slurmrestd(slurm)
        yield Live(slurm, restd.url, key_file, SlurmCli(slurm_conf=slurm.conf))
    finally:
        if restd is not None:
            restd.stop()
        slurm.stop()
        shutil.rmtree(root, ignore_errors=True)


def _sbatch(live: Live, *args: str) -> int:
    done = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", *args],
        env=live.slurm.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(done.stdout.strip().split(";")[0])


@pytest.fixture(scope="module")
def jobs(live: Live) -> dict[str, int]:
    """A running job on gpu1, a finished one on gpu2, one pending for nodes, one held."""
    made = {
        "running": _sbatch(live, "-w", "gpu1", "--wrap", "sleep 600"),
        "finished": _sbatch(live, "-w", "gpu2", "--wrap", "true"),
    }
    wait_for(lambda: live.cli.job(made["running"]).state == "RUNNING", timeout=60, what="the job to run")
    wait_for(lambda: live.cli.job(made["finished"]).state == "COMPLETED", timeout=60, what="the job to finish")
    made["pending"] = _sbatch(live, "-N", "3", "--wrap", "sleep 600")  # gpu1 is busy: waits for resources
    made["held"] = _sbatch(live, "--hold", "-N", "2", "--wrap", "true")
    wait_for(lambda: live.cli.pending("train").jobs == 1, timeout=30, what="the pending job's reason")
    return made


def _node(node: NodeInfo) -> NodeInfo:
    return node.model_copy(update={"flags": sorted(node.flags)})


def _by_id(found: list[JobInfo]) -> dict[int, JobInfo]:
    return {job.job_id: job for job in found}


@LIVE
def test_nodes_read_as_the_cli_reads_them(live: Live) -> None:
    live.slurm.scontrol("update", "NodeName=gpu3", "State=DRAIN", "Reason=site maintenance")
    try:
        rest = live.rest()
        assert sorted(map(_node, rest.nodes()), key=lambda n: n.name) == sorted(
            map(_node, live.cli.nodes()), key=lambda n: n.name
        )
        drained = rest.node("gpu3")
        assert drained == live.cli.node("gpu3") and drained.drained and drained.reason == "site maintenance"
        assert rest.node("spare1").partitions == []
        assert rest.partition_nodes("train") == live.cli.partition_nodes("train") == ["gpu1", "gpu2", "gpu3"]
    finally:
        live.slurm.scontrol("update", "NodeName=gpu3", "State=RESUME")


@LIVE
def test_an_unknown_node_is_not_found_and_an_unsafe_name_never_reaches_a_url(live: Live) -> None:
    with pytest.raises(NotFound, match="no node named 'gpu9'"):
        live.rest().node("gpu9")
    # A server that is not there: the name is refused before any request would have failed.
    gone = SlurmRest(f"http://127.0.0.1:{free_port()}", key_file=live.key_file)
    for call in (
        lambda: gone.node("../jobs"),
        lambda: gone.jobs_on_node("gpu1/../x"),
        lambda: gone.pending("train?x=1"),
        lambda: gone.job(0),
        lambda: gone.jobs_by_id([2**31]),
        lambda: gone.job_marks(-1),
    ):
        with pytest.raises(InvalidInput):
            call()


@LIVE
def test_jobs_read_as_the_cli_reads_them(live: Live, jobs: dict[str, int]) -> None:
    rest = live.rest()
    assert _by_id(rest.jobs_on_node("gpu1")) == _by_id(live.cli.jobs_on_node("gpu1"))
    assert jobs["running"] in _by_id(rest.jobs_on_node("gpu1"))
    assert rest.jobs_on_node("gpu2") == [] == live.cli.jobs_on_node("gpu2")
    recent = _by_id(rest.recent_jobs_on_node("gpu2"))
    assert recent == _by_id(live.cli.recent_jobs_on_node("gpu2")) and recent[jobs["finished"]].state == "COMPLETED"
    assert _by_id(rest.partition_jobs("train")) == _by_id(live.cli.partition_jobs("train"))
    wanted = [jobs["running"], jobs["finished"], jobs["pending"], 99999]
    assert rest.jobs_by_id(wanted) == live.cli.jobs_by_id(wanted)
    assert set(rest.jobs_by_id(wanted)) == set(wanted) - {99999}
    assert rest.jobs_by_id([99999]) == {} == live.cli.jobs_by_id([99999])
    assert rest.job(jobs["running"]) == live.cli.job(jobs["running"])
    with pytest.raises(NotFound, match="no job 99999"):
        rest.job(99999)
    with pytest.raises(NotFound, match="gpu9"):
        rest.jobs_on_node("gpu9")


@LIVE
def test_pending_demand_reads_as_the_cli_reads_it(live: Live, jobs: dict[str, int]) -> None:
    demand = live.rest().pending("train")
    assert demand == live.cli.pending("train")
    assert (demand.jobs, demand.nodes) == (1, 3)  # the held job asks for nothing yet


@LIVE
def test_marks_written_by_the_cli_are_read_through_slurmrestd(live: Live, jobs: dict[str, int]) -> None:
    mark = "gpufleet:signalled:lab-gpu1-20261202T000000Z"
    assert live.cli.mark_job(jobs["running"], mark)
    assert live.rest().job_marks(jobs["running"]) == live.cli.job_marks(jobs["running"]) == [mark]
    assert live.rest().job_marks(jobs["pending"]) == []


@LIVE
def test_hostnames_expand_as_scontrol_expands_them(live: Live) -> None:
    hostlists = (
        "gpu[1-3,5],cpu[01-02]",
        "n[08-11],x",
        "r[1-2]n[1-2]",
        "a[3],b",
        "n[9-010]",
        "n[1-2],n[2-3]",
        "a[1-2]-b[3]",
    )
    for hostlist in hostlists:
        assert live.rest().hostnames(hostlist) == live.cli.hostnames(hostlist), hostlist


@LIVE
def test_what_v0_0_38_cannot_do_is_refused_before_anything_is_sent(live: Live, jobs: dict[str, int]) -> None:
    rest = live.rest()
    running = jobs["running"]
    before = (live.cli.nodes(), live.cli.job(running), live.cli.job_marks(running))
    calls: dict[str, Callable[[], object]] = {
        "drain": lambda: rest.drain("gpu1", reason=DRAIN_REASON),
        "down": lambda: rest.down("gpu1", reason=DRAIN_REASON),
        "resume": lambda: rest.resume("gpu1"),
        "signal_job": lambda: rest.signal_job(running),
        "requeue": lambda: rest.requeue(running),
        "mark_job": lambda: rest.mark_job(running, "gpufleet:requeued:lab-gpu1-20261202T000000Z:0"),
        "add_to_partition": lambda: rest.add_to_partition("train", "spare1"),
        "remove_from_partition": lambda: rest.remove_from_partition("train", "gpu3"),
    }
    for method, call in calls.items():
        with pytest.raises(Unsupported, match=rf"^{method} is not available through slurmrestd v0\.0\.38: .*use ") as e:
            call()
        assert e.value.method == method and e.value.version == "v0.0.38" and not e.value.retryable
        assert "CLI backend" in e.value.served_by
    assert set(unsupported_methods(rest)) == set(calls)
    # Nothing changed: the nodes, the job (still running, not signalled) and its marks.
    time.sleep(1)
    assert (live.cli.nodes(), live.cli.job(running), live.cli.job_marks(running)) == before
    # And nothing was sent: a client of a server that is not there says the same.
    gone = SlurmRest(f"http://127.0.0.1:{free_port()}", key_file=live.key_file)
    with pytest.raises(Unsupported, match="drain"):
        gone.drain("gpu1", reason=DRAIN_REASON)


@LIVE
def test_a_worker_on_v0_0_38_is_told_everything_it_lacks(live: Live) -> None:
    rest = slurm_client("rest", restd_url=live.url, restd_key_file=live.key_file)
    assert isinstance(rest, SlurmRest) and rest.version == "v0.0.38"  # asked the server
    with pytest.raises(MissingSlurmMethods) as refused:
        require_methods(rest)
    said = str(refused.value)
    for method in ("drain", "resume", "signal_job", "mark_job", "requeue", "add_to_partition"):
        assert f"{method}: " in said
    assert "down: " not in said  # the worker never calls it
    require_methods(rest, ["node", "nodes", "jobs_on_node", "job_marks", "pending"])  # what it can serve


@LIVE
def test_a_token_file_is_read_at_each_request(live: Live, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(jwt_token(live.key_file.read_bytes(), "root") + "\n")
    rest = slurm_client("rest", restd_url=live.url, restd_version="v0.0.38", restd_token_file=token_file)
    assert [n.name for n in rest.nodes()][:1] == ["gpu1"]
    token_file.unlink()
    with pytest.raises(Exception, match=r"token file .* is unreadable"):
        rest.nodes()


# -- v0.0.40 to v0.0.44, against a stand-in server over HTTP -------------------------------------

# From SchedMD's OpenAPI documents of v0.0.40 to v0.0.44: update_node_msg.state items and the
# flags of DELETE /job/{job_id} that gpufleet sends are in every one of them.
NODE_UPDATE_STATES = {"DOWN", "IDLE", "RESUME", "DRAIN", "UNDRAIN", "FAIL"}
DELETE_FLAGS = {"BATCH_JOB", "ARRAY_TASK", "FULL_STEPS_ONLY", "FULL_JOB", "HURRY"}
UPDATE_NODE_FIELDS = {"comment", "extra", "features", "gres", "name", "state", "reason", "reason_uid", "weight"}


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


class StandIn:
    """slurmrestd of one API version, its nodes and jobs in memory, answering in that version's shapes."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.seen: list[Seen] = []
        self.nodes: dict[str, dict[str, Any]] = {
            "gpu1": {"name": "gpu1", "state": ["ALLOCATED"], "reason": "", "partitions": ["train"]},
            "gpu2": {"name": "gpu2", "state": ["IDLE", "DRAIN"], "reason": "site maintenance", "partitions": ["train"]},
            "spare1": {"name": "spare1", "state": ["IDLE"], "reason": "", "partitions": []},
        }
        self.jobs: dict[int, dict[str, Any]] = {
            42: _job(42, ["RUNNING"], "gpu[1-2]", "train"),
            43: _job(43, ["COMPLETED"], "gpu1", "train"),
            44: {**_job(44, ["PENDING"], "", "train,debug"), "tres_per_node": "gres/gpu:4"},
            45: {**_job(45, ["PENDING"], "", "train"), "state_reason": "JobHeldUser"},
        }
        self.jobs[44]["node_count"] = {"set": True, "infinite": False, "number": 2}
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                url = urlsplit(self.path)
                stand_in.seen.append(
                    Seen(
                        self.command,
                        url.path,
                        dict(parse_qsl(url.query)),
                        dict(self.headers),
                        json.loads(raw) if raw else None,
                    )
                )
                status, body = stand_in.answer(self.command, url.path, stand_in.seen[-1])
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def writes(self) -> list[Seen]:
        return [seen for seen in self.seen if seen.method != "GET"]

    def answer(self, method: str, path: str, seen: Seen) -> tuple[int, dict[str, Any]]:
        prefix = f"/slurm/{self.version}/"
        if not path.startswith(prefix):
            return 404, {}
        parts = path.removeprefix(prefix).strip("/").split("/")
        ok: dict[str, Any] = {"errors": [], "warnings": []}
        if parts == ["ping"]:
            return 200, {**ok, "pings": [{"hostname": "ctld", "pinged": "UP"}]}
        if parts == ["nodes"]:
            return 200, {**ok, "nodes": list(self.nodes.values())}
        if parts[0] == "node" and len(parts) == 2:
            node = self.nodes.get(parts[1])
            if node is None:
                return 500, {"errors": [{"error_number": 2018, "description": "Invalid node name specified"}]}
            if method == "POST":
                states = seen.body["state"]
                if "RESUME" in states:
                    node.update(state=[node["state"][0] if node["state"][0] != "DOWN" else "IDLE"], reason="")
                else:
                    base = "DOWN" if "DOWN" in states else node["state"][0]
                    node.update(state=[base, *(s for s in states if s != "DOWN")], reason=seen.body.get("reason", ""))
                return 200, ok
            return 200, {**ok, "nodes": [node]}
        if parts == ["jobs"]:
            return 200, {**ok, "jobs": list(self.jobs.values())}
        if parts[0] == "job" and len(parts) == 2:
            job = self.jobs.get(int(parts[1]))
            if job is None:
                return 500, {"errors": [{"error_number": 2017, "description": "Invalid job id specified"}]}
            if method == "POST":
                if job["job_state"] == ["COMPLETED"]:
                    return 500, {"errors": [{"description": "Job/step already completing or completed"}]}
                job.update(seen.body)
                return 200, {**ok, "results": [{"job_id": job["job_id"]}]}
            if method == "DELETE":
                return 200, {**ok, "status": []}
            return 200, {**ok, "jobs": [job]}
        return 500, {"errors": [{"description": f"stand-in: nothing at {path}"}]}


def _job(job_id: int, state: list[str], nodes: str, partition: str) -> dict[str, Any]:
    """A job in the v0.0.40+ shape: states as lists, numbers as {set, infinite, number}."""
    return {
        "job_id": job_id,
        "name": f"job{job_id}",
        "user_name": "alice",
        "job_state": state,
        "restart_cnt": 0,
        "nodes": nodes,
        "requeue": True,
        "standard_output": "/tmp/out",
        "start_time": {"set": True, "infinite": False, "number": 1_800_000_000 if nodes else 0},
        "comment": "",
        "admin_comment": "",
        "partition": partition,
        "node_count": {"set": True, "infinite": False, "number": 1},
        "tres_per_node": "",
        "state_reason": "Resources" if state == ["PENDING"] else "None",
    }


@pytest.fixture(params=NEWER)
def stand_in(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[StandIn, SlurmRest]]:
    server = StandIn(request.param)
    key = tmp_path / "jwt.key"
    key.write_bytes(b"k" * 32)
    client = slurm_client("rest", restd_url=server.url, restd_key_file=key, restd_user="slurm")
    assert isinstance(client, SlurmRest)
    yield server, client
    client.close()
    server.stop()


def _sun(seen: Seen) -> str:
    part = seen.headers["X-SLURM-USER-TOKEN"].split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))["sun"])


def test_a_newer_server_is_found_and_lacks_only_requeue_and_partition_edits(
    stand_in: tuple[StandIn, SlurmRest],
) -> None:
    server, client = stand_in
    assert client.version == server.version
    assert set(unsupported_methods(client)) == {"requeue", "add_to_partition", "remove_from_partition"}
    with pytest.raises(MissingSlurmMethods, match=r"lacks 3 method\(s\).*add_to_partition: .*requeue: "):
        require_methods(client)


def test_drain_down_and_resume_post_the_node_update(stand_in: tuple[StandIn, SlurmRest]) -> None:
    server, client = stand_in
    drained = client.drain("gpu1", reason=DRAIN_REASON)
    assert drained.drained and drained.reason == DRAIN_REASON and drained.state == "allocated"
    post = server.writes()[-1]
    assert (post.method, post.path) == ("POST", f"/slurm/{server.version}/node/gpu1")
    assert post.body == {"state": ["DRAIN"], "reason": DRAIN_REASON}
    assert set(post.body) <= UPDATE_NODE_FIELDS and set(post.body["state"]) <= NODE_UPDATE_STATES
    assert post.headers["X-SLURM-USER-NAME"] == "slurm" and _sun(post) == "slurm"
    assert client.drain("gpu1", reason=DRAIN_REASON) == drained and len(server.writes()) == 1  # once only
    client.down("gpu1", reason=DRAIN_REASON)
    assert server.writes()[-1].body == {"state": ["DOWN"], "reason": DRAIN_REASON}
    assert client.node("gpu1").state == "down"
    client.resume("gpu1")
    assert server.writes()[-1].body == {"state": ["RESUME"]}
    assert not client.node("gpu1").drained
    client.resume("gpu1")  # in service already: nothing sent
    assert len(server.writes()) == 3


def test_a_node_drained_by_someone_else_is_left_alone(stand_in: tuple[StandIn, SlurmRest]) -> None:
    server, client = stand_in
    assert client.drain("gpu2", reason=DRAIN_REASON).reason == "site maintenance"
    with pytest.raises(Exception, match="taken out by someone else"):
        client.resume("gpu2")
    assert server.writes() == []


def test_jobs_are_read_from_the_newer_shapes(stand_in: tuple[StandIn, SlurmRest]) -> None:
    _, client = stand_in
    assert [job.job_id for job in client.jobs_on_node("gpu2")] == [42]
    assert [job.job_id for job in client.recent_jobs_on_node("gpu1")] == [42, 43]
    assert [job.job_id for job in client.partition_jobs("train")] == [42]
    running = client.job(42)
    assert (running.state, running.nodes, running.user) == ("RUNNING", "gpu[1-2]", "alice")
    assert running.start_time is not None and running.start_time.timestamp() == 1_800_000_000
    assert client.pending("train").model_dump() == {"jobs": 1, "nodes": 2, "gpus": 8}  # 45 is held
    assert client.pending("debug").jobs == 1
    assert set(client.jobs_by_id([42, 43, 7])) == {42, 43}
    assert client.partition_nodes("train") == ["gpu1", "gpu2"]


def test_a_signal_goes_to_the_steps_alone(stand_in: tuple[StandIn, SlurmRest]) -> None:
    server, client = stand_in
    client.signal_job(42, signal="USR1")
    sent = server.writes()[-1]
    assert (sent.method, sent.path, sent.body) == ("DELETE", f"/slurm/{server.version}/job/42", None)
    assert sent.query == {"signal": "USR1", "flags": "FULL_STEPS_ONLY"} and sent.query["flags"] in DELETE_FLAGS
    with pytest.raises(InvalidInput, match="KILL"):
        client.signal_job(42, signal="KILL")
    assert len(server.writes()) == 1


def test_marks_go_into_the_admin_comment_once(stand_in: tuple[StandIn, SlurmRest]) -> None:
    server, client = stand_in
    server.jobs[42]["admin_comment"] = "site note"
    mark = "gpufleet:signalled:lab-gpu1-20261202T000000Z"
    assert client.mark_job(42, mark) and client.mark_job(42, mark)
    assert [(w.method, w.path, w.body) for w in server.writes()] == [
        ("POST", f"/slurm/{server.version}/job/42", {"admin_comment": f"site note; {mark}"})
    ]
    assert client.job_marks(42) == [mark]
    assert client.mark_job(43, mark) is False  # finished: Slurm refuses
    with pytest.raises(InvalidInput):
        client.mark_job(42, "gpufleet:x:y; rm -rf /")


def test_requeue_and_partition_edits_are_refused_without_a_request(stand_in: tuple[StandIn, SlurmRest]) -> None:
    server, client = stand_in
    before = len(server.seen)
    calls: tuple[Callable[[], object], ...] = (
        lambda: client.requeue(42),
        lambda: client.add_to_partition("train", "spare1"),
        lambda: client.remove_from_partition("train", "gpu2"),
    )
    for call in calls:
        with pytest.raises(Unsupported, match=rf"through slurmrestd {server.version}: .*CLI backend"):
            call()
    assert len(server.seen) == before


def test_a_dry_run_sends_no_write(stand_in: tuple[StandIn, SlurmRest]) -> None:
    server, client = stand_in
    with dry_run(True):
        assert client.node("gpu1").state == "allocated"
        with pytest.raises(DryRunViolation):
            client.drain("gpu1", reason=DRAIN_REASON)
        with pytest.raises(DryRunViolation):
            client.signal_job(42)
    assert server.writes() == []


def test_the_token_is_never_in_an_error_or_the_log(
    stand_in: tuple[StandIn, SlurmRest], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server (or a proxy before it) that echoes the request's headers in its refusal: the error
    says what it said, with the token left out; and a refused token is named, not shown."""
    server, client = stand_in
    caplog.set_level(logging.DEBUG)
    tokens: list[str] = []

    def echoing(method: str, path: str, seen: Seen) -> tuple[int, dict[str, Any]]:
        tokens.append(seen.headers["X-SLURM-USER-TOKEN"])
        return 500, {"errors": [{"description": f"bad request, headers {seen.headers}"}]}

    monkeypatch.setattr(server, "answer", echoing)
    with pytest.raises(ClientError) as echoed:
        client.node("gpu1")
    assert "bad request, headers" in str(echoed.value) and "[token]" in str(echoed.value)
    monkeypatch.setattr(server, "answer", lambda *_: (401, {"errors": [{"description": "unauthorized"}]}))
    with pytest.raises(ClientError, match="refused the token") as refused:
        client.node("gpu1")
    assert tokens
    for token in tokens:
        assert token not in str(echoed.value) and token not in str(refused.value) and token not in caplog.text


def test_an_empty_token_file_is_said_to_be_empty(stand_in: tuple[StandIn, SlurmRest], tmp_path: Path) -> None:
    """A token file caught empty (mid-rotation): the call says so, and sends nothing."""
    server, _ = stand_in
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    rest = slurm_client("rest", restd_url=server.url, restd_version=server.version, restd_token_file=token_file)
    sent = len(server.seen)
    with pytest.raises(Unavailable, match=r"token file .* is empty"):
        rest.node("gpu1")
    assert len(server.seen) == sent
