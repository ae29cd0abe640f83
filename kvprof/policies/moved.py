"""Moved spans: K/V a turn reads at other positions than an earlier turn computed them, and how a policy serves them.

A turn's input is a sequence of spans (`kvprof.replay.branches`): the prefix it keeps of the stored timeline, then moved
spans (ids an earlier turn processed elsewhere: the question, a tool result, another agent's reply read after this
agent's role prompt and header) and new tokens between them. A policy that moves caches
(`SharingPolicy.moves_spans`) keeps, of each turn later turns read from, the K/V that turn held (`SpanStore`), and
serves a moved span by re-aligning them: keys re-rotated from the source turn's positions to the reader's with the
model's own rotary embedding (`kvprof.model.rope.rotate_keys`), values as they are. `extend_over_moved` runs the part
of a turn after its kept prefix span by span — new tokens computed by the acting agent over the cache so far, each moved
span's K/V inserted after them — so that, with the dense run's K/V inserted, the turn is exactly the model's full
forward (causal attention: a token's K/V depend on what precedes it only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvprof.model.runtime import KV, ChunkForward, Runtime
from kvprof.traces.reuse import MovedSpan


@dataclass
class KeptSequence:
    """Part of one turn's cache: per layer (K, V), (1, H_kv, hi − lo, D), of its shared sequence's tokens
    [lo, hi), computed at positions `prefix_len` + lo.. (after the acting agent's private prefix); `agent` acted in
    that turn and `inputs` is its shared input's length (the tokens after it are its outputs). A low-rank policy
    keeps its base cache as `kv` and its LR caches of the same tokens as `low_rank` (name → per layer
    {"key"|"value": (1, hi − lo, r)}; position-free)."""

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
        """Keep tokens [lo, hi) of turn `turn`'s shared sequence from its cache `kv` (per layer (K, V),
        (B, H_kv, ≥ prefix_len + hi, D); batch row 0, copied: the cache's storage is reused by later turns); `agent`
        acted in it, its shared input `inputs` tokens long; a low-rank policy's LR caches of the same sequence
        (`low_rank`: name → per layer {"key"|"value": (1, ≥ hi, r)}) copied alike."""
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
        """The kept K/V of `span` (per layer (1, H_kv, len(span), D)) and the position its first token was
        computed at."""
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
    """What `extend_over_moved` did: the shared tokens it covered past the context (`covered`), of which `moved`
    were served from kept K/V (`spans`: their (begin, end)) and `computed` prefilled by the agent (or, with
    placeholders, left for the policy to compute: `placeholders`, their (begin, end)); the FLOPs of those forwards
    and re-rotations."""

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
    """Extend `cache` (the agent's prefix and the first `reused` shared tokens, a `kvprof.model.buffers.BufferCache`
    appending in place) over `spans` (moved spans at or after `reused`, in order): the new tokens before each are
    computed with `agent`'s adapter over the cache so far, then the span's kept K/V (`store`) are appended, keys
    re-rotated by (reader position − source position). Ends after the last span; the rest of the input is the
    turn's chunk. With `placeholders` the new tokens before a span are not computed: zeros hold their slots, for a
    policy that recomputes them with the moved spans (CacheBlend over the whole input). `on_piece(begin, forward)`
    gets each forward of new tokens (shared index of its first token; its attention inputs and residual stream
    captured), for a policy that keeps their hidden states. A policy that serves moved spans otherwise (the
    low-rank store's base and LR caches) gives `span_kv`, and one whose forwards are its own (batch rows, attention
    context) gives `forward`; a forward's FLOPs count each of its batch rows."""
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
    """Moved spans served from the K/V their source turns held (`store`), keys re-rotated by (reader position −
    source position), values as they are."""

    def kv_at(span: MovedSpan, position: int) -> tuple[list[KV], float]:
        kv, source = store.span(span)
        delta = position - source
        if not delta:
            return kv, 0.0
        rotated = runtime.ropes.rotate_kv(kv, delta)
        return rotated, 6.0 * sum(keys.numel() for keys, _ in rotated)

    return kv_at
