"""The policy over the whole Xid catalog, combinations of Xids, and operator override files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from models.degradation import DegradationSettings
from models.policy import (
    DEFAULT_BUCKET_ACTIONS,
    Action,
    DrainAfterJobsSettings,
    GuardSettings,
    Policy,
    PolicyError,
    PolicyFile,
    RemediationSettings,
    RepairSettings,
    load_policy,
    policy_from_mapping,
)
from models.sxid import sxid_catalog
from models.xid import GpuEventKind, RecoveryAction, XidEvent, xid_catalog

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "xid-catalog.csv"

APPLICATION_XIDS = [13, 31, 43, 45, 68, 69]
# The catalog's warnings that leave the work on the GPU going: drained after the jobs.
SOFT_XIDS = [63, 92, 94]


def test_catalog_covers_every_reference_row() -> None:
    catalog = xid_catalog()
    assert len(catalog) == 41
    assert catalog[79].name == "GPU has fallen off the bus"
    assert catalog[79].bucket == "RESTART_BM"
    if REFERENCE.exists():  # the shared facts sit beside the checkout
        import csv

        rows = {int(r["xid"]): r["immediate_action"] for r in csv.DictReader(REFERENCE.open())}
        assert {xid: entry.bucket for xid, entry in catalog.items()} == rows


@pytest.mark.parametrize("xid", sorted(xid_catalog()))
def test_every_catalog_xid_gets_a_deliberate_action(xid: int) -> None:
    entry = xid_catalog()[xid]
    action = Policy().action_for(xid)
    if xid == 79:
        assert action is Action.REPLACE_NODE
    elif xid in SOFT_XIDS:
        assert action is Action.DRAIN_AFTER_JOBS
    elif entry.bucket == "XID_154":
        assert action is Action.RESET_GPU  # no recovery action reported: assume a reset is needed
    else:
        assert entry.bucket in DEFAULT_BUCKET_ACTIONS, f"bucket {entry.bucket} of Xid {xid} has no action"
        assert action is DEFAULT_BUCKET_ACTIONS[entry.bucket]


@pytest.mark.parametrize("xid", APPLICATION_XIDS)
def test_application_errors_are_observed(xid: int) -> None:
    assert Policy().decide([xid]) is Action.OBSERVE


@pytest.mark.parametrize(
    ("xids", "expected"),
    [
        ([79], Action.REPLACE_NODE),
        ([48], Action.RESET_GPU),
        ([13, 79], Action.REPLACE_NODE),
        ([45, 48], Action.RESET_GPU),
        ([43, 13], Action.OBSERVE),
        ([54], Action.REPLACE_NODE),
        ([], Action.OBSERVE),
        ([999], Action.OBSERVE),
    ],
)
def test_the_most_disruptive_action_wins(xids: list[int], expected: Action) -> None:
    assert Policy().decide(xids) is expected


@pytest.mark.parametrize(
    ("recovery", "expected"),
    [
        (RecoveryAction.NONE, Action.OBSERVE),
        (RecoveryAction.GPU_RESET, Action.RESET_GPU),
        (RecoveryAction.NODE_REBOOT, Action.REBOOT_NODE),
        (RecoveryAction.DRAIN_P2P, Action.RESET_GPU),
        (RecoveryAction.DRAIN_AND_RESET, Action.DRAIN_AFTER_JOBS),
    ],
)
def test_xid_154_follows_the_recovery_action_it_names(recovery: RecoveryAction, expected: Action) -> None:
    event = XidEvent(node="gpu1", xid=154, recovery_action=recovery)
    assert Policy().decide([event]) is expected


def test_override_file_changes_only_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("xids:\n  74: REPLACE_NODE\nbuckets:\n  RESTART_APP: RESET_GPU\n")
    policy = load_policy(path)
    assert policy.decide([74]) is Action.REPLACE_NODE
    assert policy.decide([13]) is Action.RESET_GPU
    assert policy.decide([79]) is Action.REPLACE_NODE  # defaults kept


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("xids:\n  79: EXPLODE\n", "xids.79"),
        ("buckets:\n  IGNORE: [1]\n", "buckets.IGNORE"),
        ("unknown_xid: SOMETIMES\n", "unknown_xid"),
        ("colour: blue\n", "colour"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("xids: {79: [unclosed\n", "not valid YAML"),
        ("sxids:\n  22013: EXPLODE\n", "sxids.22013"),
        ("kinds:\n  cosmic_ray: REPLACE_NODE\n", "kinds.cosmic_ray"),
        ("kinds:\n  bus_lost: OBSERVE\n", "xids: {79"),
        ("kinds: [init_failed]\n", "kinds: expected a mapping"),
    ],
)
def test_invalid_override_file_names_the_field(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as error:
        load_policy(path)
    assert named in str(error.value)
    assert str(path) in str(error.value)


def test_missing_override_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read the policy file"):
        load_policy(tmp_path / "absent.yaml")


def sxid(code: int) -> XidEvent:
    return XidEvent(node="gpu1", kind=GpuEventKind.SXID, xid=code)


def test_sxid_catalog_has_both_severities() -> None:
    catalog = sxid_catalog()
    assert {entry.severity for entry in catalog.values()} == {"fatal", "non-fatal"}


@pytest.mark.parametrize("code", sorted(sxid_catalog()))
def test_sxids_follow_their_documented_severity(code: int) -> None:
    fatal = sxid_catalog()[code].severity == "fatal"
    assert Policy().action_for(sxid(code)) is (Action.REPLACE_NODE if fatal else Action.OBSERVE)


def test_an_sxid_never_meets_the_xid_of_the_same_number() -> None:
    fatal = next(code for code, entry in sorted(sxid_catalog().items()) if entry.severity == "fatal")
    policy = load_policy_text(f"xids: {{{fatal}: REBOOT_NODE}}\nsxids: {{{fatal}: RESET_GPU}}\n")
    assert policy.action_for(XidEvent(node="gpu1", xid=fatal)) is Action.REBOOT_NODE
    assert policy.action_for(sxid(fatal)) is Action.RESET_GPU
    assert Policy().action_for(sxid(79)) is Action.OBSERVE  # no SXid 79: unknown, observed
    assert Policy().action_for(XidEvent(node="gpu1", xid=79)) is Action.REPLACE_NODE


def test_an_sxid_missing_from_the_catalog_follows_the_drivers_own_word() -> None:
    unknown = next(code for code in range(30000, 40000) if code not in sxid_catalog())
    fatal = XidEvent(node="gpu1", kind=GpuEventKind.SXID, xid=unknown, message="Fatal, Link 3 something new")
    minor = XidEvent(node="gpu1", kind=GpuEventKind.SXID, xid=unknown, message="Non-fatal, Link 3 something")
    silent = XidEvent(node="gpu1", kind=GpuEventKind.SXID, xid=unknown, message="Data {0x0}")
    assert Policy().action_for(fatal) is Action.REPLACE_NODE
    assert Policy().action_for(minor) is Action.OBSERVE
    assert Policy().action_for(silent) is Action.OBSERVE  # unknown_sxid


def test_failures_without_a_code_have_their_own_entries() -> None:
    init = XidEvent(node="gpu1", kind=GpuEventKind.INIT_FAILED)
    power = XidEvent(node="gpu1", kind=GpuEventKind.POWER_CABLE)
    assert Policy().action_for(init) is Action.REPLACE_NODE
    assert Policy().action_for(power) is Action.REPLACE_NODE
    policy = load_policy_text("kinds: {power_cable: REBOOT_NODE}\n")
    assert policy.action_for(power) is Action.REBOOT_NODE
    assert policy.action_for(init) is Action.REPLACE_NODE  # left out: keeps its default


def test_a_bus_loss_without_an_xid_line_acts_as_xid_79() -> None:
    lost = XidEvent(node="gpu1", kind=GpuEventKind.BUS_LOST)
    assert lost.xid == 79 and lost.gpu_xid == 79
    assert Policy().action_for(lost) is Action.REPLACE_NODE
    assert load_policy_text("xids: {79: REBOOT_NODE}\n").action_for(lost) is Action.REBOOT_NODE


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"kind": "xid"}, "needs its code"),
        ({"kind": "sxid"}, "needs its code"),
        ({"kind": "init_failed", "xid": 3}, "has no code"),
        ({"kind": "unplugged"}, "kind"),
    ],
)
def test_events_whose_code_does_not_fit_their_kind_are_refused(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        XidEvent.model_validate({"node": "gpu1", **fields})


def load_policy_text(text: str) -> Policy:
    return policy_from_mapping(yaml.safe_load(text))


# -- every number of every section: finite, a number, within its bounds -------------------------------

SECTIONS: dict[str, type[BaseModel]] = {
    "remediation": RemediationSettings,
    "guard": GuardSettings,
    "repair": RepairSettings,
    "degradation": DegradationSettings,
    "drain_after_jobs": DrainAfterJobsSettings,
}
NUMBERS = [
    (section, name, field.annotation)
    for section, model in SECTIONS.items()
    for name, field in model.model_fields.items()
    if field.annotation in (int, float)
]


# A number added to a section is checked by being counted here.
assert len(NUMBERS) == 25, NUMBERS


@pytest.mark.parametrize(("section", "name"), [(s, n) for s, n, _ in NUMBERS])
@pytest.mark.parametrize(
    ("value", "said"),
    [
        (".nan", "Input should be a finite number"),
        (".inf", "Input should be a finite number"),
        ("-.inf", "Input should be a finite number"),
        ("true", "a number, not true"),
        ("-1", "greater than"),
        ("1.0e+30", "less than or equal to|exceeded maximum size"),
        ("'soon'", "Input should be a valid"),
        ("[1]", "Input should be a valid"),
    ],
)
def test_no_number_of_the_policy_is_nan_infinite_negative_absurd_or_of_another_type(
    tmp_path: Path, section: str, name: str, value: str, said: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n", encoding="utf-8")
    with pytest.raises(PolicyError) as refused:
        load_policy(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: {section}.{name}: ") and "\n" not in message, message
    assert any(part in message for part in said.split("|")), message


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("xids:\n  79: REPLACE_NODE  # café\n".encode("latin-1"), "not UTF-8 text (invalid continuation byte at byte"),
        (b"\xff\xfe\x00x", "not UTF-8 text"),
        (b"remediation:\n  grace_seconds: !!int soon\n", "not valid YAML: invalid literal for int()"),
        (b"remediation:\n  grace_seconds: 2001-13-01\n", "not valid YAML: month must be in 1..12"),
        (b"[" * 5000, "not valid YAML"),
        (b"remediation: 12\n", "remediation: expected a mapping, got int"),
        (b"just words\n", "expected a mapping"),
    ],
)
def test_a_file_that_is_not_utf8_yaml_or_a_mapping_is_one_line_naming_it(
    tmp_path: Path, content: bytes, said: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(content)
    with pytest.raises(PolicyError) as refused:
        load_policy(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and said in message and "\n" not in message, message


def test_the_detector_keeps_its_last_good_policy_when_the_file_stops_being_utf8(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("xids:\n  79: RESET_GPU\n", encoding="utf-8")
    policy = PolicyFile(path)
    assert policy.current().decide([79]) is Action.RESET_GPU
    path.write_bytes("xids:\n  79: OBSERVE  # café\n".encode("latin-1"))
    assert policy.current().decide([79]) is Action.RESET_GPU
    assert policy.reload_error is not None and "not UTF-8 text" in policy.reload_error


@pytest.mark.parametrize("value", ["0", "-60", ".inf", ".nan", "2592001", "soon"])
def test_an_approval_expiry_that_is_not_a_positive_finite_time_is_refused(tmp_path: Path, value: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(f"guard:\n  approval_expiry_seconds: {value}\n")
    with pytest.raises(PolicyError) as error:
        load_policy(path)
    assert "approval_expiry_seconds" in str(error.value) and str(path) in str(error.value)


def test_an_approval_expires_after_four_hours_unless_the_policy_says() -> None:
    assert Policy().guard.approval_expiry_seconds == 4 * 3600
    assert load_policy_text("guard: {approval_expiry_seconds: 86400}\n").guard.approval_expiry_seconds == 86400


@pytest.mark.parametrize(
    ("xid", "bucket", "expected"),
    [
        (63, "IGNORE", Action.DRAIN_AFTER_JOBS),  # row remap pending: reset when convenient
        (64, "RESET_GPU", Action.RESET_GPU),  # row remap failed: the catalog's reset, now
        (92, "IGNORE", Action.DRAIN_AFTER_JOBS),  # high corrected-error rate: results stand
        (94, "RESTART_APP", Action.DRAIN_AFTER_JOBS),  # contained: the others run on unaffected
    ],
)
def test_soft_failures_are_drained_after_the_jobs(xid: int, bucket: str, expected: Action) -> None:
    assert xid_catalog()[xid].bucket == bucket  # the catalog's word, the defaults' ground
    assert Policy().decide([xid]) is expected


@pytest.mark.parametrize(
    ("events", "then", "expected"),
    [
        ([XidEvent(node="gpu1", xid=92)], "validate", None),
        ([XidEvent(node="gpu1", xid=92)], "REBOOT_NODE", Action.REBOOT_NODE),
        ([XidEvent(node="gpu1", xid=94)], "validate", Action.RESET_GPU),
        ([XidEvent(node="gpu1", xid=63), XidEvent(node="gpu1", xid=92)], "validate", Action.RESET_GPU),
        ([XidEvent(node="gpu1", xid=94)], "REPLACE_NODE", Action.REPLACE_NODE),
        (
            [XidEvent(node="gpu1", xid=154, recovery_action=RecoveryAction.DRAIN_AND_RESET)],
            "validate",
            Action.RESET_GPU,
        ),
        ([XidEvent(node="gpu1", xid=154, recovery_action=RecoveryAction.NONE)], "validate", None),
        ([XidEvent(node="gpu1", kind=GpuEventKind.HEALTH_CHECK)], "validate", None),
    ],
)
def test_the_step_after_the_jobs(events: list[XidEvent], then: str, expected: Action | None) -> None:
    settings = policy_from_mapping({"drain_after_jobs": {"then": then}}).drain_after_jobs
    assert settings.after_jobs(events) is expected


def test_drain_after_jobs_settings_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("drain_after_jobs:\n  max_wait_seconds: 7200\n  then: REPLACE_NODE\n  reset_xids: []\n")
    settings = load_policy(path).drain_after_jobs
    assert (settings.max_wait_seconds, settings.then, settings.poll_seconds) == (7200, Action.REPLACE_NODE, 60)
    assert settings.after_jobs([XidEvent(node="gpu1", xid=94)]) is Action.REPLACE_NODE
    assert load_policy(None).drain_after_jobs.then == "validate"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("drain_after_jobs: 3600\n", "drain_after_jobs: expected a mapping, got int"),
        ("drain_after_jobs:\n  then: OBSERVE\n", "drain_after_jobs.then: Value error, got 'OBSERVE'; expected one of "),
        ("drain_after_jobs:\n  then: DRAIN_AFTER_JOBS\n", "drain_after_jobs.then:"),
        ("drain_after_jobs:\n  max_wait_seconds: 0\n", "drain_after_jobs.max_wait_seconds:"),
        ("drain_after_jobs:\n  poll_seconds: 0.1\n", "drain_after_jobs.poll_seconds:"),
        ("drain_after_jobs:\n  max_wait: 60\n", "drain_after_jobs.max_wait: Extra inputs are not permitted"),
    ],
)
def test_drain_after_jobs_settings_errors_name_the_field(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=None) as caught:
        load_policy(path)
    assert str(caught.value).startswith(f"{path}: ") and says in str(caught.value)
