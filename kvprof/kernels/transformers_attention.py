"""Flash-LoRA-Attention as a transformers attention implementation, "kvprof_lora".

Attends like "sdpa" (chunks after a cache through `kvprof.kernels.chunk_attention`) until a `LoraAttentionContext` is
active; then each layer with an entry attends over V = V_base + V_lr·B (LRAgent, arXiv:2602.01053), V_base from the
model's cache, V_lr and B from the context — how the low-rank policies attend with `--lora-attention`. V_lr must
cover every key attended: (B, Lk, r) or (B, H_kv, Lk, r), Lk = cached + new. The mask function is `chunk_mask`. The
name avoids "flash", which transformers reserves for FlashAttention variants.

    register_lora_attention()
    model.set_attn_implementation(LORA_ATTENTION)
    with use_lora_attention(LoraAttentionContext({layer: LoraValues(v_lr, lora_b), ...})):
        logits = model(input_ids, past_key_values=cache).logits
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from kvprof.errors import KvprofError
from kvprof.kernels.attention import flash_lora_attention
from kvprof.kernels.chunk_attention import chunk_attention, chunk_mask, scattered_attention

LORA_ATTENTION = "kvprof_lora"


@dataclass(frozen=True)
class LoraValues:
    """The rank-r side of one layer's values: v_lr (B, Lk, r) or (B, H_kv, Lk, r); lora_b (H_kv, r, D), scaled."""

    v_lr: torch.Tensor
    lora_b: torch.Tensor


@dataclass
class LoraAttentionContext:
    """Rank-r value inputs per decoder layer, keyed by `module.layer_idx`; layers without an entry use sdpa."""

    layers: dict[int, LoraValues] = field(default_factory=dict)

    def set(self, layer_idx: int, v_lr: torch.Tensor, lora_b: torch.Tensor) -> None:
        self.layers[layer_idx] = LoraValues(v_lr, lora_b)

    def get(self, layer_idx: int) -> LoraValues | None:
        return self.layers.get(layer_idx)


_stored_value_calls = 0  # layer calls that attended rank-r values as stored, in this process


def stored_value_calls() -> int:
    """How many "kvprof_lora" layer calls attended rank-r values as stored (a replay compares before and after)."""
    return _stored_value_calls


_active_context: contextvars.ContextVar[LoraAttentionContext | None] = contextvars.ContextVar(
    "kvprof_lora_attention_context", default=None
)


_scattered_positions: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "kvprof_scattered_positions", default=None
)


@contextlib.contextmanager
def scattered_queries(positions: torch.Tensor) -> Iterator[None]:
    """Inside, unmasked "kvprof_lora" calls attend queries at `positions` (Lq,) causally (`scattered_attention`)."""
    token = _scattered_positions.set(positions)
    try:
        yield
    finally:
        _scattered_positions.reset(token)


@contextlib.contextmanager
def use_lora_attention(context: LoraAttentionContext) -> Iterator[LoraAttentionContext]:
    """Make `context` the one "kvprof_lora" layers read, for the duration of the `with` block."""
    token = _active_context.set(context)
    try:
        yield context
    finally:
        _active_context.reset(token)


def lora_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, H_q, Lq, D), key/value (B, H_kv, Lk, D) → (B, Lq, H_q, D).

    No context entry: sdpa, unmasked chunks through `chunk_attention` (`scattered_attention` in `scattered_queries`).
    An entry: Flash-LoRA-Attention over value + V_lr·B (a mask replaces causality; none: bottom-right, Lq = 1 full)."""
    context = _active_context.get()
    lora = context.get(module.layer_idx) if context is not None else None
    q_len, kv_len = query.shape[2], key.shape[2]
    plain = not dropout and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    if lora is None:
        positions = _scattered_positions.get()
        if attention_mask is None and positions is not None and plain:
            return scattered_attention(query, key, value, positions, scaling).transpose(1, 2).contiguous(), None
        if attention_mask is None and 1 < q_len < kv_len and plain and getattr(module, "is_causal", True):
            return chunk_attention(query, key, value, scaling).transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise KvprofError(f"attention dropout {dropout} is not supported by {LORA_ATTENTION!r}; call model.eval().")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise KvprofError(
            f"{LORA_ATTENTION!r} supports neither logit soft-capping nor position biases; load this "
            "model with attn_implementation='sdpa' instead."
        )
    v_lr, lora_b = lora.v_lr, lora.lora_b
    if v_lr.shape[-2] != kv_len:
        raise KvprofError(
            f"layer {module.layer_idx} attends {kv_len} keys but its V_lr covers {v_lr.shape[-2]}; "
            "give the context the LR cache of every cached and new token."
        )
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    global _stored_value_calls
    _stored_value_calls += 1
    out = flash_lora_attention(query, key, value, v_lr, lora_b, scale=scaling, causal=causal, attn_mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None


def register_lora_attention() -> str:
    """Register "kvprof_lora" (attention and `chunk_mask`) with transformers; idempotent. Returns the name."""
    if AttentionInterface._global_mapping.get(LORA_ATTENTION) is not lora_attention_forward:
        AttentionInterface.register(LORA_ATTENTION, lora_attention_forward)
    if AttentionMaskInterface._global_mapping.get(LORA_ATTENTION) is not chunk_mask:
        AttentionMaskInterface.register(LORA_ATTENTION, chunk_mask)
    return LORA_ATTENTION
