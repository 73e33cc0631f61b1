"""The worker's configuration, read by each incident at its start: a worker of the wrong cluster
stops the incident with the error that says so, and nothing is changed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from activities.policy import PolicyActivities
from models.requests import WorkerConfig
from tests.workflows.test_remediation import Fleet, start, worker


async def test_a_worker_of_another_cluster_stops_the_incident_and_says_so(env: WorkflowEnvironment) -> None:
    fleet = Fleet()
    # The real activity, over a worker configured for another cluster than the incident's.
    wrong = PolicyActivities(lambda: WorkerConfig(cluster="elsewhere", settings=fleet.settings, policy=fleet.policy))
    activities = [
        wrong.worker_config if getattr(a, "__name__", "") == "worker_config" else a for a in fleet.activities()
    ]
    with ThreadPoolExecutor(max_workers=2) as executor:
        async with worker(env, fleet, activities=activities, activity_executor=executor):
            handle = await start(env.client, fleet)
            with pytest.raises(WorkflowFailureError) as failure:
                await handle.result()
    assert "this worker serves cluster 'elsewhere'" in str(failure.value.cause)
    assert "check GPUFLEET_CLUSTER" in str(failure.value.cause)
    assert not fleet.drained  # nothing was changed
