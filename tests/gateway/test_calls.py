"""The API's table: every call a gpufleet command makes maps to its gpufleet.io permission; anything
else is refused; what names who asked is the authenticated user's."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.api.common.v1 import (
    Callback,
    Header,
    Link,
    Memo,
    Payloads,
    Priority,
    RetryPolicy,
    WorkflowExecution,
    WorkflowType,
)
from temporalio.api.enums.v1 import ResetReapplyType, WorkflowIdConflictPolicy, WorkflowIdReusePolicy
from temporalio.api.query.v1 import WorkflowQuery
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice import v1 as ws
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import encode_search_attributes

from gateway.calls import Access, Refused, access, listing_access, stamp
from models.cluster import load_spec
from models.clusterops import ClusterCreateInput, ClusterDeleteInput
from models.clusterusers import UsersAction, UsersChangeInput
from models.guard import GuardCommand, GuardInput, GuardState
from models.incident import Approval, CancelRequest, RemediationInput
from models.poolops import PoolSettings, PoolState
from models.requests import ReleaseNodeRequest, ReturnNodeRequest
from models.topology import DomainDecision, NodeDomainsInput
from models.xid import XidEvent

NS = "default"
REPO = Path(__file__).resolve().parents[2]
SPEC = load_spec(yaml.safe_load((REPO / "examples" / "cluster.yaml").read_text()))
CONVERT = pydantic_data_converter.payload_converter


def args(*values: Any) -> Payloads:
    return Payloads(payloads=CONVERT.to_payloads(list(values)))


def decoded(payloads: Payloads, index: int = 0) -> Any:
    return CONVERT.from_payloads([payloads.payloads[index]], [dict])[0]


def start(kind: str, workflow_id: str, queue: str, *inputs: Any) -> ws.StartWorkflowExecutionRequest:
    return ws.StartWorkflowExecutionRequest(
        namespace=NS,
        workflow_id=workflow_id,
        workflow_type=WorkflowType(name=kind),
        task_queue=TaskQueue(name=queue),
        input=args(*inputs),
        identity="whoever@laptop",
    )


def signal_with_start(
    kind: str, workflow_id: str, queue: str, signal: str, given: Any, *signal_args: Any
) -> ws.SignalWithStartWorkflowExecutionRequest:
    return ws.SignalWithStartWorkflowExecutionRequest(
        namespace=NS,
        workflow_id=workflow_id,
        workflow_type=WorkflowType(name=kind),
        task_queue=TaskQueue(name=queue),
        input=args(given),
        signal_name=signal,
        signal_input=args(*signal_args),
    )


def signal(workflow_id: str, name: str, *signal_args: Any) -> ws.SignalWorkflowExecutionRequest:
    return ws.SignalWorkflowExecutionRequest(
        namespace=NS,
        workflow_execution=WorkflowExecution(workflow_id=workflow_id),
        signal_name=name,
        input=args(*signal_args) if signal_args else None,
        identity="whoever@laptop",
    )


def query(workflow_id: str, name: str = "status") -> ws.QueryWorkflowRequest:
    return ws.QueryWorkflowRequest(
        namespace=NS, execution=WorkflowExecution(workflow_id=workflow_id), query=WorkflowQuery(query_type=name)
    )


def listing(text: str) -> ws.ListWorkflowExecutionsRequest:
    return ws.ListWorkflowExecutionsRequest(namespace=NS, query=text)


POOL = PoolState(settings=PoolSettings(name="lab", cluster="lab", partition="train"))
USERS = UsersChangeInput(
    name="research", backend="lab", creation="run1", old=SPEC, new=SPEC, action=UsersAction.ADD, requested_by="x"
)
XID = XidEvent(node="gpu1", xid=79, source="cli")

# Every call of the commands in starters/ (and Client.connect's), with what it needs.
EVERY_CALL: list[tuple[str, str, Any, list[Access]]] = [
    ("connect", "GetSystemInfo", ws.GetSystemInfoRequest(), []),
    (
        "remediate",
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "NodeRemediationWorkflow",
            "remediate-lab-gpu1",
            "gpufleet-lab",
            "report_xid",
            RemediationInput(cluster="lab", node="gpu1"),
            XID,
        ),
        [Access("create", "incidents", "gpu1")],
    ),
    (
        "remediate --dry-run",
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "NodeRemediationWorkflow",
            "dryrun-lab-gpu1",
            "gpufleet-lab",
            "report_xid",
            RemediationInput(cluster="lab", node="gpu1", dry_run=True),
            XID,
        ),
        [Access("create", "incidents", "gpu1")],
    ),
    (
        "remediate (follow)",
        "DescribeWorkflowExecution",
        ws.DescribeWorkflowExecutionRequest(
            namespace=NS, execution=WorkflowExecution(workflow_id="remediate-lab-gpu1")
        ),
        [Access("get", "incidents")],
    ),
    (
        "remediate --wait (result)",
        "GetWorkflowExecutionHistory",
        ws.GetWorkflowExecutionHistoryRequest(
            namespace=NS, execution=WorkflowExecution(workflow_id="remediate-lab-gpu1"), wait_new_event=True
        ),
        [Access("get", "incidents")],
    ),
    ("incidents show", "QueryWorkflow", query("remediate-lab-gpu1"), [Access("get", "incidents")]),
    (
        "incidents list",
        "ListWorkflowExecutions",
        listing("WorkflowType='NodeRemediationWorkflow'"),
        [Access("list", "incidents")],
    ),
    (
        "checkpoint-done",
        "SignalWorkflowExecution",
        signal("remediate-lab-gpu1", "checkpoint_done", 42),
        [Access("update", "incidents")],
    ),
    (
        "spare-available",
        "SignalWorkflowExecution",
        signal("remediate-lab-gpu1", "spare_available"),
        [Access("update", "incidents")],
    ),
    (
        "approve",
        "SignalWorkflowExecution",
        signal("remediate-lab-gpu1", "decide", Approval(approved=True)),
        [Access("approve", "incidents")],
    ),
    (
        "reject (a dry run)",
        "SignalWorkflowExecution",
        signal("dryrun-lab-gpu1", "decide", Approval(approved=False)),
        [Access("approve", "incidents")],
    ),
    (
        "incidents cancel",
        "SignalWorkflowExecution",
        signal("remediate-lab-gpu1", "cancel_requested", CancelRequest()),
        [Access("cancel", "incidents")],
    ),
    (
        "incidents cancel",
        "RequestCancelWorkflowExecution",
        ws.RequestCancelWorkflowExecutionRequest(
            namespace=NS, workflow_execution=WorkflowExecution(workflow_id="remediate-lab-gpu1")
        ),
        [Access("cancel", "incidents")],
    ),
    (
        "nodes return",
        "StartWorkflowExecution",
        start("ReturnNodeWorkflow", "return-lab-gpu1", "gpufleet-lab", ReturnNodeRequest(node="gpu1")),
        [Access("return", "nodes", "gpu1")],
    ),
    (
        "nodes return (result)",
        "GetWorkflowExecutionHistory",
        ws.GetWorkflowExecutionHistoryRequest(namespace=NS, execution=WorkflowExecution(workflow_id="return-lab-gpu1")),
        [Access("get", "nodes")],
    ),
    (
        "nodes release",
        "StartWorkflowExecution",
        start("ReleaseNodeWorkflow", "release-lab-gpu1", "gpufleet-lab", ReleaseNodeRequest(node="gpu1")),
        [Access("release", "nodes", "gpu1")],
    ),
    (
        "nodes quarantined",
        "StartWorkflowExecution",
        start("QuarantinedNodesWorkflow", "quarantined-lab-1765000000000", "gpufleet-lab"),
        [Access("list", "nodes", "lab")],
    ),
    (
        "nodes show",
        "StartWorkflowExecution",
        start(
            "NodeDomainsWorkflow",
            "show-node-lab-1765000000000",
            "gpufleet-lab",
            NodeDomainsInput(node="gpu1", cluster="lab"),
        ),
        [Access("get", "nodes", "lab")],
    ),
    (
        "nodes show (result)",
        "GetWorkflowExecutionHistory",
        ws.GetWorkflowExecutionHistoryRequest(
            namespace=NS, execution=WorkflowExecution(workflow_id="show-node-lab-1765000000000")
        ),
        [Access("get", "nodes", "lab")],
    ),
    ("breaker status", "QueryWorkflow", query("guard-lab"), [Access("get", "breaker", "lab")]),
    ("domains show", "QueryWorkflow", query("domain-lab-rack-a"), [Access("get", "incidents", "lab")]),
    (
        "domains confirm",
        "SignalWorkflowExecution",
        signal("domain-lab-rack-a", "domain_decide", DomainDecision(confirm=True)),
        [Access("approve", "incidents", "lab")],
    ),
    (
        "domains confirm (two readings: cluster prod, rack zone-x; or cluster prod-rack, zone x)",
        "SignalWorkflowExecution",
        signal("domain-prod-rack-zone-x", "domain_decide", DomainDecision(confirm=True)),
        [Access("approve", "incidents")],
    ),
    (
        "domains release (a cluster with '-')",
        "SignalWorkflowExecution",
        signal("domain-lab-east-switch-leaf-3", "domain_decide", DomainDecision(confirm=False)),
        [Access("approve", "incidents", "lab-east")],
    ),
    (
        "breaker reset",
        "SignalWorkflowExecution",
        signal("guard-lab", "reset", GuardCommand()),
        [Access("reset", "breaker", "lab")],
    ),
    (
        "pause",
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "FleetGuardWorkflow", "guard-lab", "gpufleet-lab.guard", "pause", GuardInput(cluster="lab"), GuardCommand()
        ),
        [Access("pause", "breaker", "lab")],
    ),
    (
        "resume",
        "SignalWorkflowExecution",
        signal("guard-lab", "resume", GuardCommand()),
        [Access("pause", "breaker", "lab")],
    ),
    (
        "pause --all",
        "ListWorkflowExecutions",
        listing("WorkflowType='FleetGuardWorkflow' AND ExecutionStatus='Running'"),
        [Access("list", "breaker")],
    ),
    (
        "cluster create",
        "StartWorkflowExecution",
        start("ClusterCreation", "cluster-research", "gpufleet-clusters", ClusterCreateInput(spec=SPEC, backend="lab")),
        [Access("create", "clusters", "research")],
    ),
    (
        "cluster create --resume",
        "SignalWorkflowExecution",
        signal("cluster-research", "resume"),
        [Access("create", "clusters", "research")],
    ),
    (
        "cluster create --roll-back",
        "SignalWorkflowExecution",
        signal("cluster-research", "roll_back"),
        [Access("create", "clusters", "research")],
    ),
    ("cluster show", "QueryWorkflow", query("cluster-research"), [Access("get", "clusters", "research")]),
    (
        "cluster show (deletion)",
        "QueryWorkflow",
        query("delete-cluster-research"),
        [Access("get", "clusters", "research")],
    ),
    (
        "cluster show (users)",
        "DescribeWorkflowExecution",
        ws.DescribeWorkflowExecutionRequest(
            namespace=NS, execution=WorkflowExecution(workflow_id="users-cluster-research")
        ),
        [Access("get", "clusters", "research")],
    ),
    (
        "cluster show (users' runs)",
        "ListWorkflowExecutions",
        listing('WorkflowId = "users-cluster-research"'),
        [Access("list", "clusters", "research")],
    ),
    ("cluster list", "ListWorkflowExecutions", listing("WorkflowType='ClusterCreation'"), [Access("list", "clusters")]),
    (
        "cluster delete",
        "StartWorkflowExecution",
        start(
            "ClusterDeletion",
            "delete-cluster-research",
            "gpufleet-clusters",
            ClusterDeleteInput(spec=SPEC, backend="lab"),
        ),
        [Access("delete", "clusters", "research")],
    ),
    (
        "cluster users add",
        "StartWorkflowExecution",
        start("ClusterUsers", "users-cluster-research", "gpufleet-clusters", USERS),
        [Access("update", "clusters", "research")],
    ),
    (
        "pool start",
        "StartWorkflowExecution",
        start("PoolRebalance", "pool-lab", "gpufleet-lab", POOL),
        [Access("rebalance", "pool", "lab")],
    ),
    ("pool status", "QueryWorkflow", query("pool-lab"), [Access("get", "pool", "lab")]),
    (
        "pool rebalance",
        "SignalWorkflowExecution",
        signal("pool-lab", "rebalance", 2),
        [Access("rebalance", "pool", "lab")],
    ),
    (
        "pool set-demand",
        "SignalWorkflowExecution",
        signal("pool-lab", "set_demand", 3.0, "me"),
        [Access("rebalance", "pool", "lab")],
    ),
    ("pool pause", "SignalWorkflowExecution", signal("pool-lab", "pause"), [Access("rebalance", "pool", "lab")]),
    ("pool resume", "SignalWorkflowExecution", signal("pool-lab", "resume"), [Access("rebalance", "pool", "lab")]),
]


@pytest.mark.parametrize(("command", "method", "request_", "needed"), EVERY_CALL, ids=[c[0] for c in EVERY_CALL])
def test_every_call_of_the_commands_maps_to_its_permission(
    command: str, method: str, request_: Any, needed: list[Access]
) -> None:
    assert access(method, request_, namespace=NS) == needed


def test_a_listing_needs_what_it_may_reach() -> None:
    assert listing_access("") == [Access("list", "workflows")]
    assert listing_access("WorkflowType='SomethingElse'") == [Access("list", "workflows")]
    # An OR may reach beyond the type named: the wider permission too.
    assert listing_access("WorkflowType='NodeRemediationWorkflow' OR StartTime > '2026-01-01'") == [
        Access("list", "incidents"),
        Access("list", "workflows"),
    ]


REFUSED: list[tuple[str, Any, str]] = [
    (
        "TerminateWorkflowExecution",
        ws.TerminateWorkflowExecutionRequest(
            namespace=NS, workflow_execution=WorkflowExecution(workflow_id="remediate-lab-gpu1")
        ),
        "TerminateWorkflowExecution is not available",
    ),
    (
        "ResetWorkflowExecution",
        ws.ResetWorkflowExecutionRequest(
            namespace=NS,
            workflow_execution=WorkflowExecution(workflow_id="remediate-lab-gpu1"),
            reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_SIGNAL,
        ),
        "ResetWorkflowExecution is not available",
    ),
    ("DeleteWorkflowExecution", ws.DeleteWorkflowExecutionRequest(namespace=NS), "not available"),
    ("UpdateNamespace", ws.UpdateNamespaceRequest(namespace=NS), "not available"),
    ("CreateSchedule", ws.CreateScheduleRequest(namespace=NS), "not available"),
    ("PollWorkflowTaskQueue", ws.PollWorkflowTaskQueueRequest(namespace=NS), "not available"),
    ("RespondActivityTaskCompleted", ws.RespondActivityTaskCompletedRequest(namespace=NS), "not available"),
    ("StartWorkflowExecution", start("SomebodyElsesWorkflow", "x-1", "q"), "none of gpufleet's commands"),
    ("SignalWorkflowExecution", signal("guard-lab", "admit", GuardCommand()), "not one a gpufleet command sends"),
    ("SignalWorkflowExecution", signal("remediate-lab-gpu1", "guard_decision"), "not one a gpufleet command sends"),
    ("SignalWorkflowExecution", signal("reaper-lab", "wake"), "none of gpufleet's"),
    ("SignalWorkflowExecution", signal("someone-elses", "x"), "none of gpufleet's"),
    ("QueryWorkflow", query("remediate-lab-gpu1", "__stack_trace"), "not one a gpufleet command makes"),
    (
        "RequestCancelWorkflowExecution",
        ws.RequestCancelWorkflowExecutionRequest(
            namespace=NS, workflow_execution=WorkflowExecution(workflow_id="guard-lab")
        ),
        "only an incident is cancelled",
    ),
    # A remediation started plainly would skip its first Xid: only signal-with-start opens one.
    (
        "StartWorkflowExecution",
        start(
            "NodeRemediationWorkflow",
            "remediate-lab-gpu1",
            "gpufleet-lab",
            RemediationInput(cluster="lab", node="gpu1"),
        ),
        "started with its first signal only",
    ),
    (
        "QueryWorkflow",
        ws.QueryWorkflowRequest(
            namespace="other",
            execution=WorkflowExecution(workflow_id="guard-lab"),
            query=WorkflowQuery(query_type="status"),
        ),
        "this API serves namespace 'default'",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "said"), REFUSED, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(REFUSED)]
)
def test_anything_else_is_refused_naming_what(method: str, request_: Any, said: str) -> None:
    with pytest.raises(Refused, match=said) as refused:
        access(method, request_, namespace=NS)
    assert not refused.value.invalid


MALFORMED: list[tuple[str, Any, str]] = [
    # An incident of one cluster on another's task queue, or under another node's ID.
    (
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "NodeRemediationWorkflow",
            "remediate-lab-gpu1",
            "gpufleet-prod",
            "report_xid",
            RemediationInput(cluster="lab", node="gpu1"),
            XID,
        ),
        "runs as remediate-lab-gpu1 on task queue gpufleet-lab",
    ),
    (
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "NodeRemediationWorkflow",
            "remediate-lab-gpu2",
            "gpufleet-lab",
            "report_xid",
            RemediationInput(cluster="lab", node="gpu1"),
            XID,
        ),
        "runs as remediate-lab-gpu1",
    ),
    # A dry run under the real incident's ID would change the node.
    (
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "NodeRemediationWorkflow",
            "remediate-lab-gpu1",
            "gpufleet-lab",
            "report_xid",
            RemediationInput(cluster="lab", node="gpu1", dry_run=True),
            XID,
        ),
        "runs as dryrun-lab-gpu1",
    ),
    (
        "SignalWithStartWorkflowExecution",
        signal_with_start(
            "NodeRemediationWorkflow",
            "remediate-lab-$(reboot)",
            "gpufleet-lab",
            "report_xid",
            RemediationInput(cluster="lab", node="$(reboot)"),
            XID,
        ),
        "not a valid cluster and node",
    ),
    (
        "StartWorkflowExecution",
        start(
            "ClusterDeletion", "delete-cluster-other", "gpufleet-clusters", ClusterDeleteInput(spec=SPEC, backend="lab")
        ),
        "delete-cluster-research",
    ),
    (
        "StartWorkflowExecution",
        start("ClusterDeletion", "delete-cluster-research", "gpufleet-clusters", {"x": 1}),
        "not a ClusterDeleteInput",
    ),
    ("QueryWorkflow", query("guard-Not_A_Cluster"), "invalid cluster name"),
    (
        "StartWorkflowExecution",
        start("NodeDomainsWorkflow", "show-node-lab-1", "gpufleet-other", NodeDomainsInput(node="gpu1")),
        "runs as show-node-lab-1 on task queue gpufleet-lab",
    ),
    (
        "StartWorkflowExecution",
        start("NodeDomainsWorkflow", "show-node-lab-1", "gpufleet-lab", NodeDomainsInput(node="gpu1", cluster="other")),
        "reads its own cluster, not other",
    ),
    (
        "StartWorkflowExecution",
        start("NodeDomainsWorkflow", "show-node-lab-1", "gpufleet-lab", NodeDomainsInput(node="$(reboot)")),
        "invalid node name",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "said"), MALFORMED, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(MALFORMED)]
)
def test_a_malformed_request_is_invalid_input(method: str, request_: Any, said: str) -> None:
    with pytest.raises(Refused, match=said) as refused:
        access(method, request_, namespace=NS)
    assert refused.value.invalid


def test_who_asked_is_the_authenticated_user_whatever_the_client_said() -> None:
    approve = signal("remediate-lab-gpu1", "decide", Approval(approved=True, by="mallory", reason="fine"))
    stamp("SignalWorkflowExecution", approve, "bob")
    assert approve.identity == "bob"
    assert decoded(approve.input) == {**Approval(approved=True, by="bob", reason="fine").model_dump()}

    cancel = signal("remediate-lab-gpu1", "cancel_requested", CancelRequest(by="mallory"))
    stamp("SignalWorkflowExecution", cancel, "bob")
    assert decoded(cancel.input)["by"] == "bob"

    pause = signal_with_start(
        "FleetGuardWorkflow",
        "guard-lab",
        "gpufleet-lab.guard",
        "pause",
        GuardInput(cluster="lab"),
        GuardCommand(by="mallory"),
    )
    stamp("SignalWithStartWorkflowExecution", pause, "carol")
    assert pause.identity == "carol"
    assert decoded(pause.signal_input)["by"] == "carol"

    delete = start(
        "ClusterDeletion",
        "delete-cluster-research",
        "gpufleet-clusters",
        ClusterDeleteInput(spec=SPEC, backend="lab", requested_by="mallory", force=True),
    )
    stamp("StartWorkflowExecution", delete, "carol")
    assert (delete.identity, decoded(delete.input)["requested_by"], decoded(delete.input)["force"]) == (
        "carol",
        "carol",
        True,
    )

    demand = signal("pool-lab", "set_demand", 3.0)  # who, left to its default by the client
    stamp("SignalWorkflowExecution", demand, "carol")
    assert CONVERT.from_payloads(list(demand.input.payloads), [float, str]) == [3.0, "carol"]

    request = ws.RequestCancelWorkflowExecutionRequest(
        namespace=NS,
        workflow_execution=WorkflowExecution(workflow_id="remediate-lab-gpu1"),
        reason="gpufleet incidents cancel by mallory: wrong node",
    )
    stamp("RequestCancelWorkflowExecution", request, "bob")
    assert (request.identity, request.reason) == ("bob", "gpufleet incidents cancel by bob: wrong node")


@pytest.mark.parametrize(
    "query",
    [
        # A term inside a comment or a string literal filters nothing.
        "/* WorkflowType='NodeRemediationWorkflow' */ ExecutionStatus='Running'",
        "WorkflowId >= \"WorkflowType='NodeRemediationWorkflow'\"",
        "ExecutionStatus='Running' -- WorkflowType='NodeRemediationWorkflow'",
        # Other spellings of or and not.
        "WorkflowType='NodeRemediationWorkflow' || ExecutionStatus='Running'",
        "WorkflowType='NodeRemediationWorkflow' AND WorkflowId <> 'x'",
        "WorkflowType='NodeRemediationWorkflow' XOR ExecutionStatus='Running'",
    ],
)
def test_a_listing_that_may_reach_beyond_what_it_names_needs_the_wider_permission(query: str) -> None:
    assert Access("list", "workflows") in listing_access(query)


def test_a_listing_of_what_the_commands_name_needs_only_that() -> None:
    assert listing_access("WorkflowType='FleetGuardWorkflow' AND ExecutionStatus='Running'") == [
        Access("list", "breaker")
    ]
    assert listing_access('WorkflowId = "cluster-research"') == [Access("list", "clusters", "research")]


def _incident(**options: Any) -> ws.SignalWithStartWorkflowExecutionRequest:
    request = signal_with_start(
        "NodeRemediationWorkflow",
        "remediate-lab-gpu1",
        "gpufleet-lab",
        "report_xid",
        RemediationInput(cluster="lab", node="gpu1"),
        XID,
    )
    request.MergeFrom(ws.SignalWithStartWorkflowExecutionRequest(**options))
    return request


def _return(**options: Any) -> ws.StartWorkflowExecutionRequest:
    request = start("ReturnNodeWorkflow", "return-lab-gpu1", "gpufleet-lab", ReturnNodeRequest(node="gpu1"))
    request.MergeFrom(ws.StartWorkflowExecutionRequest(**options))
    return request


OPTIONS_REFUSED: list[tuple[str, Any, str]] = [
    ("StartWorkflowExecution", _return(cron_schedule="* * * * *"), "field cron_schedule"),
    ("StartWorkflowExecution", _return(request_eager_execution=True), "field request_eager_execution"),
    (
        "StartWorkflowExecution",
        _return(completion_callbacks=[Callback(nexus=Callback.Nexus(url="http://169.254.169.254/"))]),
        "field completion_callbacks",
    ),
    ("StartWorkflowExecution", _return(retry_policy=RetryPolicy(maximum_attempts=0)), "field retry_policy"),
    ("StartWorkflowExecution", _return(priority=Priority(priority_key=1)), "field priority"),
    ("StartWorkflowExecution", _return(memo=Memo(fields={"by": CONVERT.to_payloads(["mallory"])[0]})), "field memo"),
    (
        "StartWorkflowExecution",
        _return(header=Header(fields={"by": CONVERT.to_payloads(["mallory"])[0]})),
        "header \\['by'\\]",
    ),
    (
        "StartWorkflowExecution",
        _return(workflow_id_reuse_policy=WorkflowIdReusePolicy.WORKFLOW_ID_REUSE_POLICY_TERMINATE_IF_RUNNING),
        "terminates the running return-lab-gpu1",
    ),
    (
        "SignalWithStartWorkflowExecution",
        _incident(workflow_id_conflict_policy=WorkflowIdConflictPolicy.WORKFLOW_ID_CONFLICT_POLICY_TERMINATE_EXISTING),
        "terminates the running remediate-lab-gpu1",
    ),
    (
        "SignalWorkflowExecution",
        ws.SignalWorkflowExecutionRequest(
            namespace=NS,
            workflow_execution=WorkflowExecution(workflow_id="remediate-lab-gpu1"),
            signal_name="spare_available",
            links=[Link()],
        ),
        "field links",
    ),
    (
        "RequestCancelWorkflowExecution",
        ws.RequestCancelWorkflowExecutionRequest(
            namespace=NS, workflow_execution=WorkflowExecution(workflow_id="remediate-lab-gpu1"), links=[Link()]
        ),
        "field links",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "said"),
    OPTIONS_REFUSED,
    ids=[said for _, _, said in OPTIONS_REFUSED],
)
def test_an_option_no_command_sets_is_refused(method: str, request_: Any, said: str) -> None:
    with pytest.raises(Refused, match=said):
        access(method, request_, namespace=NS)


def test_a_deletion_cut_short_by_its_deadline_is_refused() -> None:
    request = start(
        "ClusterDeletion", "delete-cluster-research", "gpufleet-clusters", ClusterDeleteInput(spec=SPEC, backend="lab")
    )
    assert access("StartWorkflowExecution", request, namespace=NS) == [Access("delete", "clusters", "research")]
    request.workflow_execution_timeout.FromTimedelta(timedelta(seconds=1))
    with pytest.raises(Refused, match="workflow_execution_timeout"):
        access("StartWorkflowExecution", request, namespace=NS)


def test_an_incident_carries_only_its_own_search_attributes() -> None:
    def with_attributes(**values: Any) -> ws.SignalWithStartWorkflowExecutionRequest:
        request = _incident()
        pairs = [SearchAttributePair(SearchAttributeKey.for_keyword(k), v) for k, v in values.items()]
        encode_search_attributes(TypedSearchAttributes(pairs), request.search_attributes)
        return request

    assert access("SignalWithStartWorkflowExecution", with_attributes(Cluster="lab", GpuNode="gpu1"), namespace=NS) == [
        Access("create", "incidents", "gpu1")
    ]
    with pytest.raises(Refused, match="Cluster must be 'lab'"):
        access("SignalWithStartWorkflowExecution", with_attributes(Cluster="prod", GpuNode="gpu1"), namespace=NS)
    with pytest.raises(Refused, match="'Owner'"):
        access("SignalWithStartWorkflowExecution", with_attributes(Owner="mallory"), namespace=NS)
    request = _return()
    encode_search_attributes(
        TypedSearchAttributes([SearchAttributePair(SearchAttributeKey.for_keyword("Cluster"), "lab")]),
        request.search_attributes,
    )
    with pytest.raises(Refused, match="search_attributes is not one a ReturnNodeWorkflow"):
        access("StartWorkflowExecution", request, namespace=NS)


@pytest.mark.parametrize(
    ("method", "request_", "field"),
    [
        (
            "SignalWithStartWorkflowExecution",
            signal_with_start(
                "NodeRemediationWorkflow",
                "remediate-lab-gpu1",
                "gpufleet-lab",
                "report_xid",
                RemediationInput(cluster="lab", node="gpu1", pending_events=[XID]),
                XID,
            ),
            "pending_events",
        ),
        (
            "SignalWithStartWorkflowExecution",
            signal_with_start(
                "FleetGuardWorkflow",
                "guard-lab",
                "gpufleet-lab.guard",
                "pause",
                GuardInput(cluster="lab", state=GuardState(cluster="lab")),
                GuardCommand(),
            ),
            "state",
        ),
        (
            "StartWorkflowExecution",
            start("PoolRebalance", "pool-lab", "gpufleet-lab", POOL.model_copy(update={"override_by": "x"})),
            "override_by",
        ),
        ("StartWorkflowExecution", start("QuarantinedNodesWorkflow", "quarantined-lab-1", "gpufleet-lab", 1), "input"),
    ],
)
def test_a_start_may_not_hand_a_workflow_a_past(method: str, request_: Any, field: str) -> None:
    with pytest.raises(Refused, match=field) as refused:
        access(method, request_, namespace=NS)
    assert refused.value.invalid


def test_an_incident_whose_every_task_would_time_out_is_refused() -> None:
    request = _incident()
    request.workflow_task_timeout.FromTimedelta(timedelta(seconds=5))
    assert access("SignalWithStartWorkflowExecution", request, namespace=NS) == [Access("create", "incidents", "gpu1")]
    request.workflow_task_timeout.FromTimedelta(timedelta(milliseconds=1))
    with pytest.raises(Refused, match="workflow_task_timeout under 1 s"):
        access("SignalWithStartWorkflowExecution", request, namespace=NS)


def test_an_xid_is_for_the_incident_s_own_node() -> None:
    other = XidEvent(node="gpu2", xid=79, source="cli")
    with pytest.raises(Refused, match="an Xid of gpu2 is not for incident remediate-lab-gpu1") as refused:
        access(
            "SignalWithStartWorkflowExecution",
            signal_with_start(
                "NodeRemediationWorkflow",
                "remediate-lab-gpu1",
                "gpufleet-lab",
                "report_xid",
                RemediationInput(cluster="lab", node="gpu1"),
                other,
            ),
            namespace=NS,
        )
    assert refused.value.invalid
    with pytest.raises(Refused, match="an Xid of gpu2 is not for incident remediate-lab-gpu1"):
        access("SignalWorkflowExecution", signal("remediate-lab-gpu1", "report_xid", other), namespace=NS)
    assert access("SignalWorkflowExecution", signal("remediate-lab-gpu1", "report_xid", XID), namespace=NS) == [
        Access("create", "incidents")
    ]
