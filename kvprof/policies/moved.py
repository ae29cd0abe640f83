"""Moved spans: K/V a turn reads at other positions than an earlier turn computed them, and how a policy serves them.

A policy that `moves_spans` keeps each source turn's K/V (`SpanStore`) and serves a moved span re-aligned: keys
re-rotated to the reader's positions (`kvprof.model.rope.rotate_keys`), values as they are. `extend_over_moved` runs
a turn past its kept prefix span by span, so with the dense run's K/V it is exactly the model's full forward
(causal attention). Concepts: docs/design.md#concepts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvprof.model.runtime import KV, ChunkForward, Runtime
from kvprof.traces.reuse import MovedSpan


@dataclass
class KeptSequence:
    """Tokens [lo, hi) of one turn's cache: per layer (K, V) (1, H_kv, hi − lo, D) at positions `prefix_len` + lo..;
    `inputs`: its shared input's length. Low-rank policies: base cache in `kv`, position-free LR caches in
    `low_rank` (name → per layer {"key"|"value": (1, hi − lo, r)})."""

    lo: int
    hi: int
    prefix_len: int
    kv: list[KV]
    agent: str = ""
    inputs: int = 0
    low_rank: dict[str, list[dict[str, torch.Tensor]]] = field(default_factory=dict)


class SpanStore:
    """What a policy keeps of earlier turns of the trajectory for moved spans: per source turn a `KeptSequence`."""

    def __init__(self) -> None:
        self.turns: dict[int, KeptSequence] = {}

    def keep(
        self,
        turn: int,
        prefix_len: int,
        kv: Sequence[KV],
        lo: int,
        hi: int,
        agent: str = "",
        inputs: int = 0,
        low_rank: dict[str, list[dict[str, torch.Tensor]]] | None = None,
    ) -> None:
        """Copy tokens [lo, hi) of turn `turn` from `kv` (per layer (B, H_kv, ≥ prefix_len + hi, D), row 0) and
        `low_rank` (name → per layer {"key"|"value": (1, ≥ hi, r)})."""
        begin, end = prefix_len + lo, prefix_len + hi
        self.turns[turn] = KeptSequence(
            lo,
            hi,
            prefix_len,
            [(k[:1, :, begin:end].clone(), v[:1, :, begin:end].clone()) for k, v in kv],
            agent,
            inputs,
            {
                name: [{side: t[:, lo:hi].clone() for side, t in layer.items()} for layer in layers]
                for name, layers in (low_rank or {}).items()
            },
        )

    def source(self, span: MovedSpan) -> KeptSequence:
        """What was kept of the turn `span` comes from."""
        return self.turns[span.source]

    def _kept(self, span: MovedSpan) -> tuple[KeptSequence, int, int]:
        """What was kept of `span`'s source turn, and where `span` lies in it ([start, end) of its kept tokens)."""
        kept = self.turns[span.source]
        start = span.source_begin - kept.lo
        return kept, start, start + len(span)

    def span(self, span: MovedSpan) -> tuple[list[KV], int]:
        """The kept K/V of `span` (per layer (1, H_kv, len(span), D)) and its first token's source position."""
        kept, start, end = self._kept(span)
        return [(k[:, :, start:end], v[:, :, start:end]) for k, v in kept.kv], kept.prefix_len + span.source_begin

    def low_rank(self, span: MovedSpan) -> dict[str, list[dict[str, torch.Tensor]]]:
        """The kept LR caches of `span`: name → per layer {"key"|"value": (1, len(span), r)}."""
        kept, start, end = self._kept(span)
        return {
            name: [{side: t[:, start:end] for side, t in layer.items()} for layer in layers]
            for name, layers in kept.low_rank.items()
        }

    def low_rank_tensors(self) -> list[torch.Tensor]:
        return [
            t
            for kept in self.turns.values()
            for layers in kept.low_rank.values()
            for layer in layers
            for t in layer.values()
        ]

    def tensors(self) -> list[torch.Tensor]:
        return [t for kept in self.turns.values() for pair in kept.kv for t in pair] + self.low_rank_tensors()

    def tokens(self) -> int:
        return sum(kept.hi - kept.lo for kept in self.turns.values())


@dataclass
class Extension:
    """What `extend_over_moved` did: tokens `covered` past the context, `moved` from kept K/V (`spans`), `computed`
    by the agent (or left as `placeholders`), and the FLOPs."""

    covered: int = 0
    moved: int = 0
    computed: int = 0
    flops: float = 0.0
    spans: list[tuple[int, int]] = field(default_factory=list)
    placeholders: list[tuple[int, int]] = field(default_factory=list)


SpanKV = Callable[[MovedSpan, int], tuple[list[KV], float]]
"""The K/V a moved span is served from at the reader's position (per layer (B, H_kv, len(span), D)) and their FLOPs."""
PieceForward = Callable[[list[int], object, int], ChunkForward]
"""A forward of new tokens at a position over a cache (a policy's own: its adapter rows, its attention context)."""


def extend_over_moved(
    runtime: Runtime,
    agent: str,
    shared: list[int],
    cache,
    reused: int,
    spans: Sequence[MovedSpan],
    store: SpanStore,
    placeholders: bool = False,
    on_piece: Callable[[int, ChunkForward], None] | None = None,
    span_kv: SpanKV | None = None,
    forward: PieceForward | None = None,
) -> Extension:
    """Extend `cache` (a `BufferCache`: prefix + `reused` tokens) over `spans` in order: new tokens before each
    computed by `agent`, then the span's kept K/V appended, keys re-rotated; the rest of the input is the chunk.

    `placeholders`: zeros instead of new tokens, for the policy to recompute (CacheBlend); `on_piece(begin,
    forward)`: sees each forward of new tokens (hidden states captured); `span_kv`: serves spans otherwise (low-rank
    store); `forward`: the policy's own forward (batch rows; FLOPs count each row)."""
    prefix_len = len(runtime.prefix(agent))
    done = Extension()
    position = reused
    for span in spans:
        if span.begin < position:
            continue
        if span.begin > position and placeholders:
            for layer in cache.layers:
                count = span.begin - position
                layer.append(*(t.new_zeros((*t.shape[:2], count, t.shape[-1])) for t in (layer.keys, layer.values)))
            done.placeholders.append((position, span.begin))
        elif span.begin > position:
            piece, start = shared[position : span.begin], prefix_len + position
            if forward is None:
                out = runtime.forward(agent, piece, cache, start, capture=on_piece is not None, last_logits_only=True)
            else:
                out = forward(piece, cache, start)
            if on_piece is not None:
                on_piece(position, out)
            done.flops += out.logits.shape[0] * runtime.flops(len(piece), start)
            done.computed += len(piece)
        kv, flops = (span_kv or store_span_kv(runtime, store))(span, prefix_len + span.begin)
        for layer, (keys, values) in zip(cache.layers, kv):
            layer.append(keys, values)
        done.flops += flops
        done.moved += len(span)
        done.spans.append((span.begin, span.end))
        position = span.end
    done.covered = position - reused
    return done


def store_span_kv(runtime: Runtime, store: SpanStore) -> SpanKV:
    """Moved spans from their source turns' K/V (`store`), keys re-rotated by reader − source position."""

    def kv_at(span: MovedSpan, position: int) -> tuple[list[KV], float]:
        kv, source = store.span(span)
        delta = position - source
        if not delta:
            return kv, 0.0
        rotated = runtime.ropes.rotate_kv(kv, delta)
        return rotated, 6.0 * sum(keys.numel() for keys, _ in rotated)

    return kv_at
