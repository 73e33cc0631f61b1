"""One incident on one node, from Xid to resumed jobs (docs/remediation.md)."""

from workflows.remediation.flow import NodeRemediationWorkflow

__all__ = ["NodeRemediationWorkflow"]
