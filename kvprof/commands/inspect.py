"""`kvprof inspect`: validate a trace (and optionally its tokenizer against a model), summarise it, and show what its
turns could reuse (`kvprof.traces.reuse`), before any model runs."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvprof.commands.common import console, write_result
from kvprof.commands.options import DeviceOption, DtypeOption, MinSpanOption, SpanBoundariesOption
from kvprof.replay.branches import ReplayPlanSummary
from kvprof.results.inspect import InspectedTrajectory, InspectResult
from kvprof.traces.reuse import BLOCK_SIZE, MIN_SPAN, ReuseSummary, SpanMatching, TurnReuse, trajectory_reuse
from kvprof.traces.trace import check_tokenizer, iter_trajectories, read_header, shared_segment_ids

if TYPE_CHECKING:
    from kvprof.model.layers import LayerKind
    from kvprof.traces.trace import TraceHeader, Trajectory

HELP = {
    "model": "Also check that this model's tokenizer is the one the trace was captured with, and name its layers by "
    "kind: full, sliding-window or chunked attention, multi-head latent attention, and each layer's RoPE or none "
    "(loads the model).",
    "divergences": "List up to N turns whose input leaves the cached sequence it extends.",
    "block_size": "Prefix-cache block size of the serving engine whose cache hits are shown (vLLM: 16 on GPUs, 128 on "
    "its CPU backend).",
}


def command(
    trace: Annotated[Path, typer.Argument(help="Trace file (JSONL) written by `kvprof capture`.")],
    model: Annotated[str | None, typer.Option("--model", help=HELP["model"])] = None,
    divergences: Annotated[int, typer.Option("--divergences", min=0, help=HELP["divergences"])] = 10,
    block_size: Annotated[int, typer.Option("--block-size", min=1, help=HELP["block_size"])] = BLOCK_SIZE,
    min_span: MinSpanOption = MIN_SPAN,
    span_boundaries: SpanBoundariesOption = "messages",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Also write OUT/inspect.json: every turn's reuse structure and the totals."),
    ] = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
) -> None:
    """Validate a trace line by line, print what it holds and what its turns could reuse."""
    args = dict(locals())
    matching = SpanMatching(min_span, span_boundaries)
    header = read_header(trace)
    kinds = None if model is None else _model_layers(header, trace, model, device, dtype)
    table = _trajectory_table(f"{trace}: {header.mode} mode, model {header.model.get('path')}, source {header.source}")
    count = 0
    reuse_table, total, diverged, records = _reuse_table(block_size), ReuseSummary(), [], {}
    replay = ReplayPlanSummary()
    for traj in iter_trajectories(trace):
        count += 1
        rows = trajectory_reuse(traj, matching, block_size)
        replay.add(traj, header.mode, matching)
        summary = ReuseSummary()
        summary.add(rows)
        total.add(rows)
        reuse_table.add_row(traj.id, *_reuse_cells(summary))
        diverged += [(traj.id, row) for row in rows if row.divergence is not None]
        records[traj.id] = InspectedTrajectory(summary=asdict(summary), turns=[row.to_json() for row in rows])
        table.add_row(*_trajectory_cells(traj))
    console.print(table)
    reuse_table.add_section()
    reuse_table.add_row("all", *_reuse_cells(total), style="bold")
    console.print(reuse_table)
    _print_divergences(diverged, divergences)
    console.print(replay.describe(), markup=False)
    console.print(_policy_table(replay, header.mode))
    if out is not None:
        result = InspectResult(
            trace=str(trace),
            mode=header.mode,
            block_size=block_size,
            span_matching=matching.to_json(),
            layers=None if kinds is None else [kind.to_json() for kind in kinds],
            total=asdict(total),
            replay=asdict(replay),
            trajectories=records,
        )
        console.print(f"wrote {write_result(out, 'inspect', result, args)}")
    console.print(
        f"valid: {count} trajectories; agents {', '.join(header.agent_names)}; tokenizer "
        f"{header.tokenizer['name']} ({header.tokenizer['vocab_size']} ids)"
        + ("; tokenizer matches --model" if model else "")
    )


def _model_layers(header: TraceHeader, trace: Path, model: str, device: str, dtype: str) -> list[LayerKind]:
    """--model: check its tokenizer against the trace's, print its layers by kind and return them."""
    from kvprof.model.agents import load_tokenizer, tokenizer_identity
    from kvprof.model.layers import describe_layers, model_layer_kinds

    check_tokenizer(header, tokenizer_identity(load_tokenizer(model)), trace, model)
    kinds = model_layer_kinds(model, device, dtype)
    console.print(f"model {model}: {describe_layers(kinds)}", markup=False)
    return kinds


def _trajectory_table(title: str) -> Table:
    table = Table(title=title)
    columns = ("trajectory", "turns", "agents", "distinct tokens", "shared tokens", "longest input", "answer")
    for column in (*columns, "prediction"):
        table.add_column(
            column, justify="left" if column in ("trajectory", "agents", "answer", "prediction") else "right"
        )
    return table


def _trajectory_cells(traj: Trajectory) -> list[str]:
    return [
        traj.id,
        str(len(traj.turns)),
        ",".join(dict.fromkeys(t.agent for t in traj.turns)),
        str(traj.num_tokens),
        str(sum(len(traj.segments[s]) for s in shared_segment_ids(traj))),
        str(max((len(traj.input_tokens(t)) for t in traj.turns), default=0)),
        str(traj.answer),
        str(traj.prediction),
    ]


def _policy_table(plan: ReplayPlanSummary, mode: str) -> Table:
    """Per policy of the mode, what replay lets it reuse (`ReplayPlanSummary`): the prefix, moved spans if it moves
    them, and what it prefills (private prefixes included; gate refusals and selective recompute are counted by
    `kvprof replay`, not here)."""
    from kvprof.policies import REGISTRY

    table = Table(title=f"what replay lets each {mode}-mode policy reuse (input tokens after private prefixes)")
    for column in ("policy", "family", "prefix reused", "moved re-aligned", "moved recomputed", "new prefilled"):
        table.add_column(column, justify="left" if column in ("policy", "family") else "right")
    for name, policy in REGISTRY.items():
        if mode not in policy.modes or not policy.serves_others:
            continue
        moved = plan.moved if policy.moves_spans else 0
        recomputed = plan.moved - moved
        table.add_row(
            name,
            policy.family,
            plan.share(plan.kept),
            plan.share(moved),
            plan.share(recomputed),
            str(plan.new + recomputed),
        )
    return table


def _reuse_table(block_size: int) -> Table:
    table = Table(
        title="reuse structure: what each turn's input could reuse, derived from its ids (per agent: each agent "
        f"its own cache; shared: one cache for all agents; engine: a prefix cache's hits in blocks of {block_size})"
    )
    columns = ("trajectory", "turns", "input tokens", "per-agent prefix", "shared prefix", "moved spans", "new")
    for column in (*columns, "engine per agent", "engine shared"):
        table.add_column(column, justify="left" if column == "trajectory" else "right")
    table.add_column("divergences")
    return table


def _reuse_cells(summary: ReuseSummary) -> list[str]:
    counts = (summary.own_prefix, summary.shared_prefix, summary.moved, summary.new)
    shares = [f"{summary.share(n):.1%}" for n in (*counts, summary.engine_own, summary.engine_shared)]
    causes = ", ".join(f"{count} {cause}" for cause, count in summary.divergences.items() if count) or "none"
    return [str(summary.turns), str(summary.input_tokens), *shares, causes]


def _print_divergences(diverged: list[tuple[str, TurnReuse]], limit: int) -> None:
    """One line per turn whose input leaves the cached sequence its shared prefix comes from (the first `limit`)."""
    for traj_id, row in diverged[:limit]:
        assert row.divergence is not None
        console.print(
            f"trajectory {traj_id!r} turn {row.turn} ({row.agent}): leaves turn {row.divergence.turn}'s sequence at "
            f"position {row.divergence.position} ({row.divergence.cause}); {row.moved} of the {row.new + row.moved} "
            "ids after it are spans seen elsewhere",
            markup=False,
        )
    if len(diverged) > limit:
        console.print(f"... and {len(diverged) - limit} more turns that diverge (--divergences N lists more)")
