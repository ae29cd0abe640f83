"""`kvprof serve-bench` against the stub OpenAI server (kvprof.serving.stub_server), on CPU in seconds: the traffic
is the trace's, the measurements are what the server reported, and every failure is one sentence with exit 2,
nothing written and any started server stopped. The real-vLLM acceptance run is in .ci/run."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvprof.demo.assets import demo_world
from kvprof.serving.client import ServerClient
from kvprof.serving.driver import run_load
from kvprof.serving.prometheus import COUNTERS, GAUGES, metric_values
from kvprof.serving.server import VllmServer, free_port, lora_rank_slot
from kvprof.serving.stub_server import STUB_VERSION, StubServer, trace_config
from kvprof.serving.summary import percentile, summarize
from kvprof.serving.traffic import Load, ServedModels, poisson_arrivals, trajectory_traffic
from kvprof.traces.trace import read_trace

TRACE = demo_world().sample_traces["lora_short"]
AGENTS = ["plan", "act", "reflect"]
REPO = Path(__file__).resolve().parents[1]


def stub_config(**overrides):
    settings = dict(base="base", adapters=AGENTS, lifetime=60.0) | overrides
    return trace_config(str(TRACE), **settings)


def result_of(out: Path) -> dict:
    return json.loads((out / "serve_bench.json").read_text())


# ------------------------------------------------------------------------------------------------------ traffic


def test_traffic_is_the_trace_turn_by_turn():
    trace = read_trace(TRACE)
    models = ServedModels(base="base", adapters={agent: f"lora-{agent}" for agent in AGENTS})
    for pattern in ("agents", "base"):
        traffic = trajectory_traffic(trace.trajectories, pattern, models)
        for traj, requests in zip(trace.trajectories, traffic):
            assert [r.prompt for r in requests.turns] == [traj.input_tokens(t) for t in traj.turns]
            assert [r.expected for r in requests.turns] == [traj.output_tokens(t) for t in traj.turns]
            expected_models = [f"lora-{t.agent}" if pattern == "agents" else "base" for t in traj.turns]
            assert [r.model for r in requests.turns] == expected_models
            counts: dict[str, int] = {}
            for request in requests.turns:
                assert request.agent_turn == counts.get(request.agent, 0)
                counts[request.agent] = request.agent_turn + 1


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    first, again, other = (poisson_arrivals(4000, 2.0, seed) for seed in (0, 0, 1))
    assert first == again and first != other
    assert first[0] == 0.0 and all(b > a for a, b in zip(first, first[1:]))
    mean_gap = first[-1] / (len(first) - 1)
    assert abs(mean_gap - 0.5) < 0.05


def test_percentile_interpolates_like_numpy():
    numpy = pytest.importorskip("numpy")
    rng = random.Random(3)
    values = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def test_prometheus_values_are_read_per_metric():
    text = textwrap.dedent(
        """\
        # HELP vllm:num_requests_running x
        vllm:num_requests_running{engine="0",model_name="m"} 2.0
        vllm:num_requests_running{engine="1",model_name="m"} 1.0
        vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
        vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
        vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0
        """
    )
    assert metric_values(text, GAUGES) == {"running": 3.0, "kv_cache_usage": 0.5}
    assert metric_values(text, COUNTERS) == {"prefix_cache_hits": 32.0}


def test_lora_rank_slot_is_the_smallest_vllm_accepts():
    assert [lora_rank_slot([r]) for r in (1, 2, 8, 9, 64)] == [1, 8, 8, 16, 64]


# ------------------------------------------------------------------------------------------------ the driver


def test_driver_measures_what_the_server_does():
    """TTFT and TPOT come from the stream's timing; cached tokens from the server's usage; agreement from ids."""
    trace = read_trace(TRACE)
    models = ServedModels(base="base", adapters={agent: agent for agent in AGENTS})
    traffic = trajectory_traffic(trace.trajectories[:2], "agents", models)
    with StubServer(stub_config(ttft=0.05, per_token=0.01)) as stub:
        run = run_load(ServerClient(stub.url, timeout=10), traffic, "agents", Load("concurrency", 2), 0, 60)
    assert len(run.requests) == sum(len(t.turns) for t in traffic) and not run.unfinished
    for record in run.requests:
        assert 0.05 <= record.ttft < 0.5
        if record.tpot is not None:
            assert 0.009 <= record.tpot < 0.1
        assert record.e2e >= 0.05 + 0.01 * (record.output_tokens - 1)
        assert record.matches and record.cached_tokens is not None
    summary = summarize(run)
    assert summary["agreement"]["fraction"] == 1.0
    assert summary["server"]["prefix_cache"]["hits"] == sum(r.cached_tokens or 0 for r in run.requests)


def test_driver_reports_outputs_that_differ():
    trace = read_trace(TRACE)
    traffic = trajectory_traffic(trace.trajectories[:1], "base", ServedModels("base", {}))
    with StubServer(stub_config(answers={})) as stub:
        run = run_load(ServerClient(stub.url, timeout=10), traffic, "base", Load("qps", 5.0), 0, 60)
    assert run.requests and not any(record.matches for record in run.requests)
    assert summarize(run)["agreement"]["matching"] == 0


def test_max_seconds_cuts_a_run_short():
    trace = read_trace(TRACE)
    traffic = trajectory_traffic(trace.trajectories, "base", ServedModels("base", {}))
    with StubServer(stub_config(ttft=0.4)) as stub:
        run = run_load(ServerClient(stub.url, timeout=10), traffic, "base", Load("concurrency", 1), 0, 1.0)
    assert run.unfinished and len(run.requests) < sum(len(t.turns) for t in traffic)
    assert run.duration < 3.0


# ------------------------------------------------------------------------------------------ the command (--url)


def test_serve_bench_against_the_stub(run_cli, tmp_path):
    with StubServer(stub_config(per_token=0.001)) as stub:
        code, out, err = run_cli(
            "serve-bench", TRACE, "--url", stub.url, "--qps", "4", "--concurrency", "2", "--out", tmp_path
        )
    assert code == 0, err
    result = result_of(tmp_path)
    assert result["schema"] == "kvprof.result.serve_bench" and result["version"] == 1
    assert result["server"]["version"] == STUB_VERSION
    turns = sum(len(traj.turns) for traj in read_trace(TRACE).trajectories)
    summaries = {(r["summary"]["pattern"], r["summary"]["load"]["label"]): r["summary"] for r in result["runs"]}
    assert set(summaries) == {(p, load) for p in ("agents", "base") for load in ("4 qps", "2 conc")}
    for summary in summaries.values():
        assert summary["requests"] == turns and summary["agreement"]["fraction"] == 1.0
        assert summary["cache_by_turn"]["later_turns"]["with_cached_tokens"] > 0
        assert (
            summary["cache_by_turn"]["first_turns"]["cached_tokens"]
            < summary["cache_by_turn"]["later_turns"]["cached_tokens"]
        )
    # the stub keys its cache by model, as vLLM keys it by adapter: the base pattern shares across agents
    for load in ("4 qps", "2 conc"):
        assert summaries[("base", load)]["prefix_hit_ratio"] > summaries[("agents", load)]["prefix_hit_ratio"]
    # each run starts on an emptied cache: the same pattern at two loads caches the same tokens
    assert summaries[("agents", "4 qps")]["prefix_hit_ratio"] == summaries[("agents", "2 conc")]["prefix_hit_ratio"]
    assert "serve-bench: one row per reuse pattern and load" in out and "what sharing caches" in out


def test_report_shows_a_serve_bench_result(run_cli, tmp_path):
    with StubServer(stub_config()) as stub:
        code, _, err = run_cli("serve-bench", TRACE, "--url", stub.url, "--concurrency", "1", "--out", tmp_path)
    assert code == 0, err
    code, out, err = run_cli("report", tmp_path / "serve_bench.json", "--out", tmp_path / "report.html")
    assert code == 0, err
    page = (tmp_path / "report.html").read_text()
    for title in ("TTFT CDF per load", "throughput against load", "TTFT p90 against load"):
        assert title in page
    assert "serve-bench per agent" in out


@pytest.mark.parametrize(
    ("overrides", "args", "message"),
    [
        ({"answer_model": "someone-else"}, [], "with model 'someone-else'"),
        ({"adapters": ["plan"]}, [], "serves no LoRA adapter named 'act', 'reflect'"),
        ({"texts": {}}, [], "runs another tokenizer"),
        ({"resettable": False}, [], "cannot empty its prefix cache"),
        ({"max_model_len": 100}, [], "start it with a larger --max-model-len"),
        ({"die_after": 9}, [], "ended a completion stream|closed the connection"),
        ({"ttft": 2.0}, ["--request-timeout", "1"], "did not answer within 1 s"),
    ],
)
def test_server_problems_are_one_sentence_and_write_nothing(run_cli, tmp_path, overrides, args, message):
    with StubServer(stub_config(**overrides)) as stub:
        code, out, err = run_cli("serve-bench", TRACE, "--url", stub.url, "--out", tmp_path, *args)
    last = err.strip().splitlines()[-1]
    assert code == 2 and any(part in last for part in message.split("|"))
    assert last.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "serve_bench.json").exists()


def test_a_missing_server_and_bad_options_are_refused(run_cli, tmp_path):
    port = free_port()
    code, _, err = run_cli("serve-bench", TRACE, "--url", f"http://127.0.0.1:{port}", "--out", tmp_path)
    assert code == 2 and "cannot be reached" in err
    code, _, err = run_cli("serve-bench", TRACE, "--out", tmp_path)
    assert code == 2 and "either --url" in err
    code, _, err = run_cli("serve-bench", TRACE, "--url", "http://127.0.0.1:1", "--pattern", "all")
    assert code == 2 and "--pattern 'all'" in err
    code, _, err = run_cli("serve-bench", TRACE, "--url", "http://127.0.0.1:1", "--qps", "0")
    assert code == 2 and "--qps 0" in err


# ---------------------------------------------------------------------------------- the command (--start)


def fake_vllm(tmp_path: Path) -> Path:
    """A 'python' that runs the stub in place of vllm.entrypoints.openai.api_server, writing its pid first."""
    script = tmp_path / "fake-python"
    script.write_text(
        f'#!/bin/sh\necho $$ > "{tmp_path}/server.pid"\nexec {sys.executable} -m kvprof.serving.stub_server "$@"\n'
    )
    script.chmod(0o755)
    return script


def server_pid(tmp_path: Path) -> int:
    return int((tmp_path / "server.pid").read_text())


def gone(pid: int, wait: float = 5.0) -> bool:
    """Whether process `pid` has exited (or is a zombie), within `wait` seconds: a signalled process dies when it
    is next scheduled."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.fixture
def stub_env(monkeypatch):
    def configure(**settings):
        monkeypatch.setenv("KVPROF_STUB_TRACE", str(TRACE))
        monkeypatch.setenv("KVPROF_STUB", json.dumps({"lifetime": 60} | settings))

    return configure


def test_started_server_runs_the_trace_and_is_stopped(run_cli, tmp_path, stub_env):
    stub_env()
    out = tmp_path / "out"
    code, _, err = run_cli("serve-bench", TRACE, "--start", "--vllm-python", fake_vllm(tmp_path), "--out", out)
    assert code == 0, err
    result = result_of(out)
    command = result["server"]["command"]
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enable-prefix-caching" in command
    assert command[command.index("--dtype") + 1] == "float32"  # the trace's dtype
    assert {f"{a}={Path(demo_world().adapters[a]).resolve()}" for a in AGENTS} <= set(command)
    assert all(run["summary"]["agreement"]["fraction"] == 1.0 for run in result["runs"])
    assert gone(server_pid(tmp_path))


def test_started_server_that_dies_is_named_and_stopped(run_cli, tmp_path, stub_env):
    stub_env(die_after=6)
    out = tmp_path / "out"
    code, _, err = run_cli("serve-bench", TRACE, "--start", "--vllm-python", fake_vllm(tmp_path), "--out", out)
    assert code == 2 and "the vLLM server exited with code 3 during the run" in err
    assert not (out / "serve_bench.json").exists() and gone(server_pid(tmp_path))


def test_started_server_that_does_not_come_up(run_cli, tmp_path):
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'ValueError: no memory for the KV cache' >&2\nexit 1\n")
    broken.chmod(0o755)
    code, _, err = run_cli("serve-bench", TRACE, "--start", "--vllm-python", broken, "--out", tmp_path)
    assert code == 2 and "exited with code 1 during start-up" in err and "no memory for the KV cache" in err
    code, _, err = run_cli("serve-bench", TRACE, "--start", "--vllm-python", tmp_path / "nothing", "--out", tmp_path)
    assert code == 2 and "--vllm-python" in err and "does not exist" in err


def test_server_group_is_stopped_on_ctrl_c(tmp_path):
    """An interrupt inside the block stops the server's whole process group, its children too."""
    script = tmp_path / "server.sh"
    script.write_text(
        f"#!/bin/sh\nsleep 60 &\necho $! > {tmp_path}/child.pid\necho $$ > {tmp_path}/server.pid\n"
        f"exec {sys.executable} -m kvprof.serving.stub_server --model base --port $1\n"
    )
    script.chmod(0o755)
    port = free_port()
    with pytest.raises(KeyboardInterrupt), VllmServer([str(script), str(port)], port, tmp_path / "log", 30) as server:
        assert ServerClient(server.url, timeout=5).healthy()
        raise KeyboardInterrupt
    assert server.process is None
    assert gone(server_pid(tmp_path)) and gone(int((tmp_path / "child.pid").read_text()))


@pytest.mark.slow
def test_ctrl_c_exits_130_and_stops_the_server(tmp_path):
    env = os.environ | {
        "KVPROF_STUB_TRACE": str(TRACE),
        "KVPROF_STUB": json.dumps({"lifetime": 60, "ttft": 0.3}),
        "PYTHONPATH": str(REPO),
    }
    out = tmp_path / "out"
    command = [sys.executable, "-m", "kvprof", "serve-bench", str(TRACE), "--start", "--out", str(out)]
    # A test worker (pytest-xdist's, or a shell without job control) may ignore SIGINT, and its children inherit that
    restore = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    process = subprocess.Popen(
        [*command, "--vllm-python", str(fake_vllm(tmp_path))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=restore,
    )
    deadline = time.monotonic() + 60
    while not (out / "vllm-server.log").exists() or not (tmp_path / "server.pid").exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    time.sleep(2.0)  # the stub is up and requests are in flight
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err.decode()
    assert gone(server_pid(tmp_path)) and not (out / "serve_bench.json").exists()


def test_serving_modules_import_no_engine_or_framework():
    modules = ["traffic", "client", "server", "checks", "driver", "summary", "prometheus", "stub_server"]
    code = "import sys\n" + "".join(f"import kvprof.serving.{m}\n" for m in modules)
    code += (
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'triton', 'plotly', 'vllm') if m in sys.modules))"
    )
    env = os.environ | {"PYTHONPATH": str(REPO)}
    loaded = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_serve_check_passes_and_fails_on_the_acceptance(run_cli, tmp_path, stub_env):
    """scripts/serve_check.py (used by .ci/run) passes a good run and fails a run whose agents' outputs differ."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_check", REPO / "scripts" / "serve_check.py")
    assert spec is not None and spec.loader is not None
    serve_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_check)
    for settings, passes in (({}, True), ({"answers": {}}, False)):
        stub_env(**settings)
        out = tmp_path / f"out-{passes}"
        code, _, err = run_cli("serve-bench", TRACE, "--start", "--vllm-python", fake_vllm(tmp_path), "--out", out)
        assert code == 0, err
        results = serve_check.checks(result_of(out))
        assert all(ok for ok, _ in results) is passes
        assert any("is gone" in what and ok for ok, what in results)


def test_activated_lora_agents_are_served_on_the_base_pattern_only(run_cli, tmp_path):
    """vLLM refuses Activated LoRA adapters at load: a trace of aLoRA agents is refused for --pattern agents in one
    sentence before any server is asked, and runs --pattern base (the aLoRA deployment's sharing before each
    invocation)."""
    from dataclasses import replace

    from kvprof.traces.trace import Trace, write_trace

    trace = read_trace(TRACE)
    workflow = dict(trace.header.workflow)
    alora = demo_world(None).root / "adapters" / "alora"
    workflow["agents"] = [agent | {"adapter": str(alora / agent["name"])} for agent in workflow["agents"]]
    path = write_trace(tmp_path / "alora.jsonl", Trace(replace(trace.header, workflow=workflow), trace.trajectories))
    with StubServer(stub_config()) as stub:
        code, _, err = run_cli(
            "serve-bench", path, "--url", stub.url, "--concurrency", "1", "--out", tmp_path / "agents"
        )  # fmt: skip
        assert code == 2 and "are Activated LoRA adapters, which vLLM does not serve" in err
        assert "Traceback" not in err and not (tmp_path / "agents").exists()
        code, _, err = run_cli(
            "serve-bench", path, "--url", stub.url, "--pattern", "base", "--concurrency", "1",
            "--out", tmp_path / "base",
        )  # fmt: skip
    assert code == 0, err
    assert {run["summary"]["pattern"] for run in result_of(tmp_path / "base")["runs"]} == {"base"}
