"""The Slurm Protocol over slurmrestd (clients/slurmrest_protocol.py), against real servers.

Debian's 22.05 slurmrestd (API v0.0.38) in front of a real slurmctld: every read gives what the
CLI client gives on the same cluster, and every method v0.0.38 cannot serve raises Unsupported
before anything is sent. Slurm 24.11 (v0.0.40 to v0.0.42) and 26.05 (v0.0.42 to v0.0.45), each
in its cached Debian root (lab/slurmroots.py), one cluster and one slurmrestd per release for the
module, every test run once per API version the release serves: nodes drained, downed and
resumed, job marks written, signals sent to a real job's steps and not its batch shell, v0.0.45's
requeue and partition edits, all checked with the CLI client on the same cluster; what the
client must not send (a dry run, a node someone else drained) is checked in slurmrestd's own log
of the requests it served. Hostlists are expanded as ``scontrol show hostnames`` expands them.
"""

from __future__ import annotations

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

import pytest

from clients.dryrun import DryRunViolation, dry_run
from clients.errors import ClientError, Forbidden, InvalidInput, NotFound, NotOwned, Unavailable
from clients.slurm import SlurmCli
from clients.slurmrest import TERMINAL, SlurmRestClient, jwt_token
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
from lab.slurmroots import RELEASES, RootError, install_for, root_unavailable
from models.incident import JobInfo, NodeInfo

REPO = Path(__file__).resolve().parents[2]
# The newer releases the lab runs, and each API version their slurmrestd serves.
NEWER_RELEASES = ("24.11", "26.05")
SERVED_BY = {release: RELEASES[release].api_versions for release in NEWER_RELEASES}
SERVED = [(release, version) for release in NEWER_RELEASES for version in SERVED_BY[release]]
LIVE = pytest.mark.skipif(
    not slurm_installed() or bool(slurmrestd_installed()), reason=slurmrestd_installed() or "Slurm is not installed"
)
DRAIN_REASON = "gpufleet: xid 79 REPLACE_NODE incident lab-gpu1-20261202T000000Z"


# -- what no server is needed for -------------------------------------------------------------------


# It starts real slurmctld, slurmd and slurmrestd daemons (22.05 and the cached newer roots): it runs
# in make test's second part, one lab at a time, not beside another module's daemons under xdist.
pytestmark = pytest.mark.slurm


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


@pytest.mark.parametrize("release", ["22.05", "24.11", "26.05"])
def test_a_job_completing_on_another_node_is_among_the_nodes_recent_jobs(release: str, tmp_path: Path) -> None:
    """A COMPLETING job's ``nodes`` are those still completing (what tests/clients/test_slurm.py
    sees on real daemons); its allocation (``job_resources``, as each release prints it) keeps
    the node that finished its part: the job is among that node's recent jobs, not its running
    ones (the node is free)."""
    raw = json.loads((REPO / "tests" / "clients" / "data" / f"squeue_{release}.json").read_text())["jobs"][0]
    resources = raw["job_resources"]
    if isinstance(resources["nodes"], dict):
        resources["nodes"]["list"] = "gpu[2-3]"
    else:
        resources["nodes"] = "gpu[2-3]"
    state = ["COMPLETING"] if isinstance(raw["job_state"], list) else "COMPLETING"
    raw.update(nodes="gpu3", job_state=state)

    class Served(SlurmRest):
        """The protocol's filtering over what slurmrestd served (its HTTP left out)."""

        def node(self, name: str) -> NodeInfo:
            return NodeInfo(name=name, state="idle")

        def _raw_jobs(self) -> list[dict[str, object]]:
            return [raw]

    key = tmp_path / "jwt.key"
    key.write_bytes(b"k" * 32)
    rest = Served("http://127.0.0.1:1", version="v0.0.42", key_file=key)
    assert [(job.state, job.nodes) for job in rest.recent_jobs_on_node("gpu2")] == [("COMPLETING", "gpu[2-3]")]
    assert [job.nodes for job in rest.recent_jobs_on_node("gpu3")] == ["gpu3"]
    assert rest.jobs_on_node("gpu2") == [] and rest.recent_jobs_on_node("gpu1") == []


def test_the_worker_methods_are_what_the_worker_calls() -> None:
    """WORKER_METHODS (what a worker refuses to start without) against the Protocol methods
    the activities, the spare pool and the pool mover call."""
    called: set[str] = set()
    for folder in ("activities", "clients"):
        for path in (REPO / folder).glob("*.py"):
            # The Slurm clients themselves, and the Slinky adapter over one, serve these methods.
            if folder == "clients" and (path.name.startswith("slurm") or path.name == "onslinky.py"):
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
        # Read one after the other: a node Slurm updates meanwhile may differ once; they agree again.
        wait_for(
            lambda: (
                sorted(map(_node, rest.nodes()), key=lambda n: n.name)
                == sorted(map(_node, live.cli.nodes()), key=lambda n: n.name)
            ),
            timeout=15,
            what="REST and CLI to agree on the nodes",
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


# -- Slurm 24.11 and 26.05 (v0.0.40 to v0.0.45), real servers in cached Debian roots -------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test of the newer servers runs once per (release, API version it serves); the cluster
    is module-scoped per release, so pytest runs one release's tests, then the next's."""
    if "newer" in metafunc.fixturenames:
        metafunc.parametrize(
            ("newer", "version"),
            SERVED,
            indirect=["newer"],
            scope="module",
            ids=[f"slurm{release}-{version}" for release, version in SERVED],
        )


@dataclass
class Newer:
    slurm: SlurmLab
    url: str
    key_file: Path
    cli: SlurmCli
    jobs: dict[str, int]
    folder: Path
    release: str

    def rest(self, version: str) -> SlurmRest:
        return SlurmRest(self.url, version=version, key_file=self.key_file)

    def served(self, *methods: str) -> list[str]:
        """The requests slurmrestd logged serving, of ``methods``: what was sent, from the server's side."""
        log = (self.slurm.logs / "slurmrestd.out").read_text(errors="replace")
        return re.findall(rf"operations_router: \S+ ((?:{'|'.join(methods)}) /slurm/\S+)", log)

    def writes(self) -> list[str]:
        return self.served("POST", "DELETE", "PUT", "PATCH")

    def sbatch(self, *args: str) -> int:
        return self.slurm.sbatch(self.folder / "sleep.sh", "-o", "/dev/null", *args)


@pytest.fixture(scope="module")
def newer(request: pytest.FixtureRequest) -> Iterator[Newer]:
    """A cluster of Slurm ``request.param`` (gpu1..gpu3 in train, spare1 outside) and its
    slurmrestd, with a running job on gpu1, a finished one on gpu2, one pending for nodes and
    one held."""
    release = str(request.param)
    why = root_unavailable(release)
    if why:
        pytest.skip(f"Slurm {release} cannot run here: {why}")
    try:
        install = install_for(release)
    except RootError as exc:
        pytest.skip(f"Slurm {release} cannot run here: {exc}")
    missing = slurmrestd_installed(install)
    if missing:
        pytest.skip(missing)
    root = Path(tempfile.mkdtemp(prefix=f"gpufleet-restproto-{release}-", dir="/tmp"))
    root.chmod(0o755)
    key_file = root / "jwt.key"
    key_file.write_bytes(b"gpufleet-test-key-" + b"0" * 32)
    key_file.chmod(0o600)
    (root / "sleep.sh").write_text("#!/bin/sh\nsleep 600\n")
    (root / "true.sh").write_text("#!/bin/sh\ntrue\n")
    nodes = ["gpu1", "gpu2", "gpu3", "spare1"]
    site = SlurmLab(root, release=release)
    conf = [
        "ClusterName=restproto",
        # A node set DOWN stays down until resumed (with 2, its slurmd's next ping returns it).
        *(line.replace("ReturnToService=2", "ReturnToService=1") for line in site.site_lines()),
        *jwt_lines(key_file),
        "AccountingStorageType=accounting_storage/none",
        *(f"NodeName={node} {site.node_options()} State=UNKNOWN" for node in nodes),
        "PartitionName=train Nodes=gpu1,gpu2,gpu3 Default=YES MaxTime=INFINITE State=UP",
    ]
    slurm = SlurmLab(root, conf="\n".join(conf) + "\n", nodes=nodes, release=release)
    restd = None
    try:
        slurm.start()
        restd = start_slurmrestd(slurm)
        server = Newer(slurm, restd.url, key_file, slurm.client(), {}, root, release)
        cli = server.cli
        server.jobs["running"] = server.sbatch("-w", "gpu1")
        server.jobs["finished"] = slurm.sbatch(root / "true.sh", "-o", "/dev/null", "-w", "gpu2")
        wait_for(lambda: cli.job(server.jobs["running"]).state == "RUNNING", timeout=60, what="the job to run")
        wait_for(lambda: cli.job(server.jobs["finished"]).state == "COMPLETED", timeout=60, what="the job to end")
        server.jobs["pending"] = server.sbatch("-N", "3")  # gpu1 is busy: waits for resources
        server.jobs["held"] = server.sbatch("--hold", "-N", "2")
        wait_for(lambda: cli.pending("train").jobs == 1, timeout=30, what="the pending job's reason")
        yield server
    finally:
        if restd is not None:
            restd.stop()
        slurm.stop()
        shutil.rmtree(root, ignore_errors=True)


def _resume(slurm: SlurmLab, node: str) -> None:
    """Back in service, whatever the test left it in (an idle node refuses RESUME: no matter)."""
    subprocess.run(slurm.argv(["scontrol", "update", f"NodeName={node}", "State=RESUME"]), env=slurm.env, check=False)


def test_a_newer_server_is_found_and_says_what_its_version_lacks(newer: Newer, version: str) -> None:
    found = slurm_client("rest", restd_url=newer.url, restd_key_file=newer.key_file, restd_user="root")
    assert isinstance(found, SlurmRest) and found.version == SERVED_BY[newer.release][-1]
    rest = newer.rest(version)
    if version == "v0.0.45":
        assert unsupported_methods(rest) == {}
        require_methods(rest)
        return
    assert set(unsupported_methods(rest)) == {"requeue", "add_to_partition", "remove_from_partition"}
    with pytest.raises(MissingSlurmMethods, match=r"lacks 3 method\(s\).*add_to_partition: .*requeue: .*v0\.0\.45"):
        require_methods(rest)


def test_newer_nodes_read_as_the_cli_reads_them(newer: Newer, version: str) -> None:
    newer.slurm.scontrol("update", "NodeName=gpu3", "State=DRAIN", "Reason=site maintenance")
    try:
        rest = newer.rest(version)
        # Read one after the other: a node Slurm updates meanwhile may differ once; they agree again.
        wait_for(
            lambda: (
                sorted(map(_node, rest.nodes()), key=lambda n: n.name)
                == sorted(map(_node, newer.cli.nodes()), key=lambda n: n.name)
            ),
            timeout=15,
            what="REST and CLI to agree on the nodes",
        )
        drained = rest.node("gpu3")
        assert _node(drained) == _node(newer.cli.node("gpu3"))
        assert drained.drained and drained.reason == "site maintenance"
        assert rest.node("spare1").partitions == []
        assert rest.partition_nodes("train") == newer.cli.partition_nodes("train") == ["gpu1", "gpu2", "gpu3"]
        with pytest.raises(NotFound, match="no node named 'gpu9'"):
            rest.node("gpu9")
        with pytest.raises(NotFound, match="gpu9"):
            rest.jobs_on_node("gpu9")
    finally:
        _resume(newer.slurm, "gpu3")


def test_newer_jobs_read_as_the_cli_reads_them(newer: Newer, version: str) -> None:
    rest, cli, jobs = newer.rest(version), newer.cli, newer.jobs
    assert _by_id(rest.jobs_on_node("gpu1")) == _by_id(cli.jobs_on_node("gpu1"))
    assert jobs["running"] in _by_id(rest.jobs_on_node("gpu1"))
    recent = _by_id(rest.recent_jobs_on_node("gpu2"))
    assert recent[jobs["finished"]] == cli.job(jobs["finished"]) and recent[jobs["finished"]].state == "COMPLETED"
    assert _by_id(rest.partition_jobs("train")) == _by_id(cli.partition_jobs("train"))
    wanted = [jobs["running"], jobs["finished"], jobs["pending"], 99999]
    # Two reads, one after the other: a field Slurm updates meanwhile (a pending job's priority or
    # reason) may differ once; they agree when read again.
    wait_for(lambda: rest.jobs_by_id(wanted) == cli.jobs_by_id(wanted), timeout=15, what="REST and CLI to agree")
    assert set(rest.jobs_by_id(wanted)) == set(wanted) - {99999}
    assert rest.jobs_by_id([99999]) == {} == cli.jobs_by_id([99999])
    assert rest.job(jobs["running"]) == cli.job(jobs["running"])
    with pytest.raises(NotFound, match="no job 99999"):
        rest.job(99999)
    demand = rest.pending("train")
    assert demand == cli.pending("train") and (demand.jobs, demand.nodes) == (1, 3)  # the held job asks for nothing


def test_drain_down_and_resume_update_the_node_once(newer: Newer, version: str) -> None:
    rest, cli = newer.rest(version), newer.cli
    try:
        before = len(newer.writes())
        drained = rest.drain("gpu3", reason=DRAIN_REASON)
        assert drained.drained and drained.reason == DRAIN_REASON and drained.state == "idle"
        assert cli.node("gpu3").drained and cli.node("gpu3").reason == DRAIN_REASON
        assert newer.writes()[before:] == [f"POST /slurm/{version}/node/gpu3"]
        again = rest.drain("gpu3", reason=DRAIN_REASON)
        assert again.drained and again.reason == DRAIN_REASON and len(newer.writes()) == before + 1  # once only
        rest.down("gpu3", reason=DRAIN_REASON)
        assert cli.node("gpu3").state == "down" and cli.node("gpu3").reason == DRAIN_REASON
        rest.down("gpu3", reason=DRAIN_REASON)
        assert len(newer.writes()) == before + 2
        rest.resume("gpu3")
        # Back idle, and answering again (26.05 marks it not responding until its slurmd registers).
        back = wait_for(
            lambda: (n := cli.node("gpu3")).state == "idle" and "NOT_RESPONDING" not in n.flags and n,
            timeout=60,
            what="gpu3 to return",
        )
        # Slurm 24.11 keeps an idle node's reason after RESUME (scontrol's as well); 26.05 clears it.
        assert not back.drained and back.reason == ("" if newer.release == "26.05" else DRAIN_REASON)
        rest.resume("gpu3")  # in service already: nothing sent
        assert len(newer.writes()) == before + 3
    finally:
        _resume(newer.slurm, "gpu3")


def test_a_node_drained_by_someone_else_is_left_alone(newer: Newer, version: str) -> None:
    rest = newer.rest(version)
    newer.slurm.scontrol("update", "NodeName=gpu3", "State=DRAIN", "Reason=disk swap by ops")
    try:
        before = len(newer.writes())
        assert rest.drain("gpu3", reason=DRAIN_REASON).reason == "disk swap by ops"
        with pytest.raises(NotOwned, match="taken out by someone else"):
            rest.resume("gpu3")
        with pytest.raises(NotOwned, match="held by someone else"):
            rest.down("gpu3", reason=DRAIN_REASON)
        assert len(newer.writes()) == before
        node = newer.cli.node("gpu3")
        assert node.drained and node.reason == "disk swap by ops"
    finally:
        _resume(newer.slurm, "gpu3")


def test_a_signal_reaches_the_steps_and_not_the_batch_shell(newer: Newer, version: str) -> None:
    """A batch script that traps TERM and runs one step that traps it too: the step gets the
    signal and ends; the batch shell never sees it and goes on."""
    folder = Path(tempfile.mkdtemp(prefix="gpufleet-signal-", dir=newer.folder))
    script = folder / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"trap 'touch {folder}/batch-got-term; exit 0' TERM\n"
        f'srun bash -c \'trap "touch {folder}/step-got-term; exit 0" TERM; touch {folder}/step-ready; '
        "while true; do sleep 0.1; done'\n"
        f"touch {folder}/step-ended\n"
        "while true; do sleep 0.1; done\n"
    )
    job_id = newer.slurm.sbatch(script, "-o", str(folder / "out"), "-w", "gpu2")
    try:
        wait_for((folder / "step-ready").exists, timeout=60, what="the step to set its trap")
        newer.rest(version).signal_job(job_id)
        wait_for((folder / "step-ended").exists, timeout=30, what="the step to end on SIGTERM")
        assert (folder / "step-got-term").exists() and not (folder / "batch-got-term").exists()
        assert newer.cli.job(job_id).state == "RUNNING"  # the batch shell goes on
        assert newer.writes()[-1] == f"DELETE /slurm/{version}/job/{job_id}"
        with pytest.raises(InvalidInput, match="KILL"):
            newer.rest(version).signal_job(job_id, signal="KILL")
        with pytest.raises(NotFound, match="no job 99999"):
            newer.rest(version).signal_job(99999)
    finally:
        subprocess.run(newer.slurm.argv(["scancel", str(job_id)]), env=newer.slurm.env, check=False, timeout=30)
    wait_for(lambda: newer.cli.job(job_id).state == "CANCELLED", timeout=30, what="the job to end")


def test_marks_go_into_the_admin_comment_once(newer: Newer, version: str) -> None:
    rest, cli = newer.rest(version), newer.cli
    job_id = newer.sbatch("-w", "gpu1", "--hold")  # held: never runs, stays in the controller
    newer.slurm.scontrol("update", f"JobId={job_id}", "AdminComment=site note")
    mark = "gpufleet:signalled:lab-gpu1-20261202T000000Z"
    before = len(newer.writes())
    assert rest.mark_job(job_id, mark) and rest.mark_job(job_id, mark)
    assert newer.writes()[before:] == [f"POST /slurm/{version}/job/{job_id}"]
    assert rest.job_marks(job_id) == cli.job_marks(job_id) == [mark]
    assert cli._admin_comment(job_id) == f"site note; {mark}"
    assert rest.job_marks(newer.jobs["pending"]) == []
    assert rest.mark_job(newer.jobs["finished"], mark) is False  # finished: Slurm refuses
    assert cli.job_marks(newer.jobs["finished"]) == []
    with pytest.raises(InvalidInput):
        rest.mark_job(job_id, "gpufleet:x:y; rm -rf /")
    with pytest.raises(NotFound):
        rest.mark_job(99999, mark)


def test_requeue_and_partition_edits_are_served_from_v0_0_45_only(newer: Newer, version: str) -> None:
    rest, cli, slurm = newer.rest(version), newer.cli, newer.slurm
    if version != "v0.0.45":
        before = len(newer.served("GET", "POST", "DELETE"))
        calls: tuple[Callable[[], object], ...] = (
            lambda: rest.requeue(newer.jobs["running"]),
            lambda: rest.add_to_partition("train", "spare1"),
            lambda: rest.remove_from_partition("train", "gpu3"),
        )
        for call in calls:
            with pytest.raises(Unsupported, match=rf"through slurmrestd {version}: .*v0\.0\.45.*CLI backend"):
                call()
        assert len(newer.served("GET", "POST", "DELETE")) == before  # nothing sent at all
        return
    # Requeue, as scontrol requeue does: a running job goes back to pending and runs again.
    job_id = newer.sbatch("-w", "gpu3", "--requeue")
    wait_for(lambda: cli.job(job_id).state == "RUNNING", timeout=60, what="the job to run")
    rest.requeue(job_id)
    assert newer.writes()[-1] == "POST /slurm/v0.0.45/jobs/requeue"
    requeued = cli.job(job_id)
    assert requeued.restarts == 1 and requeued.state in {"PENDING", "REQUEUED", "CONFIGURING", "RUNNING"}
    rest.requeue(job_id)  # pending again, or running again: requeued once more only if it runs
    stuck = newer.sbatch("-w", "gpu2", "--no-requeue")
    wait_for(lambda: cli.job(stuck).state == "RUNNING", timeout=60, what="the --no-requeue job to run")
    with pytest.raises(InvalidInput, match="--no-requeue"):
        rest.requeue(stuck)
    with pytest.raises(NotFound):
        rest.requeue(99999)
    slurm.scontrol("update", "PartitionName=train", "Nodes=gpu1,gpu2,gpu3")
    subprocess.run(slurm.argv(["scancel", str(job_id), str(stuck)]), env=slurm.env, check=True, timeout=30)
    # Partition membership: only the node list changes.
    settings = re.sub(r"\b(Nodes|TotalCPUs|TotalNodes|TRES)=\S+", "", slurm.scontrol("show", "partition", "train"))
    try:
        rest.add_to_partition("train", "spare1")
        rest.add_to_partition("train", "spare1")
        assert cli.partition_nodes("train") == ["gpu1", "gpu2", "gpu3", "spare1"]
        rest.remove_from_partition("train", "gpu3")
        assert cli.partition_nodes("train") == ["gpu1", "gpu2", "spare1"] == rest.partition_nodes("train")
        assert cli.node("gpu3").partitions == []
        after = re.sub(r"\b(Nodes|TotalCPUs|TotalNodes|TRES)=\S+", "", slurm.scontrol("show", "partition", "train"))
        assert after == settings
        # An unknown partition is not created (POST /partitions/ would).
        with pytest.raises(NotFound, match="no partition named 'nosuch'"):
            rest.add_to_partition("nosuch", "spare1")
        assert "nosuch" not in slurm.scontrol("show", "partition")
    finally:
        slurm.scontrol("update", "PartitionName=train", "Nodes=gpu1,gpu2,gpu3")

    # The cancelled jobs' steps end only after KillWait: the next tests find gpu3 idle.
    def ended(job: int) -> bool:
        try:
            return cli.job(job).state in TERMINAL
        except NotFound:
            return True

    wait_for(
        lambda: ended(job_id) and ended(stuck) and cli.node("gpu3").state == "idle",
        timeout=60,
        what="the cancelled jobs to end and gpu3 to be idle",
    )


def test_a_dry_run_sends_no_write(newer: Newer, version: str) -> None:
    rest = newer.rest(version)
    before = len(newer.writes())
    running = newer.jobs["running"]
    with dry_run(True):
        assert rest.node("gpu3").state == "idle"
        calls: list[Callable[[], object]] = [
            lambda: rest.drain("gpu3", reason=DRAIN_REASON),
            lambda: rest.signal_job(running),
            lambda: rest.mark_job(running, "gpufleet:signalled:lab-gpu1-20261202T000000Z"),
        ]
        if version == "v0.0.45":
            calls += [lambda: rest.requeue(running), lambda: rest.add_to_partition("train", "spare1")]
        for call in calls:
            with pytest.raises(DryRunViolation):
                call()
    assert len(newer.writes()) == before
    assert not newer.cli.node("gpu3").drained and newer.cli.job(running).state == "RUNNING"


def test_the_token_is_never_in_an_error_or_the_log(
    newer: Newer, version: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused (a key that is not the cluster's) or failing (an unknown node): the errors and the
    log say what happened and never carry the token."""
    caplog.set_level(logging.DEBUG)
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(b"not-the-cluster-key-" + b"1" * 32)
    token_file = tmp_path / "token"
    token = jwt_token(wrong.read_bytes(), "root")
    token_file.write_text(token + "\n")
    refused = SlurmRest(newer.url, version=version, token_file=token_file)
    with pytest.raises(ClientError) as first:
        refused.node("gpu1")
    assert isinstance(first.value, Forbidden) or "refused" in str(first.value)
    good = jwt_token(newer.key_file.read_bytes(), "root")
    token_file.write_text(good + "\n")
    with pytest.raises(NotFound) as second:
        SlurmRest(newer.url, version=version, token_file=token_file).node("gpu9")
    for secret in (token, good):
        assert secret not in str(first.value) and secret not in str(second.value) and secret not in caplog.text


def test_an_empty_token_file_is_said_to_be_empty(newer: Newer, version: str, tmp_path: Path) -> None:
    """A token file caught empty (mid-rotation): the call says so, and sends nothing."""
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    rest = slurm_client("rest", restd_url=newer.url, restd_version=version, restd_token_file=token_file)
    sent = len(newer.served("GET", "POST", "DELETE"))
    with pytest.raises(Unavailable, match=r"token file .* is empty"):
        rest.node("gpu1")
    assert len(newer.served("GET", "POST", "DELETE")) == sent


# -- what no server here does: a proxy that echoes the request's headers ---------------------------


def test_a_token_a_proxy_echoes_back_is_left_out_of_the_error(tmp_path: Path) -> None:
    """A proxy before slurmrestd that quotes the request's headers in its refusal: the error says
    what it said, with the token left out."""
    seen: list[str] = []

    class Echo(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.headers["X-SLURM-USER-TOKEN"])
            data = json.dumps({"errors": [{"description": f"bad request, headers {dict(self.headers)}"}]}).encode()
            self.send_response(502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    key = tmp_path / "jwt.key"
    key.write_bytes(b"k" * 32)
    try:
        client = SlurmRest(f"http://127.0.0.1:{server.server_address[1]}", version="v0.0.45", key_file=key)
        with pytest.raises(Unavailable) as echoed:
            client.node("gpu1")
    finally:
        server.shutdown()
        server.server_close()
    assert "bad request, headers" in str(echoed.value) and "[token]" in str(echoed.value)
    assert seen and all(token not in str(echoed.value) for token in seen)


def test_the_raw_client_submits_and_reads_in_each_version(newer: Newer, version: str) -> None:
    """clients/slurmrest.py (the Slinky backend's client): the script inside the job, the
    environment a list, states lists of flags; ping as each version words it."""
    client = SlurmRestClient(newer.url, newer.key_file.read_bytes(), version=version)
    assert SlurmRestClient(newer.url, newer.key_file.read_bytes()).detect_version() == SERVED_BY[newer.release][-1]
    assert client.ping().startswith(newer.release + ".")
    job_id = client.submit(
        "#!/bin/sh\nsleep 600\n", user="root", partition="train", name="raw-smoke", cwd=str(newer.folder)
    )
    try:
        submitted = newer.cli.job(job_id)
        assert (submitted.name, submitted.user, submitted.stdout) == ("raw-smoke", "root", "/dev/null")
        assert client.job_state(job_id, user="root").split("+")[0] in {"PENDING", "RUNNING"}
        # Once it runs (its state no longer moving), the listing and the job's own read agree.
        wait_for(lambda: client.job_state(job_id) == "RUNNING", timeout=30, what="the job to run")
        assert client.jobs()[job_id] == client.job_state(job_id) == "RUNNING"
        assert client.nodes()["spare1"] == ("IDLE", [])
    finally:
        client.cancel(job_id)
    assert wait_for(lambda: newer.cli.job(job_id).state == "CANCELLED", timeout=30, what="the cancel")
