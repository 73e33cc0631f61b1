"""`gpufleet api` end to end: the gpufleet CLI run as a user would, through the API (TLS, the
user's kubeconfig token), to a real Temporal server; the users and their roles are those of the
emulated Kubernetes API (static tokens, RBAC ClusterRoles and bindings applied through it).

The CLI's TEMPORAL_ADDRESS points nowhere: every call it makes goes through the API or fails.
The incident and the fleet guard are stand-in workflows (a status query, the signals a person
sends) on the task queues gpufleet's worker would serve: what is checked is what reaches them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode, TLSConfig
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from lab.procs import free_port, stop
from models.cluster import load_spec
from models.clusterops import CLUSTER_DELETION_WORKFLOW, CLUSTER_TASK_QUEUE, ClusterDeleteInput
from models.guard import GuardCommand, GuardInput, GuardState, GuardStatus
from models.incident import Approval, IncidentStatus, RemediationInput
from models.policy import GuardSettings
from starters.server import dev_server_argv
from starters.temporal import connect_temporal
from tests.conftest import REPO, gpufleet_cli, gpufleet_daemon
from tests.gateway.world import workflow_exists

CLUSTER = "lab"
INCIDENT = f"remediate-{CLUSTER}-gpu1"
INCIDENT_ID = f"{CLUSTER}-gpu1-20261206T100000Z"
TOKENS = {"alice": "viewer-token", "bob": "approver-token", "carol": "operator-token"}
ROLES = {"alice": "gpufleet-viewer", "bob": "gpufleet-approver", "carol": "gpufleet-operator"}


# -- stand-ins for the incident and the guard ----------------------------------------------------


@workflow.defn(name="NodeRemediationWorkflow")
class WaitingIncident:
    """An incident waiting for approval, as `gpufleet approve` finds one."""

    def __init__(self) -> None:
        self._status = IncidentStatus(
            incident_id=INCIDENT_ID,
            cluster=CLUSTER,
            node="gpu1",
            waiting_for_approval="gpu1 was drained by someone else",
            approval_wait=1,
        )

    @workflow.run
    async def run(self, params: RemediationInput) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal
    def decide(self, approval: Approval) -> None:
        self._status.waiting_for_approval = None

    @workflow.query
    def status(self) -> IncidentStatus:
        return self._status


@workflow.defn(name="FleetGuardWorkflow")
class Guard:
    def __init__(self) -> None:
        self._state = GuardState(cluster=CLUSTER)

    @workflow.run
    async def run(self, params: GuardInput) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name="reset")
    def reset(self, command: GuardCommand) -> None:
        self._state.handled += 1

    @workflow.query
    def status(self) -> GuardStatus:
        return GuardStatus(state=self._state, limits=GuardSettings())


# -- the servers ---------------------------------------------------------------------------------


def _wait_for_port(port: int, proc: subprocess.Popen[Any], what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text() if log is not None and log.exists() else ""
            raise RuntimeError(f"{what} exited ({proc.returncode}): {said}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} does not listen on {port}")


def _certificates(folder: Path) -> None:
    """A CA; the API's certificate for 127.0.0.1 signed by it; and a user's client certificate as a
    cluster's CA signs one (CN the user, O a group)."""
    folder.mkdir(parents=True, exist_ok=True)

    def ssl(command: str) -> None:
        subprocess.run(["openssl", *command.split()], cwd=folder, check=True, capture_output=True)

    (folder / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    sign = "x509 -req -CA ca.pem -CAkey ca.key -CAcreateserial -days 1"
    ssl("req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=gpufleet-test-CA")
    ssl("req -newkey rsa:2048 -nodes -keyout api.key -out api.csr -subj /CN=localhost")
    ssl(f"{sign} -in api.csr -out api.pem -extfile ext")
    ssl("req -newkey rsa:2048 -nodes -keyout dave.key -out dave.csr -subj /O=gpufleet-viewers/CN=dave")
    (folder / "client-ext").write_text("extendedKeyUsage=clientAuth\n")  # a v3 certificate, as rustls wants
    ssl(f"{sign} -in dave.csr -out dave.pem -extfile client-ext")


def _rbac(kubeconfig: Path) -> None:
    """deploy/'s roles, and a user bound to each, applied through the API server."""
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    rbac = k8s.RbacAuthorizationV1Api(k8s.ApiClient(configuration))
    for role in yaml.safe_load_all((REPO / "deploy" / "base" / "user-roles.yaml").read_text()):
        if role and role["kind"] == "ClusterRole":
            rbac.create_cluster_role(role)
    subjects = [("User", user, role) for user, role in ROLES.items()] + [
        ("Group", "gpufleet-viewers", "gpufleet-viewer")
    ]
    for kind, subject, role in subjects:
        group = "rbac.authorization.k8s.io"
        rbac.create_cluster_role_binding(
            k8s.V1ClusterRoleBinding(
                metadata=k8s.V1ObjectMeta(name=f"{subject}-{role}"),
                role_ref=k8s.V1RoleRef(api_group=group, kind="ClusterRole", name=role),
                subjects=[k8s.RbacV1Subject(api_group=group, kind=kind, name=subject)],
            )
        )


def _user_kubeconfig(path: Path, server: str, user: str, credentials: dict[str, str]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "lab", "cluster": {"server": server}}],
                "users": [{"name": user, "user": credentials}],
                "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": user}}],
                "current-context": "lab",
            }
        )
    )
    return path


@dataclass
class Fleet:
    temporal: str  # host:port of Temporal itself
    api: str  # host:port of the gpufleet API
    mtls: str  # host:port of the one that takes client certificates
    metrics: int
    certs: Path
    kubeconfigs: dict[str, Path]

    def env(self, user: str) -> dict[str, str]:
        """What a user's shell holds: the API's address and CA, their kubeconfig; no way to Temporal."""
        return {
            "GPUFLEET_API_ADDRESS": self.mtls if user == "dave" else self.api,
            "GPUFLEET_API_CA_FILE": str(self.certs / "ca.pem"),
            "GPUFLEET_API_KUBECONFIG": str(self.kubeconfigs[user]),
            "GPUFLEET_CLUSTER": CLUSTER,
            "TEMPORAL_ADDRESS": "127.0.0.1:1",
            # What getpass.getuser() would say: a name anyone sets.
            "USER": "mallory",
            "LOGNAME": "mallory",
        }

    def cli(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        return gpufleet_cli(*args, env=self.env(user), timeout=60)

    async def as_user(self, user: str) -> Client:
        """A client of the API that is no gpufleet command: what anyone holding the token could run."""
        return await Client.connect(
            self.api,
            data_converter=pydantic_data_converter,
            tls=TLSConfig(server_root_ca_cert=(self.certs / "ca.pem").read_bytes()),
            api_key=TOKENS[user],
        )


def _serve_workers(address: str, stopped: threading.Event, ready: threading.Event) -> None:
    async def main() -> None:
        client = await connect_temporal(address=address)
        runner = UnsandboxedWorkflowRunner()
        async with (
            Worker(client, task_queue=f"gpufleet-{CLUSTER}", workflows=[WaitingIncident], workflow_runner=runner),
            Worker(client, task_queue=f"gpufleet-{CLUSTER}.guard", workflows=[Guard], workflow_runner=runner),
        ):
            ready.set()
            while not stopped.is_set():
                await asyncio.sleep(0.1)

    asyncio.run(main())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("api")
    _certificates(root / "certs")
    pids: list[int] = []
    threads: list[threading.Thread] = []
    stopped = threading.Event()
    try:
        # Temporal (the dev server: it lists workflows).
        port = free_port()
        temporal = subprocess.Popen(
            dev_server_argv(db_file=root / "temporal.db", port=port, ui_port=free_port()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        pids.append(temporal.pid)
        _wait_for_port(port, temporal, "the Temporal dev server")
        address = f"127.0.0.1:{port}"
        # The emulated Kubernetes API with static-token users, and the roles bound to them.
        (root / "tokens.csv").write_text(
            "".join(f"{token},{user},{1000 + i}\n" for i, (user, token) in enumerate(TOKENS.items()))
        )
        ready_file, admin = root / "kube-ready", root / "admin.kubeconfig"
        kube = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lab.kubeapi",
                "--kubeconfig",
                str(admin),
                "--ready-file",
                str(ready_file),
                "--token-file",
                str(root / "tokens.csv"),
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=open(root / "kubeapi.log", "wb"),  # noqa: SIM115
            start_new_session=True,
        )
        pids.append(kube.pid)
        deadline = time.monotonic() + 30
        while not ready_file.exists():
            if kube.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the emulated API did not start: {(root / 'kubeapi.log').read_text()}")
            time.sleep(0.05)
        server = ready_file.read_text()
        _rbac(admin)
        kubeconfigs = {
            user: _user_kubeconfig(root / f"{user}.kubeconfig", server, user, {"token": token})
            for user, token in TOKENS.items()
        }
        kubeconfigs["nobody"] = _user_kubeconfig(root / "nobody.kubeconfig", server, "nobody", {})
        certs = root / "certs"
        # As a cluster's kubeconfig names its API server: over https (the loader reads client
        # certificates for https servers only); the gpufleet API never contacts it.
        kubeconfigs["dave"] = _user_kubeconfig(
            root / "dave.kubeconfig",
            "https://kubernetes.example.com:6443",
            "dave",
            {"client-certificate": str(certs / "dave.pem"), "client-key": str(certs / "dave.key")},
        )
        # The API.
        # The API; and one that takes client certificates (mutual TLS: every caller presents one).
        api_port, metrics_port, mtls_port = free_port(), free_port(), free_port()
        serving = {
            "GPUFLEET_API_TLS_CERT": str(root / "certs" / "api.pem"),
            "GPUFLEET_API_TLS_KEY": str(root / "certs" / "api.key"),
            "GPUFLEET_KUBECONFIG": str(admin),
            "TEMPORAL_ADDRESS": address,
        }
        api = gpufleet_daemon(
            "api", env={**serving, "GPUFLEET_API_PORT": str(api_port), "GPUFLEET_API_METRICS_PORT": str(metrics_port)}
        )
        mtls = gpufleet_daemon(
            "api",
            env={
                **serving,
                "GPUFLEET_API_PORT": str(mtls_port),
                "GPUFLEET_API_METRICS_PORT": "0",
                "GPUFLEET_API_CLIENT_CA": str(root / "certs" / "ca.pem"),
            },
        )
        pids += [api.pid, mtls.pid]
        _wait_for_port(api_port, api, "gpufleet api")
        _wait_for_port(mtls_port, mtls, "gpufleet api (client certificates)")
        # gpufleet's side: the stand-in workflows' worker, and an incident waiting, the guard running.
        ready = threading.Event()
        thread = threading.Thread(target=_serve_workers, args=(address, stopped, ready), daemon=True)
        thread.start()
        threads.append(thread)
        assert ready.wait(30), "the worker did not start"

        async def open_incident() -> None:
            client = await connect_temporal(address=address)
            await client.start_workflow(
                "NodeRemediationWorkflow",
                RemediationInput(cluster=CLUSTER, node="gpu1"),
                id=INCIDENT,
                task_queue=f"gpufleet-{CLUSTER}",
            )
            await client.start_workflow(
                "FleetGuardWorkflow",
                GuardInput(cluster=CLUSTER),
                id=f"guard-{CLUSTER}",
                task_queue=f"gpufleet-{CLUSTER}.guard",
            )

        asyncio.run(open_incident())
        yield Fleet(
            temporal=address,
            api=f"127.0.0.1:{api_port}",
            mtls=f"127.0.0.1:{mtls_port}",
            metrics=metrics_port,
            certs=root / "certs",
            kubeconfigs=kubeconfigs,
        )
    finally:
        stopped.set()
        for thread in threads:
            thread.join(timeout=10)
        stop(pids)


def _signals(fleet: Fleet, workflow_id: str) -> list[tuple[str, str, list[Any]]]:
    """The signals in the workflow's history: (name, the event's identity, the decoded arguments)."""

    async def read() -> list[tuple[str, str, list[Any]]]:
        client = await connect_temporal(address=fleet.temporal)
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        found = []
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                attributes = event.workflow_execution_signaled_event_attributes
                values = pydantic_data_converter.payload_converter.from_payloads(
                    list(attributes.input.payloads), [dict] * len(attributes.input.payloads)
                )
                found.append((attributes.signal_name, attributes.identity, values))
        return found

    return asyncio.run(read())


def _exists(fleet: Fleet, workflow_id: str) -> bool:
    return workflow_exists(fleet.temporal, workflow_id)


def _refused_line(ran: subprocess.CompletedProcess[str], user: str, what: str, role: str) -> None:
    assert ran.returncode == 1, ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1, ran.stderr
    assert f"{user} may not {what}" in lines[0] and f"ask for the {role} role" in lines[0], ran.stderr


def _deletion_refused(fleet: Fleet, user: str) -> None:
    """A forced deletion of the cluster, started by ``user`` through the API: refused, nothing
    started. (`cluster delete` refuses a cluster that was never created before it asks anything;
    the API refuses the deletion itself to any client that tries it.)"""

    async def delete() -> RPCError:
        client = await fleet.as_user(user)
        spec = load_spec(yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text()))
        with pytest.raises(RPCError) as refused:
            await client.start_workflow(
                CLUSTER_DELETION_WORKFLOW,
                ClusterDeleteInput(spec=spec, backend="lab", force=True),
                id="delete-cluster-research",
                task_queue=CLUSTER_TASK_QUEUE,
            )
        return refused.value

    refused = asyncio.run(delete())
    assert refused.status == RPCStatusCode.PERMISSION_DENIED
    assert f"{user} may not delete gpufleet.io/clusters research" in refused.message
    assert "ask for the gpufleet-operator role" in refused.message
    assert not _exists(fleet, "delete-cluster-research")


# -- the tests -----------------------------------------------------------------------------------


def test_a_viewer_reads_incidents(fleet: Fleet) -> None:
    listed = fleet.cli("alice", "incidents", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert INCIDENT in [row["id"] for row in json.loads(listed.stdout)]
    shown = fleet.cli("alice", "incidents", "show", INCIDENT, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["waiting_for_approval"] == "gpu1 was drained by someone else"


def test_a_viewer_may_change_nothing(fleet: Fleet) -> None:
    approve = fleet.cli("alice", "approve", INCIDENT, "--reason", "looks fine")
    _refused_line(approve, "alice", "approve gpufleet.io/incidents", "gpufleet-approver")
    assert [name for name, _, _ in _signals(fleet, INCIDENT)] == []

    reset = fleet.cli("alice", "breaker", "reset")
    _refused_line(reset, "alice", f"reset gpufleet.io/breaker {CLUSTER}", "gpufleet-operator")
    assert _signals(fleet, f"guard-{CLUSTER}") == []

    returned = fleet.cli("alice", "nodes", "return", "gpu2")
    _refused_line(returned, "alice", "return gpufleet.io/nodes gpu2", "gpufleet-operator")
    assert not _exists(fleet, f"return-{CLUSTER}-gpu2")

    paused = fleet.cli("alice", "pause", "--reason", "maintenance")
    _refused_line(paused, "alice", f"pause gpufleet.io/breaker {CLUSTER}", "gpufleet-operator")
    assert _signals(fleet, f"guard-{CLUSTER}") == []

    released = fleet.cli("alice", "nodes", "release", "gpu2", "--reason", "repaired")
    _refused_line(released, "alice", "release gpufleet.io/nodes gpu2", "gpufleet-operator")
    assert not _exists(fleet, f"release-{CLUSTER}-gpu2")

    _deletion_refused(fleet, "alice")


def test_an_approver_may_not_touch_the_breaker_or_clusters(fleet: Fleet) -> None:
    """An approver decides incidents; the breaker, nodes and clusters are an operator's."""
    before = _signals(fleet, f"guard-{CLUSTER}")
    reset = fleet.cli("bob", "breaker", "reset")
    _refused_line(reset, "bob", f"reset gpufleet.io/breaker {CLUSTER}", "gpufleet-operator")
    assert _signals(fleet, f"guard-{CLUSTER}") == before

    _deletion_refused(fleet, "bob")


def test_a_client_certificate_is_its_cn_in_its_o_groups(fleet: Fleet) -> None:
    listed = fleet.cli("dave", "incidents", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert INCIDENT in [row["id"] for row in json.loads(listed.stdout)]
    # Bound through its group (O=gpufleet-viewers) to the viewer's role: reads, never approves.
    approve = fleet.cli("dave", "approve", INCIDENT)
    _refused_line(approve, "dave", "approve gpufleet.io/incidents", "gpufleet-approver")
    assert [name for name, _, _ in _signals(fleet, INCIDENT)] == []
    # An API that takes tokens only says so to a certificate's holder.
    ran = gpufleet_cli("incidents", "list", env={**fleet.env("dave"), "GPUFLEET_API_ADDRESS": fleet.api})
    assert ran.returncode == 1, ran.stderr
    assert "this API accepts no client certificates" in ran.stderr and len(ran.stderr.strip().splitlines()) == 1


def test_an_approver_approves_and_the_history_names_them(fleet: Fleet) -> None:
    ran = fleet.cli("bob", "approve", INCIDENT, "--reason", "checked the node")
    assert ran.returncode == 0, ran.stderr
    assert f"{INCIDENT_ID}: approved" in ran.stdout
    decisions = [(identity, args[0]) for name, identity, args in _signals(fleet, INCIDENT) if name == "decide"]
    # The client said "mallory" (its USER); the history says who the token is.
    assert decisions == [
        ("bob", {"approved": True, "by": "bob", "reason": "checked the node", "wait": 1, "incident_id": INCIDENT_ID})
    ]


def test_a_client_claiming_another_name_is_overwritten(fleet: Fleet) -> None:
    async def claim() -> None:
        client = await fleet.as_user("bob")
        await client.get_workflow_handle(INCIDENT).signal(
            "decide", Approval(approved=False, by="carol", reason="not me")
        )

    asyncio.run(claim())
    last = [(identity, args[0]["by"]) for name, identity, args in _signals(fleet, INCIDENT) if name == "decide"][-1]
    assert last == ("bob", "bob")


def test_temporals_own_errors_come_back_as_they_came(fleet: Fleet) -> None:
    """A call Temporal itself refuses (a workflow that does not exist) reaches the caller with
    Temporal's status and message, as `gpufleet breaker status` on a cluster with no guard meets it."""

    async def describe() -> RPCError:
        client = await fleet.as_user("carol")
        with pytest.raises(RPCError) as raised:
            await client.get_workflow_handle(f"guard-{CLUSTER}x").describe()
        return raised.value

    error = asyncio.run(describe())
    assert error.status == RPCStatusCode.NOT_FOUND, error
    shown = fleet.cli("carol", "breaker", "status", "--cluster", f"{CLUSTER}x")
    assert shown.returncode == 0, shown.stderr
    assert "no incident has asked the fleet guard yet" in shown.stdout


def test_an_unmapped_method_is_refused_even_to_an_operator(fleet: Fleet) -> None:
    async def terminate() -> RPCError:
        client = await fleet.as_user("carol")
        with pytest.raises(RPCError) as refused:
            await client.get_workflow_handle(INCIDENT).terminate(reason="because I can")
        return refused.value

    refused = asyncio.run(terminate())
    assert refused.status == RPCStatusCode.PERMISSION_DENIED
    assert "TerminateWorkflowExecution is not available through the gpufleet API" in refused.message

    async def status() -> WorkflowExecutionStatus | None:
        client = await connect_temporal(address=fleet.temporal)
        return (await client.get_workflow_handle(INCIDENT).describe()).status

    assert asyncio.run(status()) == WorkflowExecutionStatus.RUNNING


def test_no_credentials_is_a_clear_error(fleet: Fleet) -> None:
    ran = fleet.cli("nobody", "incidents", "list")
    assert ran.returncode == 2, ran.stderr
    assert "has neither a token nor a client certificate" in ran.stderr

    async def anonymous() -> str:
        with pytest.raises(Exception) as failed:  # the SDK's connect wraps what the server said
            await Client.connect(fleet.api, tls=TLSConfig(server_root_ca_cert=(fleet.certs / "ca.pem").read_bytes()))
        return str(failed.value)

    said = asyncio.run(anonymous())
    assert "no credentials: the gpufleet API needs a bearer token" in said

    bad = fleet.cli("alice", "incidents", "list", "--json")
    assert bad.returncode == 0  # alice's token stays good; a wrong one is refused by its review:
    wrong = dict(fleet.env("alice"))
    wrong_config = fleet.kubeconfigs["alice"].with_name("wrong.kubeconfig")
    wrong_config.write_text(fleet.kubeconfigs["alice"].read_text().replace(TOKENS["alice"], "not-a-token"))
    wrong["GPUFLEET_API_KUBECONFIG"] = str(wrong_config)
    ran = gpufleet_cli("incidents", "list", env=wrong)
    assert ran.returncode == 1, ran.stderr
    assert "the token was not accepted" in ran.stderr and len(ran.stderr.strip().splitlines()) == 1


def test_requests_are_counted_by_method_and_result(fleet: Fleet) -> None:
    fleet.cli("alice", "approve", INCIDENT)
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("gpufleet_api_requests")]
    assert any('method="SignalWorkflowExecution"' in line and 'result="denied"' in line for line in lines), lines
    assert any('method="QueryWorkflow"' in line and 'result="ok"' in line for line in lines), lines
