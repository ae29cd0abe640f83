"""`kvprof simulate`: the modelled engine's sanity (monotone in load and in work, out of memory when it must be, a
lone request costs exactly its step model), the step-model fit, and the command's answers to bad input."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from kvprof.results.serve_bench import ServeBenchResult, ServeLoad, ServeRun, ServeSummary
from kvprof.serving.traffic import Load
from kvprof.simulate.cost import Observation, StepCost, fit, serve_bench_observations
from kvprof.simulate.engine import EngineConfig, Traffic, simulate
from kvprof.simulate.sweep import cached_block, run_policy, static_out_of_memory
from kvprof.simulate.workload import RequestWork, TrajectoryWork, at_block_granularity, replay_work

KV_PER_TOKEN = 4096.0
COST = StepCost(a=2e-3, b=50e-6, c=100e-6, d=1e-7, e=1e-3, source="test")


def request(prefill: int, context: int, output: int = 8, kept: int = 0, working: int = 0) -> RequestWork:
    return RequestWork(
        agent="a",
        prefill_tokens=prefill,
        prefill_weight=1.0,
        context_tokens=context,
        decode_steps=output,
        decode_weight=1.0,
        working_bytes=working or (context + output) * int(KV_PER_TOKEN),
        kept_bytes=kept,
        input_tokens=context,
        output_tokens=output,
    )


def trajectories(prefill_share: float = 1.0, kept_share: float = 1.0, output: int = 8) -> tuple[TrajectoryWork, ...]:
    """Four trajectories of five turns whose context grows by 200 tokens a turn; `prefill_share` of each turn's
    context is prefilled (1: everything, as NonShared's first sight; less: a reusing policy); the turn's peak is
    its whole context's KV (input and `output` tokens), `kept_share` of it is kept until the next turn."""
    result = []
    for t in range(4):
        turns = []
        for i in range(5):
            context = 200 * (i + 1) + 10 * t
            working = (context + output) * int(KV_PER_TOKEN)
            kept = int(kept_share * working)
            turns.append(request(max(1, int(prefill_share * context)), context, output, kept, working))
        result.append(TrajectoryWork(f"t{t}", tuple(turns)))
    return tuple(result)


def config(gib: float = 1.0) -> EngineConfig:
    return EngineConfig.from_memory(gib * 2**30, KV_PER_TOKEN)


def p90(label: str, work, load: Load, engine: EngineConfig | None = None) -> float:
    row = run_policy(label, work, COST, engine or config(64), Traffic(load, duration=120, seed=3))
    assert row["out_of_memory"] is None
    return row["ttft"]["p90"]


def test_more_load_never_lowers_p90_ttft():
    work = trajectories()
    open_loop = [p90("nonshared", work, Load("qps", q)) for q in (0.5, 1, 2, 4, 8, 16)]
    closed_loop = [p90("nonshared", work, Load("concurrency", n)) for n in (1, 2, 4, 8, 16)]
    assert open_loop == sorted(open_loop) and open_loop[-1] > 2 * open_loop[0]
    assert closed_loop == sorted(closed_loop) and closed_loop[-1] > 2 * closed_loop[0]


@pytest.mark.parametrize("load", [Load("qps", 2), Load("qps", 12), Load("concurrency", 8)], ids=lambda x: x.label)
def test_fewer_prefilled_tokens_never_raise_ttft_at_equal_memory(load):
    dense, reusing = trajectories(1.0), trajectories(0.3)
    assert p90("reusing", reusing, load) <= p90("dense", dense, load)
    assert p90("reusing", reusing, load) < p90("dense", dense, load) * 0.9


def test_a_budget_below_a_policys_need_is_out_of_memory():
    work = trajectories()
    largest = max(r.working_bytes for t in work for r in t.requests)
    small = EngineConfig.from_memory(largest * 0.9, KV_PER_TOKEN)
    row = run_policy("nonshared", work, COST, small, Traffic(Load("qps", 1), duration=60))
    assert row["requests"] == 0 and "a single request needs" in row["out_of_memory"]
    # held kept state (not evicted): each trajectory fits alone, but eight keep more between turns than the memory
    roomy = EngineConfig.from_memory(largest * 3, KV_PER_TOKEN, evict_kept=False)
    assert static_out_of_memory(work, roomy, Load("concurrency", 1)) is None
    assert "keep up to" in static_out_of_memory(work, roomy, Load("concurrency", 8))
    # open loop: the kept caches of the trajectories in flight fill the memory during the run
    row = run_policy("nonshared", work, COST, roomy, Traffic(Load("qps", 50), duration=20))
    assert row["out_of_memory"] and "trajectories" in row["out_of_memory"]
    assert (
        run_policy("nonshared", work, COST, config(4), Traffic(Load("qps", 50), duration=20))["out_of_memory"] is None
    )


@pytest.mark.parametrize("seed", range(6))
def test_eviction_keeps_the_block_books_and_never_runs_out_when_each_request_fits(seed):
    """Random trajectories in a memory a few requests fill: with eviction every request finishes (nothing is out of
    memory when each fits alone), the peak stays within the capacity, and when the run ends every block is free."""
    from kvprof.simulate.engine import _Engine

    rng = random.Random(seed)
    work = []
    for t in range(12):
        requests, context = [], 0
        for _ in range(rng.randint(1, 6)):
            new, output = rng.randint(5, 200), rng.randint(1, 120)
            reused = context if rng.random() < 0.7 else 0
            context += new
            kept = int((context + output) * KV_PER_TOKEN * rng.choice([0.0, 0.5, 1.0]))
            requests.append(replace(request(context - reused, context, output, kept=kept), agent=f"a{t % 3}"))
            context += output
        work.append(TrajectoryWork(f"t{t}", tuple(requests)))
    largest = max(r.working_bytes for t in work for r in t.requests)
    tight = EngineConfig.from_memory(largest * rng.uniform(1.0, 2.5), KV_PER_TOKEN)
    load = Load("qps", 40) if seed % 2 else Load("concurrency", 6)
    engine = _Engine(tuple(work), COST, tight, Traffic(load, count=24, seed=seed))
    run = engine.run()
    assert run.out_of_memory is None and len(run.e2e) == sum(len(work[k % 12].requests) for k in range(24))
    assert run.peak_blocks <= tight.capacity_blocks and run.evictions > 0 and run.preemptions > 0
    assert engine.free == tight.capacity_blocks and engine.used == 0 and not engine.idle and engine.idle_blocks == 0


def test_a_preempted_requests_kept_state_is_evicted_before_the_next_request_is_preempted():
    """A grows alone; B runs a turn that needs nothing beyond the state its trajectory keeps. When A lacks a block,
    B (newest) is preempted — freeing none of its turn's blocks — and its now idle kept state is evicted, so A goes
    on instead of being preempted itself (which, alone, would be out of memory)."""
    block = 16 * KV_PER_TOKEN
    kept = 40 * block
    grower = request(10, 10, output=400, working=int(410 * KV_PER_TOKEN))
    first = request(10, 10, output=1, kept=kept, working=kept)
    second = request(1, 11, output=1000, kept=kept, working=kept)
    work = (TrajectoryWork("A", (grower,)), TrajectoryWork("B", (first, second)))
    memory = EngineConfig.from_memory(kept + 20 * block, KV_PER_TOKEN)  # A's 26 blocks fit alone, not beside B's 40
    run = simulate(work, COST, memory, Traffic(Load("concurrency", 2), count=2, arrivals=(0.0, 0.001)))
    assert run.out_of_memory is None and len(run.e2e) == 3
    assert run.preemptions >= 1 and run.evictions >= 1


def test_a_policy_out_of_memory_is_a_row_of_the_table(tmp_path, run_cli):
    replay_json(tmp_path / "replay.json")
    weights = replay_work(json.loads((tmp_path / "replay.json").read_text()), tmp_path).weight_bytes()
    memory = (weights + 48 * 4096) / 2**30  # room for 48 tokens of K/V (4 KiB each): the largest turn needs 105
    code, out, err = run_cli(
        "simulate", tmp_path / "replay.json", "--qps", "1", "--memory", f"{memory:.9f}", "--duration", "5",
        "--out", tmp_path / "sim",
    )  # fmt: skip
    assert code == 0, err
    assert "OOM" in out and "out of memory: a single request needs" in out


def test_evicted_kept_state_is_recomputed_instead_of_running_out_of_memory():
    """vLLM's way: idle trajectories' kept blocks are reclaimed (least recently used first) when blocks run out; the
    evicted trajectories' next turns prefill their whole input, so the run finishes, slower than with memory to
    spare."""
    work = trajectories(prefill_share=0.3)  # a reusing policy: eviction costs it its reuse
    largest = max(r.working_bytes for t in work for r in t.requests)
    evicting = EngineConfig.from_memory(largest * 3, KV_PER_TOKEN)
    assert static_out_of_memory(work, evicting, Load("concurrency", 8)) is None
    traffic = Traffic(Load("qps", 50), duration=20, seed=1)
    tight = run_policy("reusing", work, COST, evicting, traffic)
    spare = run_policy("reusing", work, COST, config(64), traffic)
    assert tight["out_of_memory"] is None and tight["requests"] == spare["requests"]
    assert tight["evictions"] > 0 and spare["evictions"] == 0
    assert tight["ttft"]["p50"] > spare["ttft"]["p50"]
    assert tight["peak_kv_bytes"] <= evicting.capacity_blocks * evicting.block_bytes


def test_a_lone_request_costs_exactly_its_step_model():
    work = (TrajectoryWork("t", (request(300, 500, output=5),)),)
    run = simulate(work, COST, config(), Traffic(Load("concurrency", 1), count=1))
    prefill = COST.step_time(300, 0, 500)
    decode = sum(COST.step_time(0, 1, 500 + j) for j in range(1, 5))
    assert run.ttft == [pytest.approx(COST.e + prefill, rel=1e-12)]
    assert run.e2e == [pytest.approx(COST.e + prefill + decode, rel=1e-12)]
    # a prefill longer than the token budget is chunked: two steps, each reading the context computed so far
    chunked = simulate(
        work,
        COST,
        EngineConfig.from_memory(2**30, KV_PER_TOKEN, token_budget=200),
        Traffic(Load("concurrency", 1), count=1),
    )
    two_chunks = COST.step_time(200, 0, 500 * 200 / 300) + COST.step_time(100, 0, 500)
    assert chunked.ttft == [pytest.approx(COST.e + two_chunks, rel=1e-12)]


def test_preemption_frees_memory_and_everything_still_finishes():
    # four kept caches fit (2 × the largest turn), four running turns, whose long outputs grow their memory, do not
    work = trajectories(kept_share=0.5, output=400)
    tight = EngineConfig.from_memory(2.5 * max(r.working_bytes for t in work for r in t.requests), KV_PER_TOKEN)
    run = simulate(work, COST, tight, Traffic(Load("concurrency", 4), count=4))
    assert run.out_of_memory is None and run.preemptions > 0
    assert len(run.e2e) == 20 and run.peak_blocks <= tight.capacity_blocks


def test_fit_recovers_known_coefficients():
    truth = StepCost(a=3e-3, b=40e-6, c=150e-6, d=2e-8, e=5e-3, source="truth", f=25e-6, g=300e-6)
    rng = random.Random(0)
    observations = []
    for _ in range(80):
        steps, prefill = rng.randint(1, 40), rng.randint(0, 4000)
        decode, read = steps * rng.randint(1, 8), rng.randint(0, 200_000)
        ttft, adapter = rng.random() < 0.4, rng.random() < 0.5  # the agents and base patterns mixed
        seconds = truth.a * steps + truth.b * prefill + truth.c * decode + truth.d * read + (truth.e if ttft else 0.0)
        seconds += adapter * (truth.f * (prefill + decode) + truth.g * steps)
        observations.append(
            Observation(
                "ttft" if ttft else "decode", seconds, steps, prefill, decode, read, ttft, adapter * (prefill + decode),
                adapter * steps,
            )
        )  # fmt: skip
    fitted = fit(observations, "synthetic")
    for name in ("a", "b", "c", "d", "e", "f", "g"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fitted.fit["r2_ttft"] == pytest.approx(1.0) and fitted.fit["r2_decode"] == pytest.approx(1.0)
    # every request with an adapter: f and g cannot be told from b and c, and are folded into them
    every = [replace(o, adapter_tokens=o.prefill + o.decode, adapter_steps=o.steps) for o in observations]
    folded = fit(every, "all adapters")
    assert folded.f == folded.g == 0.0 and any("not identifiable" in note for note in folded.fit["notes"])


def test_serve_bench_requests_become_the_steps_they_spanned():
    # one request alone: a 100-token prefill step, then 4 decode steps
    lone = {
        "due": 0.0,
        "send_delay": 0.0,
        "ttft": 0.1,
        "e2e": 0.5,
        "server_queue": 0.02,
        "prompt_tokens": 120,
        "cached_tokens": 20,
        "output_tokens": 5,
    }
    ttft, decode = serve_bench_observations([lone])
    assert (ttft.seconds, ttft.steps, ttft.prefill, ttft.decode, ttft.kv_read) == (pytest.approx(0.1), 1, 100, 0, 120)
    assert (decode.seconds, decode.steps, decode.decode) == (pytest.approx(0.4), 4, 4)
    assert decode.kv_read == 4 * 120 + 10
    # a second request sent while the first decodes: its TTFT spans the first's decode steps until its prefill
    second = lone | {"due": 0.2, "ttft": 0.15, "e2e": 0.4, "prompt_tokens": 60, "cached_tokens": 0, "output_tokens": 3}
    observations = serve_bench_observations([lone, second])
    spanned = observations[2]
    assert spanned.kind == "ttft" and spanned.prefill == 60
    assert spanned.decode == pytest.approx(4 * 0.15 / 0.4) and spanned.steps == pytest.approx(4 * 0.15 / 0.4)
    # a stream whose tokens after the first came in one burst gives one observation, send to last token
    burst = lone | {"due": 1.0, "ttft": 0.45, "e2e": 0.4501}
    paced = [lone | {"due": 2.0 + k} for k in range(3)]
    observations = serve_bench_observations([burst, *paced])
    assert observations[0].kind == "ttft" and observations[1].kind == "ttft"
    assert (observations[0].seconds, observations[0].steps, observations[0].decode) == (pytest.approx(0.4501), 5, 4)


def replay_json(path) -> dict:
    turn = {
        "agent": "a",
        "trajectory": "t0",
        "turn": 0,
        "input_tokens": 50,
        "output_tokens": 4,
        "prefilled": 50,
        "ttft_flops": 5e6,
        "flops": 7e6,
        "decode_steps": 4,
        "ttft_s": 0.01,
        "decode_s": 0.02,
        "memory_bytes": 54 * 4096,
        "working_peak_bytes": 54 * 4096,
    }
    second = turn | {"turn": 1, "input_tokens": 80, "prefilled": 30, "memory_bytes": 84 * 4096}
    turns = [  # four trajectories, timings growing with the work
        one
        | {
            "trajectory": f"t{k}",
            "input_tokens": one["input_tokens"] + 7 * k,
            "prefilled": one["prefilled"] + 3 * k,
            "ttft_s": one["ttft_s"] * (1 + 0.2 * k),
            "memory_bytes": (one["input_tokens"] + 7 * k + 4) * 4096,
            "working_peak_bytes": (one["input_tokens"] + 7 * k + 4) * 4096,
        }
        for k in range(4)
        for one in (turn, second)
    ]
    data = {
        "schema": "kvprof.result.replay",
        "version": 1,
        "dtype": "float32",
        "dense": {"turns": turns},
        "policies": {"nonshared": {"turns": turns}, "fullshared": {"turns": turns}},
    }
    path.write_text(json.dumps(data))
    return data


def test_replay_records_become_requests(tmp_path):
    data = replay_json(tmp_path / "replay.json")
    work = replay_work(data, tmp_path / "replay.json")
    first, second = work.policies["nonshared"][0].requests
    assert len(work.policies["nonshared"]) == 4
    assert work.kv_bytes_per_token == 4096 and (first.prefill_tokens, second.prefill_tokens) == (50, 30)
    assert first.prefill_weight == 1.0 and first.decode_weight == 1.0 and second.kept_bytes == 84 * 4096


def test_the_command_writes_a_result(tmp_path, run_cli):
    replay_json(tmp_path / "replay.json")
    code, out, err = run_cli(
        "simulate",
        str(tmp_path / "replay.json"),
        "--qps",
        "1",
        "--concurrency",
        "2",
        "--duration",
        "30",
        "--ttft-slo",
        "1",
        "--memory",
        "1",
        "--out",
        str(tmp_path / "sim"),
    )
    assert code == 0, err
    result = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    assert result["schema"] == "kvprof.result.simulate" and len(result["runs"]) == 4
    assert result["calibration_errors"] and "fit to the dense timings" in result["cost_model"]["source"]
    assert "simulated serving" in out


def test_shapes_sweep_each_length_and_the_dashboard_draws_load_and_memory(tmp_path, run_cli):
    replay_json(tmp_path / "replay.json")
    code, _, err = run_cli(
        "simulate", tmp_path / "replay.json", "--device-model", "h100", "--shapes", "--shared-tokens", "1000",
        "--shared-tokens", "4000", "--qps", "1", "--qps", "4", "--duration", "20", "--out", tmp_path / "sim",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    assert sorted({row["shared_tokens"] for row in result["runs"]}) == [1000, 4000] and len(result["runs"]) == 8
    memory = {row["shared_tokens"]: row["peak_kv_bytes"] for row in result["runs"] if row["load"]["value"] == 1}
    assert memory[4000] > memory[1000]  # four times the context keeps more
    code, _, err = run_cli("report", tmp_path / "sim" / "simulate.json", "--out", tmp_path / "report.html")
    assert code == 0, err
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "TTFT p90 against load (simulated)" in page and "peak KV memory against shared context" in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--qps", "-1"], "--qps -1 is not a positive rate"),
        (["--device-model", "tpu"], "--device-model 'tpu' is not one of"),
        (["--memory", "0.000001"], "leaves no room for KV blocks"),
        (["--policy", "nosuch"], "policy 'nosuch' is not in"),
    ],
)
def test_bad_options_give_one_sentence(tmp_path, run_cli, args, message):
    replay_json(tmp_path / "replay.json")
    code, _, err = run_cli("simulate", str(tmp_path / "replay.json"), *args, "--out", str(tmp_path / "sim"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_file_that_is_no_replay_is_refused(tmp_path, run_cli):
    (tmp_path / "other.json").write_text(json.dumps({"schema": "kvprof.result.serve_bench", "runs": []}))
    code, _, err = run_cli("simulate", str(tmp_path / "other.json"), "--out", str(tmp_path / "sim"))
    assert code == 2 and "is not a kvprof replay result" in err and len(err.strip().splitlines()) == 1


def _serve_bench(loads: tuple[int, ...]) -> ServeBenchResult:
    """A serve-bench result with one run per pattern and load, each of 8 requests sent one after another."""
    runs = []
    for pattern in ("agents", "base"):
        for load in loads:
            requests = [
                {
                    "trajectory": f"t{i}", "due": 0.2 * i, "send_delay": 0.0, "ttft": 0.01 * load + 0.002 * i,
                    "e2e": 0.05 + 0.01 * load, "server_queue": 0.0, "prompt_tokens": 40 + 10 * i,
                    "cached_tokens": 0, "output_tokens": 4 + i % 3,
                }
                for i in range(8)
            ]  # fmt: skip
            summary = ServeSummary(pattern=pattern, load=ServeLoad(kind="concurrency", value=load), overall={})
            runs.append(ServeRun(summary=summary, requests=requests))
    return ServeBenchResult(server={}, runs=runs)


def test_fit_load_fits_one_load_and_refuses_a_missing_one():
    from kvprof.errors import KvprofError
    from kvprof.simulate.cost import fitted_run, serve_bench_cost

    data = _serve_bench((1, 2))
    one = serve_bench_cost(data, "sb.json", fit_load=2)
    assert "at load 2" in one.source and one.fit["observations"] < serve_bench_cost(data, "sb.json").fit["observations"]
    assert [fitted_run(run, 2) for run in data.runs] == [False, True, False, True]
    with pytest.raises(KvprofError, match="has no run at load 3"):
        serve_bench_cost(data, "sb.json", fit_load=3)


def test_adapter_costs_count_adapter_tokens_and_steps_with_any_adapter():
    """f per token (prefill or decode) of a request with an adapter; g once per step in which any request has one:
    an adapter-free request decoding beside an adapter one adds no g, two adapter requests share theirs."""
    cost = StepCost(a=1e-3, b=0.0, c=0.0, d=0.0, e=0.0, source="adapters", f=1e-5, g=4e-3)
    lone = (TrajectoryWork("t", (replace(request(100, 100, output=3), adapter=True),)),)
    run = simulate(lone, cost, config(), Traffic(Load("concurrency", 1), count=1))
    assert run.ttft == [pytest.approx(1e-3 + 100 * 1e-5 + 4e-3)]
    assert run.e2e[0] == pytest.approx(run.ttft[0] + 2 * (1e-3 + 1e-5 + 4e-3))

    def finish(adapters: tuple[bool, bool]) -> float:
        work = tuple(
            TrajectoryWork(f"t{i}", (replace(request(10, 10, output=50), adapter=adapter, agent=f"a{i}"),))
            for i, adapter in enumerate(adapters)
        )
        return max(simulate(work, cost, config(), Traffic(Load("concurrency", 2), count=2, arrivals=(0.0, 0.0))).e2e)

    none, one, both = finish((False, False)), finish((True, False)), finish((True, True))
    # one prefill step (10 adapter tokens) and 49 decode steps (1 adapter token each): g in all 50, f for 59 tokens
    assert one - none == pytest.approx(50 * 4e-3 + 59 * 1e-5, rel=1e-9)
    assert both - one == pytest.approx(59 * 1e-5, rel=1e-9)  # the second adapter request adds only its tokens' f


def test_token_arrival_times_give_the_engines_single_steps():
    """A decodes alone for a step, then B's prefill joins its decode step, then both decode: three timed steps (the
    first group follows an idle engine and is not one); a token that came in a burst hides its step."""

    def sent_at(due: float, prompt: int, times: list[float]) -> dict:
        record = {"due": due, "send_delay": 0.0, "ttft": times[0], "e2e": times[-1], "prompt_tokens": prompt}
        return record | {"cached_tokens": 0, "output_tokens": len(times), "token_times": times}

    first = sent_at(0.0, 10, [0.010, 0.015, 0.020, 0.025])
    second = sent_at(0.012, 20, [0.008, 0.013])
    steps = [o for o in serve_bench_observations([first, second]) if o.kind == "decode"]
    assert [(o.seconds, o.prefill, o.decode) for o in steps] == [
        (pytest.approx(0.005), 0, 1),
        (pytest.approx(0.005), 20, 1),
        (pytest.approx(0.005), 0, 2),
    ]
    burst = first | {"token_times": [0.010, 0.015, 0.01501, 0.025]}  # its third token 10 µs after the second
    steps = [o for o in serve_bench_observations([burst, second]) if o.kind == "decode"]
    assert [o.decode for o in steps] == [1, 2]  # the step with the burst token and the one after it are left out


def test_an_engines_prefix_cache_reuses_whole_blocks():
    """Reused tokens are rounded down to whole blocks, the rest prefilled densely; the block a serve-bench run's
    server cached by is read off its cached token counts."""
    reused = request(30, 300)  # 270 reused tokens: two blocks of 128, 14 tokens recomputed
    (rounded,) = at_block_granularity((TrajectoryWork("t", (reused,)),), 128)[0].requests
    assert rounded.prefill_tokens == 44 and rounded.prefill_weight == pytest.approx(1.0)
    assert at_block_granularity((TrajectoryWork("t", (reused,)),), 1)[0].requests[0] is reused
    assert cached_block(served([{"cached_tokens": 256}, {"cached_tokens": 0}, {"cached_tokens": 384}])) == 128
    assert cached_block(served([{}])) is None
    assert cached_block(served([{"cached_tokens": 2048}, {"cached_tokens": 2048}])) is None  # every hit one prefix


def served(requests: list[dict]) -> ServeBenchResult:
    """A serve-bench result of one run holding `requests`."""
    summary = ServeSummary(pattern="agents", load=ServeLoad(kind="concurrency", value=1), overall={})
    return ServeBenchResult(server={}, runs=[ServeRun(summary=summary, requests=requests)])


def test_serving_claims_get_a_verdict_at_their_setting_or_say_why_not():
    from kvprof.claims.serving import serving_verdicts

    def row(policy: str, qps: float, ttft: float, oom: str | None = None) -> dict:
        load = {"kind": "qps", "value": qps, "label": f"{qps:g} qps"}
        return {
            "policy": policy, "load": load, "out_of_memory": oom, "ttft": {"p50": ttft}, "e2e": {"p50": 2 * ttft},
            "shared_tokens": 1050,
        }  # fmt: skip

    claim = {
        "measure": "ttft_p50", "low": 0.4, "high": 0.6, "reading": "r", "references": ("nonshared",),
        "shared_tokens": 1000, "qps": 8.0, "reference_options": (), "policy_options": (("chain", "chain"),),
    }  # fmt: skip
    oom = claim | {"measure": "out_of_memory", "low": 1.0, "high": 1.0, "references": (), "policy_options": ()}
    published = {
        "kvcmas": [{"paper": "P", "where": "w", "claim": "2× lower", "serving": claim}],
        "kvcomm": [{"paper": "P", "where": "w", "claim": "out of memory", "serving": oom}],
    }
    policies = {
        "kvcmas-chain": {"name": "kvcmas", "options": {"chain": "chain"}},
        "kvcmas-star": {"name": "kvcmas", "options": {"chain": "star"}},
        "kvcomm": {"name": "kvcomm", "options": {}},
    }
    runs = [row("kvcmas-chain", 8, 0.5), row("kvcmas-star", 8, 0.9), row("nonshared", 8, 1.0)]
    runs.append(row("kvcomm", 8, 0.0, oom="a single request needs more"))
    result = {"runs": runs, "cost_model": {"source": "roofline"}, "model": {"kv_bytes_per_token": 1000.0}}
    verdicts = serving_verdicts(result, policies, published)
    assert [(v["policy"], v["reference"], v["holds"]) for v in verdicts] == [
        ("kvcmas-chain", "nonshared", True),  # 0.5 in [0.4, 0.6]; the star variant makes no such claim
        ("kvcomm", None, True),
    ]
    result["runs"][0] = row("kvcmas-chain", 8, 0.7)
    assert serving_verdicts(result, policies, published)[0]["verdict"] == "does not hold (simulated)"
    unscaled = result | {"runs": [r | {"shared_tokens": None} for r in runs]}
    assert "not scaled to 1000" in serving_verdicts(unscaled, policies, published)[0]["why"]
    small_model = serving_verdicts(
        result,
        policies,
        published | {"kvcomm": [published["kvcomm"][0] | {"serving": oom | {"kv_bytes_per_token": 131072}}]},
    )
    assert small_model[1]["holds"] is None and "bytes of K/V per token" in small_model[1]["why"]
    evicting = result | {"runs": [*runs[:3], row("kvcomm", 8, 0.2)], "settings": {"kept": "evict"}}
    assert "--kept hold" in serving_verdicts(evicting, policies, published)[1]["why"]
    other_load = result | {"runs": [row(r["policy"], 2, 0.5) for r in runs]}
    assert "8 qps not simulated" in serving_verdicts(other_load, policies, published)[0]["why"]
