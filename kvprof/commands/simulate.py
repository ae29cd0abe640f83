"""`kvprof simulate`: a replay's policies served by a modelled continuous-batching engine (`kvprof.simulate`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvprof.commands.common import console, write_result
from kvprof.commands.options import OutOption, SeedOption
from kvprof.simulate import DEFAULT_QPS

if TYPE_CHECKING:
    from kvprof.results.simulate import SimulateResult


HELP = {
    "replay": "A replay result (replay.json from `kvprof replay --policy all`).",
    "device_model": "Uncalibrated roofline step times from a device's peak FLOP/s and bandwidth: a100, h100 or h200.",
    "policy": "A policy label of the replay, repeatable (default: all).",
    "memory": "Device memory in GiB (KV capacity = this minus the weights).",
    "ttft_slo": "TTFT p90 target in seconds: report the highest load meeting it.",
    "token_budget": "Tokens per engine step (vLLM's max_num_batched_tokens).",
    "max_num_seqs": "Sequences per engine step (vLLM's max_num_seqs).",
    "calibration": "A serve-bench result (serve_bench.json) to fit the step-time model to (preferred); without it "
    "and without --device-model, the model is fitted to the replay's own dense timings.",
    "fit_load": "With --calibration: fit only to the serve-bench runs at this load (a qps or concurrency value); "
    "the file's other runs then validate the fit (their errors are printed too).",
    "qps": "Open loop: trajectories per second (Poisson arrivals); repeatable (default, without --concurrency: "
    f"{', '.join(f'{q:g}' for q in DEFAULT_QPS)}).",
    "prefix_block": "Tokens per block of the engine's prefix cache: reused tokens are rounded down to whole blocks "
    "(default: the block the --calibration server cached by, else 16 as vLLM on GPU; its CPU backend uses "
    "128; 1: token-exact reuse, as the policies' reference code).",
    "kept": "What the engine does with the state a trajectory keeps between turns when blocks run out: evict "
    "(vLLM's way: idle trajectories' cached blocks are reclaimed, least recently used first, before anything "
    "is preempted; their next turn prefills its whole input) or hold (kept until the trajectory ends; "
    "out of memory when the kept state fills the memory).",
    "shapes": "Scale every turn's input-side work linearly so that trajectories reach --shared-tokens of context "
    "(the papers' 32K).",
    "shared_tokens": "With --shapes: the final context length to scale to; repeatable, each length swept in turn "
    "(default 32768).",
}


def command(
    replay: Annotated[Path, typer.Argument(help=HELP["replay"])] = Path("runs/replay/replay.json"),
    calibration: Annotated[Path | None, typer.Option("--calibration", help=HELP["calibration"])] = None,
    fit_load: Annotated[float | None, typer.Option("--fit-load", help=HELP["fit_load"])] = None,
    device_model: Annotated[str | None, typer.Option("--device-model", help=HELP["device_model"])] = None,
    policy: Annotated[list[str] | None, typer.Option("--policy", help=HELP["policy"])] = None,
    qps: Annotated[list[float] | None, typer.Option("--qps", help=HELP["qps"])] = None,
    concurrency: Annotated[
        list[int] | None, typer.Option("--concurrency", help="Closed loop: trajectories in flight; repeatable.")
    ] = None,
    memory: Annotated[float, typer.Option("--memory", min=0.0, help=HELP["memory"])] = 80.0,
    ttft_slo: Annotated[float | None, typer.Option("--ttft-slo", min=0.0, help=HELP["ttft_slo"])] = None,
    duration: Annotated[
        float, typer.Option("--duration", min=1.0, help="Seconds of arrivals per policy and load.")
    ] = 600.0,
    token_budget: Annotated[int, typer.Option("--token-budget", min=1, help=HELP["token_budget"])] = 8192,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help=HELP["max_num_seqs"])] = 256,
    prefix_block: Annotated[int | None, typer.Option("--prefix-block", min=1, help=HELP["prefix_block"])] = None,
    kept: Annotated[str, typer.Option("--kept", help=HELP["kept"])] = "evict",
    shapes: Annotated[bool, typer.Option("--shapes", help=HELP["shapes"])] = False,
    shared_tokens: Annotated[
        list[int] | None, typer.Option("--shared-tokens", min=1, help=HELP["shared_tokens"])
    ] = None,
    out: OutOption = Path("runs/simulate"),
    seed: SeedOption = 0,
) -> None:
    """Serve every policy's measured per-turn work (from a replay) on a modelled vLLM-style engine at each load:
    TTFT p50/p90/p99, throughput, peak KV memory, out-of-memory, and the highest load meeting a TTFT SLO."""
    args = dict(locals())
    from kvprof.simulate.run import DEFAULT_SHARED_TOKENS, SimulationRequest, prepare

    request = SimulationRequest(
        replay=replay,
        calibration=calibration,
        fit_load=fit_load,
        device_model=device_model,
        policies=policy,
        qps=qps or [],
        concurrency=concurrency or [],
        memory_gib=memory,
        ttft_slo=ttft_slo,
        duration=duration,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
        prefix_block=prefix_block,
        kept=kept,
        shared_tokens=(shared_tokens or [DEFAULT_SHARED_TOKENS]) if shapes else None,
        seed=seed,
    )
    simulation = prepare(request)
    with console.status(simulation.description):
        result = simulation.run()
    show(result)
    path = write_result(out, "simulate", result.to_json(), args)
    console.print(f"wrote {path} (dashboard: kvprof report {path})")


def show(result: SimulateResult) -> None:
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
