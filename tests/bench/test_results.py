"""`make bench` and `make bench-scale` keep their JSON where --output says, with its provenance
first (the runs themselves are labs: here what they measure is stood in for)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

from bench import bench, bench_scale


def test_make_bench_scale_keeps_its_json_with_its_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def measured(args: argparse.Namespace, *, home: Path, say: Any) -> dict[str, Any]:
        return {"burst": args.burst, "bound": "stood in"}

    monkeypatch.setattr(bench_scale, "bench_scale", measured)
    out = tmp_path / "results" / "bench-scale.json"
    bench_scale.main(["--nodes", "20", "--spares", "5", "--burst", "5", "--output", str(out)])
    kept = json.loads(out.read_text())
    assert next(iter(kept)) == "provenance" and kept["provenance"]["machine"]["cores"] == os.cpu_count()
    assert kept["burst"] == 5 and kept["bound"] == "stood in"


def test_make_bench_keeps_its_json_with_its_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def leave(code: int) -> NoReturn:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)  # main leaves without interpreter teardown
    out = tmp_path / "results" / "bench.json"
    skipped = ["--drills", "0", "--detector-samples", "0", "--parse-lines", "0", "--idle-seconds", "0"]
    skipped += ["--health-checks", "0"]
    skipped += ["--clusters", "0", "--pool-moves", "0"]
    monkeypatch.setattr(sys, "argv", ["bench", *skipped, "--output", str(out)])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert stopped.value.code == 0
    kept = json.loads(out.read_text())
    assert set(kept) == {"provenance", "flavor"} and kept["provenance"]["commit"] and kept["flavor"] == "default"


def test_make_bench_on_slinky_says_what_it_skips_and_refuses_to_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def leave(code: int) -> NoReturn:
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    out = tmp_path / "results" / "bench-slinky.json"
    argv = ["bench", "--flavor", "slinky", "--drills", "0", "--clusters", "0", "--pool-moves", "0"]
    monkeypatch.setattr(sys, "argv", [*argv, "--output", str(out)])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert stopped.value.code == 0
    kept = json.loads(out.read_text())
    assert list(kept)[:3] == ["provenance", "flavor", "skipped"] and kept["flavor"] == "slinky"
    # Cluster creation and pool moves run on Slinky too: only the parts that run no lab are skipped.
    assert set(kept["skipped"]) == {"parse", "detector_idle", "health_check", "detector"}
    assert "runs no lab" in kept["skipped"]["parse"]
    assert "clusters" not in kept and "pool" not in kept  # asked for none
    # Asked for a part the flavor does not run: refused, saying why, before any lab starts.
    monkeypatch.setattr(sys, "argv", ["bench", "--flavor", "slinky", "--parse-lines", "1000"])
    with pytest.raises(SystemExit) as refused:
        bench.main()
    assert refused.value.code == 2
    assert "--parse-lines is not run on the slinky flavor: the parser on one core runs no lab" in (
        capsys.readouterr().err
    )


def test_make_bench_on_slinky_creates_its_cluster_with_the_slinky_backend_and_moves_pool_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def leave(code: int) -> NoReturn:
        raise SystemExit(code)

    asked: dict[str, Any] = {}

    def clusters(rounds: int, *, home: Path, say: Any, flavor: str) -> dict[str, Any]:
        # The lab home the Slinky cluster's users run their jobs from: short and reachable.
        asked["clusters"] = (rounds, flavor, bench.cluster_home_problem(home, {"name": "research", "partitions": []}))
        return {"backend": "slinky", "cluster_create_seconds": 9.7, "cluster_delete_seconds": 1.1}

    def pool(rounds: int, *, home: Path, say: Any, flavor: str) -> dict[str, Any]:
        asked["pool"] = (rounds, flavor)
        return {
            "flavor": flavor,
            "pool_move_to_inference_seconds": 4.3,
            "pool_move_to_training_seconds": 2.4,
            "training_steps_lost_per_move": 0.0,
        }

    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setattr(bench, "cluster_bench", clusters)
    monkeypatch.setattr(bench, "pool_bench", pool)
    out = tmp_path / "bench-slinky.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--flavor", "slinky", "--drills", "0", "--output", str(out)])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert stopped.value.code == 0
    assert asked == {"clusters": (1, "slinky", ""), "pool": (1, "slinky")}
    kept = json.loads(out.read_text())
    assert kept["clusters"]["backend"] == "slinky" and kept["pool"]["flavor"] == "slinky"
    # The same top-level keys as the default flavor's, for the report and whoever reads the JSON.
    assert kept["cluster_create_seconds"] == 9.7 and kept["cluster_delete_seconds"] == 1.1
    assert kept["pool_move_to_inference_seconds"] == 4.3 and kept["training_steps_lost_per_move"] == 0.0
