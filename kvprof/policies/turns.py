"""What passes between the turn loop and a policy: the request, the context a policy assembles (`Context`), the
chunk computed over it, the prefill and decode steps' outputs and the turn's result."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import torch

from kvprof.kernels.transformers_attention import LoraAttentionContext, LoraValues
from kvprof.model.buffers import HEADROOM, KVBuffer, Rewrite
from kvprof.model.recurrent import StateBuffer
from kvprof.model.runtime import KV, ChunkForward
from kvprof.traces.reuse import MovedSpan


@dataclass
class TurnRequest:
    """One agent call: input ids, `output_ids` to teacher-force (None: greedy), `moved` spans
    (`kvprof.replay.branches`) a `moves_spans` policy serves (`kvprof.policies.moved`)."""

    agent: str
    input_ids: list[int]
    output_ids: list[int] | None = None
    max_new_tokens: int = 32
    moved: tuple[MovedSpan, ...] = ()
    boundaries: frozenset[int] = frozenset()  # message boundaries of input + output, from the sequence's start


@dataclass(kw_only=True)
class ReuseCounts:
    """How a turn's context was made, which the turn's result reports as the context counted it.

    recomputed: (token, layer) entries recomputed in `assemble` (`kvprof.policies.selective`; reused × layers: all);
    realigned: reused tokens whose keys were re-rotated.
    corrected / fallback: tokens of others' segments a delta gate accepted / refused (`kvprof.policies.delta`);
    from_others: reused tokens from another agent's computation, when the policy counts them itself;
    corrected_spans: (start, end, hop) per corrected segment, hop = 1 + earlier readers besides the producer.
    extended / moved / moved_spans: tokens covered past the reused span (`extend_over_moved`), `moved` of them served
    re-aligned (at `moved_spans`).
    adapter_made: prefilled tokens an earlier aLoRA call computed with its adapter, recomputed with the base weights.
    """

    recomputed: int = 0
    realigned: int = 0
    corrected: int = 0
    fallback: int = 0
    from_others: int | None = None
    corrected_spans: list[tuple[int, int, int]] = field(default_factory=list)
    extended: int = 0
    moved: int = 0
    moved_spans: list[tuple[int, int]] = field(default_factory=list)
    adapter_made: int = 0


def reuse_counts(context: ReuseCounts) -> dict:
    """The `ReuseCounts` fields of `context`, to hand on to the turn's result."""
    return {item.name: getattr(context, item.name) for item in fields(ReuseCounts)}


@dataclass
class Context(ReuseCounts):
    """The cache a policy hands the acting agent before its chunk (a policy carrying work to `commit` subclasses it).

    kv: per layer (K, V), each (B, H_kv, len(prefix) + reused, D); B is 1, or 2 double-batched.
    reused: shared tokens served from stored caches (`kvprof.replay.metrics.reused_from_others` counts others' share);
    adapter_free: those from an adapter-free cache. extra_prefill / extra_flops: tokens through the backbone besides the
    chunk, and the analytic FLOPs of `assemble`'s own work; working_bytes: its transients beyond the turn's cache.
    lora_values: per layer (v_lr (1, reused − refreshed, r), B (H_kv, r, D)) when `kv` holds V_base only
    (Flash-LoRA-Attention adds (P·V_lr)·B); None when `kv` is complete. padded_lora: `lora_context`'s zero-padded
    v_lr per layer, kept across the turn's forwards.
    buffers: the `KVBuffer`s `kv` views, when the turn may append in place (past `kv`'s length: scratch); None: copied.
    placeholders: tokens past the reused span neither moved nor computed in `assemble` (`extra_prefill`).
    The `ReuseCounts` say how the context was made.
    refreshed / rewrite: the last `refreshed` reused tokens go through the turn's forward with the chunk, their K/V
    replaced per layer by `rewrite` (`kvprof.model.buffers.Rewrite`; BaseShared's `lr_prefill=code`); `kv` covers the
    first reused − refreshed tokens.
    adapter_made: prefilled tokens an earlier aLoRA call computed with its adapter, recomputed with the base weights.
    state_marks / kept_states: on a hybrid, the positions (tokens from the sequence's start, private prefix
    included) after which the turn keeps its recurrent states (`kvprof.policies.state_checkpoints`), and the states
    kept there by the turn's forwards (position → layer → `StateBuffer`).
    """

    kv: list[KV]
    reused: int
    adapter_free: int = 0
    extra_prefill: int = 0
    extra_flops: float = 0.0
    working_bytes: int = 0
    lora_values: list[LoraValues | None] | None = None
    buffers: list[KVBuffer] | None = None
    refreshed: int = 0
    rewrite: Rewrite | None = None
    placeholders: list[tuple[int, int]] = field(default_factory=list)
    padded_lora: dict[int, torch.Tensor] = field(default_factory=dict)
    state_marks: frozenset[int] = frozenset()
    kept_states: dict[int, dict[int, StateBuffer]] = field(default_factory=dict)

    @property
    def covered(self) -> int:
        """Shared tokens the context covers (reused, then extended over moved spans); the chunk follows them."""
        return self.reused + self.extended


ContextT = TypeVar("ContextT", bound=Context)


@dataclass
class Chunk(Generic[ContextT]):
    """What the acting agent computed this turn, handed to `commit`.

    start: timeline index of the chunk's first token; ids: chunk then output tokens; kv: per layer (K, V)
    (B, H_kv, len(prefix) + start + n, D) of the whole sequence; context: the turn's `Context`; buffers: the `KVBuffer`s
    `kv` views, which a policy may keep.
    """

    agent: str
    start: int
    ids: list[int]
    kv: list[KV]
    context: ContextT
    buffers: list[KVBuffer]


@dataclass
class TurnResult(ReuseCounts):
    """One policy's account of one turn.

    logits: (n_out, vocab) fp32, row j predicting output j; input_kv: per layer (K, V) (H_kv, T_in, D) attended over the
    input, reused span [prefix_len, prefix_len + reused) plus moved spans at prefix_len + begin..; flops / ttft_flops:
    the turn's analytic FLOPs (every batch row) and its prefill phase's; decode_s / decode_steps: decode time and
    forwards; memory: bytes per stored structure after the turn, stored_before_bytes their sum before; transient_bytes:
    the turn's working set; cuda_peak_bytes: the allocator's peak above the turn's start plus stored bytes;
    cuda_allocated_bytes: `torch.cuda.max_memory_allocated` over the turn, everything included (both None off CUDA).
    The `ReuseCounts` are the `Context`'s.
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

    @property
    def working_peak_bytes(self) -> int:
        """The turn's analytic working peak: the stores before it plus its transients, or the stores after it."""
        return max(self.stored_before_bytes + self.transient_bytes, sum(self.memory.values()))


@dataclass
class Prefill(Generic[ContextT]):
    """The timed first step (TTFT): the policy's context and the chunk's forward.

    input_kv: per layer (K, V) (H_kv, T_in, D) of row 0, before decoding appends; start: the chunk's first position;
    flops: `on_prefill`'s.
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
    """Per layer (K, V) (H_kv, T_in, D) of row 0 as attention uses them: V_base + V_lr·B under
    Flash-LoRA-Attention (float32 sum, cache dtype), as the expanded path caches. Metrics only, untimed."""
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


def lora_context(context: Context, rows: int, keys: int) -> LoraAttentionContext:
    """Flash-LoRA-Attention inputs attending `keys` keys: `context`'s v_lr over the reused context, zero after it
    and for rows after the first ((rows, keys, r) views of `context.padded_lora`, written on the turn's first forward
    with `HEADROOM` slots for its decode steps, and again only if a forward attends more keys)."""
    assert context.lora_values is not None
    attention = LoraAttentionContext()
    for layer, entry in enumerate(context.lora_values):
        if entry is None:
            continue
        padded = context.padded_lora.get(layer)
        if padded is None or padded.shape[0] != rows or padded.shape[1] < keys:
            shape = (rows, keys + HEADROOM, entry.v_lr.shape[-1])
            padded = torch.zeros(shape, dtype=entry.v_lr.dtype, device=entry.v_lr.device)
            padded[:1, : entry.v_lr.shape[1]] = entry.v_lr
            context.padded_lora[layer] = padded
        attention.set(layer, padded[:, :keys], entry.lora_b)
    return attention
