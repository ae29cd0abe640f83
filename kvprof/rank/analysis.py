"""Rank and cross-agent similarity of the caches agents build on shared context (`kvprof rank-analysis`).

Per trajectory each selected agent prefills what it holds after its last turn (`kvprof.rank.kv_capture`); each pair
(i, j), i before j in agent order, is compared on the shared segments both hold (its span), per layer, for K and V:
C_i, C_j and Δ_{j←i} = C_j − R(C_i) (R: RoPE re-alignment in prompt mode, identity in lora mode); in lora mode also
base parts and adapter outputs (key parts before a key norm and RoPE). Matrices are flattened (n, H_kv·D) or per head
(n, D) (`per_head=True`). Prompt mode adds KVCMAS's quantity, Δ_j = C_{j,seg} − R(C_{ref,seg}) against each segment's
context-free encoding, one record per (trajectory, agent, segment). Statistics (`kvprof.replay.metrics`): effective
and energy ranks above the `noise_floor`, spectra, cosines, relative norms; each record counts once in the means.

Claims checked (`claims()`): LRAgent's base-cache cosine > 0.97 and nearly orthogonal adapter outputs (|mean token
cosine| < 0.1, kvprof's reading); KVCMAS's delta effective rank < 32 and higher-rank caches — on Δ_j in prompt mode
(records > 32 tokens when any), on Δ_{j←i} in lora mode (kvprof's extension, said so). Definitions:
docs/design.md#metrics-same-definitions-everywhere, docs/commands/rank-analysis.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvprof.claims.papers import KVCMAS_DELTA_RANK
from kvprof.claims.rank import (
    BETWEEN_AGENTS_QUANTITY,
    CONTEXT_FREE_QUANTITY,
    EXTENSION,
    KV_NAMES,
    Claim,
    kvcmas_claims,
    lragent_claims,
)
from kvprof.errors import KvprofError
from kvprof.model.agents import AgentSet
from kvprof.model.rope import LayerRopes, Rope, rotate_keys
from kvprof.rank.kv_capture import TurnCapture, capture_turn
from kvprof.replay import metrics
from kvprof.traces.trace import Trace, Trajectory

SPECTRUM_LENGTH = 128  # leading entries of each mean energy spectrum kept in results


# ------------------------------------------------------------------------------------------------- spans


@dataclass
class AgentSequence:
    """An agent's tokens after its last turn (input + output, ≤ `max_tokens`): `tokens` (L,), `spans` segment id →
    (start, end)."""

    agent: str
    tokens: list[int]
    spans: dict[str, tuple[int, int]]


@dataclass
class PairSpan:
    """Shared tokens two agents hold: `source_rows`, `target_rows` (n,) indices, `shift` (n,) target − source
    position (0 in lora mode), `segments` covered."""

    trajectory: str
    source: str
    target: str
    source_rows: torch.Tensor
    target_rows: torch.Tensor
    shift: torch.Tensor
    segments: list[str]

    def __len__(self) -> int:
        return int(self.source_rows.numel())


def agent_sequence(traj: Trajectory, agent: str, max_tokens: int | None = None) -> AgentSequence | None:
    """What `agent` holds after its last turn in `traj` (None if it never acts there)."""
    turns = [turn for turn in traj.turns if turn.agent == agent]
    if not turns:
        return None
    turn = turns[-1]
    layout = traj.segment_spans(turn)
    end = layout[-1][2] if layout else 0
    layout.append((turn.output, end, end + len(traj.segments[turn.output])))
    tokens = traj.input_tokens(turn) + traj.output_tokens(turn)
    limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
    spans = {seg_id: (start, min(stop, limit)) for seg_id, start, stop in layout if start < limit}
    return AgentSequence(agent=agent, tokens=tokens[:limit], spans=spans)


def pair_span(traj: Trajectory, source: AgentSequence, target: AgentSequence) -> PairSpan:
    """The shared segments both sequences hold (in the target's order), token by token (see `PairSpan`)."""
    source_rows: list[int] = []
    target_rows: list[int] = []
    segments: list[str] = []
    for seg_id, (t_start, t_end) in target.spans.items():
        if traj.segments[seg_id].scope != "shared" or seg_id not in source.spans:
            continue
        s_start, s_end = source.spans[seg_id]
        count = min(s_end - s_start, t_end - t_start)
        if count <= 0:
            continue
        segments.append(seg_id)
        source_rows.extend(range(s_start, s_start + count))
        target_rows.extend(range(t_start, t_start + count))
    source_idx = torch.tensor(source_rows, dtype=torch.long)
    target_idx = torch.tensor(target_rows, dtype=torch.long)
    return PairSpan(
        trajectory=traj.id,
        source=source.agent,
        target=target.agent,
        source_rows=source_idx,
        target_rows=target_idx,
        shift=target_idx - source_idx,
        segments=segments,
    )


# ------------------------------------------------------------------------------------------------- statistics


def as_matrices(states: torch.Tensor, per_head: bool) -> torch.Tensor:
    """(H, n, D) cache rows → (H, n, D) per head, or (1, n, H·D) flattened (all heads of a token in one row)."""
    if per_head:
        return states
    heads, tokens, dim = states.shape
    return states.permute(1, 0, 2).reshape(1, tokens, heads * dim)


def noise_floor(reference: torch.Tensor, per_head: bool, dtype: torch.dtype) -> torch.Tensor:
    """Per matrix σ_max(C)·max(n, columns)·ε(dtype), numpy's matrix_rank tolerance from the cache C (H, n, D) the
    quantity belongs to: a delta of pure rounding gets rank 0."""
    matrices = as_matrices(reference, per_head)
    return metrics.singular_values(matrices)[:, 0] * max(matrices.shape[-2:]) * torch.finfo(dtype).eps


def rank_stats(states: torch.Tensor, per_head: bool, floor: torch.Tensor) -> dict:
    """{"effective", "energy90", "energy99", "spectrum" (k,)} of (H, n, D) states, σ ≤ `floor` (matrices,) as zero."""
    sigmas = metrics.singular_values(as_matrices(states, per_head))
    sigmas = torch.where(sigmas > floor[:, None], sigmas, torch.zeros_like(sigmas))
    count = sigmas.shape[0]
    return {
        "effective": sum(metrics.entropy_effective_rank(s) for s in sigmas) / count,
        "energy90": sum(metrics.energy_rank(s, 0.90) for s in sigmas) / count,
        "energy99": sum(metrics.energy_rank(s, 0.99) for s in sigmas) / count,
        "spectrum": torch.stack([metrics.energy_spectrum(s) for s in sigmas]).mean(0),
    }


def similarity(a: torch.Tensor, b: torch.Tensor, per_head: bool) -> tuple[float, float]:
    """(mean token cosine, flattened-matrix cosine) of two (H, n, D) states, per head or flattened (see module doc)."""
    ma, mb = as_matrices(a, per_head), as_matrices(b, per_head)
    flat = sum(metrics.flat_cosine(x, y) for x, y in zip(ma, mb)) / ma.shape[0]
    return metrics.mean_token_cosine(ma, mb), flat


@dataclass
class PairLayer:
    """One pair, one layer, K or V: `values` (`METRICS`) and `spectra` ("cache", "delta", "base", "adapter" → (k,))."""

    values: dict[str, float]
    spectra: dict[str, torch.Tensor]


def _rank_metrics(prefix: str, stats: list[dict]) -> dict[str, float]:
    """`prefix`_rank / _energy90 / _energy99, averaged over `stats` (one per agent, or the delta's alone)."""
    return {
        f"{prefix}_{suffix}": sum(s[key] for s in stats) / len(stats)
        for suffix, key in (("rank", "effective"), ("energy90", "energy90"), ("energy99", "energy99"))
    }


METRICS = {
    **{
        f"{q}_{suffix}": f"{label} of {what}"
        for q, what in (
            ("cache", "C (mean of the two agents)"),
            ("delta", "Δ_j←i"),
            ("base", "the base part X·W0 (mean of the two agents)"),
            ("adapter", "the adapter output s·X·A·B (mean of the two agents)"),
        )
        for suffix, label in (
            ("rank", "entropy effective rank"),
            ("energy90", "energy rank (90 %)"),
            ("energy99", "energy rank (99 %)"),
        )
    },
    "delta_relative": "‖Δ‖/‖C_j‖",
    "adapter_relative": "‖adapter output‖/‖C‖ (mean of the two agents; ‖base + adapter‖ for keys a model normalises "
    "before RoPE)",
    "cache_cosine": "mean token cosine of C_i, C_j",
    "cache_cosine_flat": "cosine of flattened C_i, C_j",
    "base_cosine": "mean token cosine of the base parts",
    "base_cosine_flat": "cosine of flattened base parts",
    "adapter_cosine": "mean token cosine of the adapter outputs",
    "adapter_cosine_flat": "cosine of flattened adapter outputs",
}


def _align(states: torch.Tensor, shift: torch.Tensor, rope: Rope, is_key: bool) -> torch.Tensor:
    """Move the source's (H, n, D) states to the target's positions: keys are rotated by `shift`, values unchanged."""
    if not is_key or not bool(shift.any()):
        return states
    return rotate_keys(states, shift.to(states.device), rope)


def compare_pair(
    source: TurnCapture,
    target: TurnCapture,
    span: PairSpan,
    layer: int,
    rope: Rope,
    per_head: bool,
    dtype: torch.dtype = torch.float32,
) -> dict[str, PairLayer]:
    """{"K"|"V": PairLayer} of one pair at one layer in fp64; `dtype` sets the noise floor (from C_j)."""
    src, dst = source.layers[layer], target.layers[layer]
    # Captures compared here are taken with parts including "kv" (`run_rank_analysis`), so keys and values are set.
    assert src.keys is not None and src.values is not None, "source capture lacks keys/values"
    assert dst.keys is not None and dst.values is not None, "target capture lacks keys/values"
    rows_s, rows_t = span.source_rows.to(src.keys.device), span.target_rows.to(src.keys.device)
    out = {}
    for kv, projection in (("K", "k_proj"), ("V", "v_proj")):
        is_key = kv == "K"
        pairs = {
            "cache": (
                _align((src.keys if is_key else src.values)[:, rows_s].double(), span.shift, rope, is_key),
                (dst.keys if is_key else dst.values)[:, rows_t].double(),
            )
        }
        normalised = False
        if projection in src.split and projection in dst.split:
            split_s, split_t = src.split[projection], dst.split[projection]
            normalised = split_s.normalised  # split before the key norm and RoPE: nothing to re-align
            for name in ("base", "adapter"):
                pairs[name] = (
                    _align(getattr(split_s, name)[:, rows_s].double(), span.shift, rope, is_key and not normalised),
                    getattr(split_t, name)[:, rows_t].double(),
                )
        cache_s, cache_t = pairs["cache"]
        delta = cache_t - cache_s
        floor = noise_floor(cache_t, per_head, dtype)
        stats = {name: [rank_stats(x, per_head, floor) for x in states] for name, states in pairs.items()}
        stats["delta"] = [rank_stats(delta, per_head, floor)]
        values = {"delta_relative": metrics.relative_norm(delta, cache_t)}
        for name, states in pairs.items():
            values.update(_rank_metrics(name, stats[name]))
            values[f"{name}_cosine"], values[f"{name}_cosine_flat"] = similarity(*states, per_head)
        values.update(_rank_metrics("delta", stats["delta"]))
        if "adapter" in pairs:
            totals = [base + adapter for base, adapter in zip(pairs["base"], pairs["adapter"])]
            reference_s, reference_t = totals if normalised else (cache_s, cache_t)
            values["adapter_relative"] = (
                metrics.relative_norm(pairs["adapter"][0], reference_s)
                + metrics.relative_norm(pairs["adapter"][1], reference_t)
            ) / 2
        spectra = {name: (sum(s["spectrum"] for s in group) / len(group)).cpu() for name, group in stats.items()}
        out[kv] = PairLayer(values=values, spectra=spectra)
    return out


# ------------------------------------------------------------------------------------------------- context-free


CONTEXT_FREE_METRICS = {
    **{
        f"{q}_{suffix}": f"{label} of {what}"
        for q, what in (
            ("cache", "C_j,seg, the agent's cache of the segment"),
            ("delta", "Δ_j = C_j,seg − R(C_ref,seg), against the context-free encoding"),
        )
        for suffix, label in (
            ("rank", "entropy effective rank"),
            ("energy90", "energy rank (90 %)"),
            ("energy99", "energy rank (99 %)"),
        )
    },
    "delta_relative": "‖Δ_j‖/‖C_j,seg‖",
    "reference_cosine": "mean token cosine of C_j,seg and R(C_ref,seg)",
}


def reference_captures(
    agents: AgentSet, traj: Trajectory, lengths: dict[str, int], layers: Sequence[int]
) -> dict[str, TurnCapture]:
    """Each segment's first `lengths[id]` tokens encoded alone at 0..n−1, no adapter: {id: capture (H_kv, n, D)}."""
    return {
        seg_id: capture_turn(agents, None, traj.segments[seg_id].tokens[:count], layers=layers, parts=("kv",))
        for seg_id, count in lengths.items()
    }


def compare_reference(
    agent: TurnCapture,
    reference: TurnCapture,
    start: int,
    count: int,
    layer: int,
    rope: Rope,
    per_head: bool,
    dtype: torch.dtype = torch.float32,
) -> dict[str, PairLayer]:
    """Δ_j = C_j,seg − R(C_ref,seg) on rows start..start+count−1 at one layer, {"K"|"V": PairLayer}
    (`CONTEXT_FREE_METRICS`), fp64; reference keys rotated by `start`."""
    own, ref = agent.layers[layer], reference.layers[layer]
    # Both captures are taken with the "kv" part (`analyze_trace`, `reference_captures`).
    assert own.keys is not None and own.values is not None, "agent capture lacks keys/values"
    assert ref.keys is not None and ref.values is not None, "reference capture lacks keys/values"
    shift = torch.full((count,), start, dtype=torch.long)
    out = {}
    for kv in KV_NAMES:
        is_key = kv == "K"
        cache = (own.keys if is_key else own.values)[:, start : start + count].double()
        aligned = _align((ref.keys if is_key else ref.values)[:, :count].double(), shift, rope, is_key)
        delta = cache - aligned
        floor = noise_floor(cache, per_head, dtype)
        stats = {"cache": rank_stats(cache, per_head, floor), "delta": rank_stats(delta, per_head, floor)}
        values = {
            **_rank_metrics("cache", [stats["cache"]]),
            **_rank_metrics("delta", [stats["delta"]]),
            "delta_relative": metrics.relative_norm(delta, cache),
            "reference_cosine": similarity(cache, aligned, per_head)[0],
        }
        out[kv] = PairLayer(values=values, spectra={name: s["spectrum"].cpu() for name, s in stats.items()})
    return out


# ------------------------------------------------------------------------------------------------- results


@dataclass
class PairResult:
    """One pair in one trajectory: span, {layer: {"K"|"V": PairLayer}}, `bound` = min(n, columns)."""

    trajectory: str
    source: str
    target: str
    tokens: int
    bound: int
    segments: list[str]
    layers: dict[int, dict[str, PairLayer]]


@dataclass
class SegmentResult:
    """One agent's segment against its context-free encoding: {layer: {"K"|"V": PairLayer}}, `start` in the
    agent's sequence, `bound` = min(tokens, columns)."""

    trajectory: str
    agent: str
    segment: str
    start: int
    tokens: int
    bound: int
    layers: dict[int, dict[str, PairLayer]]


def _layer_means(
    results: Sequence[PairResult | SegmentResult], layers: Sequence[int], names: dict[str, str]
) -> dict[int, dict[str, dict[str, float]]]:
    """{layer: {"K"|"V": {metric: mean over `results`}}}, metrics in the order of `names` (those present)."""
    out: dict[int, dict[str, dict[str, float]]] = {}
    for layer in layers:
        out[layer] = {}
        for kv in KV_NAMES:
            records = [result.layers[layer][kv] for result in results]
            present = [name for name in names if name in records[0].values]
            out[layer][kv] = {name: sum(r.values[name] for r in records) / len(records) for name in present}
    return out


def _layer_spectra(
    results: Sequence[PairResult | SegmentResult], layers: Sequence[int]
) -> dict[int, dict[str, dict[str, list[float]]]]:
    """{layer: {"K"|"V": {quantity: mean energy spectrum over `results`, first SPECTRUM_LENGTH entries}}}."""
    out: dict[int, dict[str, dict[str, list[float]]]] = {}
    for layer in layers:
        out[layer] = {}
        for kv in KV_NAMES:
            records = [result.layers[layer][kv] for result in results]
            out[layer][kv] = {}
            for quantity in records[0].spectra:
                width = max(r.spectra[quantity].numel() for r in records)
                total = torch.zeros(width, dtype=torch.float64)
                for r in records:
                    total[: r.spectra[quantity].numel()] += r.spectra[quantity]
                out[layer][kv][quantity] = (total / len(records))[:SPECTRUM_LENGTH].tolist()
    return out


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {name: round(value, 6) for name, value in values.items()}


def _layer_records(
    means: dict[int, dict[str, dict[str, float]]], spectra: dict[int, dict[str, dict[str, list[float]]]]
) -> tuple[list[dict], list[dict]]:
    """Per-layer means and spectra as JSON lists: [{"layer", "K": {...}, "V": {...}}] each."""
    return (
        [{"layer": layer, **{kv: _rounded(values) for kv, values in by_kv.items()}} for layer, by_kv in means.items()],
        [
            {
                "layer": layer,
                **{kv: {q: [round(x, 6) for x in s] for q, s in by_q.items()} for kv, by_q in by_kv.items()},
            }
            for layer, by_kv in spectra.items()
        ],
    )


@dataclass
class RankAnalysis:
    """All results of one rank analysis (see module docstring). segments: the context-free records (prompt mode)."""

    mode: str
    agents: list[str]
    layers: list[int]
    per_head: bool
    head_dim: int
    kv_heads: int
    pairs: list[PairResult] = field(default_factory=list)
    segments: list[SegmentResult] = field(default_factory=list)

    @property
    def matrix(self) -> str:
        if self.per_head:
            return f"per KV head: (tokens, D={self.head_dim}), statistics averaged over {self.kv_heads} heads"
        return f"flattened: (tokens, H_kv·D={self.kv_heads * self.head_dim}), one row per token"

    def layer_means(self) -> dict[int, dict[str, dict[str, float]]]:
        """{layer: {"K"|"V": {metric: mean over (trajectory, pair)}}}."""
        return _layer_means(self.pairs, self.layers, METRICS)

    def layer_spectra(self) -> dict[int, dict[str, dict[str, list[float]]]]:
        """{layer: {"K"|"V": {quantity: mean energy spectrum, first SPECTRUM_LENGTH entries}}}."""
        return _layer_spectra(self.pairs, self.layers)

    def context_free_means(
        self, records: Sequence[SegmentResult] | None = None
    ) -> dict[int, dict[str, dict[str, float]]]:
        """{layer: {"K"|"V": {metric: mean over (trajectory, agent, segment)}}} of `records` (default: all)."""
        return _layer_means(self.segments if records is None else records, self.layers, CONTEXT_FREE_METRICS)

    def claims(self) -> list[Claim]:
        """Verdicts for the LRAgent and KVCMAS claims (see module docstring), with the measured values."""
        claims = lragent_claims(self.mode, self.layer_means(), self.layers)
        if self.mode == "prompt":
            testable = [record for record in self.segments if record.bound > KVCMAS_DELTA_RANK]
            records = testable or self.segments
            scope = (
                f"the {len(testable)} of {len(self.segments)} (trajectory, agent, segment) records of more than "
                f"{KVCMAS_DELTA_RANK:g} tokens"
                if testable
                else f"all {len(records)} (trajectory, agent, segment) records"
            )
            claims += kvcmas_claims(
                self.context_free_means(records),
                self.layers,
                bound=max(record.bound for record in records),
                scope=scope,
                delta="deltas against the context-free reference, Δ_j = C_j,seg − R(C_ref,seg),",
                cache="the caches C_j,seg",
                quantity=CONTEXT_FREE_QUANTITY,
            )
        else:
            claims += kvcmas_claims(
                self.layer_means(),
                self.layers,
                bound=max(pair.bound for pair in self.pairs),
                scope=f"{len(self.pairs)} (trajectory, agent pair) spans",
                delta="deltas Δ_j←i between agents",
                cache="the caches C_i, C_j",
                quantity=BETWEEN_AGENTS_QUANTITY,
                label=f" [{EXTENSION}]",
            )
        return claims

    def to_dict(self) -> dict:
        """JSON-ready results: settings, means, spectra, pairs, context-free records (None in lora mode), claims."""
        layer_means, spectra = _layer_records(self.layer_means(), self.layer_spectra())
        return {
            "mode": self.mode,
            "agents": self.agents,
            "layers": self.layers,
            "per_head": self.per_head,
            "matrix": self.matrix,
            "metrics": METRICS,
            "layer_means": layer_means,
            "spectra": spectra,
            "pairs": [
                {
                    "trajectory": p.trajectory,
                    "source": p.source,
                    "target": p.target,
                    "tokens": p.tokens,
                    "bound": p.bound,
                    "segments": p.segments,
                    "layers": _per_layer(p, self.layers),
                }
                for p in self.pairs
            ],
            "context_free": self._context_free_dict() if self.segments else None,
            "claims": [
                {
                    "paper": c.paper,
                    "statement": c.statement,
                    "holds": c.holds,
                    "measured": c.measured,
                    "detail": c.detail,
                    "quantity": c.quantity,
                }
                for c in self.claims()
            ],
        }

    def _context_free_dict(self) -> dict:
        layer_means, spectra = _layer_records(self.context_free_means(), _layer_spectra(self.segments, self.layers))
        return {
            "quantity": CONTEXT_FREE_QUANTITY,
            "metrics": CONTEXT_FREE_METRICS,
            "layer_means": layer_means,
            "spectra": spectra,
            "segments": [
                {
                    "trajectory": r.trajectory,
                    "agent": r.agent,
                    "segment": r.segment,
                    "start": r.start,
                    "tokens": r.tokens,
                    "bound": r.bound,
                    "layers": _per_layer(r, self.layers),
                }
                for r in self.segments
            ],
        }


def _per_layer(result: PairResult | SegmentResult, layers: Sequence[int]) -> list[dict]:
    return [{"layer": layer, **{kv: _rounded(result.layers[layer][kv].values) for kv in KV_NAMES}} for layer in layers]


# ------------------------------------------------------------------------------------------------- driver


def select_agents(trace: Trace, names: Sequence[str] | None) -> list[str]:
    """The agents to compare, in the trace's order; refuses unknown names and fewer than two agents."""
    declared = trace.header.agent_names
    if names:
        unknown = [name for name in names if name not in declared]
        if unknown:
            raise KvprofError(
                f"--agents names {', '.join(map(repr, unknown))}, which the trace does not have; "
                f"its agents are {', '.join(declared)}."
            )
        chosen = [name for name in declared if name in names]
    else:
        chosen = list(declared)
    if len(chosen) < 2:
        raise KvprofError(
            f"rank analysis compares agent pairs, but only {', '.join(chosen) or 'no agent'} is "
            "selected; pass a trace with two or more agents (and --agents with at least two names)."
        )
    return chosen


def _context_free_records(
    agents: AgentSet,
    traj: Trajectory,
    spans: Sequence[PairSpan],
    sequences: dict[str, AgentSequence],
    captures: dict[str, TurnCapture],
    layers: Sequence[int],
    ropes: LayerRopes,
    per_head: bool,
    columns: int,
) -> list[SegmentResult]:
    """One `SegmentResult` per captured agent and segment of its pair spans, in order; `columns` per matrix."""
    rows: dict[tuple[str, str], tuple[int, int]] = {}
    for name in captures:
        held = {seg for span in spans if name in (span.source, span.target) for seg in span.segments}
        for seg in sorted(held, key=sequences[name].spans.__getitem__):
            rows[name, seg] = sequences[name].spans[seg]
    lengths: dict[str, int] = {}
    for (_, seg), (start, stop) in rows.items():
        lengths[seg] = max(lengths.get(seg, 0), stop - start)
    references = reference_captures(agents, traj, lengths, layers)
    return [
        SegmentResult(
            trajectory=traj.id,
            agent=name,
            segment=seg,
            start=start,
            tokens=stop - start,
            bound=min(stop - start, columns),
            layers={
                layer: compare_reference(
                    captures[name],
                    references[seg],
                    start,
                    stop - start,
                    layer,
                    ropes[layer],
                    per_head,
                    agents.base_model.dtype,
                )
                for layer in layers
            },
        )
        for (name, seg), (start, stop) in rows.items()
    ]


def _shared_spans(traj: Trajectory, agent_names: Sequence[str], sequences: dict[str, AgentSequence]) -> list[PairSpan]:
    """The non-empty shared span of every agent pair (i before j in `agent_names`) that both act in `traj`."""
    spans = []
    for i, source in enumerate(agent_names):
        for target in agent_names[i + 1 :]:
            if source in sequences and target in sequences:
                span = pair_span(traj, sequences[source], sequences[target])
                if len(span):
                    spans.append(span)
    return spans


def _pair_result(
    agents: AgentSet,
    traj: Trajectory,
    span: PairSpan,
    captures: dict[str, TurnCapture],
    layers: Sequence[int],
    per_head: bool,
    columns: int,
) -> PairResult:
    """One pair's comparison on its shared span, per layer, from the two agents' captures."""
    return PairResult(
        trajectory=traj.id,
        source=span.source,
        target=span.target,
        tokens=len(span),
        bound=min(len(span), columns),
        segments=span.segments,
        layers={
            layer: compare_pair(
                captures[span.source],
                captures[span.target],
                span,
                layer,
                agents.ropes[layer],
                per_head,
                agents.base_model.dtype,
            )
            for layer in layers
        },
    )


def analyze_trace(
    agents: AgentSet,
    trace: Trace,
    agent_names: Sequence[str],
    layers: Sequence[int],
    max_tokens: int | None = None,
    per_head: bool = False,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> RankAnalysis:
    """Capture every selected agent on each trajectory and compare all pairs on their spans (`layers` resolved);
    `KvprofError` if no pair shares a segment."""
    mode = trace.header.mode
    shapes = [agents.cache_shapes[layer] for layer in layers]
    heads = max(shape[0] for shape in shapes)
    dim = max(max(shape[1:]) for shape in shapes)  # an MLA model's latent (V) is wider than its RoPE key (K)
    result = RankAnalysis(
        mode=mode,
        agents=list(agent_names),
        layers=list(layers),
        per_head=per_head,
        head_dim=dim,
        kv_heads=heads,
    )
    ropes = agents.ropes
    parts = ("kv", "split") if mode == "lora" else ("kv",)
    columns = dim if per_head else dim * heads
    for traj in trace.trajectories:
        # Agents that never act in this trajectory hold nothing there and are left out.
        sequences = {
            name: sequence for name in agent_names if (sequence := agent_sequence(traj, name, max_tokens)) is not None
        }
        spans = _shared_spans(traj, agent_names, sequences)
        if spans:
            needed = {span.source for span in spans} | {span.target for span in spans}
            captures = {
                name: capture_turn(agents, name, sequences[name].tokens, layers=layers, parts=parts)
                for name in agent_names
                if name in needed
            }
            result.pairs += [_pair_result(agents, traj, span, captures, layers, per_head, columns) for span in spans]
            if mode == "prompt":
                result.segments += _context_free_records(
                    agents, traj, spans, sequences, captures, layers, ropes, per_head, columns
                )
        if on_trajectory:
            on_trajectory(traj)
    if not result.pairs:
        raise KvprofError(
            f"no shared segment is held by two of the agents {', '.join(agent_names)} in any trajectory "
            "of this trace, so there is nothing to compare; pass a trace whose agents read common "
            "context (segments with scope 'shared')."
        )
    return result
