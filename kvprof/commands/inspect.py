"""`kvprof inspect`: validate a trace (and optionally its tokenizer against a model), summarise it, and show what its
turns could reuse (`kvprof.traces.reuse`), before any model runs; on a hybrid `--model`, what a prefix cache that
resumes the recurrent layers only from kept states serves under each engine's rule (`kvprof.traces.checkpoints`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvprof.commands.common import console, write_result
from kvprof.commands.options import (
    CheckpointRetentionOption,
    DeviceOption,
    DtypeOption,
    KernelBlockOption,
    MinSpanOption,
    SpanBoundariesOption,
)
from kvprof.errors import KvprofError
from kvprof.replay.branches import ReplayPlanSummary
from kvprof.results.inspect import CheckpointTotals, InspectCheckpoints, InspectedTrajectory, InspectResult
from kvprof.traces.checkpoints import (
    PREFILL_CHUNK,
    SGLANG_TRACK_INTERVAL,
    VLLM_KERNEL_BLOCK,
    CheckpointRule,
    checkpoint_rule,
    checkpoint_rule_names,
    retention_text,
    trajectory_checkpoint_hits,
    vllm_hybrid_block_size,
    vllm_kernel_block,
    vllm_retention,
)
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
    "checkpoints": "On a hybrid --model, the engine rule whose kept recurrent states a prefix-cache hit resumes from: "
    "vllm (--mamba-cache-mode align, its hybrid block size derived from the model), sglang (extra_buffer: a state per "
    "prefill step and every --track-interval ids of decode), boundaries (kvprof's own: every message boundary and "
    "each call's end). Repeat for several [default: all three on a hybrid model].",
    "track_interval": "SGLang's --mamba-track-interval: decode keeps the state at its last multiple of this many ids.",
    "prefill_chunk": "The most ids one prefill step computes (vLLM's --max-num-batched-tokens, SGLang's "
    "--chunked-prefill-size); the engines keep a state where a step ends. 0: a whole prompt in one step.",
    "state_capacity": "The most recurrent-state checkpoints the engine keeps at once, least recently used evicted "
    "first [default: no limit].",
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
    checkpoints: Annotated[list[str] | None, typer.Option("--checkpoints", help=HELP["checkpoints"])] = None,
    track_interval: Annotated[
        int, typer.Option("--track-interval", min=1, help=HELP["track_interval"])
    ] = SGLANG_TRACK_INTERVAL,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", min=0, help=HELP["prefill_chunk"])] = PREFILL_CHUNK,
    state_capacity: Annotated[int | None, typer.Option("--state-capacity", min=1, help=HELP["state_capacity"])] = None,
    retention_interval: CheckpointRetentionOption = "0",
    kernel_block: KernelBlockOption = "gpu",
) -> None:
    """Validate a trace line by line, print what it holds and what its turns could reuse."""
    args = dict(locals())
    matching = SpanMatching(min_span, span_boundaries)
    names = checkpoint_rule_names(checkpoints)
    vllm = _VllmSettings(vllm_retention(retention_interval), vllm_kernel_block(kernel_block))
    if checkpoints and model is None:
        raise KvprofError(
            "--checkpoints needs --model naming a hybrid model (vLLM's block size comes from its layers); pass --model."
        )
    header = read_header(trace)
    kinds = None if model is None else _model_layers(header, trace, model, device, dtype)
    settings = (track_interval, prefill_chunk, state_capacity, checkpoints, vllm, device, dtype)
    hybrid = None if model is None or kinds is None else _hybrid(trace, model, kinds, names, *settings)
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
        if hybrid is not None:
            hybrid.add(traj, records[traj.id])
        table.add_row(*_trajectory_cells(traj))
    console.print(table)
    reuse_table.add_section()
    reuse_table.add_row("all", *_reuse_cells(total), style="bold")
    console.print(reuse_table)
    if hybrid is not None:
        console.print(hybrid.table(total, block_size))
    _print_divergences(diverged, divergences)
    console.print(replay.describe(), markup=False)
    console.print(_policy_table(replay, header.mode, hybrid is not None))
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
            checkpoints=None if hybrid is None else hybrid.result(),
        )
        console.print(f"wrote {write_result(out, 'inspect', result, args)}")
    console.print(
        f"valid: {count} trajectories; agents {', '.join(header.agent_names)}; tokenizer "
        f"{header.tokenizer['name']} ({header.tokenizer['vocab_size']} ids)"
        + ("; tokenizer matches --model" if model else "")
    )


def _model_layers(header: TraceHeader, trace: Path, model: str, device: str, dtype: str) -> list[LayerKind]:
    """--model: check its tokenizer against the trace's, print its layers by kind and return them."""
    from kvprof.model.agents import load_tokenizer, model_layer_kinds, tokenizer_identity
    from kvprof.model.layers import describe_layers

    check_tokenizer(header, tokenizer_identity(load_tokenizer(model)), trace, model)
    kinds = model_layer_kinds(model, device, dtype)
    console.print(f"model {model}: {describe_layers(kinds)}", markup=False)
    return kinds


@dataclass(frozen=True)
class _VllmSettings:
    """The vllm rule's settings: vLLM's --prefix-cache-retention-interval (None: dense) and the kernel block."""

    retention: int | None = 0
    kernel_block: int = VLLM_KERNEL_BLOCK


@dataclass
class _Hybrid:
    """Checkpointed prefix reuse on a hybrid model: the rules (vllm's B from the model's sizes) and their totals."""

    trace: Path
    model: str
    names: tuple[str, ...]
    track_interval: int
    prefill_chunk: int
    state_capacity: int | None
    vllm: _VllmSettings = field(default_factory=_VllmSettings)
    state_bytes: int = 0
    token_bytes: int = 0
    block: int = 0
    rules: tuple[CheckpointRule, ...] = ()
    totals: dict[str, list[int]] | None = None

    def load(self, device: str, dtype: str) -> None:
        """The sizes vLLM's block comes from, measured on the model (one recurrent layer's state: the states of a
        sequence over the recurrent layers; one attention layer's K/V per token), and the rules."""
        from kvprof.model.agents import load_agents_for_trace
        from kvprof.model.runtime import Runtime

        runtime = Runtime(load_agents_for_trace(self.trace, self.model, device=device, dtype=dtype))
        self.state_bytes, self.token_bytes = runtime.hybrid_page_sizes
        self.block = vllm_hybrid_block_size(self.state_bytes, self.token_bytes, self.vllm.kernel_block)
        chunk, interval, retention = self.prefill_chunk, self.track_interval, self.vllm.retention
        self.rules = tuple(
            checkpoint_rule(name, self.block, interval, budget=chunk, retention=retention) for name in self.names
        )
        self.totals = {rule.name: [0, 0] for rule in self.rules}
        console.print(
            f"vLLM's hybrid block B = {self.block} ids: one recurrent layer's state ({self.state_bytes} bytes) over "
            f"one attention layer's K/V per token ({self.token_bytes} bytes), in multiples of {self.vllm.kernel_block}",
            markup=False,
        )

    def add(self, traj: Trajectory, record: InspectedTrajectory) -> None:
        """`traj`'s hits under every rule, into its record (per turn and in all) and the totals."""
        assert self.totals is not None
        per_turn: list[dict[str, list[int]]] = [{} for _ in traj.turns]
        record.checkpoints = {}
        for rule in self.rules:
            hits = trajectory_checkpoint_hits(traj, rule, self.state_capacity)
            for turn, (own, shared) in zip(per_turn, hits, strict=True):
                turn[rule.name] = [own, shared]
            own_total, shared_total = sum(own for own, _ in hits), sum(shared for _, shared in hits)
            record.checkpoints[rule.name] = {"engine_own": own_total, "engine_shared": shared_total}
            self.totals[rule.name][0] += own_total
            self.totals[rule.name][1] += shared_total
        for row, turn in zip(record.turns, per_turn, strict=True):
            row["checkpoints"] = turn

    def table(self, total: ReuseSummary, block_size: int) -> Table:
        """Per rule, the input tokens served per agent and shared, beside an attention-only model's engine columns."""
        assert self.totals is not None
        chunk = f"prefill steps of at most {self.prefill_chunk} ids" if self.prefill_chunk else "whole-prompt prefills"
        kept = "no limit on states" if self.state_capacity is None else f"at most {self.state_capacity} states"
        table = Table(
            title="checkpointed prefix reuse on this hybrid: input tokens a prefix cache serves when it resumes the "
            f"recurrent layers only from states it kept ({chunk}; {kept})"
        )
        for column in ("engine", "states kept at", "per agent", "shared"):
            table.add_column(column, justify="left" if column in ("engine", "states kept at") else "right")

        def cell(tokens: int) -> str:
            return f"{tokens} ({total.share(tokens):.1%})"

        table.add_row(
            f"attention-only model (blocks of {block_size})",
            "every id (no recurrent layer)",
            cell(total.engine_own),
            cell(total.engine_shared),
        )
        for rule in self.rules:
            own, shared = self.totals[rule.name]
            table.add_row(rule.label, rule.describe(), cell(own), cell(shared))
        return table

    def result(self) -> InspectCheckpoints:
        assert self.totals is not None
        return InspectCheckpoints(
            state_bytes=self.state_bytes,
            token_bytes=self.token_bytes,
            block_size=self.block,
            prefill_chunk=self.prefill_chunk,
            state_capacity=self.state_capacity,
            retention=retention_text(self.vllm.retention),
            kernel_block=self.vllm.kernel_block,
            rules={
                rule.name: CheckpointTotals(
                    rule=rule.name, interval=rule.interval, engine_own=own, engine_shared=shared
                )
                for rule in self.rules
                for own, shared in [self.totals[rule.name]]
            },
        )


def _hybrid(
    trace: Path,
    model: str,
    kinds: list[LayerKind],
    names: tuple[str, ...],
    track_interval: int,
    prefill_chunk: int,
    state_capacity: int | None,
    asked: list[str] | None,
    vllm: _VllmSettings,
    device: str,
    dtype: str,
) -> _Hybrid | None:
    """Checkpointed reuse for a model with recurrent layers, its sizes measured on the model (None otherwise;
    --checkpoints then refused)."""
    if not any(kind.attention == "recurrent" for kind in kinds):
        if asked:
            raise KvprofError(
                f"--checkpoints applies to hybrid models, and {model} has no recurrent layer; leave it out."
            )
        return None
    hybrid = _Hybrid(trace, model, names, track_interval, prefill_chunk, state_capacity, vllm)
    hybrid.load(device, dtype)
    return hybrid


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


def _policy_table(plan: ReplayPlanSummary, mode: str, hybrid: bool) -> Table:
    """Per policy of the mode, what replay lets it reuse (`ReplayPlanSummary`): the prefix, moved spans if it moves
    them, and what it prefills (private prefixes included; gate refusals and selective recompute are counted by
    `kvprof replay`, not here). On a `hybrid`, the policies that replay one (`ON_HYBRIDS`), moved spans recomputed."""
    from kvprof.policies import ON_HYBRIDS, REGISTRY

    title = f"what replay lets each {mode}-mode policy reuse (input tokens after private prefixes)"
    if hybrid:
        title += "; on this hybrid the prefix only up to kept states (the checkpointed table above)"
    table = Table(title=title)
    for column in ("policy", "family", "prefix reused", "moved re-aligned", "moved recomputed", "new prefilled"):
        table.add_column(column, justify="left" if column in ("policy", "family") else "right")
    for name, policy in REGISTRY.items():
        if mode not in policy.modes or not policy.serves_others or hybrid and name not in ON_HYBRIDS:
            continue
        moved = plan.moved if policy.moves_spans and not hybrid else 0
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
