"""`kvprof simulate`: every sharing policy of a replay served by a modelled continuous-batching engine at the
user's loads; the maths lives in kvprof/simulate/."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import OutOption, SeedOption, console, write_result
from kvprof.errors import KvprofError
from kvprof.serving.traffic import loads

DEVICE_MODELS = ("a100", "h100", "h200")
DEFAULT_QPS = (0.5, 1.0, 2.0, 4.0, 8.0)
KEPT = ("evict", "hold")


def command(
    replay: Annotated[
        Path, typer.Argument(help="A replay result (replay.json from `kvprof replay --policy all`).")
    ] = Path("runs/replay/replay.json"),
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration",
            help="A serve-bench result (serve_bench.json) to fit the step-time model to (preferred); without it "
            "and without --device-model, the model is fitted to the replay's own dense timings.",
        ),
    ] = None,
    fit_load: Annotated[
        float | None,
        typer.Option(
            "--fit-load",
            help="With --calibration: fit only to the serve-bench runs at this load (a qps or concurrency value); "
            "the file's other runs then validate the fit (their errors are printed too).",
        ),
    ] = None,
    device_model: Annotated[
        str | None,
        typer.Option(
            "--device-model",
            help="Uncalibrated roofline step times from a device's peak FLOP/s and bandwidth: a100, h100 or h200.",
        ),
    ] = None,
    policy: Annotated[
        list[str] | None, typer.Option("--policy", help="A policy label of the replay, repeatable (default: all).")
    ] = None,
    qps: Annotated[
        list[float] | None,
        typer.Option(
            "--qps",
            help="Open loop: trajectories per second (Poisson arrivals); repeatable (default, without --concurrency: "
            f"{', '.join(f'{q:g}' for q in DEFAULT_QPS)}).",
        ),
    ] = None,
    concurrency: Annotated[
        list[int] | None,
        typer.Option("--concurrency", help="Closed loop: trajectories in flight; repeatable."),
    ] = None,
    memory: Annotated[
        float, typer.Option("--memory", min=0.0, help="Device memory in GiB (KV capacity = this minus the weights).")
    ] = 80.0,
    ttft_slo: Annotated[
        float | None,
        typer.Option("--ttft-slo", min=0.0, help="TTFT p90 target in seconds: report the highest load meeting it."),
    ] = None,
    duration: Annotated[
        float, typer.Option("--duration", min=1.0, help="Seconds of arrivals per policy and load.")
    ] = 600.0,
    token_budget: Annotated[
        int, typer.Option("--token-budget", min=1, help="Tokens per engine step (vLLM's max_num_batched_tokens).")
    ] = 8192,
    max_num_seqs: Annotated[
        int, typer.Option("--max-num-seqs", min=1, help="Sequences per engine step (vLLM's max_num_seqs).")
    ] = 256,
    prefix_block: Annotated[
        int | None,
        typer.Option(
            "--prefix-block",
            min=1,
            help="Tokens per block of the engine's prefix cache: reused tokens are rounded down to whole blocks "
            "(default: the block the --calibration server cached by, else 16 as vLLM on GPU; its CPU backend uses "
            "128; 1: token-exact reuse, as the policies' reference code).",
        ),
    ] = None,
    kept: Annotated[
        str,
        typer.Option(
            "--kept",
            help="What the engine does with the state a trajectory keeps between turns when blocks run out: evict "
            "(vLLM's way: idle trajectories' cached blocks are reclaimed, least recently used first, before anything "
            "is preempted; their next turn prefills its whole input) or hold (kept until the trajectory ends; "
            "out of memory when the kept state fills the memory).",
        ),
    ] = "evict",
    shapes: Annotated[
        bool,
        typer.Option(
            "--shapes",
            help="Scale every turn's input-side work linearly so that trajectories reach --shared-tokens of context "
            "(the papers' 32K).",
        ),
    ] = False,
    shared_tokens: Annotated[
        list[int] | None,
        typer.Option(
            "--shared-tokens",
            min=1,
            help="With --shapes: the final context length to scale to; repeatable, each length swept in turn "
            "(default 32768).",
        ),
    ] = None,
    out: OutOption = Path("runs/simulate"),
    seed: SeedOption = 0,
) -> None:
    """Serve every policy's measured per-turn work (from a replay) on a modelled vLLM-style engine at each load:
    TTFT p50/p90/p99, throughput, peak KV memory, out-of-memory, and the highest load meeting a TTFT SLO."""
    args = dict(locals())
    from kvprof.simulate import cost as costs
    from kvprof.simulate import sweep as sweeps
    from kvprof.simulate.workload import read_replay, replay_work, scale_to_shapes

    if calibration is not None and device_model is not None:
        raise KvprofError("pass either --calibration or --device-model, not both.")
    if fit_load is not None and calibration is None:
        raise KvprofError("--fit-load selects runs of a --calibration file; pass --calibration SERVE_BENCH.json too.")
    if device_model is not None and device_model not in DEVICE_MODELS:
        raise KvprofError(
            f"--device-model {device_model!r} is not one of {', '.join(DEVICE_MODELS)}; pass one of them."
        )
    if kept not in KEPT:
        raise KvprofError(f"--kept {kept!r} is not one of {', '.join(KEPT)}; pass evict or hold.")
    sweep_loads = loads(qps or [], concurrency or []) or loads(list(DEFAULT_QPS), [])
    replay_data = read_replay(replay)
    work = replay_work(replay_data, replay)
    labels = policy or list(work.policies)
    unknown = [label for label in labels if label not in work.policies]
    if unknown:
        raise KvprofError(
            f"policy {unknown[0]!r} is not in {replay}; pass one of {', '.join(work.policies)} (or no --policy)."
        )
    calibration_data = costs.read_serve_bench(calibration) if calibration is not None else None
    if device_model is not None:
        step_cost = costs.roofline_cost(device_model, work)
    elif calibration_data is not None:
        step_cost = costs.serve_bench_cost(calibration_data, str(calibration), fit_load)
    else:
        step_cost = costs.fit(costs.replay_observations(replay_data), f"fit to the dense timings of {replay}")
    if prefix_block is None:
        prefix_block = (sweeps.cached_block(calibration_data) if calibration_data else None) or 16
    settings = sweeps.Settings(
        prefix_block=prefix_block,
        evict_kept=kept == "evict",
        memory_bytes=memory * sweeps.GIB,
        duration=duration,
        ttft_slo=ttft_slo,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
        seed=seed,
    )
    errors = []
    if calibration_data is not None:
        errors = sweeps.serve_bench_errors(calibration_data, work, step_cost, settings, fit_load)
    elif device_model is None:
        errors = sweeps.replay_errors(replay_data, work, step_cost, settings)
    lengths: list[int | None] = list(shared_tokens or [32768]) if shapes else [None]
    rows, factors = [], {}
    with console.status(f"simulating {len(labels)} policies at {len(sweep_loads)} loads × {len(lengths)} lengths"):
        for length in lengths:
            scaled = work if length is None else scale_to_shapes(work, length)
            factors[str(length)] = scaled.scale
            for row in sweeps.sweep(scaled, step_cost, settings, sweep_loads, labels):
                rows.append(row | {"shared_tokens": length})
    payload = {
        "replay": str(replay),
        "calibration": str(calibration) if calibration is not None else None,
        "cost_model": step_cost.as_dict(),
        "calibration_errors": errors,
        "scale": {"shared_tokens": lengths if shapes else None, "factors": factors, "linear": True},
        "model": {
            "params": work.params,
            "weight_bytes": work.weight_bytes(),
            "kv_bytes_per_token": work.kv_bytes_per_token,
        },
        "settings": {
            "memory_bytes": settings.memory_bytes,
            "token_budget": token_budget,
            "max_num_seqs": max_num_seqs,
            "block_size": 16,
            "prefix_block": prefix_block,
            "kept": kept,
            "duration_s": duration,
            "ttft_slo_s": ttft_slo,
        },
        "runs": rows,
        "sustainable": sweeps.sustainable_loads(rows, ttft_slo) if ttft_slo is not None else None,
    }
    payload["serving_claims"] = serving_claims(payload, replay_data)
    show(payload)
    path = write_result(out, "simulate", payload, args)
    console.print(f"wrote {path} (dashboard: kvprof report {path})")


def serving_claims(payload: dict, replay_data: dict) -> list[dict]:
    """Verdicts on the simulated policies' published serving figures (kvprof.claims.serving), the claims read from
    the policy registry so that replays saved before a claim was recorded get its verdict too."""
    from dataclasses import asdict

    from kvprof.claims.serving import serving_verdicts
    from kvprof.policies import REGISTRY

    runs = {label: {"name": entry.get("name", label), "options": entry.get("options") or {}} for label, entry in
            replay_data["policies"].items()}  # fmt: skip
    published = {name: [asdict(figure) for figure in cls.published] for name, cls in REGISTRY.items()}
    return serving_verdicts(payload, runs, published)


def show(result: dict) -> None:
    """The cost model line, the calibration's errors, the per-policy table and the sustainable loads."""
    from kvprof.report.simulate import (
        claim_lines,
        cost_lines,
        errors_table,
        out_of_memory_lines,
        runs_table,
        sustainable_table,
    )

    for line in cost_lines(result):
        console.print(line, markup=False)
    errors = errors_table(result)
    if errors is not None:
        console.print(errors.to_rich())
    console.print(runs_table(result).to_rich())
    for line in out_of_memory_lines(result):
        console.print(line, markup=False)
    sustainable = sustainable_table(result)
    if sustainable is not None:
        console.print(sustainable.to_rich())
    for line in claim_lines(result):
        console.print(line, markup=False)
