"""Every policy at every load: latency percentiles (TTFT, TPOT, end to end), throughput, peak memory, out-of-memory
verdicts, the highest load whose TTFT p90 meets the SLO, and the step model's errors on its calibration runs.

Out of memory: a request's peak above the KV memory (before simulating); with kept state held, also kept bytes ×
concurrency above it (closed loop) or no room left during the run (`engine`). Percentiles interpolate linearly (as
serve-bench's); seconds and bytes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kvprof.errors import KvprofError
from kvprof.results.replay import ReplayResult, measured
from kvprof.results.serve_bench import ServeBenchResult
from kvprof.serving.summary import distribution
from kvprof.serving.traffic import Load
from kvprof.simulate.cost import StepCost, fitted_run
from kvprof.simulate.engine import (
    BLOCK_SIZE,
    MAX_NUM_SEQS,
    TOKEN_BUDGET,
    EngineConfig,
    Traffic,
    simulate,
    single_request_fits,
)
from kvprof.simulate.workload import ReplayWork, TrajectoryWork, at_block_granularity, without_adapters

GIB = 2**30
PATTERN_POLICY = {"agents": "nonshared", "base": "fullshared"}  # serve-bench's patterns as the policies they do


@dataclass(frozen=True)
class Settings:
    """Server and run: device memory (bytes; KV capacity = this − weights), token budget, sequence limit, prefix-cache
    block, evict or hold kept state, seconds of arrivals, arrival seed, TTFT SLO (s, on p90)."""

    memory_bytes: float
    duration: float
    ttft_slo: float | None = None
    token_budget: int = TOKEN_BUDGET
    max_num_seqs: int = MAX_NUM_SEQS
    seed: int = 0
    prefix_block: int = BLOCK_SIZE
    evict_kept: bool = True

    def engine(self, work: ReplayWork, memory_bytes: float | None = None) -> EngineConfig:
        """The modelled server for `work`'s model with `memory_bytes` (default: the settings') of device memory."""
        memory = self.memory_bytes if memory_bytes is None else memory_bytes
        kv_bytes = memory - work.weight_bytes()
        if kv_bytes < work.kv_bytes_per_token * 16:
            raise KvprofError(
                f"--memory {memory / GIB:g} GiB leaves no room for KV blocks next to the model's "
                f"{work.weight_bytes() / GIB:.3g} GiB of weights; pass a larger --memory."
            )
        return EngineConfig.from_memory(
            kv_bytes,
            work.kv_bytes_per_token,
            token_budget=self.token_budget,
            max_num_seqs=self.max_num_seqs,
            evict_kept=self.evict_kept,
        )


def static_out_of_memory(trajectories: tuple[TrajectoryWork, ...], config: EngineConfig, load: Load) -> str | None:
    """Why the policy cannot run at `load` whatever the timing, or None."""
    capacity = config.capacity_blocks * config.block_bytes
    largest = max((r for t in trajectories for r in t.requests), key=lambda r: r.working_bytes)
    if not single_request_fits(largest, config):
        return (
            f"a single request needs {largest.working_bytes / GIB:.3g} GiB, more than the {capacity / GIB:.3g} GiB "
            "of KV memory"
        )
    kept = max(r.kept_bytes for t in trajectories for r in t.requests)
    if not config.evict_kept and load.kind == "concurrency" and kept * load.value > capacity:
        return (
            f"{load.value:g} trajectories keep up to {kept * load.value / GIB:.3g} GiB between turns, more than "
            f"the {capacity / GIB:.3g} GiB of KV memory"
        )
    return None


def run_policy(
    label: str, trajectories: tuple[TrajectoryWork, ...], cost: StepCost, config: EngineConfig, traffic: Traffic
) -> dict:
    """One policy at one load: its row of the result (see the module docstring)."""
    row: dict = {"policy": label, "load": {"kind": traffic.load.kind, "value": traffic.load.value}}
    row["load"]["label"] = traffic.load.label
    verdict = static_out_of_memory(trajectories, config, traffic.load)
    if verdict is not None:
        return row | {"out_of_memory": verdict, "requests": 0}
    run = simulate(trajectories, cost, config, traffic)
    duration = max(run.duration, 1e-12)
    return row | {
        "out_of_memory": run.out_of_memory,
        "requests": len(run.e2e),
        "ttft": distribution(run.ttft),
        "e2e": distribution(run.e2e),
        "tpot": distribution(run.tpot),
        "throughput": {
            "requests_per_s": len(run.e2e) / duration,
            "tokens_per_s": run.tokens / duration,
            "output_tokens_per_s": run.output_tokens / duration,
            "trajectories_per_s": run.trajectories / duration,
        },
        "peak_kv_bytes": run.peak_blocks * config.block_bytes,
        "preemptions": run.preemptions,
        "evictions": run.evictions,
        "steps": run.steps,
        "duration_s": run.duration,
    }


def sweep(work: ReplayWork, cost: StepCost, settings: Settings, loads: list[Load], policies: list[str]) -> list[dict]:
    """Every policy in `policies` at every load, for `settings.duration` seconds of arrivals each."""
    config = settings.engine(work)
    rows = []
    for label in policies:
        trajectories = at_block_granularity(work.policies[label], settings.prefix_block)
        for load in loads:
            traffic = Traffic(load, duration=settings.duration, seed=settings.seed)
            rows.append(run_policy(label, trajectories, cost, config, traffic))
    return rows


def cached_block(result: ServeBenchResult) -> int | None:
    """The prefix-cache block of a serve-bench `result`: the GCD of its requests' cached token counts, or None when
    fewer than two distinct non-zero counts leave it undetermined."""
    counts = {r.get("cached_tokens") or 0 for run in result.runs for r in run.requests}
    counts.discard(0)
    return math.gcd(*counts) if len(counts) >= 2 else None


def sustainable_loads(rows: list[dict], slo: float) -> dict[str, dict]:
    """Per policy (and "policy @ N tokens" when several contexts were swept) and load kind: the highest load whose TTFT
    p90 meets `slo` without OOM (None: none)."""
    lengths = {row.get("shared_tokens") for row in rows}
    best: dict[str, dict] = {}
    for row in rows:
        kind = row["load"]["kind"]
        name = row["policy"] if len(lengths) < 2 else f"{row['policy']} @ {row['shared_tokens']} tokens"
        entry = best.setdefault(name, {}).setdefault(kind, None)
        meets = not row["out_of_memory"] and row.get("ttft") and row["ttft"]["p90"] <= slo
        if meets and (entry is None or row["load"]["value"] > entry):
            best[name][kind] = row["load"]["value"]
    return best


def serve_bench_errors(
    result: ServeBenchResult, work: ReplayWork, cost: StepCost, settings: Settings, fit_load: float | None = None
) -> list[dict]:
    """Each serve-bench run re-simulated (agents → nonshared, base → fullshared) at its measured arrivals or
    concurrency, KV memory and cached block; simulated vs measured median TTFT and throughput as relative errors,
    each row `fitted` or a validation run."""
    kv_gib = ((result.envelope.args if result.envelope else None) or {}).get("kv_cache_gib")
    memory = settings.memory_bytes if kv_gib is None else kv_gib * GIB + work.weight_bytes()
    config = settings.engine(work, memory)
    block = cached_block(result) or settings.prefix_block
    rows = []
    for run in result.runs:
        summary = run.summary
        label = PATTERN_POLICY.get(summary.pattern)
        if label not in work.policies:
            continue
        trajectories = work.policies[label]
        if summary.pattern == "base":
            trajectories = without_adapters(trajectories)
        by_id = {t.id: t for t in at_block_granularity(trajectories, block)}
        starts: dict[str, float] = {}
        for request in run.requests:
            starts[request["trajectory"]] = min(request["due"], starts.get(request["trajectory"], request["due"]))
        order = sorted((t for t in starts if t in by_id), key=starts.__getitem__)
        if not order or summary.overall["ttft"] is None:
            continue
        load = Load(summary.load.kind, summary.load.value)
        arrivals = tuple(starts[t] for t in order)  # a closed loop's first trajectories start as they were sent
        traffic = Traffic(load, count=len(order), arrivals=arrivals)
        simulated = run_policy(label, tuple(by_id[t] for t in order), cost, config, traffic)
        measured = summary.overall["ttft"]["p50"], (summary.throughput or {})["requests_per_s"]
        row = _errors(f"{summary.pattern} ({label}) @ {load.label}", *measured, simulated)
        rows.append(row | {"fitted": fitted_run(run, fit_load)})
    return rows


def _errors(label: str, ttft: float, rate: float, simulated: dict) -> dict:
    """Measured median TTFT `ttft` (s) and throughput `rate` (req/s) against the simulated, with relative errors."""
    sim_ttft = simulated["ttft"]["p50"] if simulated.get("ttft") else None
    sim_rate = simulated["throughput"]["requests_per_s"] if "throughput" in simulated else None
    return {
        "run": label,
        "ttft_p50": ttft,
        "ttft_p50_simulated": sim_ttft,
        "ttft_error": None if sim_ttft is None else sim_ttft / ttft - 1,
        "requests_per_s": rate,
        "requests_per_s_simulated": sim_rate,
        "throughput_error": None if sim_rate is None else sim_rate / rate - 1,
    }


def replay_errors(replay: ReplayResult | dict, work: ReplayWork, cost: StepCost, settings: Settings) -> list[dict]:
    """The replay's dense run re-simulated as it ran (closed loop of 1, nonshared's work): simulated median TTFT and
    throughput against its per-turn timings."""
    turns = ReplayResult.of(replay).dense.turns
    if "nonshared" not in work.policies:
        return []
    trajectories = work.policies["nonshared"]
    load = Load("concurrency", 1)
    simulated = run_policy(
        "nonshared", trajectories, cost, settings.engine(work), Traffic(load, count=len(trajectories))
    )
    ttft = statistics.median(measured(t.ttft_s) for t in turns)
    rate = len(turns) / sum(measured(t.ttft_s) + measured(t.decode_s) for t in turns)
    return [_errors("dense replay (nonshared) @ 1 conc", ttft, rate, simulated)]
