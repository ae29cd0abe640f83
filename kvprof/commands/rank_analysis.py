"""`kvprof rank-analysis`: effective rank and cross-agent similarity of caches, adapter outputs and deltas, per layer.
Maths: `kvprof.rank.analysis`, `kvprof.rank.trace_analysis`; rendering: `kvprof.report.rank_analysis`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console, demo_trace, progress, use_threads, write_result
from kvprof.commands.options import (
    AgentOverrideOption,
    DeviceOption,
    DtypeOption,
    LimitOption,
    ModelOverrideOption,
    OutOption,
    SeedOption,
    ThreadsOption,
    TraceArgument,
)
from kvprof.errors import KvprofError


def command(
    trace: TraceArgument = None,
    model: ModelOverrideOption = None,
    agent: AgentOverrideOption = None,
    agents: Annotated[
        str | None,
        typer.Option("--agents", help="Comma-separated agents to compare (default: all in the trace), e.g. plan,act."),
    ] = None,
    layers: Annotated[
        str | None, typer.Option("--layers", help="Layers to analyse: 0,2 or 0-3 or a mix (default: all).")
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", help="Use at most the first N tokens each agent holds (default: 2048)."),
    ] = 2048,
    limit: LimitOption = None,
    per_head: Annotated[
        bool,
        typer.Option(
            "--per-head",
            help="One (tokens, D) matrix per KV head, averaged over heads, instead of one flattened "
            "(tokens, H_kv·D) matrix per layer.",
        ),
    ] = False,
    out: OutOption = Path("runs/rank-analysis"),
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    seed: SeedOption = 0,
) -> None:
    """Effective rank and cross-agent cosine similarity of base caches, adapter outputs and deltas, per layer."""
    args = dict(locals())
    use_threads(threads)
    import torch

    from kvprof.rank.trace_analysis import prepare_rank_analysis, run_rank_analysis
    from kvprof.report.rank_analysis import layer_tables, verdict_lines, write_report

    if max_tokens is not None and max_tokens < 1:
        raise KvprofError(f"--max-tokens {max_tokens} must be at least 1.")
    if limit is not None and limit < 1:
        raise KvprofError(f"--limit {limit} must be at least 1.")
    torch.manual_seed(seed)
    if trace is None:
        trace, model = demo_trace(model)
        args.update(trace=trace, model=model)
    setup = prepare_rank_analysis(
        trace,
        model=model,
        agent_flags=agent,
        limit=limit,
        layers=parse_layers(layers),
        device=device,
        dtype=dtype,
        agent_names=[name.strip() for name in agents.split(",") if name.strip()] if agents else None,
    )
    with progress() as bar:
        job = bar.add_task("capturing and comparing caches", total=len(setup.trace.trajectories))
        payload = run_rank_analysis(
            setup, max_tokens=max_tokens, per_head=per_head, on_trajectory=lambda traj: bar.advance(job)
        )
    for table in layer_tables(payload):
        console.print(table.to_rich())
    for line in verdict_lines(payload):
        console.print(line, markup=False)
    json_path = write_result(out, "rank_analysis", payload, args)
    html_path = write_report(out / "rank_analysis.html", payload)
    console.print(f"wrote {json_path} and {html_path} ({payload.seconds:.1f} s)")


def parse_layers(text: str | None) -> list[int] | None:
    """'0,2' → [0, 2]; '0-3' → [0, 1, 2, 3]; mixes allowed; None → None (all layers)."""
    if text is None:
        return None
    chosen: list[int] = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        low, sep, high = piece.partition("-")
        try:
            if sep:
                start, stop = int(low), int(high)
                if stop < start:
                    raise ValueError
                chosen.extend(range(start, stop + 1))
            else:
                chosen.append(int(piece))
        except ValueError:
            raise KvprofError(
                f"--layers {text!r} is not a list of layer indices or ranges; use e.g. --layers 0,2 or --layers 0-3."
            ) from None
    return chosen
