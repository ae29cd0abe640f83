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


def merge_into(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Merge `part` (..., L, D) over other keys, log-sum-exps `part_lse` (..., L), into float32 `out` and `lse` in
    place: out ← out + σ(lse_part − lse)·(part − out), lse ← log(e^lse + e^lse_part)."""
    out.lerp_(part.float(), torch.sigmoid(part_lse - lse).unsqueeze(-1))
    torch.logaddexp(lse, part_lse, out=lse)


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
    out = past.float()
    merge_into(out, past_lse.float(), own, own_lse)
    return out.to(query.dtype)


def scatter_block(count: int, keys: int) -> int:
    """Queries per block of `scattered_attention` for `count` queries among `keys` keys: 320·√(count / keys), 32 to
    512. Fewer blocks make fewer passes and merges, smaller ones compute less of each band under its mask; the best
    block grows as √(count / keys) (on 2 cores, 3k and 17k keys, 2 % to 50 % of them queried: within 10 % of the
    best of 32 to 512 there)."""
    return min(512, max(32, round(320 * math.sqrt(count / keys))))


def query_blocks(positions: torch.Tensor, block: int) -> list[tuple[int, int, bool]]:
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
    block: int | None = None,
) -> torch.Tensor:
    """Causal attention of queries at increasing `positions` (Lq,): query (B, H_q, Lq, D), key, value
    (B, H_kv, Lk, D) → (B, H_q, Lq, D); `block` queries per block (default `scatter_block`).

    On CPU the queries are rows per KV head (query i's g = H_q / H_kv heads at rows i·g ..), so the queries from any
    one on are a view. Per block of queries (`query_blocks`), first position lo, last hi: the block's own band of keys
    [lo, hi] (causal for a run of consecutive positions, else under a small mask); then the keys [lo, lo') up to the
    next block's first position, unmasked, for every later query at once. The keys before the first query are one
    unmasked pass for every query. The unmasked passes, most of the work, see many rows (CPU flash attention tiles
    queries by 256 from 768 rows on, by 64 below: a quarter faster); each row's passes are LSE-merged in float32."""
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

    def as_rows(states: torch.Tensor) -> torch.Tensor:
        """(B, H_q, n, ...) → (B, H_kv, n·g, ...): query i's heads at rows i·g .. i·g + g − 1."""
        tail = states.shape[3:]
        grouped = states.reshape(batch, kv_heads, groups, states.shape[2], *tail).transpose(2, 3)
        return grouped.reshape(batch, kv_heads, states.shape[2] * groups, *tail)

    rows = as_rows(query)
    out = torch.empty(rows.shape, dtype=torch.float32, device=query.device)
    lse = torch.empty(rows.shape[:3], dtype=torch.float32, device=query.device)
    row_positions = positions.repeat_interleave(groups)

    def attend(taken: slice, keys_from: int, part: torch.Tensor, part_lse: torch.Tensor) -> None:
        """Rows `taken` attended keys from `keys_from` on in `part`: their first keys at 0, else LSE-merged."""
        if keys_from == 0:
            out[:, :, taken], lse[:, :, taken] = part, part_lse
        else:
            merge_into(out[:, :, taken], lse[:, :, taken], part, part_lse)

    first = int(positions[0])
    if first:
        attend(slice(None), 0, *flash(rows, key[:, :, :first], value[:, :, :first], scale=scale)[:2])
    for start, end, run in query_blocks(positions, block or scatter_block(q_len, key.shape[2])):
        lo, hi = int(positions[start]), int(positions[end - 1])
        band_keys, band_values = key[:, :, lo : hi + 1], value[:, :, lo : hi + 1]
        own = slice(start * groups, end * groups)
        if run:  # queries at lo..hi: a causal prefill over their own keys, K/V heads repeated per query head
            if groups > 1:
                band_keys = band_keys.repeat_interleave(groups, dim=1)
                band_values = band_values.repeat_interleave(groups, dim=1)
            part, part_lse = flash(query[:, :, start:end], band_keys, band_values, is_causal=True, scale=scale)[:2]
            part, part_lse = as_rows(part), as_rows(part_lse)
        else:
            shown = torch.arange(lo, hi + 1, device=query.device)
            band_mask = torch.zeros(own.stop - own.start, hi + 1 - lo, dtype=query.dtype, device=query.device)
            band_mask.masked_fill_(shown[None, :] > row_positions[own, None], -math.inf)
            part, part_lse = flash(rows[:, :, own], band_keys, band_values, attn_mask=band_mask, scale=scale)[:2]
        attend(own, lo, part, part_lse)
        if end < q_len:  # the keys up to the next block, for every later query
            later, reach = slice(end * groups, None), int(positions[end])
            attend(later, lo, *flash(rows[:, :, later], key[:, :, lo:reach], value[:, :, lo:reach], scale=scale)[:2])
    grouped = out.view(batch, kv_heads, q_len, groups, head_dim).transpose(2, 3)
    return grouped.reshape(batch, q_heads, q_len, head_dim).to(query.dtype)
