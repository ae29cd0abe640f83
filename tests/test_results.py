"""The typed result files (`kvprof.results`): each reads the file its command writes and writes it back unchanged,
refuses a foreign or newer file in one sentence naming it, and imports without torch.

Each result is written here by its command on the tiny world, once per module; tests/data/results/replay.json is
an older replay result.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvprof.results
from kvprof.cli import app
from kvprof.demo.assets import demo_world
from kvprof.errors import KvprofError
from kvprof.results.base import ENVELOPE_FIELDS, ResultFile
from kvprof.results.capture import CaptureResult
from kvprof.results.inspect import InspectResult
from kvprof.results.plan import PlanResult
from kvprof.results.rank_analysis import RankAnalysisResult
from kvprof.results.recommend import RecommendResult
from kvprof.results.replay import ReplayResult
from kvprof.results.serve_bench import ServeBenchResult
from kvprof.results.simulate import SimulateResult
from kvprof.results.tune_tau import TuneTauResult
from kvprof.serving.stub_server import StubServer, trace_config

DATA = Path(__file__).parent / "data"
TYPES: dict[str, type[ResultFile]] = {
    "capture": CaptureResult,
    "inspect": InspectResult,
    "plan": PlanResult,
    "rank_analysis": RankAnalysisResult,
    "recommend": RecommendResult,
    "replay": ReplayResult,
    "serve_bench": ServeBenchResult,
    "simulate": SimulateResult,
    "tune_tau": TuneTauResult,
}


def kvprof_run(*args: object) -> None:
    """`kvprof ARGS...` in this process; fails the test when it fails."""
    run = CliRunner().invoke(app, [str(arg) for arg in args])
    assert run.exit_code == 0, run.output[-2000:]


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_world, lora_trace, prompt_trace) -> dict[str, Path]:
    """Each typed kind's result file as its command wrote it."""
    out = tmp_path_factory.mktemp("results")
    kvprof_run(
        "capture", "--model", tiny_world.model, "--tasks", tiny_world.tasks, "--workflow", tiny_world.lora_workflow,
        "--out", out / "capture", "--device", "cpu",
    )  # fmt: skip
    kvprof_run("inspect", lora_trace, "--out", out / "inspect")
    simulated = DATA / "simulate"
    kvprof_run(
        "simulate", simulated / "replay.json", "--calibration", simulated / "serve_bench.json", "--qps", "1",
        "--duration", "2", "--out", out / "simulate",
    )  # fmt: skip
    served = demo_world().sample_traces["lora_short"]
    with StubServer(trace_config(str(served), base="base", adapters=["plan", "act", "reflect"])) as stub:
        kvprof_run("serve-bench", served, "--url", stub.url, "--concurrency", "1", "--out", out / "serve_bench")
    kvprof_run("rank-analysis", lora_trace, "--out", out / "rank", "--device", "cpu")
    kvprof_run(
        "tune-tau", prompt_trace, "--grid", "0,0.5,1", "--tune", "2", "--option", "rank=4", "--max-kl", "1e-3",
        "--no-online", "--out", out / "tune", "--device", "cpu",
    )  # fmt: skip
    kvprof_run(
        "replay", prompt_trace, "--policy", "nonshared", "--policy", "kvcmas", "--limit", "1", "--repeats", "1",
        "--out", out / "replay", "--device", "cpu",
    )  # fmt: skip
    kvprof_run(
        "replay", prompt_trace, "--policy", "nonshared", "--policy", "kvcmas", "--limit", "1", "--repeats", "1",
        "--out", out / "plan", "--device", "cpu", "--plan",
    )  # fmt: skip
    kvprof_run(
        "recommend", out / "replay" / "replay.json", "--target", "kl<=0.01, load=1qps", "--fit-replay", "--duration",
        "5", "--out", out / "recommend",
    )  # fmt: skip
    return {
        "capture": out / "capture" / "capture.json",
        "inspect": out / "inspect" / "inspect.json",
        "plan": out / "plan" / "plan.json",
        "rank_analysis": out / "rank" / "rank_analysis.json",
        "recommend": out / "recommend" / "recommend.json",
        "replay": out / "replay" / "replay.json",
        "serve_bench": out / "serve_bench" / "serve_bench.json",
        "simulate": out / "simulate" / "simulate.json",
        "tune_tau": out / "tune" / "tune_tau.json",
    }


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_a_result_reads_its_commands_file_and_writes_it_back(written, kind):
    path = written[kind]
    result = TYPES[kind].read(path)
    assert result.envelope is not None and result.envelope.kind == kind
    assert json.dumps(result.to_json()) == json.dumps(json.loads(path.read_text()))
    assert TYPES[kind].from_json(result.to_json(), str(path)) == result


def with_first_number(record: object, value: float) -> object:
    """`record` with its first number (depth first) replaced by `value`; the same if it has none."""
    if isinstance(record, dict) or isinstance(record, list):
        items = list(record.items()) if isinstance(record, dict) else list(enumerate(record))
        for key, item in items:
            replaced = with_first_number(item, value)
            if replaced is not item:
                copy = dict(record) if isinstance(record, dict) else list(record)
                copy[key] = replaced
                return copy
        return record
    return value if isinstance(record, (int, float)) and not isinstance(record, bool) else record


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_a_foreign_newer_unversioned_or_non_finite_file_is_refused_in_one_sentence(written, kind, tmp_path):
    payload = json.loads(written[kind].read_text())
    other = next(name for name in TYPES if name != kind)
    results = {key: value for key, value in payload.items() if key not in ENVELOPE_FIELDS}
    cases = {
        "foreign.json": (payload | {"schema": f"kvprof.result.{other}"}, "but a"),
        "newer.json": (payload | {"version": 99}, "format version 99"),
        "stranger.json": ({"schema": "someone.else", "rows": []}, "is not a kvprof"),
        "unversioned.json": ({key: value for key, value in payload.items() if key != "version"}, "without a format"),
        "nan.json": (payload | with_first_number(results, float("nan")), "holds NaN where a number is required"),
        "infinity.json": (payload | with_first_number(results, float("-inf")), "holds -Infinity where"),
    }
    assert json.dumps(cases["nan.json"][0]) != json.dumps(payload), "the result holds no number to make NaN"
    for name, (content, says) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(content))
        with pytest.raises(KvprofError) as refused:
            TYPES[kind].read(path)
        message = str(refused.value)
        assert str(path) in message and "\n" not in message and message.count("; ") == 1, message
        assert says in message, message


def test_an_older_replay_file_reads():
    """tests/data/results/replay.json predates moved spans, layer kinds and the self-check: it reads, and is written
    back with the nullable fields it lacks as null."""
    path = DATA / "results" / "replay.json"
    result = ReplayResult.read(path)
    assert result.span_matching is None and result.self_check is None
    assert result.to_json() == json.loads(path.read_text()) | {"self_check": None}


def test_a_missing_field_is_refused_naming_where(tmp_path):
    payload = json.loads((DATA / "results" / "replay.json").read_text())
    del payload["policies"]["fullshared"]["summary"]["kl"]
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(KvprofError, match="policies 'fullshared', summary has no field 'kl'; pass the replay.json"):
        ReplayResult.read(path)


def test_results_import_without_torch():
    modules = [m.name for m in pkgutil.walk_packages(kvprof.results.__path__, "kvprof.results.")]
    assert sorted(modules) == sorted(f"kvprof.results.{name}" for name in ("base", *TYPES))
    code = "import sys, importlib; sys.modules['torch'] = None; " + "; ".join(
        f"importlib.import_module({name!r})" for name in modules
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(importlib.import_module(name) for name in modules)
