"""The named changes to workflow code since v0.2.0, each taken through ``workflow.patched(ID)``.

A workflow that was already running when the change was deployed replays its history without
the change (``patched`` is False where its history has no marker) and keeps its old course; one
started afterwards takes the new one. Each ID is listed in CHANGELOG.md with what it changed, and
removed (with its old branch) in a later release, once no workflow of the old code can still run.
"""

from __future__ import annotations

# NodeRemediationWorkflow: the Slurm drain comes right after the classification, never held back
# by the fleet guard (which is told of it, to count storms); the jobs the failure already ended
# are requeued at once; a guard slot is held around each destructive step only (killing jobs,
# a repair, the retirement), not from the drain to the close.
DRAIN_FIRST = "drain-first"

# NodeRemediationWorkflow: a failed incident pages the operators (notification kind
# "incident_failed") as well as telling the owner; incidents that failed before it replay without.
PAGE_ON_FAILURE = "page-operators-on-failure"

# FleetGuardWorkflow: an incident that asks for a slot while every slot is held waits in line
# for one instead of tripping the breaker (storms still trip it by the share of nodes drained).
GUARD_SLOTS_WAIT = "guard-slots-wait"

# NodeRemediationWorkflow: a cancel (`gpufleet incidents cancel`, the Temporal UI, `cluster delete`)
# requeues the jobs the incident signalled and had not requeued yet, stops its repair Jobs, gives
# back its claim, slot and lease, closes "cancelled" and says what it leaves drained.
CANCEL_CLEANS_UP = "cancel-cleans-up"

# NodeRemediationWorkflow: a wait for `gpufleet approve|reject` that a person must answer reminds
# on a schedule with a short message (kind "approval_reminder"), raises the request again to the
# owner and the operators when it expires ("approval_expired"; never approved by default), and
# classifies an Xid that joins meanwhile and tells the owner ("new_xid"); a more severe one raises
# the action and starts a new wait ("action_raised"), so an answer given for the old action is
# dropped. Waits that began before it replay as they were.
APPROVAL_FOLLOW_UP = "approval-follow-up"

# NodeRemediationWorkflow: the spare claim asks to hear of a claimed spare that could not come
# in (drained since by someone else: its drain is never undone); the incident says so in its
# timeline and claims again. An inference node's replacement serves inference (policy
# spares.inference: a spare into the inference pool, never waited for; or none), never training.
SPARE_CLAIMS_CHECKED = "spare-claims-checked"

# ClusterDeletionWorkflow: before anything is removed, the cluster's open incidents are cancelled
# (each gives back what it holds and requeues what it signalled) and its fleet guard and reaper
# end; a deletion whose incidents do not stop (their worker is down) stops there, the cluster whole.
DELETE_STOPS_INCIDENTS = "delete-stops-incidents"

# Inputs from outside gpufleet's services are checked inside the workflows too (models/trust.py):
# a cluster deletion refuses a force without who and why, or text that is not one printable line,
# before it changes anything; an incident ignores an approval, a rejection or a cancel request
# whose by or reason fails the checks; the pool ignores an asked move of 0 nodes or of more than
# it has (before, it was cut to the limits). Histories from before it replay as they were.
INPUTS_CHECKED = "inputs-checked"

# NodeRemediationWorkflow: an event the incident already holds (the same event, its timestamp
# included) is folded, not joined again: a detector posts again an event whose answer it never
# got (a timeout, a connection reset after the intake or Temporal took it), and that copy must
# not count as the node failing again (while settling, it escalated the repair). Histories from
# before it replay as they were.
DUPLICATES_FOLDED = "duplicate-events-folded"

# NodeRemediationWorkflow: DRAIN_AFTER_JOBS (policy drain_after_jobs) drains the node and signals
# nothing: its jobs run on to their end (up to max_wait_seconds, then REPLACE_NODE), then the node
# is validated, repaired or replaced; a more severe event meanwhile escalates at once. Before it,
# such an incident went the way of a repair that does not hold. Histories from before replay so.
DRAIN_AFTER_JOBS_WAITS = "drain-after-jobs-waits"

# Validation before a node goes back into service (docs/validation.md): ReturnNodeWorkflow climbs
# the policy's validation ladder before it returns the node (unless skipped, by whom and why
# recorded) and puts the node on probation after; NodeRemediationWorkflow does the same after a
# repair in place held (a failure escalates to REPLACE_NODE and counts toward quarantine), and
# replaces and quarantines at once a node on probation. Histories from before it replay as they were.
VALIDATION_LADDER = "validation-ladder"

# NodeRemediationWorkflow: Slurm's drain after a failed Prolog or Epilog ("Prolog error", "Epilog
# error") on the node of an incident decided by gpufleet's own health_check event is that
# incident's, not someone else's: no owner is asked, and the drain's reason becomes gpufleet's
# (models.constants.takes_over), so the node can be repaired, returned or retired as any other.
HOOK_DRAINS_TAKEN = "hook-drains-taken"

# NodeRemediationWorkflow: as an incident closes (whichever way) it upserts its memo with its
# goodput ledger (key "ledger", models/goodput.py) and a summary (key "incident": its ID, cluster,
# node, outcome, action, spare, whether a dry run, GPUs per node), which `gpufleet report` reads from visibility
# without fetching each history. Only where the incident sets search attributes (the time-skipping
# test server knows neither). Histories from before it replay without the upsert; the ledger in the
# result needs no patch (no command).
GOODPUT_LEDGER = "goodput-ledger"

# The fleet guard reads each drained node's failure domains and counts failures per domain; a
# domain with enough of them opens a domain incident, and its nodes' repairs and replacements
# wait for a person's confirm or release (workflows/guard_domains.py, workflows/domain.py).
GUARD_DOMAINS = "guard-domains"

# NodeRemediationWorkflow: the requeue step also takes the jobs seen on the node before that the
# checkpoint step's listing no longer showed (a job the failure ended meanwhile leaves the node's
# listing as its nodes finish completing), each requeued by its state as one the failure ended
# (a job still running elsewhere is left alone). Before, such a job was left unrequeued.
JOBS_LEFT_REQUEUED = "jobs-left-requeued"

# FleetGuardWorkflow: a reset of the tripped breaker lets the incidents it held through: those in
# the window, held by the breaker or in flight at the reset are not counted again for the next
# window_seconds (their later steps' slots each re-counted them, and a storm of incidents with
# running jobs tripped the breaker again on its second step). A reset during a pause lets nothing
# through; a new failure is counted as before.
GUARD_RESET_LETS_THROUGH = "guard-reset-lets-through"
