"""`kvprof recommend`: one sharing decision for a target over replay results (`kvprof.recommend`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console, write_result
from kvprof.commands.options import OutOption, SeedOption

HELP = {
    "results": "Replay results (replay.json), of one trace, or each named NAME=RESULT to compare agent families "
    "(LoRA agents, aLoRA agents, role prompts) replayed on different traces.",
    "target": "The target, as clauses (repeatable or comma-separated): accuracy-drop<=1pt, kl<=0.01, ttft-p50<=300ms, "
    "ttft-p90<=2s, tpot-p50<=20ms, tpot-p90<=40ms, kv-memory<=2GiB (upper bounds against NonShared or at the load), "
    "load=4qps or load=8conc (required), optimise=throughput|ttft|memory (default throughput).",
    "calibration": "A serve-bench result (serve_bench.json) to fit the step-time model to.",
    "device_model": "Uncalibrated roofline step times from a device's peak FLOP/s and bandwidth: a100, h100 or h200.",
    "fit_replay": "Fit the step-time model to each replay's own dense timings (single stream, as `kvprof simulate` "
    "does without a calibration).",
    "memory": "Device memory in GiB when the target sets no kv-memory budget (KV capacity = this minus the weights).",
    "duration": "Seconds of arrivals per simulated candidate and load.",
    "split": "Choose on this share of each trace's trajectories (drawn with --seed); confirm the choice on the rest.",
}


def command(
    results: Annotated[list[str], typer.Argument(help=HELP["results"])],
    target: Annotated[list[str], typer.Option("--target", help=HELP["target"])],
    calibration: Annotated[Path | None, typer.Option("--calibration", help=HELP["calibration"])] = None,
    device_model: Annotated[str | None, typer.Option("--device-model", help=HELP["device_model"])] = None,
    fit_replay: Annotated[bool, typer.Option("--fit-replay", help=HELP["fit_replay"])] = False,
    memory: Annotated[float, typer.Option("--memory", min=0.0, help=HELP["memory"])] = 80.0,
    duration: Annotated[float, typer.Option("--duration", min=1.0, help=HELP["duration"])] = 120.0,
    split: Annotated[float | None, typer.Option("--split", help=HELP["split"])] = None,
    out: OutOption = Path("runs/recommend"),
    seed: SeedOption = 0,
) -> None:
    """One decision for a target: every replayed policy setting's accuracy and KL against NonShared (intervals over
    tasks) and its serving at the target's load (simulated), the choice meeting every bound, the runner-up, why each
    other candidate misses, the choice on held-out trajectories (--split), and the decision at other loads and KV
    budgets."""
    args = dict(locals())
    from kvprof.recommend.run import RecommendRequest, prepare
    from kvprof.recommend.serving import StepModel
    from kvprof.recommend.target import parse_target
    from kvprof.report.terminal import show_recommendation

    request = RecommendRequest(
        results=results,
        target=parse_target(target),
        step_model=StepModel(calibration, device_model, fit_replay),
        duration=duration,
        memory_gib=memory,
        split=split,
        seed=seed,
    )
    recommendation = prepare(request)
    with console.status("simulating") as status:
        result = recommendation.run(on_step=lambda step: status.update(f"simulating {step}"))
    show_recommendation(result)
    path = write_result(out, "recommend", result, args)
    console.print(f"wrote {path} (dashboard: kvprof report {path})")
