"""A chunk after a cache attended without an explicit mask (`kvprof.kernels.chunk_attention`), against SDPA with
transformers' bottom-right causal mask; queries at scattered positions (a selective recompute's), against SDPA with
the explicit mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from kvprof.kernels.chunk_attention import chunk_attention, chunk_mask, query_blocks, scattered_attention


def masked_reference(query, key, value, scale=None):
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(("q_len", "kv_len"), [(2, 3), (7, 40), (33, 50)])
def test_chunk_attention_equals_masked_sdpa(dtype, q_heads, kv_heads, q_len, kv_len):
    generator = torch.Generator().manual_seed(q_len * kv_len + q_heads)
    query = torch.randn(2, q_heads, q_len, 32, generator=generator).to(dtype)
    key = torch.randn(2, kv_heads, kv_len, 32, generator=generator).to(dtype)
    value = torch.randn(2, kv_heads, kv_len, 32, generator=generator).to(dtype)
    actual = chunk_attention(query, key, value, scale=0.2)
    assert actual.shape == query.shape and actual.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), masked_reference(query, key, value, 0.2), atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (4, 2)])
@pytest.mark.parametrize(
    "positions",
    [[0, 1, 2], [3, 9, 10, 30, 47], list(range(5, 45, 3)), [0, *range(20, 50)], [2, 5, *range(10, 40), 44, 45]],
    ids=["from 0", "sparse", "strided", "run", "run between"],
)
@pytest.mark.parametrize("block", [2, 256])
def test_scattered_attention_equals_masked_sdpa(dtype, q_heads, kv_heads, positions, block):
    """Each query sees the keys up to its own position, across blocks that start at 0 or after it, scattered or a
    run of consecutive positions (block 2: every run of two or more is attended as a causal prefill)."""
    generator = torch.Generator().manual_seed(len(positions) + q_heads)
    kv_len = 50
    query = torch.randn(2, q_heads, len(positions), 32, generator=generator).to(dtype)
    key = torch.randn(2, kv_heads, kv_len, 32, generator=generator).to(dtype)
    value = torch.randn(2, kv_heads, kv_len, 32, generator=generator).to(dtype)
    at = torch.tensor(positions)
    actual = scattered_attention(query, key, value, at, scale=0.2, block=block)
    assert actual.shape == query.shape and actual.dtype == dtype
    mask = torch.arange(kv_len)[None, :] <= at[:, None]
    groups = q_heads // kv_heads
    expected = F.scaled_dot_product_attention(
        query.float(),
        key.repeat_interleave(groups, 1).float(),
        value.repeat_interleave(groups, 1).float(),
        attn_mask=mask,
        scale=0.2,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("from_zero", [True, False], ids=["first at 0", "first later"])
def test_scattered_attention_over_many_blocks_equals_masked_sdpa(from_zero):
    """Many blocks of scattered queries, each row LSE-merging its band and every earlier block's keys (a
    selective recompute's top tokens), with a run among them."""
    generator = torch.Generator().manual_seed(7)
    kv_len, q_heads, kv_heads = 600, 4, 2
    chosen = torch.randperm(kv_len - 1, generator=generator)[:150] + 1
    at = torch.cat([chosen, torch.arange(300, 340), torch.tensor([0] if from_zero else [])]).long().unique()
    query = torch.randn(1, q_heads, len(at), 32, generator=generator)
    key = torch.randn(1, kv_heads, kv_len, 32, generator=generator)
    value = torch.randn(1, kv_heads, kv_len, 32, generator=generator)
    actual = scattered_attention(query, key, value, at, scale=0.2, block=16)
    assert any(run for _, _, run in query_blocks(at, 16)) and len(query_blocks(at, 16)) > 8
    mask = torch.arange(kv_len)[None, :] <= at[:, None]
    expected = F.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask, scale=0.2
    )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_query_blocks_keep_runs_whole():
    """Runs of at least `block` consecutive positions are blocks of their own; the queries between them go in blocks
    of up to `block`."""
    positions = torch.tensor([1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 30, 31])
    assert query_blocks(positions, 3) == [(0, 4, True), (4, 9, True), (9, 12, False)]
    assert query_blocks(positions, 5) == [(0, 4, False), (4, 9, True), (9, 12, False)]
    assert query_blocks(positions, 256) == [(0, 12, False)]
    assert query_blocks(torch.arange(7), 2) == [(0, 7, True)]


def test_chunk_attention_reads_strided_cache_views():
    """Keys and values as views of a longer buffer (how `kvprof.model.buffers` hands them over)."""
    generator = torch.Generator().manual_seed(0)
    buffer_k = torch.randn(1, 2, 100, 16, generator=generator)
    buffer_v = torch.randn(1, 2, 100, 16, generator=generator)
    query = torch.randn(1, 4, 9, 16, generator=generator)
    key, value = buffer_k[:, :, :30], buffer_v[:, :, :30]
    torch.testing.assert_close(chunk_attention(query, key, value), masked_reference(query, key, value))


def test_chunk_mask_is_none_only_for_a_plain_chunk_after_a_cache():
    chunk = dict(batch_size=1, q_length=5, kv_length=12, q_offset=7, kv_offset=0)
    assert chunk_mask(**chunk) is None
    assert chunk_mask(**chunk, attention_mask=torch.ones(1, 12, dtype=torch.bool)) is None
    padded = torch.ones(1, 12, dtype=torch.bool)
    padded[0, 0] = False
    mask = chunk_mask(**chunk, attention_mask=padded)
    assert mask is not None and not bool(mask[0, 0, :, 0].any())
    window = chunk_mask(**chunk, mask_function=sliding_window_causal_mask_function(4), local_size=4)
    assert window is not None and not bool(window[0, 0, -1, :7].any())
    assert chunk_mask(**chunk, allow_is_causal_skip=False) is not None
    # a square prefill and a decode step keep sdpa's own skips (is_causal, no mask)
    assert chunk_mask(batch_size=1, q_length=6, kv_length=6, mask_function=causal_mask_function) is None
    assert chunk_mask(batch_size=1, q_length=1, kv_length=9, q_offset=8) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunk_attention_on_cuda_equals_masked_sdpa(dtype):
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 8, 64, 64, generator=generator).to("cuda", dtype)
    key = torch.randn(1, 2, 300, 64, generator=generator).to("cuda", dtype)
    value = torch.randn(1, 2, 300, 64, generator=generator).to("cuda", dtype)
    expected = masked_reference(query.cpu().float(), key.cpu().float(), value.cpu().float())
    torch.testing.assert_close(chunk_attention(query, key, value).cpu().float(), expected, atol=2e-2, rtol=0)
