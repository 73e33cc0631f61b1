"""docker-compose.temporal.yml: a production-shaped Temporal for gpufleet."""

from __future__ import annotations

from models.constants import SEARCH_ATTRIBUTES
from tests.test_deploy import documents


def test_compose_registers_every_search_attribute() -> None:
    compose = documents("docker-compose.temporal.yml")[0]
    command = " ".join(compose["services"]["register-search-attributes"]["command"])
    for key in SEARCH_ATTRIBUTES:
        assert f"--name {key.name} --type" in command
