"""The policy's validation: section: read like the rest of the policy, each mistake named."""

from __future__ import annotations

import pytest

from models.policy import PolicyError, policy_from_mapping
from models.validation import RungKind, RungOutcome, RungResult, ValidationResult


def test_the_defaults_are_off_and_climb_quick_dcgm_nccl() -> None:
    validation = policy_from_mapping({}).validation
    assert not validation.enabled
    assert [(r.name, r.kind) for r in validation.rungs] == [
        ("quick", RungKind.QUICK),
        ("dcgm", RungKind.DCGM),
        ("nccl", RungKind.NCCL),
    ]
    assert validation.rungs[1].skip_exit_code == 127  # no dcgmi: skipped


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"rungs": [{"name": "a", "kind": "site", "image": "x", "command": ["burn", "{gpu}"]}]}, "names {gpu}"),
        ({"rungs": [{"name": "a", "kind": "site", "image": "x", "command": "burn-in --all"}]}, "rungs.0.command"),
        ({"rungs": [{"name": "Burn In", "kind": "site", "image": "x", "command": ["b"]}]}, "a rung's name is 1 to 16"),
        ({"rungs": [{"name": "a", "kind": "smoke", "image": "x", "command": ["b"]}]}, "rungs.0.kind"),
        (
            {"rungs": [{"name": "a", "kind": "site", "image": "x", "command": ["b"]}] * 2},
            "a named twice",
        ),
        ({"enabled": True, "rungs": []}, "validation is enabled but has no rungs"),
        ({"nccl_median_fraction": 1.5}, "validation.nccl_median_fraction"),
        ({"dcgm_level": 9}, "validation.dcgm_level"),
        ({"probation_jobs": 3}, "validation.probation_jobs: Extra inputs are not permitted"),
    ],
)
def test_a_wrong_validation_section_is_named(section: dict[str, object], says: str) -> None:
    with pytest.raises(PolicyError, match=r"^site\.yaml: ") as raised:
        policy_from_mapping({"validation": section}, origin="site.yaml")
    assert says in str(raised.value)


def test_a_failed_ladder_says_which_rung_with_what_figure() -> None:
    result = ValidationResult(
        node="gpu1",
        passed=False,
        rungs=[
            RungResult(name="quick", kind=RungKind.QUICK, outcome=RungOutcome.PASSED),
            RungResult(name="nccl", kind=RungKind.NCCL, outcome=RungOutcome.FAILED, figure=61.5, threshold=100),
        ],
    )
    assert result.summary() == "gpu1 failed validation at rung nccl: failed 61.5 GB/s (threshold 100)"
