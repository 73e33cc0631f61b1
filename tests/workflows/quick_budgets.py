"""The incident with every call's budget cut to seconds, for tests of what happens when a budget
runs out (tests/workflows/test_bounded_retries.py). A module of its own, importing only what a
workflow may: the sandbox imports it again for each run."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from models.constants import REMEDIATION_WORKFLOW
    from models.incident import IncidentStatus, RemediationInput

from workflows.remediation import NodeRemediationWorkflow

# Every call's budget: a few retries (1 s, then 2 s apart) and then no more.
QUICK = timedelta(seconds=4)


@workflow.defn(name=REMEDIATION_WORKFLOW)
class QuickBudgets(NodeRemediationWorkflow):
    """NodeRemediationWorkflow, its commands unchanged, with budgets of seconds instead of minutes."""

    @workflow.run
    async def run(self, params: RemediationInput) -> IncidentStatus:
        return await super().run(params)

    def _budget(self, timeout: timedelta) -> timedelta:
        return QUICK
