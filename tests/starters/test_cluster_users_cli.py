"""`gpufleet cluster users` as a person uses it, against the time-skipping test server with a
worker running the real cluster workflows and stand-in steps under the activities' real names:
what it checks before anything starts (exit 2, naming what is wrong), the steps it prints, a
failed change undone, and the cluster's current users as `users list`, `cluster show` and
`cluster delete` see them after a change."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.cluster import ClusterActivities
from clients.notify import WebhookNotifier
from models.cluster import ClusterSpec, load_spec
from models.clusterops import (
    CLUSTER_TASK_QUEUE,
    ClusterCreateInput,
    ClusterOutcome,
    ClusterRequest,
    ClusterStatus,
    JobsResult,
    StepResult,
    cluster_workflow_id,
)
from models.clusterusers import UsersAction, UsersChangeInput, UsersOutcome, users_workflow_id
from tests.models.test_cluster_spec import EXAMPLE
from tests.starters.test_cli_every_command import Ran, gpufleet
from workflows.cluster import DO, UNDO, ClusterCreationWorkflow, ClusterDeletionWorkflow
from workflows.clusterusers import ClusterUsersWorkflow

pytestmark = pytest.mark.timeout(120)

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGbRLO3ZFsuyq0E7A3y5lV8Kfy2kOQH9S+8q0q3JmfpH carol@laptop"
DELETION = ["cluster_stop_incidents", "cluster_drain", "cluster_notify_deleted", "cluster_cancel_jobs"]


@dataclass
class Server:
    """The test server and a worker on the cluster task queue, in a thread of their own."""

    address: str
    client: Client
    loop: asyncio.AbstractEventLoop
    calls: list[tuple[str, str, list[str]]] = field(default_factory=list)  # activity, cluster, users
    fail: dict[str, int] = field(default_factory=dict)
    differs: str = ""  # what the backend says of the logins now against a change's old users

    def logins_differ(self, spec: ClusterSpec) -> str:
        return self.differs

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def activities(self) -> list[Callable[..., Any]]:
        names = {*DO.values(), *UNDO.values(), *DELETION, "cluster_set_logins", "cluster_remove_users"}

        def make(name: str) -> Callable[..., Any]:
            @activity.defn(name=name)
            async def run(request: ClusterRequest) -> StepResult:
                self.calls.append((name, request.spec.name, [u.name for u in request.spec.users]))
                if self.fail.get(name, 0) > 0:
                    self.fail[name] -= 1
                    raise ApplicationError(f"{name} broke on purpose", type="StepFailed", non_retryable=True)
                return StepResult(detail=f"{name} ok")

            return run

        @activity.defn(name="cluster_running_jobs")
        async def running_jobs(request: ClusterRequest) -> JobsResult:
            return JobsResult(running=0)

        # The check of the cluster is the worker's own: it asks Temporal for the creation.
        real = ClusterActivities(None, {"lab": self}, WebhookNotifier(url=""))  # type: ignore[arg-type, dict-item]
        return [*(make(n) for n in sorted(names)), running_jobs, real.users_check]

    def create(self, name: str, *, fail_at: str = "") -> ClusterStatus:
        """A cluster made (its steps stood in for); ``fail_at``: the step that fails, rolled back."""
        raw = yaml.safe_load(EXAMPLE.read_text())
        raw["name"] = name
        spec: ClusterSpec = load_spec(raw)
        if fail_at:
            self.fail[fail_at] = 1

        async def go() -> ClusterStatus:
            handle = await self.client.start_workflow(
                ClusterCreationWorkflow.run,
                ClusterCreateInput(spec=spec, backend="lab"),
                id=cluster_workflow_id(name),
                task_queue=CLUSTER_TASK_QUEUE,
            )
            return await handle.result()

        return self.run(go())  # type: ignore[no-any-return]

    def gpufleet(self, *args: str) -> Ran:
        return gpufleet(*args, env={"TEMPORAL_ADDRESS": self.address})

    def of(self, cluster: str, activity_name: str) -> list[list[str]]:
        """The users each call of this activity for this cluster was given."""
        return [users for name, where, users in self.calls if name == activity_name and where == cluster]


@pytest.fixture(scope="module")
def server(temporal_test_server: str) -> Iterator[Server]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> WorkflowEnvironment:
        return await WorkflowEnvironment.start_time_skipping(
            data_converter=pydantic_data_converter,
            test_server_existing_path=temporal_test_server,
            test_server_startup_timeout=timedelta(seconds=60),
        )

    env = asyncio.run_coroutine_threadsafe(start(), loop).result(90)
    found = Server(env.client.service_client.config.target_host, env.client, loop)

    async def make() -> Worker:  # in the loop it runs in
        return Worker(
            env.client,
            task_queue=CLUSTER_TASK_QUEUE,
            workflows=[ClusterCreationWorkflow, ClusterDeletionWorkflow, ClusterUsersWorkflow],
            activities=found.activities(),
        )

    worker: Worker = found.run(make())

    async def serve() -> None:
        await worker.run()

    running = asyncio.run_coroutine_threadsafe(serve(), loop)
    try:
        yield found
    finally:
        found.run(worker.shutdown())
        running.result(30)
        found.run(env.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def fresh() -> str:
    return f"u{uuid.uuid4().hex[:8]}"


def test_a_user_added_shows_its_steps_and_is_listed_shown_and_removed_at_deletion(
    server: Server, tmp_path: Path
) -> None:
    name = fresh()
    assert server.create(name).outcome == ClusterOutcome.READY
    key_file = tmp_path / "id_ed25519.pub"
    key_file.write_text(f"# carol's laptop\n{KEY}\n")
    ran = server.gpufleet(
        "cluster", "users", "add", name, "--user", "carol", "--uid", "2100", "--key-file", str(key_file)
    )
    assert ran.code == 0, (ran.out, ran.err)
    out = " ".join(ran.out.split())
    for said in ("validate done: adding: carol", "add_accounts done", "set_logins done", "remove_accounts done"):
        assert said in out, out
    assert f"cluster {name}: users now alice, bob, carol" in out
    assert server.of(name, "cluster_set_logins") == [["alice", "bob", "carol"]]
    listed = server.gpufleet("cluster", "users", "list", name, "--json")
    assert listed.code == 0 and [u["name"] for u in json.loads(listed.out)] == ["alice", "bob", "carol"]
    carol = json.loads(listed.out)[2]
    assert carol["uid"] == 2100 and carol["ssh_keys"] == [KEY] and carol["account"] == "research"
    shown = server.gpufleet("cluster", "show", name)
    assert shown.code == 0 and "users: alice, bob, carol" in shown.out
    assert json.loads(server.gpufleet("cluster", "show", name, "--json").out)["users"] == ["alice", "bob", "carol"]
    # Then bob goes; the deletion removes the accounts of the users the cluster has now.
    removed = server.gpufleet("cluster", "users", "remove", name, "--user", "bob")
    assert removed.code == 0, (removed.out, removed.err)
    assert server.of(name, "cluster_remove_users") == [["alice", "bob", "carol"]]  # bob's account, from the old spec
    deleted = server.gpufleet("cluster", "delete", name)
    assert deleted.code == 0, (deleted.out, deleted.err)
    assert server.of(name, "cluster_remove_users")[-1] == ["alice", "carol"]


def test_new_keys_replace_the_old_ones(server: Server) -> None:
    name = fresh()
    server.create(name)
    ran = server.gpufleet("cluster", "users", "set-keys", name, "--user", "alice", "--key", KEY)
    assert ran.code == 0, (ran.out, ran.err)
    assert "validate done: new keys for: alice" in " ".join(ran.out.split())
    listed = json.loads(server.gpufleet("cluster", "users", "list", name, "--json").out)
    assert next(u for u in listed if u["name"] == "alice")["ssh_keys"] == [KEY]
    again = server.gpufleet("cluster", "users", "set-keys", name, "--user", "alice", "--key", KEY)
    assert again.code == 2 and "has these keys already" in again.error_line()


def test_a_failed_change_is_undone_says_why_and_leaves_the_users_as_they_were(server: Server) -> None:
    name = fresh()
    server.create(name)
    server.fail["cluster_set_logins"] = 1
    ran = server.gpufleet("cluster", "users", "add", name, "--user", "carol", "--uid", "2100", "--key", KEY)
    assert ran.code == 1
    out = " ".join(ran.out.split())
    assert "set_logins failed: cluster_set_logins broke on purpose" in out
    assert "add_accounts undone" in out and "the users are as they were" in out
    listed = json.loads(server.gpufleet("cluster", "users", "list", name, "--json").out)
    assert [u["name"] for u in listed] == ["alice", "bob"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["add", "{name}", "--user", "alice", "--uid", "2100", "--key", KEY], "user alice exists on"),
        (["add", "{name}", "--user", "carol", "--uid", "{alice_uid}", "--key", KEY], "is taken on {name} by alice"),
        (["add", "{name}", "--user", "carol", "--uid", "7", "--key", KEY], "outside the allowed range"),
        (["remove", "{name}", "--user", "carol"], "no user carol on {name} (its users: alice, bob)"),
        (["set-keys", "{name}", "--user", "carol", "--key", KEY], "no user carol on"),
    ],
)
def test_a_change_that_cannot_be_is_refused_before_it_starts(server: Server, args: list[str], says: str) -> None:
    name = fresh()
    made = server.create(name)
    assert made.spec is not None
    fill = {"name": name, "alice_uid": str(made.spec.users[0].uid)}
    ran = server.gpufleet("cluster", "users", *(a.format(**fill) for a in args))
    assert ran.code == 2, (ran.out, ran.err)
    assert says.format(**fill) in ran.error_line()
    assert server.of(name, "cluster_set_logins") == []  # no change started


def test_a_cluster_that_is_not_ready_or_not_there_is_said(server: Server) -> None:
    name = fresh()
    assert server.create(name, fail_at="cluster_smoke_test").outcome == ClusterOutcome.ROLLED_BACK
    ran = server.gpufleet("cluster", "users", "add", name, "--user", "carol", "--uid", "2100", "--key", KEY)
    assert ran.code == 1 and f"cluster {name} is not ready (it is rolled_back)" in ran.error_line()
    nothing = server.gpufleet("cluster", "users", "remove", fresh(), "--user", "carol")
    assert nothing.code == 2 and "no cluster named" in nothing.error_line()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["add", "research", "--user", "Carol", "--uid", "2100", "--key", KEY], "name: a Linux user name"),
        (["add", "research", "--user", "carol", "--uid", "2100", "--key", "ssh-ed25519 nope"], "not valid base64"),
        (["add", "research", "--user", "carol", "--uid", "2100", "--key", "ssh-dss AAAA"], "unknown SSH key type"),
        (["add", "research", "--user", "carol", "--uid", "2100"], "no SSH key given"),
        (["set-keys", "research", "--user", "carol"], "no SSH key given"),
        (["set-keys", "research", "--user", "carol", "--key-file", "/nonexistent/id.pub"], "cannot read"),
        (["remove", "research", "--user", "-x"], "--user '-x': a Linux user name"),
        (["list", "Bad Name"], "invalid cluster name"),
    ],
)
def test_bad_input_is_refused_before_anything_is_contacted(args: list[str], says: str, tmp_path: Path) -> None:
    ran = gpufleet("cluster", "users", *args, env={"TEMPORAL_ADDRESS": "127.0.0.1:9", "GPUFLEET_HOME": str(tmp_path)})
    assert ran.code == 2, (ran.out, ran.err)
    assert says in ran.error_line()


def test_the_workflow_checks_the_creation_it_is_given(server: Server) -> None:
    """What the command read is checked again by the worker: a change naming another creation of
    the cluster, or a cluster that is not there, is refused, and nothing changes."""
    name = fresh()
    made = server.create(name)
    spec = made.spec
    assert spec is not None
    new = spec.model_copy(update={"users": spec.users[:1]})

    async def change(cluster: str, creation: str) -> Any:
        request = UsersChangeInput(
            name=cluster,
            backend="lab",
            creation=creation,
            old=spec.model_copy(update={"name": cluster}),
            new=new.model_copy(update={"name": cluster}),
            action=UsersAction.REMOVE,
        )
        handle = await server.client.start_workflow(
            ClusterUsersWorkflow.run, request, id=users_workflow_id(cluster), task_queue=CLUSTER_TASK_QUEUE
        )
        return await handle.result()

    stale = server.run(change(name, "an-earlier-creation"))
    assert stale.outcome == UsersOutcome.REFUSED and f"was made by creation {made.creation}" in stale.error
    nowhere = server.run(change(fresh(), made.creation))
    assert nowhere.outcome == UsersOutcome.REFUSED and "no cluster named" in nowhere.error
    assert server.of(name, "cluster_set_logins") == []


def test_a_change_read_before_another_ended_is_refused_and_moves_nothing(server: Server) -> None:
    """The logins are not what the change read (another change ended in between): refused, no
    step runs, and the users now are still those of the last change that was done."""
    name = fresh()
    server.create(name)
    assert server.gpufleet("cluster", "users", "remove", name, "--user", "bob").code == 0
    steps_before = len(server.calls)
    server.differs = "its users are alice"
    try:
        late = server.gpufleet("cluster", "users", "add", name, "--user", "carol", "--uid", "2100", "--key", KEY)
    finally:
        server.differs = ""
    said = " ".join((late.out + late.err).split())  # as one line, however the terminal wrapped it
    assert late.code == 1 and "users changed since this change was read (its users are alice)" in said
    assert [call for call in server.calls[steps_before:] if call[1] == name] == []  # no step ran
    listed = server.gpufleet("cluster", "users", "list", name, "--json")
    assert listed.code == 0, listed.out + listed.err
    assert [user["name"] for user in json.loads(listed.out)] == ["alice"]
