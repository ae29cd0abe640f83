"""What passes between the turn loop and a policy: the request, the context a policy assembles (`Context`), the
chunk computed over it, the prefill and decode steps' outputs and the turn's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from kvprof.kernels.transformers_attention import LoraAttentionContext, LoraValues
from kvprof.model.buffers import KVBuffer, Rewrite
from kvprof.model.runtime import KV, ChunkForward
from kvprof.traces.reuse import MovedSpan


@dataclass
class TurnRequest:
    """One agent call: its input ids; `output_ids` teacher-forces the output, None generates it greedily; `moved`:
    the moved spans of its shared input (`kvprof.replay.branches`), which a policy that `moves_spans` serves from the
    K/V it kept (`kvprof.policies.moved`)."""

    agent: str
    input_ids: list[int]
    output_ids: list[int] | None = None
    max_new_tokens: int = 32
    moved: tuple[MovedSpan, ...] = ()


@dataclass
class Context:
    """The cache a policy hands the acting agent before its chunk.

    kv: per layer (K, V), each (B, H_kv, len(prefix) + reused, D); B is 1, or 2 for a double-batched policy.
    reused: shared tokens served from stored caches (which of them another agent processed is the replay engine's
    count, one definition for every policy: `kvprof.replay.metrics.reused_from_others`); adapter_free: of the reused
    tokens, those served from an adapter-free cache. extra_prefill: tokens pushed through the full backbone besides
    the chunk; extra_flops: analytic FLOPs of the policy's own work in `assemble` (LR prefill, expansions,
    rotations). working_bytes: bytes of transient structures the policy's own work holds during the turn beyond
    the turn's cache (e.g. an LR prefill's cache and hidden states).
    lora_values: per layer the rank-r value side (v_lr (1, reused − refreshed, r), B (H_kv, r, D)) when the values
    in `kv` are V_base only and attention must add (P·V_lr)·B (Flash-LoRA-Attention); None when `kv` is complete.
    buffers: the storage `kv` are views of (per layer a `KVBuffer`), when the turn may append in place after them
    (whatever lies past `kv`'s length there is scratch the policy will overwrite or not read); None: the turn
    copies `kv` into fresh buffers.
    recomputed: (token, layer) K/V entries of the reused span the policy recomputed for this agent in `assemble`
    (selective recompute, `kvprof.policies.selective`); reused × layers of them means all of it. realigned: reused
    tokens whose keys were re-rotated from the positions another agent computed them at (prompt mode).
    corrected / fallback: tokens of other agents' segments read this turn that a delta-correction gate accepted
    (served corrected) / refused (prefilled densely) (`kvprof.policies.delta`); from_others: when not None, the
    reused tokens whose K/V came from another agent's computation, for a policy whose reused span also holds tokens
    the agent computed itself (otherwise the replay counts them from the timeline, `reused_from_others`);
    corrected_spans: (start, end, hop) of each corrected segment in shared-timeline coordinates, hop = 1 + how many
    agents besides its producer read it before this one (the replay measures the error per hop).
    extended / moved / moved_spans / placeholders: shared tokens the context covers past the reused span, span by
    span (`kvprof.policies.moved.extend_over_moved`): of them `moved` served from the K/V kept of earlier turns,
    re-aligned (their (begin, end) in `moved_spans`), the rest computed by the agent in `assemble` (in
    `extra_prefill`; `placeholders`: the (begin, end) of those the policy computes itself, with the moved spans);
    `kv` then covers prefix + reused + extended tokens.
    refreshed / rewrite: the last `refreshed` tokens of the reused span go through the turn's forward with the
    chunk (their queries, hidden states and everything after attention computed there), while the K/V they and
    the chunk attend to at their slots are what `rewrite` writes over the forward's own once each layer has
    projected them (`kvprof.model.buffers.Rewrite`; BaseShared's LR prefill as LRAgent's code runs it); `kv` then
    covers only the first reused − refreshed tokens, and `extra_prefill` / `extra_flops` count the refreshed
    tokens' pass.
    adapter_made: of the tokens the turn prefills, those an earlier call computed with its Activated LoRA (from its
    invocation on) that this one recomputes with the base weights (`kvprof.policies.alorashared`).
    A policy that carries work to `commit` subclasses this with typed fields.
    """

    kv: list[KV]
    reused: int
    adapter_free: int = 0
    extra_prefill: int = 0
    extra_flops: float = 0.0
    working_bytes: int = 0
    lora_values: list[LoraValues | None] | None = None
    buffers: list[KVBuffer] | None = None
    recomputed: int = 0
    realigned: int = 0
    corrected: int = 0
    fallback: int = 0
    from_others: int | None = None
    corrected_spans: list[tuple[int, int, int]] = field(default_factory=list)
    refreshed: int = 0
    rewrite: Rewrite | None = None
    extended: int = 0
    moved: int = 0
    moved_spans: list[tuple[int, int]] = field(default_factory=list)
    placeholders: list[tuple[int, int]] = field(default_factory=list)
    adapter_made: int = 0

    @property
    def covered(self) -> int:
        """Shared tokens the context covers (reused, then extended over moved spans); the chunk follows them."""
        return self.reused + self.extended


ContextT = TypeVar("ContextT", bound=Context)


@dataclass
class Chunk(Generic[ContextT]):
    """What the acting agent computed this turn, handed to `commit`.

    start: the shared-timeline index of the chunk's first token; ids: chunk input tokens then all output tokens;
    kv: per layer the (K, V) of the agent's whole sequence after the turn, (B, H_kv, len(prefix) + start + n, D);
    context: the `Context` the turn ran on (a policy's own subclass carries its prefill and decode work);
    buffers: per layer the `KVBuffer` `kv` are views of (`context.buffers` when the turn appended in place), which
    a policy may keep as its storage.
    """

    agent: str
    start: int
    ids: list[int]
    kv: list[KV]
    context: ContextT
    buffers: list[KVBuffer]


@dataclass
class TurnResult:
    """One policy's account of one turn.

    logits: (n_out, vocab) fp32, row j predicting output token j; input_kv: per layer (K, V), (H_kv, T_in, D),
    what the agent attended to over its whole input; reused span = input positions
    [prefix_len, prefix_len + reused). flops: analytic FLOPs of the whole turn, every batch row counted;
    ttft_flops: those of the prefill phase (context, chunk forward, prefill-phase work). decode_s / decode_steps:
    time and count of the decode forwards (one per output token). memory: analytic bytes of each stored structure
    after the turn; stored_before_bytes: their sum before it; transient_bytes: the turn's working set (its cache,
    captured hidden states, the policy's own transients); cuda_peak_bytes: on CUDA, the allocator's peak during the
    turn above what was allocated before it, plus the policy's stored bytes; cuda_allocated_bytes: on CUDA,
    `torch.cuda.max_memory_allocated` during the turn, everything the process holds included (weights, other
    runs' caches) (both None elsewhere). recomputed,
    realigned, corrected, fallback, from_others, corrected_spans, moved, moved_spans, extended, adapter_made: the
    context's (`Context`);
    moved tokens are reused too, at input positions prefix_len + begin.. of each moved span.
    """

    agent: str
    output_ids: list[int]
    logits: torch.Tensor
    input_kv: list[KV]
    prefix_len: int
    reused: int
    adapter_free: int
    prefilled: int
    flops: float
    ttft_flops: float
    ttft_s: float
    decode_s: float
    decode_steps: int
    latency_s: float
    memory: dict[str, int] = field(default_factory=dict)
    stored_before_bytes: int = 0
    transient_bytes: int = 0
    cuda_peak_bytes: int | None = None
    cuda_allocated_bytes: int | None = None
    recomputed: int = 0
    realigned: int = 0
    corrected: int = 0
    fallback: int = 0
    from_others: int | None = None
    corrected_spans: list[tuple[int, int, int]] = field(default_factory=list)
    moved: int = 0
    moved_spans: list[tuple[int, int]] = field(default_factory=list)
    extended: int = 0
    adapter_made: int = 0


@dataclass
class Prefill(Generic[ContextT]):
    """The timed first step of a turn: the policy's context and the forward of the chunk over it (TTFT).

    input_kv: per layer (K, V), (H_kv, T_in, D), of row 0 over the whole input, taken before decoding appends to
    the forward's cache; start: the position of the chunk's first token; flops: the FLOPs of `on_prefill`.
    """

    context: ContextT
    forward: ChunkForward
    input_kv: list[KV]
    start: int
    seconds: float
    flops: float


@dataclass
class Decoded:
    """The output tokens of a turn: ids, logits (n_out, vocab) fp32, the last forward (its cache holds the whole
    sequence), the decode time of `steps` forwards (one per output token) and the FLOPs of the per-step work."""

    output_ids: list[int]
    logits: torch.Tensor
    last: ChunkForward
    seconds: float
    steps: int
    flops: float


def attended_kv(kv: list[KV], context: Context, prefix_len: int) -> list[KV]:
    """Per layer (K, V), (H_kv, T_in, D), of batch row 0 as attention effectively uses them: under
    Flash-LoRA-Attention the cache holds V_base on the tokens v_lr covers and attention adds (P·V_lr)·B, so the
    values measured there are V_base + V_lr·B (formed in float32, returned in the cache's dtype) — the same values the
    expanded path caches. For metrics only: outside the timed prefill."""
    rows = [(keys[0], values[0]) for keys, values in kv]
    if context.lora_values is None:
        return rows
    for layer, entry in enumerate(context.lora_values):
        if entry is None:
            continue
        span = slice(prefix_len, prefix_len + entry.v_lr.shape[1])
        keys, values = rows[layer]
        low_rank = torch.einsum("lr,hrd->hld", entry.v_lr[0].float(), entry.lora_b.float())
        values = values.clone()
        values[:, span] = (values[:, span].float() + low_rank).to(values.dtype)
        rows[layer] = (keys, values)
    return rows


def lora_context(values: list[LoraValues | None], rows: int, keys: int) -> LoraAttentionContext:
    """Flash-LoRA-Attention inputs for a forward attending `keys` keys: each layer's v_lr covers the reused
    context and is zero for the tokens after it (their values are complete); batch rows after the first (an
    adapter-free row) get zeros too."""
    context = LoraAttentionContext()
    for layer, entry in enumerate(values):
        if entry is None:
            continue
        v_lr = torch.zeros(rows, keys, entry.v_lr.shape[-1], dtype=entry.v_lr.dtype, device=entry.v_lr.device)
        v_lr[:1, : entry.v_lr.shape[1]] = entry.v_lr
        context.set(layer, v_lr, entry.lora_b)
    return context
