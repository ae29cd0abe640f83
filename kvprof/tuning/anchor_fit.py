"""Fitting anchor pools offline from calibration trajectories (`kvprof fit-anchors`), and what they cost
(docs/commands/fit-anchors.md).

Segments are cut as the delta policies cut them online (`SegmentLog`), following the replay's plan, moved spans as
placeholder segments (`observed_segments`). Each segment is an anchor of its slot: its base the cache the policies
correct from (an output's producer's cache, an input's context-free encoding), a delta per other agent, V + 1 kept
per slot (`AnchorPool`'s eviction). The low-rank pool is the truncated SVD of each layer's (L × H_kv·D) matrix; the
report gives truncation error per rank, effective ranks and bytes (measured and by formula).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.model.runtime import KV, Runtime
from kvprof.policies.anchors import Anchor, AnchorPool, Stored
from kvprof.policies.delta import NeutralContext, SegmentLog, SharedSegment, Stacked, pool_identity, stack
from kvprof.replay.branches import plan_of
from kvprof.replay.metrics import entropy_effective_rank
from kvprof.traces.reuse import DEFAULT_MATCHING, SpanMatching
from kvprof.traces.trace import Trajectory

RANKS = (1, 2, 4, 8, 16, 32, 64, 128)
PARTS = ("base_k", "base_v", "delta_k", "delta_v")


@dataclass(frozen=True)
class Observed:
    """A logged segment, its shared `sequence`, and where its producer computed it (`produced_in` at `produced_at`:
    the same sequence and start, except for a moved span)."""

    segment: SharedSegment
    sequence: list[int]
    produced_in: list[int]
    produced_at: int


def observed_segments(runtime: Runtime, traj: Trajectory) -> list[Observed]:
    """The trajectory's segments as the delta policies log them, following `plan_of` (a return takes that turn's
    log, a divergence cuts it), then each turn's moved spans as placeholders (`DeltaCorrection.moved_segment`). Each
    with its shared sequence (the turn that added it; a moved span: the reader). Serves private prefixes on
    `runtime`."""
    runtime.serve_trajectory(traj)
    log = SegmentLog(traj.id)
    logs: list[SegmentLog] = []
    shared_inputs: list[list[int]] = []
    sequences: list[list[int]] = []
    found: list[Observed] = []
    for turn, start in zip(traj.turns, plan_of(traj, runtime.prefixes, runtime.span_matching)):
        shared = traj.input_tokens(turn)[len(runtime.prefix(turn.agent)) :]
        sequence = shared + traj.output_tokens(turn)
        if start.restore is not None:
            log = copy.deepcopy(logs[start.restore])
        if start.dropped:
            log.truncate(start.keep)
        for span in start.moved:
            source = traj.turns[span.source]
            part = "out" if span.source_begin >= len(shared_inputs[span.source]) else "in"
            name = f"{traj.id}@{span.source}+{span.source_begin}:{len(span)}"
            segment = SharedSegment(span.begin, span.end, source.agent, f"{source.agent}.{part}.moved", name, part)
            found.append(Observed(segment, sequence, sequences[span.source], span.source_begin))
        for segment in log.observe(turn.agent, len(shared), len(sequence)):
            found.append(Observed(segment, sequence, sequence, segment.start))
        logs.append(copy.deepcopy(log))
        shared_inputs.append(shared)
        sequences.append(sequence)
    return found


class DenseCaches:
    """Each agent's dense cache of its prefix + a shared sequence, computed once for the longest given sequence
    starting with it (causal attention: a prefix's cache is the same inside it)."""

    def __init__(self, runtime: Runtime, sequences: list[list[int]]):
        self.runtime = runtime
        self.sequences = sequences
        self.longest: dict[int, int] = {}  # id of a sequence asked for -> index of the longest one extending it
        self.caches: dict[tuple[str, int], list[KV]] = {}

    def view(self, agent: str, sequence: list[int], start: int, end: int) -> Stacked:
        """`agent`'s K/V of [start, end) of `sequence` after its prefix, in their frame."""
        if id(sequence) not in self.longest:
            self.longest[id(sequence)] = max(
                (index for index, other in enumerate(self.sequences) if other[: len(sequence)] == sequence),
                key=lambda index: len(self.sequences[index]),
            )
        longest = self.longest[id(sequence)]
        key = (agent, longest)
        if key not in self.caches:
            self.caches[key] = dense_cache(self.runtime, agent, self.sequences[longest])
        begin = len(self.runtime.prefix(agent)) + start
        return stack(self.caches[key], begin, begin + end - start, -begin, self.runtime.ropes)


def dense_cache(runtime: Runtime, agent: str, timeline: list[int]) -> list[KV]:
    """`agent`'s cache of its prefix and the whole timeline, per layer (K, V) (1, H_kv, T, D)."""
    ids = runtime.prefix(agent) + timeline
    out = runtime.forward(agent, ids, runtime.cache_from(runtime.empty_kv()), 0, last_logits_only=True)
    return runtime.kv_of(out.cache)


def fit_pool(
    runtime: Runtime,
    trajectories: Sequence[Trajectory],
    capacity: int,
    window: int = 5,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> AnchorPool:
    """A full-dimensional pool of every segment of `trajectories` (see module docstring)."""
    names = [agent.name for agent in runtime.agents.spec.agents]
    pool = AnchorPool(capacity, window, None)
    with torch.inference_mode():
        for traj in trajectories:
            observed = observed_segments(runtime, traj)
            neutral = NeutralContext(runtime)
            caches = DenseCaches(runtime, [seq for item in observed for seq in (item.sequence, item.produced_in)])
            for item in observed:
                segment = item.segment
                views = {name: caches.view(name, item.sequence, segment.start, segment.end) for name in names}
                owner = segment.producer if segment.is_output else None
                if owner is None:
                    base = neutral.encode(item.sequence[segment.start : segment.end])
                else:  # the producer's cache where it produced the segment
                    base = caches.view(owner, item.produced_in, item.produced_at, item.produced_at + segment.length)
                anchor = pool.add(segment.slot, segment.name, owner, *base)
                for name in names:
                    pool.add_delta(anchor, name, *views[name])
            if on_trajectory:
                on_trajectory(traj)
    return pool


def truncated(pool: AnchorPool, rank: int) -> AnchorPool:
    """The pool with every stored matrix replaced by its rank-`rank` truncated SVD per (layer, head)."""
    low = AnchorPool(pool.capacity, pool.window, rank)
    for slot, anchors in pool.slots.items():
        for anchor in anchors:
            copy = Anchor(
                anchor.name,
                anchor.owner,
                Stored.of(anchor.base_keys.dense(anchor.length).to(anchor.base_keys.tensors()[0].dtype), rank),
                Stored.of(anchor.base_values.dense(anchor.length).to(anchor.base_values.tensors()[0].dtype), rank),
                activations=anchor.activations,
            )
            for agent, (keys, values) in anchor.deltas.items():
                dtype = keys.tensors()[0].dtype
                copy.deltas[agent] = (
                    Stored.of(keys.dense(anchor.length).to(dtype), rank),
                    Stored.of(values.dense(anchor.length).to(dtype), rank),
                )
            low.slots.setdefault(slot, []).append(copy)
    return low


@dataclass
class _Spectra:
    """Per layer and part: Σσ² in all, Σσ² beyond each rank in `RANKS`, and the effective ranks of its matrices."""

    total: torch.Tensor  # (layers, parts)
    tail: torch.Tensor  # (layers, parts, ranks)
    effective: list[list[list[float]]]  # [layer][part] -> effective ranks


def spectra(pool: AnchorPool, layers: int) -> _Spectra:
    total = torch.zeros(layers, len(PARTS), dtype=torch.float64)
    tail = torch.zeros(layers, len(PARTS), len(RANKS), dtype=torch.float64)
    effective: list[list[list[float]]] = [[[] for _ in PARTS] for _ in range(layers)]
    for anchors in pool.slots.values():
        for anchor in anchors:
            matrices = [(0, anchor.base_keys), (1, anchor.base_values)]
            for keys, values in anchor.deltas.values():
                matrices += [(2, keys), (3, values)]
            for part, stored in matrices:
                matrix = stored.dense(anchor.length).double().transpose(1, 2).flatten(2)  # (layers, L, H·D)
                sigma = torch.linalg.svdvals(matrix)  # (layers, min(L, H·D))
                energy = sigma**2
                total[:, part] += energy.sum(dim=1)
                for index, rank in enumerate(RANKS):
                    tail[:, part, index] += energy[..., rank:].sum(dim=1)
                for layer in range(layers):
                    effective[layer][part].append(entropy_effective_rank(sigma[layer]))
    return _Spectra(total, tail, effective)


def fit_report(pool: AnchorPool, low: AnchorPool, runtime: Runtime) -> dict:
    """What `kvprof fit-anchors` reports about a full-dimensional pool and `low`, its truncation (`truncated`)."""
    rank = low.rank
    shape = (runtime.num_layers, runtime.kv_heads, (runtime.key_dim, runtime.value_dim), runtime.dtype.itemsize)
    stats = spectra(pool, runtime.num_layers)
    ranks = [r for r in RANKS if r <= runtime.kv_heads * max(runtime.key_dim, runtime.value_dim)]
    layers = []
    for layer in range(runtime.num_layers):
        row: dict = {"layer": layer}
        for part, name in enumerate(PARTS):
            energy = float(stats.total[layer, part])
            errors = {
                str(r): (float(stats.tail[layer, part, i]) / energy) ** 0.5 if energy else 0.0
                for i, r in enumerate(RANKS)
                if r in ranks
            }
            ranks_seen = stats.effective[layer][part]
            row[name] = {
                "error_at_rank": errors,
                "effective_rank": sum(ranks_seen) / len(ranks_seen) if ranks_seen else 0.0,
            }
        layers.append(row)
    anchors = [a for group in pool.slots.values() for a in group]
    return {
        "slots": {slot: [a.length for a in group] for slot, group in pool.slots.items()},
        "anchors": len(anchors),
        "agents": sorted({agent for a in anchors for agent in a.deltas}),
        "rank": rank,
        "anchors_per_slot": pool.capacity,
        "ranks": ranks,
        "layers": layers,
        "memory": {
            "full_bytes": pool.nbytes(),
            "full_formula_bytes": pool.analytic_bytes(*shape),
            "low_rank_bytes": low.nbytes(),
            "low_rank_formula_bytes": low.analytic_bytes(*shape),
            "saving": pool.nbytes() / low.nbytes() if low.nbytes() else None,
        },
        "identity": pool_identity(runtime),
    }


def require_per_token_layers(runtime: Runtime) -> None:
    """Refuse a hybrid model (`kvprof.model.recurrent`): an anchor is per-token K/V of every layer, and a recurrent
    layer's state has no per-token entries (the policies that would read the pool are refused there too)."""
    if runtime.recurrent:
        index, mixer = next(iter(runtime.recurrent.items()))
        raise KvprofError(
            f"anchor pools hold per-token K/V of every layer for kvcmas and kvcomm, and layer {index} of model "
            f"{runtime.agents.base_model.config.name_or_path!r} is a recurrent layer ({mixer}), whose state has no "
            "per-token entries; on hybrid models replay nonshared, fullshared or alorashared, which need no anchors."
        )


def fit_anchors(
    agents: AgentSet,
    trajectories: Sequence[Trajectory],
    rank: int | None,
    capacity: int,
    window: int = 5,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> tuple[AnchorPool, dict]:
    """Fit a pool on `trajectories` (moved spans per `span_matching`) and report it; the pool to save (rank-`rank`
    factors, full-dimensional if None) and the report (figures at `rank`, or 32 when full)."""
    started = time.perf_counter()
    runtime = Runtime(agents, span_matching=span_matching)
    require_per_token_layers(runtime)
    full = fit_pool(runtime, trajectories, capacity, window, on_trajectory)
    low = truncated(full, rank or 32)
    report = fit_report(full, low, runtime)
    report.update(trajectories=len(trajectories), seconds=round(time.perf_counter() - started, 3))
    return (full if rank is None else low), report


def fit_and_save(
    agents: AgentSet,
    trace: Path,
    trajectories: Sequence[Trajectory],
    rank: int | None,
    capacity: int,
    pool_path: Path,
    window: int = 5,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    span_matching: SpanMatching = DEFAULT_MATCHING,
) -> tuple[Path, dict]:
    """`kvprof fit-anchors`' step: `fit_anchors` on `trajectories` of `trace`, the pool saved at `pool_path` for
    these agents (`pool_identity`); its path and the report naming the trace, model, pool and stored rank."""
    pool, report = fit_anchors(agents, trajectories, rank, capacity, window, on_trajectory, span_matching)
    saved = pool.save(pool_path, pool_identity(Runtime(agents)))
    report.update(trace=str(trace), model=agents.model_name, pool=str(saved), stored_rank=rank)
    return saved, report
