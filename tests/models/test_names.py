"""Node names that could reach a command line are validated first."""

from __future__ import annotations

import pytest

from lab import kubevalidate
from models.names import InvalidName, dns_name, label_value, validate_cluster_name, validate_node_name
from models.xid import XidEvent

FQDN = "ip-10-0-12-34.us-west-2.compute.internal"
BARE_METAL = "gpu-node-0001.rack12.dc1.example.com"
LONGEST_LABEL = "gpu-" + "n" * 59  # 63 characters


@pytest.mark.parametrize("name", ["gpu1", "node-a.rack3", "a", "GPU_07", FQDN, BARE_METAL, LONGEST_LABEL])
def test_ordinary_node_names_pass(name: str) -> None:
    assert validate_node_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "gpu1; rm -rf /",
        "$(reboot)",
        "gpu`id`",
        "-gpu1",
        "gpu1 gpu2",
        "a" * 64,
        "gpu[1-4]",
        "gpu1\n",
        "a" * 64 + ".example.com",  # a part longer than a DNS label
        ".".join(["a" * 63] * 4),  # 255 characters
        "gpu1.",
        "gpu1,gpu2",
        "gpu1/../x",
    ],
)
def test_shell_metacharacters_and_odd_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_node_name(name)


def test_an_xid_event_refuses_an_unsafe_node() -> None:
    with pytest.raises(ValueError, match="invalid node name"):
        XidEvent(node="gpu1;reboot", xid=79)


@pytest.mark.parametrize("name", ["Lab", "lab_1", "", "-lab"])
def test_bad_cluster_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_cluster_name(name)


@pytest.mark.parametrize("text", ["remediate-lab-gpu1", "lab-gpu1-20260101T000000Z", "", "a" * 63, "a.b_c-D"])
def test_a_label_value_that_fits_is_kept_as_it_is(text: str) -> None:
    assert label_value(text) == text


@pytest.mark.parametrize(
    "text",
    [
        f"prod-{LONGEST_LABEL}-20261205T052600Z",
        f"prod-{FQDN}-20261205T052600Z",
        f"dryrun-a-forty-character-cluster-name-0123456789-{BARE_METAL}-20261205T052600Z",
        "remediate-lab-gpu1:attempt/2",
        "-leading and trailing-",
        "::::",
    ],
)
def test_a_label_value_that_does_not_fit_is_a_readable_prefix_and_a_hash(text: str) -> None:
    short = label_value(text)
    assert kubevalidate.label_value(short) == []  # what the API server takes
    assert label_value(text) == short  # stable
    assert label_value(short) == short  # and itself a value that fits
    assert len(short) <= 63
    readable = text.replace(":", "-").replace("/", "-").replace(" ", "-").strip("-")[:20]
    assert not readable or short.startswith(readable)


def test_shortened_values_of_different_texts_differ() -> None:
    base = f"prod-{LONGEST_LABEL}"
    shortened = {label_value(f"{base}-20261205T0526{second:02d}Z") for second in range(60)}
    assert len(shortened) == 60  # the same 52-character prefix, told apart by the hash
    assert label_value("a:b") != label_value("a-b") == "a-b"


@pytest.mark.parametrize(
    "text",
    [
        "gpufleet-reset-gpu1-1a2b3c4d",
        f"gpufleet-reboot-{FQDN}"[:52] + "-1a2b3c4d",
        "GPUFLEET_Reset-GPU_07-1a2b3c4d",
        "x" * 80,
    ],
)
def test_dns_names_fit_a_job_name_and_its_pods_label(text: str) -> None:
    name = dns_name(text)
    assert kubevalidate.dns1123_subdomain(name) == [] and kubevalidate.label_value(name) == []
    if kubevalidate.dns1123_subdomain(text) == [] and len(text) <= 63:
        assert name == text
