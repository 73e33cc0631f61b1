"""Which gpufleet permission each call of Temporal's WorkflowService needs, and the identity it carries.

Every call the ``gpufleet`` commands make is named here (the table is in docs/api.md): a start
by its workflow type and ID, a signal by its name, a query, a description, a history or a
listing by the workflow it reads. Anything this table does not name is refused (default deny):
another method (terminate, reset, delete, namespaces, schedules, workers), another workflow
type, another signal or query, a workflow ID of no known form, another namespace.

What the caller cannot be trusted with is replaced here (``stamp``): the request's ``identity``
and the ``by``/``requested_by`` of what a person asks for, so that a history names the
authenticated user, never what the client said.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from google.protobuf.message import Message
from pydantic import BaseModel, ValidationError
from temporalio.api.common.v1 import Payloads
from temporalio.api.enums.v1 import WorkflowIdConflictPolicy, WorkflowIdReusePolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import decode_typed_search_attributes

from models.clusterops import (
    CLUSTER_CREATION_WORKFLOW,
    CLUSTER_DELETION_WORKFLOW,
    CLUSTER_TASK_QUEUE,
    RESUME_SIGNAL,
    ROLL_BACK_SIGNAL,
    ClusterCreateInput,
    ClusterDeleteInput,
    cluster_workflow_id,
    deletion_workflow_id,
)
from models.clusterusers import CLUSTER_USERS_WORKFLOW, UsersChangeInput, users_workflow_id
from models.constants import (
    GUARD_PAUSE_SIGNAL,
    GUARD_RESET_SIGNAL,
    GUARD_RESUME_SIGNAL,
    GUARD_WORKFLOW,
    QUARANTINED_NODES_WORKFLOW,
    RELEASE_NODE_WORKFLOW,
    REMEDIATION_WORKFLOW,
    RETURN_NODE_WORKFLOW,
    SA_CLUSTER,
    SA_EVENT_KIND,
    SA_GPU_NODE,
    SA_XID,
    dry_run_workflow_id,
    guard_task_queue,
    guard_workflow_id,
    release_workflow_id,
    remediation_workflow_id,
    return_workflow_id,
    task_queue,
)
from models.guard import GuardInput
from models.incident import RemediationInput
from models.names import InvalidName, validate_cluster_name, validate_node_name
from models.poolops import (
    POOL_PAUSE_SIGNAL,
    POOL_RESUME_SIGNAL,
    POOL_WORKFLOW,
    REBALANCE_SIGNAL,
    SET_DEMAND_SIGNAL,
    PoolState,
    pool_workflow_id,
)
from models.requests import ReleaseNodeRequest, ReturnNodeRequest
from models.topology import (
    DOMAIN_DECIDE_SIGNAL,
    GUARD_DOMAIN_SIGNAL,
    NODE_DOMAINS_WORKFLOW,
    Domain,
    DomainKind,
    NodeDomainsInput,
)
from models.xid import XidEvent

SERVICE = "temporal.api.workflowservice.v1.WorkflowService"
# The one query every gpufleet workflow answers; Temporal's built-in ones (__stack_trace, ...) are refused.
STATUS_QUERY = "status"
XID_SIGNAL = "report_xid"  # an incident's Xid (starters/temporal.py report_xid)
ROLE_HINT = "ask for the gpufleet-approver or gpufleet-operator role"
# The shortest workflow task timeout a start may give (an incident's is 5 s).
MIN_TASK_TIMEOUT = timedelta(seconds=1)


class Refused(Exception):
    """A call the API does not forward: ``invalid`` when the request itself is malformed
    (INVALID_ARGUMENT), else not permitted whoever asks (PERMISSION_DENIED)."""

    def __init__(self, message: str, *, invalid: bool = False) -> None:
        super().__init__(message)
        self.invalid = invalid


@dataclass(frozen=True)
class Access:
    """One SubjectAccessReview: ``verb`` on gpufleet.io ``resource`` (``name``: the node or
    cluster concerned, '' for the resource as a whole)."""

    verb: str
    resource: str
    name: str = ""

    def said(self) -> str:
        return f"{self.verb} gpufleet.io/{self.resource}" + (f" {self.name}" if self.name else "")


@dataclass(frozen=True, eq=False)
class Kind:
    """A gpufleet workflow as the API sees it: its resource, and the signals a person may send it
    (signal: the verb it needs, and the field of its payload, or the argument, that names who)."""

    resource: str
    signals: dict[str, tuple[str, str | int | None]]


INCIDENT = Kind(
    "incidents",
    {
        XID_SIGNAL: ("create", None),
        "checkpoint_done": ("update", None),
        "spare_available": ("update", None),
        "decide": ("approve", "by"),
        "cancel_requested": ("cancel", "by"),
    },
)
GUARD = Kind(
    "breaker",
    {
        GUARD_RESET_SIGNAL: ("reset", "by"),
        GUARD_PAUSE_SIGNAL: ("pause", "by"),
        GUARD_RESUME_SIGNAL: ("pause", "by"),
        # A domain's decision told to the guard itself, when its domain incident has ended without one.
        GUARD_DOMAIN_SIGNAL: ("reset", "by"),
    },
)
# A domain incident (workflows/domain.py): confirming or releasing it decides its nodes' fixes, as
# approving an incident does; its ID's name is the cluster.
DOMAIN = Kind("incidents", {DOMAIN_DECIDE_SIGNAL: ("approve", "by")})
RETURN = Kind("nodes", {})
RELEASE = Kind("nodes", {})
QUARANTINED = Kind("nodes", {})
NODE_DOMAINS = Kind("nodes", {})
POOL = Kind(
    "pool",
    {
        REBALANCE_SIGNAL: ("rebalance", None),
        SET_DEMAND_SIGNAL: ("rebalance", 1),  # set_demand(nodes, by)
        POOL_PAUSE_SIGNAL: ("rebalance", None),
        POOL_RESUME_SIGNAL: ("rebalance", None),
    },
)
CREATION = Kind("clusters", {RESUME_SIGNAL: ("create", None), ROLL_BACK_SIGNAL: ("create", None)})
DELETION = Kind("clusters", {})
USERS = Kind("clusters", {})

_CLUSTER = r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?"
# Workflow IDs by form (models/constants.py, models/clusterops.py, ...); the first that matches.
# ``pair``: the rest is CLUSTER-NODE; else the rest is the one name concerned.
_IDS: list[tuple[re.Pattern[str], Kind, bool]] = [
    (re.compile(r"^(?:remediate|dryrun)-(?P<rest>.+)$"), INCIDENT, True),
    (re.compile(r"^guard-(?P<rest>.+)$"), GUARD, False),
    (re.compile(rf"^domain-(?P<rest>{_CLUSTER})-(?:rack|zone|nvlink|switch)-.+$"), DOMAIN, False),
    (re.compile(r"^return-(?P<rest>.+)$"), RETURN, True),
    (re.compile(r"^release-(?P<rest>.+)$"), RELEASE, True),
    (re.compile(rf"^quarantined-(?P<rest>{_CLUSTER})-\d+$"), QUARANTINED, False),
    (re.compile(rf"^show-node-(?P<rest>{_CLUSTER})-\d+$"), NODE_DOMAINS, False),
    (re.compile(r"^pool-(?P<rest>.+)$"), POOL, False),
    (re.compile(r"^delete-cluster-(?P<rest>.+)$"), DELETION, False),
    (re.compile(r"^users-cluster-(?P<rest>.+)$"), USERS, False),
    (re.compile(r"^cluster-(?P<rest>.+)$"), CREATION, False),
]

# Workflow type: its kind, the verb a start needs, and its input's field naming who asked.
_STARTS: dict[str, tuple[Kind, str, str | None]] = {
    REMEDIATION_WORKFLOW: (INCIDENT, "create", None),
    GUARD_WORKFLOW: (GUARD, "pause", None),
    RETURN_NODE_WORKFLOW: (RETURN, "return", "by"),  # who skipped its validation, if anyone did
    RELEASE_NODE_WORKFLOW: (RELEASE, "release", "by"),
    QUARANTINED_NODES_WORKFLOW: (QUARANTINED, "list", None),
    NODE_DOMAINS_WORKFLOW: (NODE_DOMAINS, "get", None),
    POOL_WORKFLOW: (POOL, "rebalance", None),
    CLUSTER_CREATION_WORKFLOW: (CREATION, "create", "requested_by"),
    CLUSTER_DELETION_WORKFLOW: (DELETION, "delete", "requested_by"),
    CLUSTER_USERS_WORKFLOW: (USERS, "update", "requested_by"),
}
_TYPE_RESOURCES = {name: kind.resource for name, (kind, _, _) in _STARTS.items()}


def _valid_pair(cluster: str, node: str) -> bool:
    try:
        validate_cluster_name(cluster)
        validate_node_name(node)
    except InvalidName:
        return False
    return True


def _pair(rest: str) -> bool:
    """Whether ``rest`` is CLUSTER-NODE for some valid cluster and node name."""
    for at in (i for i, c in enumerate(rest) if c == "-"):
        try:
            validate_cluster_name(rest[:at])
            validate_node_name(rest[at + 1 :])
        except InvalidName:
            continue
        return True
    return False


def _domain_cluster(workflow_id: str) -> str:
    """The cluster of a domain incident's ID (``domain-CLUSTER-KIND-NAME``); '' where two readings
    are valid (cluster ``prod`` and rack ``zone-x``, or cluster ``prod-rack`` and zone ``x``): the
    caller then needs the permission on every cluster, never on the wrong one."""
    rest = workflow_id.removeprefix("domain-")
    clusters = set()
    for kind in DomainKind:
        at = rest.find(f"-{kind}-")
        while at > 0:
            cluster, name = rest[:at], rest[at + len(kind) + 2 :]
            try:
                validate_cluster_name(cluster)
                Domain(kind=kind, name=name)
            except (InvalidName, ValueError):
                pass
            else:
                clusters.add(cluster)
            at = rest.find(f"-{kind}-", at + 1)
    if not clusters:
        raise Refused(f"workflow ID {workflow_id!r}: no valid cluster, kind and domain name", invalid=True)
    return clusters.pop() if len(clusters) == 1 else ""


def workflow_kind(workflow_id: str) -> tuple[Kind, str]:
    """The kind of a gpufleet workflow ID and the name it concerns (a cluster or pool; '' where the
    ID joins a cluster and a node, which cannot be told apart: both may hold '-').

    Raises:
        Refused: an ID of no gpufleet form (INVALID_ARGUMENT when it names a malformed cluster or node).
    """
    for pattern, kind, pair in _IDS:
        found = pattern.match(workflow_id)
        if found is None:
            continue
        rest = found["rest"]
        if kind is DOMAIN:
            return kind, _domain_cluster(workflow_id)
        if pair:
            if not _pair(rest):
                raise Refused(
                    f"workflow ID {workflow_id!r}: its CLUSTER-NODE is not a valid cluster and node", invalid=True
                )
            return kind, ""
        try:
            validate_cluster_name(rest)
        except InvalidName as exc:
            raise Refused(f"workflow ID {workflow_id!r}: {exc}", invalid=True) from None
        return kind, rest
    raise Refused(f"workflow {workflow_id!r} is none of gpufleet's: the API serves gpufleet's workflows only")


def _decode(payloads: Payloads, index: int, model: type[Any]) -> Any:
    """Argument ``index`` of a call, decoded as the pydantic data converter would."""
    if len(payloads.payloads) <= index:
        raise Refused(f"argument {index + 1} is missing", invalid=True)
    try:
        return pydantic_data_converter.payload_converter.from_payloads([payloads.payloads[index]], [model])[0]
    except (ValidationError, ValueError, TypeError) as exc:
        raise Refused(
            f"argument {index + 1} is not a {getattr(model, '__name__', model)}: {exc}", invalid=True
        ) from None


def _restamp(payloads: Payloads, where: str | int, user: str) -> None:
    """Put ``user`` as who asked: in field ``where`` of the first argument, or as argument ``where``."""
    convert = pydantic_data_converter.payload_converter
    if isinstance(where, int):
        while len(payloads.payloads) <= where:  # an argument left to its default: given now
            payloads.payloads.append(convert.to_payloads([None])[0])
        payloads.payloads[where].CopyFrom(convert.to_payloads([user])[0])
        return
    body = _decode(payloads, 0, dict)
    if not isinstance(body, dict):
        raise Refused("argument 1 is not an object", invalid=True)
    body[where] = user
    payloads.payloads[0].CopyFrom(convert.to_payloads([body])[0])


# The fields of a request a gpufleet command sets; any other one set is refused, named (a cron
# schedule, a retry policy, a memo, eager execution, completion callbacks, links, a versioning
# override, a start delay, ...: none is a command's, and some would let a caller act as a worker,
# have Temporal call out, or end a workflow early).
_FIELDS: dict[str, frozenset[str]] = {
    "StartWorkflowExecution": frozenset(
        {
            "namespace",
            "workflow_id",
            "workflow_type",
            "task_queue",
            "input",
            "identity",
            "request_id",
            "workflow_id_reuse_policy",
            "workflow_id_conflict_policy",
            "workflow_execution_timeout",
            "workflow_run_timeout",
            "workflow_task_timeout",
            "search_attributes",
            "user_metadata",
            "header",
            "priority",  # the SDK's default, empty: checked below
        }
    ),
    "SignalWorkflowExecution": frozenset(
        {"namespace", "workflow_execution", "signal_name", "input", "identity", "request_id", "header"}
    ),
    "RequestCancelWorkflowExecution": frozenset(
        {"namespace", "workflow_execution", "identity", "request_id", "reason", "first_execution_run_id"}
    ),
}
_FIELDS["SignalWithStartWorkflowExecution"] = _FIELDS["StartWorkflowExecution"] | {"signal_name", "signal_input"}
# What replaces a running workflow (it ends without its compensation, as a terminate would).
_TERMINATING = (
    WorkflowIdReusePolicy.WORKFLOW_ID_REUSE_POLICY_TERMINATE_IF_RUNNING,
    WorkflowIdConflictPolicy.WORKFLOW_ID_CONFLICT_POLICY_TERMINATE_EXISTING,
)
# The search attributes an incident is started with (starters/temporal.py report_xid).
_INCIDENT_ATTRIBUTES = frozenset(key.name for key in (SA_GPU_NODE, SA_CLUSTER, SA_EVENT_KIND, SA_XID))


def _options(method: str, request: Any) -> None:
    """Refuse a field of ``request`` that no gpufleet command sets (default deny, field by field)."""
    for field, _ in request.ListFields():
        if field.name not in _FIELDS[method]:
            raise Refused(f"field {field.name} is not one a gpufleet command sets")
    if "header" in _FIELDS[method] and request.header.fields:
        raise Refused(f"header {sorted(request.header.fields)} is not one a gpufleet command sends")
    if "priority" in _FIELDS[method] and request.priority.ListFields():
        raise Refused("field priority: every gpufleet command is started at the default priority")
    if method in ("StartWorkflowExecution", "SignalWithStartWorkflowExecution") and (
        request.workflow_id_reuse_policy in _TERMINATING or request.workflow_id_conflict_policy in _TERMINATING
    ):
        raise Refused(f"a start that terminates the running {request.workflow_id} (terminate is not available)")


def _start_options(kind: Kind, request: Any, incident: RemediationInput | None) -> None:
    """The timeouts and search attributes a start of ``kind`` may carry: those its command sets."""
    for field in ("workflow_execution_timeout", "workflow_run_timeout"):
        if request.HasField(field) and kind not in (QUARANTINED, NODE_DOMAINS, RELEASE):
            raise Refused(f"field {field}: a {request.workflow_type.name} runs until it ends, never cut short")
    if request.HasField("workflow_task_timeout"):
        if kind is not INCIDENT:
            raise Refused(f"field workflow_task_timeout is not one a {request.workflow_type.name} is started with")
        if request.workflow_task_timeout.ToTimedelta() < MIN_TASK_TIMEOUT:
            # Every workflow task would time out: the incident would never move.
            raise Refused(f"workflow_task_timeout under {MIN_TASK_TIMEOUT.seconds} s", invalid=True)
    if not request.search_attributes.indexed_fields:
        return
    if incident is None:
        raise Refused(f"field search_attributes is not one a {request.workflow_type.name} is started with")
    given = set(request.search_attributes.indexed_fields)
    if not given <= _INCIDENT_ATTRIBUTES:
        raise Refused(f"search attributes {sorted(given - _INCIDENT_ATTRIBUTES)} are none an incident is started with")
    try:
        attributes = decode_typed_search_attributes(request.search_attributes)
    except Exception as exc:  # the SDK's decoder raises what a malformed payload makes it raise
        raise Refused(f"search attributes: {exc}", invalid=True) from None
    for key, expected in ((SA_CLUSTER, incident.cluster), (SA_GPU_NODE, incident.node)):
        if key.name in given and attributes.get(key) != expected:
            raise Refused(f"search attribute {key.name} must be {expected!r}, the incident's", invalid=True)


# The fields of a start's input that only the workflow itself sets, when it continues as new: a
# person who starts one with them would hand it a past it never had.
_WORKFLOW_ONLY: dict[type[BaseModel], tuple[str, ...]] = {
    RemediationInput: ("carried", "pending_events"),
    GuardInput: ("state",),
    PoolState: tuple(name for name in PoolState.model_fields if name != "settings"),
}


def _fresh(given: BaseModel) -> None:
    """Refuse an input whose workflow-only fields are not their defaults."""
    model = type(given)
    for name in _WORKFLOW_ONLY.get(model, ()):
        field = model.model_fields[name]
        if getattr(given, name) != field.get_default(call_default_factory=True):
            raise Refused(f"field {name} of a {model.__name__} is set only by the workflow itself", invalid=True)


def _start_access(workflow_type: str, workflow_id: str, queue: str, payloads: Payloads) -> tuple[Kind, Access]:
    """The kind and permission of a start, once its ID and task queue agree with its input."""
    if workflow_type not in _STARTS:
        raise Refused(f"workflow type {workflow_type!r} is none of gpufleet's commands")
    kind, verb, _ = _STARTS[workflow_type]
    found, name = workflow_kind(workflow_id)
    if found is not kind:
        raise Refused(f"workflow ID {workflow_id!r} is not the ID of a {workflow_type}", invalid=True)
    expected: tuple[str, str]  # (the ID it must have, its task queue)
    if kind is INCIDENT:
        incident: RemediationInput = _decode(payloads, 0, RemediationInput)
        _fresh(incident)
        _names(incident.cluster, incident.node)
        make_incident = dry_run_workflow_id if incident.dry_run else remediation_workflow_id
        expected = (make_incident(incident.cluster, incident.node), task_queue(incident.cluster))
        name = incident.node
    elif kind is GUARD:
        guard: GuardInput = _decode(payloads, 0, GuardInput)
        _fresh(guard)
        expected = (guard_workflow_id(guard.cluster), guard_task_queue(guard.cluster))
    elif kind in (RETURN, RELEASE):
        request = _decode(payloads, 0, ReturnNodeRequest if kind is RETURN else ReleaseNodeRequest)
        cluster = workflow_id.split("-", 1)[1].removesuffix(f"-{request.node}")
        _names(cluster, request.node)
        make = return_workflow_id if kind is RETURN else release_workflow_id
        expected, name = (make(cluster, request.node), task_queue(cluster)), request.node
    elif kind is QUARANTINED:
        if payloads.payloads:
            raise Refused(f"a {workflow_type} takes no input", invalid=True)
        expected = (workflow_id, task_queue(name))
    elif kind is NODE_DOMAINS:
        shown: NodeDomainsInput = _decode(payloads, 0, NodeDomainsInput)
        _names(name, shown.node)
        if shown.cluster not in ("", name):
            raise Refused(
                f"a {workflow_type} of cluster {name} reads its own cluster, not {shown.cluster}", invalid=True
            )
        expected = (workflow_id, task_queue(name))
    elif kind is POOL:
        state: PoolState = _decode(payloads, 0, PoolState)
        _fresh(state)
        _names(state.settings.cluster)
        expected = (pool_workflow_id(state.settings.name), task_queue(state.settings.cluster))
    else:
        models: dict[Kind, type[BaseModel]] = {CREATION: ClusterCreateInput, DELETION: ClusterDeleteInput}
        model = models.get(kind, UsersChangeInput)
        given = _decode(payloads, 0, model)
        cluster = given.name if isinstance(given, UsersChangeInput) else given.spec.name
        make_id = {CREATION: cluster_workflow_id, DELETION: deletion_workflow_id}.get(kind, users_workflow_id)
        expected = (make_id(cluster), CLUSTER_TASK_QUEUE)
    if (workflow_id, queue) != expected:
        raise Refused(
            f"a {workflow_type} for this input runs as {expected[0]} on task queue {expected[1]}, "
            f"not {workflow_id} on {queue}",
            invalid=True,
        )
    return kind, Access(verb, kind.resource, name)


def _names(cluster: str, node: str | None = None) -> None:
    try:
        validate_cluster_name(cluster)
        if node is not None:
            validate_node_name(node)
    except InvalidName as exc:
        raise Refused(str(exc), invalid=True) from None


def _same_node(payloads: Payloads, workflow_id: str, node: str | None) -> None:
    """Refuse an Xid for another node than the incident's (``node``; None: read from its ID,
    CLUSTER-NODE, as the node it ends with)."""
    event: XidEvent = _decode(payloads, 0, XidEvent)
    if node is None:
        cluster = workflow_id.split("-", 1)[1].removesuffix(f"-{event.node}")
        matches = workflow_id.endswith(f"-{cluster}-{event.node}") and _valid_pair(cluster, event.node)
    else:
        matches = event.node == node
    if not matches:
        raise Refused(f"an Xid of {event.node} is not for incident {workflow_id}", invalid=True)


def _signal_access(kind: Kind, signal: str, name: str, workflow_id: str) -> Access:
    if signal not in kind.signals:
        raise Refused(f"signal {signal!r} to {workflow_id} is not one a gpufleet command sends")
    return Access(kind.signals[signal][0], kind.resource, name)


# A string literal of Temporal's list filter: quoted with ', " or ` (backslash escapes; a doubled
# quote reads as two literals side by side, which covers the same text).
_LITERAL = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|`(?:[^`\\]|\\.)*`""")
_TERM = re.compile(r"\b(WorkflowType|WorkflowId)\s*=\s*\x00(\d+)\x00")
# What may make a filter reach beyond a type or ID it names: an or, a not, a comment that hides a
# term, an unbalanced quote.
_WIDE = re.compile(r"\b(?:or|not|xor)\b|\||!|<>|/\*|\*/|--|#|['\"`]", re.IGNORECASE)


def listing_access(query: str) -> list[Access]:
    """What a listing (or count) of workflows needs: ``list`` on the resource of each gpufleet
    workflow type or ID it names; ``workflows list`` too when it names none, names another, or
    may reach beyond them (an OR, a NOT, a comment). Only a term outside the filter's string
    literals names anything."""
    literals: list[str] = []

    def hide(found: re.Match[str]) -> str:
        literals.append(found[0][1:-1])
        return f"\x00{len(literals) - 1}\x00"

    bare = _LITERAL.sub(hide, query)
    needed: list[Access] = []
    wide = not query.strip() or "\x00" in query or _WIDE.search(bare) is not None
    for found in _TERM.finditer(bare):
        named = literals[int(found[2])]
        if found[1] == "WorkflowId":
            kind, name = workflow_kind(named)
            needed.append(Access("list", kind.resource, name))
        elif named in _TYPE_RESOURCES:
            needed.append(Access("list", _TYPE_RESOURCES[named]))
        else:
            wide = True
    if wide or not needed:
        needed.append(Access("list", "workflows"))
    return list(dict.fromkeys(needed))


def _execution_id(request: Message, field: str) -> str:
    return str(getattr(request, field).workflow_id)


def access(method: str, request: Any, *, namespace: str) -> list[Access]:
    """Every permission ``method`` with ``request`` needs ([] for GetSystemInfo: any authenticated
    caller); Refused when the API does not forward it."""
    if method != "GetSystemInfo" and getattr(request, "namespace", None) != namespace:
        raise Refused(f"namespace {getattr(request, 'namespace', '')!r}: this API serves namespace {namespace!r}")
    if method == "GetSystemInfo":
        return []
    if method in ("ListWorkflowExecutions", "CountWorkflowExecutions"):
        return listing_access(request.query)
    if method in _FIELDS:
        _options(method, request)
    if method in ("StartWorkflowExecution", "SignalWithStartWorkflowExecution"):
        kind, needed = _start_access(
            request.workflow_type.name, request.workflow_id, request.task_queue.name, request.input
        )
        incident = _decode(request.input, 0, RemediationInput) if kind is INCIDENT else None
        _start_options(kind, request, incident)
        if method == "StartWorkflowExecution":
            if kind is INCIDENT or kind is GUARD:
                raise Refused(f"a {request.workflow_type.name} is started with its first signal only")
            return [needed]
        signal = _signal_access(kind, request.signal_name, needed.name, request.workflow_id)
        if incident is not None and request.signal_name == XID_SIGNAL:
            _same_node(request.signal_input, request.workflow_id, incident.node)
        return list(dict.fromkeys([needed, signal]))
    if method == "SignalWorkflowExecution":
        workflow_id = _execution_id(request, "workflow_execution")
        kind, name = workflow_kind(workflow_id)
        needed = _signal_access(kind, request.signal_name, name, workflow_id)
        if kind is INCIDENT and request.signal_name == XID_SIGNAL:
            _same_node(request.input, workflow_id, None)
        return [needed]
    if method in ("QueryWorkflow", "DescribeWorkflowExecution", "GetWorkflowExecutionHistory"):
        workflow_id = _execution_id(request, "execution")
        kind, name = workflow_kind(workflow_id)
        if method == "QueryWorkflow" and request.query.query_type != STATUS_QUERY:
            raise Refused(f"query {request.query.query_type!r} is not one a gpufleet command makes")
        return [Access("get", kind.resource, name)]
    if method == "RequestCancelWorkflowExecution":
        workflow_id = _execution_id(request, "workflow_execution")
        kind, name = workflow_kind(workflow_id)
        if kind is not INCIDENT:
            raise Refused(
                f"only an incident is cancelled through the API (`gpufleet incidents cancel`), not {workflow_id}"
            )
        return [Access("cancel", kind.resource, name)]
    raise Refused(f"{method} is not available through the gpufleet API: no gpufleet command calls it")


def stamp(method: str, request: Any, user: str) -> None:
    """Write the authenticated ``user`` into what the request records: its ``identity`` (the
    history's event identity) and the ``by``/``requested_by`` of what a person asks for."""
    if method in (
        "StartWorkflowExecution",
        "SignalWithStartWorkflowExecution",
        "SignalWorkflowExecution",
        "RequestCancelWorkflowExecution",
    ):
        request.identity = user
    if method in ("StartWorkflowExecution", "SignalWithStartWorkflowExecution"):
        _, _, field = _STARTS[request.workflow_type.name]
        if field is not None:
            _restamp(request.input, field, user)
    if method == "RequestCancelWorkflowExecution":
        request.reason = _cancel_reason(request.reason, user)
    if method in ("SignalWorkflowExecution", "SignalWithStartWorkflowExecution"):
        workflow_id = (
            request.workflow_execution.workflow_id if method == "SignalWorkflowExecution" else request.workflow_id
        )
        kind, _ = workflow_kind(workflow_id)
        where = kind.signals[request.signal_name][1]
        if where is not None:
            payloads = request.input if method == "SignalWorkflowExecution" else request.signal_input
            if isinstance(where, str) and not payloads.payloads:
                raise Refused(f"signal {request.signal_name!r} needs its argument", invalid=True)
            _restamp(payloads, where, user)


_CANCEL_BY = re.compile(r"^gpufleet incidents cancel by [^\s:]*")


def _cancel_reason(reason: str, user: str) -> str:
    """A cancel's reason as `gpufleet incidents cancel` writes it, naming the authenticated user."""
    if _CANCEL_BY.match(reason):
        return _CANCEL_BY.sub(lambda _: f"gpufleet incidents cancel by {user}", reason, count=1)
    return f"gpufleet incidents cancel by {user}" + (f": {reason}" if reason else "")
