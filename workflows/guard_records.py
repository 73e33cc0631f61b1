"""What the fleet guard knows of each node: its recent incidents (lemons are quarantined) and its
last repair in place (a repeat failure escalates); part of FleetGuardWorkflow (workflows/guard.py)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from models.constants import QUARANTINE_COOLDOWN, QUARANTINE_REPEAT
    from models.guard import GuardState, NodeRecord
    from models.policy import Action, GuardSettings


class NodeRecords:
    """The node records of FleetGuardWorkflow."""

    _state: GuardState
    _limits: GuardSettings

    def _record_incident(self, node: str, incident_id: str) -> NodeRecord:
        """Count an incident on the node, once however often it drains and asks."""
        limits, now = self._limits, workflow.now()
        record = self._state.nodes.setdefault(node, NodeRecord())
        since = now - timedelta(seconds=limits.quarantine_window_seconds)
        record.incidents = [at for at in record.incidents if at >= since]
        if not incident_id or record.last_incident != incident_id:
            record.incidents.append(now)
            record.last_incident = incident_id
        return record

    def _record_failed_validation(self, node: str, key: str) -> NodeRecord:
        """Count a failed validation (``key``: which one) as an incident of the node, once."""
        limits, now = self._limits, workflow.now()
        record = self._state.nodes.setdefault(node, NodeRecord())
        if key not in record.failed_validations:
            since = now - timedelta(seconds=limits.quarantine_window_seconds)
            record.incidents = [at for at in record.incidents if at >= since] + [now]
            record.failed_validations = [*record.failed_validations, key][-20:]
        return record

    def _quarantine_earned(self, node: str, incident_id: str = "") -> tuple[str, str]:
        """Record an incident on the node; the quarantine it has earned (label value, why), if any."""
        limits, now = self._limits, workflow.now()
        record = self._record_incident(node, incident_id)
        if limits.cooldown_seconds and record.returned_at is not None:
            back = (now - record.returned_at).total_seconds()
            if back < limits.cooldown_seconds:
                return QUARANTINE_COOLDOWN, (
                    f"failed again {back / 3600:.1f} h after it was returned to service "
                    f"(cooldown {limits.cooldown_seconds / 3600:g} h)"
                )
        if limits.quarantine_after and len(record.incidents) >= limits.quarantine_after:
            return QUARANTINE_REPEAT, (
                f"{len(record.incidents)} incidents within {limits.quarantine_window_seconds / 86400:g} days "
                f"(quarantined from {limits.quarantine_after})"
            )
        return "", ""

    def _escalation(self, node: str) -> tuple[str, str]:
        """One level above the node's last repair in place, when that was within the window."""
        limits, record = self._limits, self._state.nodes.get(node)
        if (
            record is None
            or not record.repaired_by
            or record.repaired_at is None
            or not limits.escalation_window_seconds
        ):
            return "", ""
        ago = (workflow.now() - record.repaired_at).total_seconds()
        if ago > limits.escalation_window_seconds:
            return "", ""
        after = Action(record.repaired_by).escalated()
        return after.value, f"reported again {ago / 3600:.1f} h after {record.repaired_by} repaired it"
