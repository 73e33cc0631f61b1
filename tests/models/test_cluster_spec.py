"""Cluster specs: the example loads; every problem of a bad spec is named by field, all at once;
slurm.conf is rendered as the golden file says, and parses back to the spec."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from models.cluster import ClusterSpec, SpecError, check_ssh_key, load_spec, render_slurm_conf

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cluster.yaml"
GOLDEN = Path(__file__).parent / "data" / "research.slurm.conf"
PLACEMENT = {"train": ["free1", "free2"], "debug": ["free3"]}


def example() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return raw


def test_the_example_spec_loads() -> None:
    spec = load_spec(example(), free_nodes=4)
    assert [(p.name, p.nodes) for p in spec.partitions] == [("train", 2), ("debug", 1)]
    assert [u.name for u in spec.users] == ["alice", "bob"] and spec.nodes_needed == 4


def test_every_problem_is_named_by_field_at_once() -> None:
    raw = example()
    raw["name"] = "Research_1"
    raw["partitions"][1]["name"] = "train"  # taken
    raw["partitions"][1]["default"] = True  # a second default
    raw["partitions"][0]["max_time"] = "two days"
    raw["users"][1]["uid"] = 20001  # alice's
    raw["users"][0]["ssh_keys"] = ["ssh-ed25519 not-base64!"]
    raw["users"].append({"name": "carol", "uid": 99, "ssh_keys": ["ssh-rsa AAAA"]})
    raw["slurm_conf"].append("KillWait=5")
    raw["storage"]["size"] = "lots"
    with pytest.raises(SpecError) as caught:
        load_spec(raw, free_nodes=3)
    fields = [where for where, _ in caught.value.problems]
    assert sorted(fields) == sorted(
        [
            "name",
            "partitions[0].max_time",
            "users[0].ssh_keys",
            "users[2].ssh_keys",
            "slurm_conf",
            "storage.size",
            "partitions[1].name",
            "partitions[1].default",
            "users[1].uid",
            "users[2].uid",
            "partitions",  # 2 + 1 + 1 spare > 3 free
        ]
    )
    text = str(caught.value)
    assert "users[1].uid: uid 20001 is already users[0]'s" in text
    assert "users[2].uid: 99 is outside the allowed range 2000-59999" in text
    assert "KillWait is set by gpufleet" in text
    assert "partitions: 4 nodes asked (spares included) but the free pool holds 3" in text


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("ssh-ed25519", "not valid base64"),
        ("ssh-dss AAAAB3NzaC1kc3M=", "unknown SSH key type"),
        # An RSA key's body under the ed25519 type.
        ("ssh-ed25519 AAAAB3NzaC1yc2EAAAADAQABAAABAQ==", "is a 'ssh-rsa' key"),
    ],
)
def test_a_key_that_does_not_parse_says_why(key: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_ssh_key(key if " " in key else f"{key} @@@")


def test_unknown_fields_and_wrong_types_are_named() -> None:
    raw = example()
    raw["partitions"][0]["gpus"] = 8
    raw["spares"] = "one"
    with pytest.raises(SpecError) as caught:
        load_spec(raw)
    assert {where for where, _ in caught.value.problems} == {"partitions[0].gpus", "spares"}


@pytest.mark.parametrize("field", ["partitions", "users"])
@pytest.mark.parametrize("value", [3, "train", {"name": "train"}])
def test_a_list_field_that_is_no_list_is_named_not_a_crash(field: str, value: Any) -> None:
    raw = example()
    raw[field] = value
    with pytest.raises(SpecError) as caught:
        load_spec(raw, free_nodes=8)
    assert field in {where for where, _ in caught.value.problems}


@pytest.mark.parametrize(("field", "key"), [("partitions", "name"), ("users", "name"), ("users", "uid")])
def test_a_name_or_uid_of_the_wrong_type_is_named_not_a_crash(field: str, key: str) -> None:
    raw = example()
    raw[field][0][key] = ["not", "scalar"]
    raw[field][1][key] = {"nor": "this"}
    with pytest.raises(SpecError) as caught:
        load_spec(raw, free_nodes=8)
    assert {f"{field}[0].{key}", f"{field}[1].{key}"} <= {where for where, _ in caught.value.problems}


def parse_conf(text: str) -> tuple[dict[str, str], list[dict[str, str]], list[dict[str, str]]]:
    """slurm.conf read back: the plain keys, the NodeName lines and the PartitionName lines."""
    plain: dict[str, str] = {}
    nodes, partitions = [], []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        fields = dict(part.split("=", 1) for part in line.split())
        if "NodeName" in fields:
            nodes.append(fields)
        elif "PartitionName" in fields:
            partitions.append(fields)
        else:
            assert len(fields) == 1, line
            plain.update(fields)
    return plain, nodes, partitions


def test_slurm_conf_matches_the_golden_file_and_parses_back_to_the_spec() -> None:
    spec = load_spec(example())
    text = render_slurm_conf(spec, PLACEMENT)
    assert text == GOLDEN.read_text()
    plain, nodes, partitions = parse_conf(text)
    assert plain["ClusterName"] == "research" and plain["JobRequeue"] == "1"
    assert plain["KillWait"] == "120"  # the spec's grace
    assert plain["SchedulerParameters"] == "bf_continue"
    assert {n["NodeName"]: n["Gres"] for n in nodes} == {"free1": "gpu:8", "free2": "gpu:8", "free3": "gpu:8"}
    assert [(p["PartitionName"], p["Nodes"].split(","), p["Default"], p["MaxTime"]) for p in partitions] == [
        ("train", ["free1", "free2"], "YES", "2-00:00:00"),
        ("debug", ["free3"], "NO", "1:00:00"),
    ]
    assert partitions[1]["OverSubscribe"] == "NO"


def test_requeue_off_makes_jobs_requeue_only_when_they_ask() -> None:
    body = example()
    body["remediation"] = {"grace_seconds": 30, "requeue": False}
    plain, _, _ = parse_conf(render_slurm_conf(load_spec(body), PLACEMENT))
    assert plain["JobRequeue"] == "0" and plain["KillWait"] == "30"


def test_a_placement_that_does_not_match_the_spec_is_refused() -> None:
    spec = ClusterSpec.model_validate(example())
    wrong = copy.deepcopy(PLACEMENT)
    wrong["train"].pop()
    with pytest.raises(ValueError, match="train"):
        render_slurm_conf(spec, wrong)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("slurm_conf", ["jobrequeue=0"], "jobrequeue is set by gpufleet or its backend"),
        ("slurm_conf", ["SchedulerParameters=bf_continue KillWait=0"], "KillWait is set by gpufleet"),
        ("slurm_conf", ["SlurmUser=root"], "SlurmUser is set by gpufleet or its backend"),
        ("slurm_conf", ["AccountingStoragePass=hunter2"], "holds a password"),
        # Wherever the key stands in the line, and whatever else is wrong with it, the
        # message never repeats the password.
        ("slurm_conf", ["SlurmUser=x AccountingStoragePass=hunter2"], "AccountingStoragePass holds a password"),
        ("slurm_conf", ["Bad StoragePass=hunter2"], "StoragePass holds a password"),
        ("slurm_conf", ["accountingstoragepass=hunter2#x"], "accountingstoragepass holds a password"),
        ("name", "clusters", "reserved"),
    ],
)
def test_what_would_override_gpufleet_or_leak_a_secret_is_refused(field: str, value: Any, problem: str) -> None:
    raw = example()
    raw[field] = value
    with pytest.raises(SpecError, match=problem) as refused:
        load_spec(raw)
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize("name", ["Train", "gpu_a", "x-", "-x"])
def test_a_partition_name_must_also_be_a_label_value_and_an_object_name(name: str) -> None:
    raw = example()
    raw["partitions"][0]["name"] = name
    with pytest.raises(SpecError, match=r"partitions\[0\]\.name"):
        load_spec(raw)


def test_accounting_storage_is_checked_field_by_field() -> None:
    raw = example()
    raw["accounting"] = True
    raw["accounting_storage"] = {"host": "db host", "port": 0, "database": "acct;drop", "password_secret": {}}
    with pytest.raises(SpecError) as refused:
        load_spec(raw)
    said = str(refused.value)
    for field in ("accounting_storage.host", "accounting_storage.port", "accounting_storage.database"):
        assert field in said, said
    assert "accounting_storage.password_secret.namespace" in said and "accounting_storage.password_secret.name" in said


@pytest.mark.parametrize(
    ("where", "value", "problem"),
    [
        (("remediation", "grace_seconds"), float("nan"), "Input should be a finite number"),
        (("remediation", "grace_seconds"), float("inf"), "Input should be a finite number"),
        (("remediation", "grace_seconds"), True, "a number, not true"),
        (("remediation", "grace_seconds"), -1, "greater than or equal to 0"),
        (("remediation", "grace_seconds"), 1e12, "less than or equal to 3600"),
        (("partitions", 0, "nodes"), True, "a number, not true"),
        (("partitions", 0, "nodes"), float("nan"), "Input should be a finite number"),
        (("partitions", 0, "gpus_per_node"), False, "a number, not false"),
        (("users", 0, "uid"), True, "a number, not true"),
        (("spares",), True, "a number, not true"),
        (("spares",), 2.5, "fractional part"),
    ],
)
def test_no_number_in_a_spec_is_nan_infinite_or_a_boolean(where: tuple[Any, ...], value: Any, problem: str) -> None:
    raw = example()
    target: Any = raw
    for key in where[:-1]:
        target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
    target[where[-1]] = value
    field = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in where).lstrip(".")
    with pytest.raises(SpecError) as refused:
        load_spec(raw)
    assert any(f == field and problem in p for f, p in refused.value.problems), refused.value.problems


@pytest.mark.parametrize("path", ["/home", "/home/shared", "/etc/data", "/usr/local/data", "/tmp", "/var/lib/x"])
def test_storage_may_not_be_mounted_over_a_system_folder(path: str) -> None:
    raw = example()
    raw["storage"] = {"mount_path": path}
    with pytest.raises(SpecError, match=r"storage\.mount_path.*system folder of every node"):
        load_spec(raw)


@pytest.mark.parametrize("name", ["root", "sshd", "slurm", "munge"])
def test_a_user_may_not_be_a_system_account(name: str) -> None:
    raw = example()
    raw["users"][0]["name"] = name
    with pytest.raises(SpecError, match=r"users\[0\]\.name.*system account of every node"):
        load_spec(raw)


@pytest.mark.parametrize("path", ["/./etc", "//etc", "/.//usr/bin", "/.", "/./", "/shared/./x", "/shared//x"])
def test_a_mount_path_not_written_plainly_is_refused(path: str) -> None:
    raw = example()
    raw["storage"] = {"mount_path": path}
    with pytest.raises(SpecError, match=r"storage\.mount_path"):
        load_spec(raw)


@pytest.mark.parametrize("tail", ['\ncommand="sh" ssh-ed25519 AAAA', "\x00", "\tx"])
def test_a_key_with_a_second_line_or_a_control_byte_is_refused(tail: str) -> None:
    key = example()["users"][0]["ssh_keys"][0]
    with pytest.raises(ValueError, match="one line of printable characters"):
        check_ssh_key(f"{key} me{tail}")
