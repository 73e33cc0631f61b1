"""Failure domains' names and the policy's domains: section, refused in one line when wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from models.topology import Domain, DomainKind, DomainSettings, domain_workflow_id


def test_a_domain_is_kind_slash_name_and_names_its_incident() -> None:
    domain = Domain.parse("rack/r12")
    assert domain == Domain(kind=DomainKind.RACK, name="r12") and domain.key == "rack/r12"
    assert domain_workflow_id("lab", domain) == "domain-lab-rack-r12"


@pytest.mark.parametrize("text", ["rak/a", "rack", "rack/", "rack/-a", "rack/a b", "/a"])
def test_a_bad_domain_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Domain.parse(text)


@pytest.mark.parametrize("key", ["gpufleet.io/rack", "example.com/rack", "rack", "nvidia.com/gpu.clique"])
def test_label_keys_are_taken(key: str) -> None:
    assert DomainSettings(rack_label=key).rack_label == key


@pytest.mark.parametrize("key", ["a,b", "x!=y", "/rack", "a/b/c", "Example.com/rack", "", "rack "])
def test_anything_but_a_label_key_is_refused_naming_it(key: str) -> None:
    """Each would change the selector that counts a domain's nodes, and so its share."""
    with pytest.raises(ValidationError, match="no Kubernetes label key"):
        DomainSettings(rack_label=key)


def test_a_domain_incident_needs_two_nodes_at_least() -> None:
    with pytest.raises(ValidationError):
        DomainSettings(min_nodes=1)
