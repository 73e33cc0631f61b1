"""One incident on one node, from Xid to resumed jobs (docs/remediation.md).

flow.py holds the workflow and its flow in the order of the recovery; the parts it is built from:
state.py (what every part reads, and how an activity is called), timeline.py (the record and its
metrics), notify.py (messages beside the flow), slot.py (the fleet guard's slot), close.py (how an
incident ends), approvals.py (the gates that wait for a person), jobs.py (checkpoints, requeues,
resumes), repair.py (repair in place) and replace.py (retire beside replace).
"""

from workflows.remediation.flow import NodeRemediationWorkflow

__all__ = ["NodeRemediationWorkflow"]
