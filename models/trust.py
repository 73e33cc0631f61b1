"""Checks on workflow inputs that come from outside gpufleet's own services.

A signal or a start reaches a workflow from whoever may talk to Temporal: the CLI checks its
arguments, but a workflow cannot assume it was the CLI. These checks run inside the workflows
as well (pure functions, deterministic), and each returns what is wrong in words, or None.
"""

from __future__ import annotations

# Who answered: a Kubernetes user name. A ServiceAccount's, system:serviceaccount:<ns>:<name>,
# reaches 339 characters (a 63-character namespace, a 253-character name): room for it.
MAX_BY = 512
# Why: one line for the incident's record, the owner's message and the notifications.
MAX_REASON = 1000


def text_problem(value: object, *, what: str, limit: int, required: bool = False) -> str | None:
    """What is wrong with a free-text field (``by``, ``reason``): not a string, empty when
    ``required``, longer than ``limit`` characters, or holding a character that is not printable
    (a newline, a control or escape sequence that would forge a line in a log or a terminal)."""
    if not isinstance(value, str):
        return f"{what} is {type(value).__name__}, not text"
    if required and not value.strip():
        return f"{what} is empty: name who asked"
    if len(value) > limit:
        return f"{what} has {len(value)} characters, more than {limit}"
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        return f"{what} holds {bad!r}, not printable: one line of plain text"
    return None


def answer_problem(*, by: object, reason: object) -> str | None:
    """What is wrong with an approval, a rejection or a cancel request: ``by`` must name
    someone (printable, at most MAX_BY characters), ``reason`` be printable (at most MAX_REASON)."""
    return text_problem(by, what="by", limit=MAX_BY, required=True) or text_problem(
        reason, what="reason", limit=MAX_REASON
    )


def deletion_problem(*, force: object, requested_by: object, reason: object) -> str | None:
    """What is wrong with a cluster deletion's request: ``force`` is a bool and is given only
    with a ``requested_by`` and a ``reason`` (it cancels running jobs, not requeued); both printable."""
    if not isinstance(force, bool):
        return f"force is {type(force).__name__}, not true or false"
    problem = text_problem(requested_by, what="requested_by", limit=MAX_BY, required=force) or text_problem(
        reason, what="reason", limit=MAX_REASON
    )
    if problem:
        return problem
    if force and not str(reason).strip():
        return "force without a reason: it cancels the running jobs, so say why (gpufleet cluster delete --reason)"
    return None


def move_problem(nodes: object, *, total: int | None) -> str | None:
    """What is wrong with a request to move ``nodes`` now (+ to inference, - to training): a
    whole number, not 0, and no more than the pool's ``total`` nodes (None: not counted yet).
    The pool's limits are applied after (the move is cut to what they allow, and says so)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int):
        return f"{nodes!r} is not a whole number of nodes"
    if nodes == 0:
        return "0 nodes: ask for at least one (+ to inference, - to training)"
    if total is not None and abs(nodes) > total:
        return f"{abs(nodes)} node(s) asked, the pool has {total}"
    return None
