"""docs/benchmarks.md is what bench/report.py makes of docs/results/*.json, and nothing else: each
result's provenance and figures in tables, a missing result said to be missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.report import COMMAND, PAGE, RESULTS, main, render

PROVENANCE = {
    "commit": "0123456789abcdef0123456789abcdef01234567",
    "dirty": True,
    "date": "2026-12-04T10:00:00+00:00",
    "machine": {"cores": 2, "cpu_model": "AMD EPYC", "memory_total_mb": 24105, "python": "3.11.7"},
}


def drill(
    resumed: float,
    overhead: float,
    replaced: float = 1.4,
    running: dict[str, float] | None = None,
    node: str = "gpu1",
    ended: list[int] | None = None,
) -> dict[str, Any]:
    return {
        "node": node,
        "jobs_ended_by_failure": ended or [],
        "outcome": "resolved",
        "timings_s": {
            "detect_to_workflow": 0.1,
            "detect_to_drained": 0.27,
            "detect_to_requeued": 1.25,
            "detect_to_replaced": replaced,
            "detect_to_resumed": resumed,
        },
        "history": {
            "control_plane_overhead_s": overhead,
            "polling_delay_bound_s": 0.5,
            "activity_running_s": running or {"claim_spare": 0.08, "jobs_resumed": resumed - 1.4},
        },
    }


# The shapes bench/bench.py, lab/chaos.py and bench/bench_scale.py write (figures from earlier runs).
BENCH = {
    "provenance": PROVENANCE,
    "parse": {
        "lines": 1_000_000,
        "non_driver": {"lines_per_second": 3_300_000, "cpu_seconds": 0.3, "events": 0, "events_expected": 0},
        "mixed_1_in_1000": {
            "lines_per_second": 3_100_000,
            "cpu_seconds": 0.32,
            "events": 1000,
            "events_expected": 1000,
        },
        "target_non_driver_lines_per_second": 1_000_000,
        "source": {"lines": 1_000_000, "cpu_seconds": 0.6, "lines_per_second": 1_600_000},
    },
    "detector_idle": {"seconds": 10.0, "cpu_percent_of_one_core": 1.2},
    "detector": {"samples": 20, "median_line_to_incident_s": 0.09, "target_median_s": 1.0},
    "drills": [drill(7.1, 0.6, ended=[1]), drill(7.2, 0.62, node="gpu2"), drill(7.3, 0.64, node="gpu3")],
    "medians_s": {
        "detect_to_workflow": 0.1,
        "detect_to_drained": 0.27,
        "detect_to_requeued": 1.25,
        "detect_to_replaced": 1.4,
        "detect_to_resumed": 7.2,
    },
    "median_control_plane_overhead_s": 0.62,
    "median_polling_delay_bound_s": 0.5,
    "targets_s": {"detect_to_replaced": 10, "detect_to_resumed": 30, "control_plane_overhead": 1},
    "clusters": {
        "spec": "examples/cluster.yaml",
        "rounds": 3,
        "cluster_create_seconds": 8.5,
        "cluster_delete_seconds": 2.1,
        "create_s": [7.8, 8.5, 19.3],
        "delete_s": [2.1, 2.4, 1.2],
    },
}
# What bench/bench.py --flavor slinky writes: the drills, the cluster (backend slinky) and the pool
# moves; the parts that run no lab skipped with the reason.
SLINKY = {
    "provenance": {**PROVENANCE, "commit": "fedcba9876543210fedcba9876543210fedcba98", "dirty": False},
    "flavor": "slinky",
    "skipped": {
        "parse": "the parser on one core runs no lab",
        "detector": "a kernel-log line to its incident runs no lab",
    },
    "lab": {
        "flavor": "slinky",
        "slurm": "26.05.5",
        "slurm_backend": "rest",
        "job": "counter",
        "partition": "lab-train",
    },
    "drills": [
        drill(9.1, 0.7, replaced=4.2, running={"claim_spare": 2.9, "jobs_resumed": 4.9, "classify_xids": 0.01}),
        drill(
            9.4,
            0.72,
            replaced=4.4,
            running={"claim_spare": 3.2, "jobs_resumed": 5.0, "classify_xids": 0.02},
            node="spare1",
        ),
    ],
    "medians_s": {
        "detect_to_workflow": 0.1,
        "detect_to_drained": 0.3,
        "detect_to_requeued": 1.3,
        "detect_to_replaced": 4.3,
        "detect_to_resumed": 9.25,
    },
    "median_control_plane_overhead_s": 0.71,
    "median_polling_delay_bound_s": 0.5,
    "targets_s": {"detect_to_replaced": 10, "detect_to_resumed": 30, "control_plane_overhead": 1},
    "clusters": {
        "spec": "examples/cluster.yaml",
        "backend": "slinky",
        "rounds": 1,
        "cluster_create_seconds": 9.7,
        "cluster_delete_seconds": 1.1,
        "create_s": [9.7],
        "delete_s": [1.1],
        "torn_down_after_delete_s": [0.4],
        "median_torn_down_after_delete_s": 0.4,
        "note": "backend slinky: the operator stand-in bringing up Slurm 26.05 from the cluster's objects",
    },
    "cluster_create_seconds": 9.7,
    "cluster_delete_seconds": 1.1,
    "pool": {
        "flavor": "slinky",
        "rounds": 1,
        "pool_move_to_inference_seconds": 4.3,
        "pool_move_to_training_seconds": 2.4,
        "training_steps_lost_per_move": 0.0,
        "to_inference_s": [4.3],
        "to_training_s": [2.4],
        "steps_lost": [0.0],
    },
    "pool_move_to_inference_seconds": 4.3,
    "pool_move_to_training_seconds": 2.4,
    "training_steps_lost_per_move": 0.0,
}
CHAOS = {
    "provenance": {**PROVENANCE, "dirty": False},
    "scenarios": [
        {"name": "baseline", "passed": True, "outcome": "resolved", "added_delay_s": None},
        {
            "name": "worker_killed_at_checkpoint",
            "passed": True,
            "within_budget": True,
            "outcome": "resolved",
            "added_delay_s": 2.1,
            "added_to_drained_s": 0.3,
            "fault_at_step": "checkpoint",
        },
        {"name": "webhook_hangs", "passed": False, "outcome": "error", "error": "TimeoutError: it | hung"},
        {
            "name": "storm_four_nodes_at_once",
            "passed": True,
            "outcome": "tripped, then reset",
            "storm_drained": 2,
            "storm_waiting": 2,
            "storm_paged": 1,
        },
    ],
    "passed": False,
    "jobs_lost": 0,
    "double_claims": 0,
    "nodes_undrained_not_ours": 0,
    "claims_leaked": 1,
    "max_added_delay_s": 2.1,
    "baseline": {"detect_to_drained": 0.46, "detect_to_resumed": 8.9},
}
CHAOS_SLINKY = {
    "provenance": {**PROVENANCE, "dirty": False},
    "flavor": "slinky",
    "scenarios": [
        {"name": "baseline", "passed": True, "outcome": "resolved", "added_delay_s": None},
        {
            "name": "pod_protect_blocks_eviction",
            "passed": True,
            "outcome": "failed",
            "failed_at": "drain_kubernetes",
            "detect_to_failed": 211.3,
            "incident_error": "PodStillProtected: slurm-lab/lab-train-1 did not leave gpu2 within 5 s",
            "pod_kept": True,
        },
    ],
    "passed": True,
    "jobs_lost": 0,
    "double_claims": 0,
    "nodes_undrained_not_ours": 0,
    "claims_leaked": 0,
    "max_added_delay_s": None,
    "baseline": {"detect_to_drained": 0.29, "detect_to_resumed": 10.9},
}
SCALE = {
    "provenance": PROVENANCE,
    "fleet": {
        "nodes": 10000,
        "training": 9000,
        "spares": 1000,
        "slurm": "Slurm is simulated at the protocol level (bench/simslurm.py)",
        "sticky_timeout_seconds": 3.0,
        "max_cached_workflows": 1000,
        "workflow_sandbox": "shared",
    },
    "burst": 1000,
    "incidents_started_per_s": 58.5,
    "burst_drain_seconds": 832.0,
    "open_after_timeout": 0,
    "overhead_p50_s": 677.0,
    "overhead_p99_s": 811.0,
    "history_events_per_incident": 200,
    "worker_peak_rss_mb": 407.2,
    "guard_held": 257,
    "open_guard": {"history_events_per_incident_p50": 148, "outcomes": {"resolved": 1000}},
    "default_guard": {"guard_limit": 2, "past_guard_max": 2},
    "targets": {
        "incidents_started_per_s": ">= 50",
        "history_events_per_incident": "<= 150",
        "worker_peak_rss_mb": "<= 500",
        "met": {
            "incidents_started_per_s": True,
            "history_events_per_incident": False,
            "worker_peak_rss_mb": True,
            "guard_never_exceeded": None,
            "all_resolved": True,
        },
    },
    "bound": "the machine's CPU: 2 cores, 81% busy with the burst's processes (server 44%, kubeapi 31%, worker 25%)",
}


def results(tmp_path: Path, **files: dict[str, Any]) -> Path:
    for name, content in files.items():
        (tmp_path / f"{name.replace('_', '-')}.json").write_text(json.dumps(content))
    return tmp_path


def test_the_committed_page_is_what_the_committed_results_give() -> None:
    assert PAGE.exists(), f"{PAGE} is missing: run `{COMMAND}`"
    assert PAGE.read_text(encoding="utf-8") == render(RESULTS), (
        f"{PAGE.relative_to(RESULTS.parents[1])} is not what docs/results/ gives: run `{COMMAND}` "
        "(it is generated; edit bench/report.py, not the page)"
    )


def test_a_missing_result_is_said_to_be_missing_and_nothing_is_invented(tmp_path: Path) -> None:
    page = render(tmp_path)
    for command, name in (
        ("make bench", "bench"),
        ("make bench FLAVOR=slinky", "bench-slinky"),
        ("make chaos", "chaos"),
        ("make chaos FLAVOR=slinky", "chaos-slinky"),
        ("make bench-scale", "bench-scale"),
    ):
        assert f"Not measured yet: run `{command}` (it writes `docs/results/{name}.json`)." in page
    assert "|" not in page and "Measured at" not in page
    only_chaos = render(results(tmp_path, chaos=CHAOS))
    assert "Not measured yet: run `make bench`" in only_chaos and "Not measured yet: run `make chaos`" not in only_chaos


def test_each_result_gives_its_provenance_and_figures(tmp_path: Path) -> None:
    page = render(results(tmp_path, bench=BENCH, bench_slinky=SLINKY, chaos=CHAOS, bench_scale=SCALE))
    assert [line for line in page.splitlines() if "Not measured yet" in line] == [
        "Not measured yet: run `make chaos FLAVOR=slinky` (it writes `docs/results/chaos-slinky.json`)."
    ]
    assert (
        "From `docs/results/bench.json`. Measured at commit `0123456789ab` with uncommitted changes, on "
        "2026-12-04T10:00:00+00:00; machine: 2 cores, AMD EPYC, 23.5 GiB of memory, Python 3.11.7." in page
    )
    assert "From `docs/results/chaos.json`. Measured at commit `0123456789ab`, on" in page  # not dirty
    # The slinky section repeats the drills' rows: the test below reads it.
    slinky = page[page.index("## `make bench FLAVOR=slinky`") : page.index("## `make chaos`")]
    lines = page.replace(slinky, "").splitlines()

    def row(starting: str) -> str:
        found = [line for line in lines if line.startswith(f"| {starting}")]
        assert len(found) == 1, (starting, found)
        return found[0]

    # make bench: the detector, the drills (median, each, target), clusters; the pool moves skipped.
    assert row("parser throughput, kernel chatter").endswith("| 3.30 M lines/s | ≥ 1.00 M lines/s |")
    assert "1,000 events found of 1,000" in row("parser throughput, one driver line")
    assert row("kernel-log line → Xid").endswith("| 0.09 s | ≤ 1 s |")
    assert row("detector idle CPU").endswith("| 1.20 % of a core |  |")
    assert row("Xid → job running again").endswith("| 7.20 s | 7.10, 7.20, 7.30 s | ≤ 30 s |")
    assert row("Xid → workflow started").endswith("| 0.10 s | 0.10, 0.10, 0.10 s |  |")
    assert row("control-plane overhead").endswith("| 0.62 s | 0.60, 0.62, 0.64 s | ≤ 1 s |")
    assert "Outcomes: resolved, resolved, resolved." in lines
    assert row("`cluster_create_seconds`").endswith("| 8.50 s | 7.80, 8.50, 19.3 s |")
    shared_pool = lines.index("### Shared-pool moves")
    assert lines[shared_pool + 2] == "Not in this run (its options skipped it)."
    # make chaos: the verdict, the four totals and each scenario.
    assert "Passed: **no** (some scenario failed or a total is not 0), 4 scenarios." in lines
    assert row("`claims_leaked`").endswith("| 1 |") and row("`jobs_lost`").endswith("| 0 |")
    assert row("`worker_killed_at_checkpoint`") == (
        "| `worker_killed_at_checkpoint` | yes | resolved | 2.10 s | 0.30 s | fault at checkpoint |"
    )
    assert row("`webhook_hangs`").endswith("| **no** | error | n/a | n/a | error: TimeoutError: it \\| hung |")
    assert "drained 2, waiting 2, paged 1" in row("`storm_four_nodes_at_once`")

    # make bench-scale: headline figures, targets met, the bound.
    assert row("`incidents_started_per_s`").endswith("| 58.5 /s | >= 50 | yes |")
    assert row("`history_events_per_incident`").endswith("| 200 (median 148) | <= 150 | **no** |")
    assert row("`default_guard.past_guard_max`").endswith("| 2 | ≤ its limit (2) | not measured |")
    assert row("every incident of the open burst resolved").endswith("| resolved: 1,000 | all resolved | yes |")
    assert "3 of 4 judged met, 1 not measured" in page
    assert f"As the run names it: {SCALE['bound']}." in lines


def test_the_slinky_flavor_sits_beside_the_default_one_each_with_its_commit(tmp_path: Path) -> None:
    page = render(results(tmp_path, bench=BENCH, bench_slinky=SLINKY))
    section = page[page.index("## `make bench FLAVOR=slinky`") :]
    lines = section.splitlines()
    beside, drills = section.split("### Recovery drills")
    drills, parts = drills.split("### Cluster creation and deletion")

    def row(starting: str, part: str = beside) -> str:
        found = [line for line in part.splitlines() if line.startswith(f"| {starting}")]
        assert len(found) == 1, (starting, found)
        return found[0]

    assert "From `docs/results/bench-slinky.json`. Measured at commit `fedcba987654`, on" in section
    # What the flavor does not run, and why, as the run said.
    assert "- the parser's throughput: the parser on one core runs no lab." in lines
    assert "- kernel-log line to incident: a kernel-log line to its incident runs no lab." in lines
    assert "cluster creation and deletion:" not in beside and "shared-pool moves:" not in beside
    # Each median beside the default flavor's, the difference and the target; the commits of both.
    assert "(3 drills, commit `0123456789ab`)" in section and "(2 drills, commit `fedcba987654`)" in section
    assert row("Xid → spare in the partition") == (
        "| Xid → spare in the partition (`detect_to_replaced`) | 1.40 s | 4.30 s | +2.90 s | ≤ 10 s |"
    )
    assert row("Xid → job running again") == (
        "| Xid → job running again (`detect_to_resumed`) | 7.20 s | 9.25 s | +2.05 s | ≤ 30 s |"
    )
    assert row("control-plane overhead").endswith("| 0.62 s | 0.71 s | +0.09 s | ≤ 1 s |")
    # What the drills ran on: recorded for the slinky run, not for a default run from before.
    assert row("the worker's Slurm backend") == "| the worker's Slurm backend | not recorded | rest |  |  |"
    assert row("training job") == "| training job | not recorded | counter |  |  |"
    # Which nodes failed, and how the jobs ended: the drills' own record.
    assert row("nodes failed") == "| nodes failed, drill by drill | gpu1, gpu2, gpu3 | gpu1, spare1 |  |  |"
    assert row("drills whose job the failure had ended").endswith("| 1 of 3 | 0 of 2 |  |  |")
    # The activities that take the time; those under 0.1 s on both flavors left to the JSON.
    assert row("activity `claim_spare` running") == "| activity `claim_spare` running | 0.08 s | 3.05 s | +2.97 s |  |"
    assert "`classify_xids`" not in section
    assert "The drills ran on the slinky flavor: Slurm 26.05.5, the worker on its `rest` backend" in section
    assert row("Xid → job running again", drills).endswith("| 9.25 s | 9.10, 9.40 s | ≤ 30 s |")
    # The cluster (backend slinky) and the pool moves beside the default flavor's, and in full.
    assert row("`cluster_create_seconds`") == "| `cluster_create_seconds` | 8.50 s | 9.70 s | +1.20 s |  |"
    assert row("`training_steps_lost_per_move`").startswith("| `training_steps_lost_per_move` | ")
    assert "created and deleted once on the lab's free pool, through the CLI, with `--backend slinky`:" in parts
    assert "Backend slinky: the operator stand-in bringing up Slurm 26.05 from the cluster's objects." in parts
    assert row("`cluster_delete_seconds`", parts) == "| `cluster_delete_seconds` | 1.10 s | 1.10 s |"
    assert row("its daemons stopped", parts) == "| its daemons stopped, after the deletion ended | 0.40 s | 0.40 s |"
    assert "On the slinky flavor a move scales the NodeSet in" in parts
    assert row("`pool_move_to_inference_seconds`", parts) == "| `pool_move_to_inference_seconds` | 4.30 s | 4.30 s |"
    assert row("`training_steps_lost_per_move`", parts) == "| `training_steps_lost_per_move` | 0 | 0 |"
    # Without the default flavor's result, it says so and invents nothing.
    (tmp_path / "alone").mkdir()
    alone = render(results(tmp_path / "alone", bench_slinky=SLINKY))
    assert "The default flavor is not measured yet: run `make bench`" in alone
    assert "slinky minus default" not in alone


def test_the_slinky_chaos_run_has_a_section_of_its_own(tmp_path: Path) -> None:
    page = render(results(tmp_path, chaos_slinky=CHAOS_SLINKY))
    section = page[page.index("## `make chaos FLAVOR=slinky`") : page.index("## `make bench-scale`")]
    assert "From `docs/results/chaos-slinky.json`. Measured at commit `0123456789ab`, on" in section
    assert "Passed: yes (every scenario passed and the four totals are 0), 2 scenarios." in section
    assert "each incident is keyed on the Kubernetes node under one" in section
    # The pod-protect incident fails where it must, its pod kept.
    assert (
        "| `pod_protect_blocks_eviction` | yes | failed | n/a | n/a | incident failed at drain_kubernetes, "
        "211 s after the Xid; pod kept on its node |"
    ) in section.splitlines()
    assert "Not measured yet: run `make chaos` (it writes `docs/results/chaos.json`)." in page


def test_a_result_from_before_provenance_says_so(tmp_path: Path) -> None:
    old = {key: value for key, value in SCALE.items() if key != "provenance"}
    page = render(results(tmp_path, bench_scale=old))
    assert "Provenance: not recorded in this result (a run from before it was)." in page


def test_check_says_whether_the_page_is_up_to_date(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results").mkdir()
    source, page = results(tmp_path / "results", chaos=CHAOS), tmp_path / "benchmarks.md"
    with pytest.raises(SystemExit) as stopped:
        main(["--results", str(source), "--page", str(page), "--check"])
    assert stopped.value.code == 1 and COMMAND in capsys.readouterr().err
    main(["--results", str(source), "--page", str(page)])
    assert page.read_text(encoding="utf-8") == render(source)
    main(["--results", str(source), "--page", str(page), "--check"])  # up to date: returns
