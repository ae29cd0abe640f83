"""`kvprof fit-anchors`: fit anchor pools from calibration trajectories, save them (safetensors), report their error
and size. Maths: `kvprof.tuning.anchor_fit`, `kvprof.policies.anchors`; tables: `kvprof.report.anchors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands import planning
from kvprof.commands.common import console, demo_prompt_trace, progress, use_threads, write_result
from kvprof.commands.options import (
    DeviceOption,
    DtypeOption,
    LimitOption,
    MinSpanOption,
    ModelOverrideOption,
    OutOption,
    RoleOverrideOption,
    SeedOption,
    SpanBoundariesOption,
    ThreadsOption,
)
from kvprof.errors import KvprofError
from kvprof.traces.reuse import MIN_SPAN, SpanMatching
from kvprof.traces.trace import read_trace


def command(
    trace: Annotated[
        Path | None,
        typer.Argument(help="Prompt-mode trace of calibration trajectories [default: the demo world's tuning trace]."),
    ] = None,
    rank: Annotated[
        str,
        typer.Option("--rank", help="Factor rank r of the stored anchors (KVCMAS: 32), or 'full' (KVComm)."),
    ] = "32",
    anchors_per_slot: Annotated[
        int, typer.Option("--anchors-per-slot", min=1, help="Anchors kept per placeholder slot (V).")
    ] = 10,
    window: Annotated[int, typer.Option("--window", min=1, help="Eviction window of the pool.")] = 5,
    limit: LimitOption = None,
    model: ModelOverrideOption = None,
    role: RoleOverrideOption = None,
    min_span: MinSpanOption = MIN_SPAN,
    span_boundaries: SpanBoundariesOption = "messages",
    out: OutOption = Path("runs/fit-anchors"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    seed: SeedOption = 0,
    plan: planning.PlanOption = False,
) -> None:
    """Fit anchor pools (per segment a base — the producer's cache of an output, the context-free encoding of an
    input — and per-agent deltas, V per slot) from a trace, save them
    for `kvprof replay --policy kvcmas|kvcomm --policy-option POLICY.anchors=FILE`, and report the truncation
    error per layer against rank and the pool's memory, full-dimensional vs rank r."""
    args = dict(locals())
    use_threads(threads)
    import torch

    from kvprof.model.agents import load_agents_for_trace
    from kvprof.policies.anchors import POOL_FILE
    from kvprof.report.anchors import fit_error_table, fit_memory_table
    from kvprof.tuning.anchor_fit import fit_and_save

    torch.manual_seed(seed)
    matching = SpanMatching(min_span, span_boundaries)
    if rank == "full":
        factor_rank = None
    elif rank.isdigit() and int(rank) >= 1:
        factor_rank = int(rank)
    else:
        raise KvprofError(f"--rank {rank!r} is not a whole number ≥ 1 or 'full'; pass e.g. --rank 32.")
    if limit is not None and limit < 1:
        raise KvprofError(f"--limit {limit} must be at least 1.")
    if trace is None:
        trace, model = demo_prompt_trace(model)
        args.update(trace=trace, model=model)
    trajectories = read_trace(trace).trajectories[:limit]  # the whole trace validated before the model loads
    if planning.plan_first("fit-anchors", args, trace, model).stop:
        return
    agents = load_agents_for_trace(trace, model=model, role_flags=role, device=device, dtype=dtype)
    if agents.spec.mode != "prompt":
        raise KvprofError(
            f"{trace} is a {agents.spec.mode}-mode trace; anchor pools correct shared segments read after different "
            "role prompts, so pass a prompt-mode trace."
        )
    with progress() as bar:
        job = bar.add_task("fitting anchors", total=len(trajectories))
        pool_path, report = fit_and_save(
            agents, trace, trajectories, factor_rank, anchors_per_slot, out / POOL_FILE, window,
            on_trajectory=lambda traj: bar.advance(job), span_matching=matching,
        )  # fmt: skip
    console.print(fit_error_table(report).to_rich())
    console.print(fit_memory_table(report).to_rich())
    path = write_result(out, "fit_anchors", report, args)
    console.print(f"wrote {pool_path} and {path} ({report['seconds']:.1f} s)")
