"""Chunked prefill over a cache at the speed of a prefill from scratch (why: docs/design.md#kernels-kvprofkernels).

A chunk after a cache is attended as two unmasked passes merged by log-sum-exp,
O = (e^{m₁} O₁ + e^{m₂} O₂) / (e^{m₁} + e^{m₂}): over the cached keys (query heads of a KV group stacked, the cache
read once per KV head) and over the chunk's own keys (causal); equal to masked SDPA to float rounding. `chunk_mask`
returns None exactly for a plain bottom-right causal chunk, so under kvprof's implementation a None mask with
1 < Lq < Lk means that rule. CPU uses `aten._scaled_dot_product_flash_attention_for_cpu` (it returns the LSE); other
devices build the mask and call SDPA. `scattered_attention` does the same for queries at scattered cache positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function, sdpa_mask


def chunk_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """None for a plain bottom-right causal chunk after a cache, else `sdpa_mask`'s (causal skip only at Lq = 1 or
    Lq = Lk)."""
    plain = (
        allow_is_causal_skip
        and mask_function is causal_mask_function
        and local_size is None
        and isinstance(q_offset, int)
        and q_offset + q_length == kv_offset + kv_length
        and (attention_mask is None or bool(attention_mask.all()))
    )
    if plain and 1 < q_length < kv_length:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip and (q_length == 1 or q_length == kv_length),
        **kwargs,
    )


def chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Bottom-right causal attention: query (B, H_q, Lq, D), key (B, H_kv, Lk, D), value (B, H_kv, Lk, D_v),
    Lk > Lq (the last Lq keys the chunk's) → (B, H_q, Lq, D_v)."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    cached = kv_len - q_len
    if query.device.type != "cpu" or value.shape[-1] != head_dim:  # CPU flash attention needs D_v = D (not MLA)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(cached)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    stacked = query.reshape(batch, kv_heads, groups * q_len, head_dim)
    past, past_lse = flash(stacked, key[:, :, :cached], value[:, :, :cached], scale=scale)[:2]
    past = past.reshape(batch, q_heads, q_len, head_dim)
    past_lse = past_lse.reshape(batch, q_heads, q_len)
    own_keys, own_values = key[:, :, cached:], value[:, :, cached:]
    if groups > 1:
        own_keys = own_keys.repeat_interleave(groups, dim=1)
        own_values = own_values.repeat_interleave(groups, dim=1)
    own, own_lse = flash(query, own_keys, own_values, is_causal=True, scale=scale)[:2]
    return merge_by_lse(past, past_lse, own, own_lse).to(query.dtype)


def merge_by_lse(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """Merge outputs (..., L, D) over disjoint keys by their log-sum-exps (..., L), in float32."""
    top = torch.maximum(first_lse, second_lse)
    first_weight = (first_lse - top).exp().unsqueeze(-1)
    second_weight = (second_lse - top).exp().unsqueeze(-1)
    return (first.float() * first_weight + second.float() * second_weight) / (first_weight + second_weight)


SCATTER_BLOCK = 256  # queries per block of `scattered_attention`


def query_blocks(positions: torch.Tensor, block: int = SCATTER_BLOCK) -> list[tuple[int, int, bool]]:
    """`scattered_attention`'s blocks of queries at increasing `positions` (Lq,): (start, end, run). A run of at least
    `block` consecutive positions is one block (run: True, attended as a causal prefill); the other queries go in
    blocks of up to `block` (run: False)."""
    count = int(positions.numel())
    steps = (positions[1:] - positions[:-1]).ne(1).nonzero().flatten().add(1).tolist()
    blocks: list[tuple[int, int, bool]] = []
    pending = 0  # the first query not yet in a block
    for begin, end in zip([0, *steps], [*steps, count]):
        if end - begin < block:
            continue
        blocks += [(lo, min(lo + block, begin), False) for lo in range(pending, begin, block)]
        blocks.append((begin, end, True))
        pending = end
    return blocks + [(lo, min(lo + block, count), False) for lo in range(pending, count, block)]


def scattered_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    block: int = SCATTER_BLOCK,
) -> torch.Tensor:
    """Causal attention of queries at increasing `positions` (Lq,): query (B, H_q, Lq, D), key, value
    (B, H_kv, Lk, D) → (B, H_q, Lq, D). Per block of queries (`query_blocks`), first position lo, last hi: keys
    [0, lo) unmasked, [lo, hi] causal (a run of consecutive positions) or under a small mask, LSE-merged."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    if q_len > 1 and not bool((positions[1:] > positions[:-1]).all()):
        raise ValueError("scattered_attention needs increasing query positions")
    if query.device.type != "cpu" or value.shape[-1] != head_dim:  # CPU flash attention needs D_v = D (not MLA)
        keys = torch.arange(key.shape[2], device=query.device)
        mask = keys[None, :] <= positions[:, None]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = torch.empty_like(query)
    for start, end, run in query_blocks(positions, block):
        count = end - start
        lo, hi = int(positions[start]), int(positions[end - 1])
        near_keys, near_values = key[:, :, lo : hi + 1], value[:, :, lo : hi + 1]
        # the block's queries stacked per KV head (a copy under GQA): for the masked band and the keys before lo
        stacked = None if run and lo == 0 else query[:, :, start:end].reshape(batch, kv_heads, groups * count, head_dim)
        if run:  # queries at lo..hi: a causal prefill over their own keys, K/V heads repeated per query head
            if groups > 1:
                near_keys = near_keys.repeat_interleave(groups, dim=1)
                near_values = near_values.repeat_interleave(groups, dim=1)
            near, near_lse = flash(query[:, :, start:end], near_keys, near_values, is_causal=True, scale=scale)[:2]
        else:
            shown = torch.arange(lo, hi + 1, device=query.device)
            hidden = (shown[None, :] > positions[start:end, None]).repeat(groups, 1)
            near_mask = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device)
            near_mask.masked_fill_(hidden, -math.inf)
            near, near_lse = flash(stacked, near_keys, near_values, attn_mask=near_mask, scale=scale)[:2]
            near = near.reshape(batch, q_heads, count, head_dim)
            near_lse = near_lse.reshape(batch, q_heads, count)
        if lo == 0:
            out[:, :, start:end] = near
            continue
        far, far_lse = flash(stacked, key[:, :, :lo], value[:, :, :lo], scale=scale)[:2]
        far = far.reshape(batch, q_heads, count, head_dim)
        merged = merge_by_lse(far, far_lse.reshape(batch, q_heads, count), near, near_lse)
        out[:, :, start:end] = merged.to(query.dtype)
    return out
