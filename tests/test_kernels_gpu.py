"""The Triton kernels on a CUDA GPU: every shipped configuration against the torch reference, the registered
attention through the kernel, and the benchmark's timer. Skipped without CUDA (tests/conftest.py).

Pass rule, as in the interpreter tests: max|out − ref_fp32| ≤ 2·max|ref_lowp − ref_fp32| + 1e-3.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvprof.kernels.attention import flash_lora_attention, flash_lora_attention_ref
from kvprof.kernels.attention_triton import RANK_PADS, flash_lora_attention_triton
from kvprof.kernels.correction import low_rank_correction, low_rank_correction_ref

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (32, 64, 128)
RANKS = {16: 8, 32: 32, 64: 40}


def _inputs(dtype, head_dim, rank, q_len, kv_len, group=4, kv_heads=2, batch=2, shared=True, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator, device="cuda") * std).to(dtype)

    lr_shape = (batch, kv_len, rank) if shared else (batch, kv_heads, kv_len, rank)
    return (
        normal(batch, kv_heads * group, q_len, head_dim),
        normal(batch, kv_heads, kv_len, head_dim),
        normal(batch, kv_heads, kv_len, head_dim),
        normal(*lr_shape),
        normal(kv_heads, rank, head_dim, std=rank**-0.5),
    )


def _check(out, ref_low, ref_fp32):
    error = (out.float() - ref_fp32).abs().max().item()
    tolerance = 2 * (ref_low.float() - ref_fp32).abs().max().item() + 1e-3
    assert error <= tolerance, (error, tolerance)


def _compare(inputs, **kwargs):
    out = flash_lora_attention_triton(*inputs, **kwargs)
    ref_low = flash_lora_attention_ref(*inputs, **kwargs)
    ref_fp32 = flash_lora_attention_ref(*(tensor.float() for tensor in inputs), **kwargs)
    _check(out, ref_low, ref_fp32)


@pytest.mark.parametrize("rank_pad", RANK_PADS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_len,kv_len", [(300, 300), (1, 5000)], ids=["prefill", "decode-split-kv"])
def test_every_shipped_configuration_matches_reference(dtype, head_dim, rank_pad, q_len, kv_len):
    _compare(_inputs(dtype, head_dim, RANKS[rank_pad], q_len, kv_len))


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-head"])
def test_chunked_prefill_gqa_and_layouts(group, shared):
    _compare(_inputs(torch.bfloat16, 128, 16, 77, 1200, group=group, shared=shared))


def test_mask_and_non_causal():
    inputs = _inputs(torch.bfloat16, 128, 16, 40, 700)
    mask = torch.rand(2, 1, 40, 700, device="cuda") > 0.3
    mask[1, 0, 5] = False
    _compare(inputs, attn_mask=mask)
    _compare(inputs, causal=False)
    assert torch.all(flash_lora_attention_triton(*inputs, attn_mask=mask)[1, :, 5] == 0)


def test_dispatcher_uses_the_kernel_on_cuda():
    inputs = _inputs(torch.bfloat16, 64, 16, 50, 50)
    torch.testing.assert_close(flash_lora_attention(*inputs), flash_lora_attention_triton(*inputs))


def test_dispatcher_expands_for_head_dims_without_a_kernel():
    inputs = _inputs(torch.bfloat16, 96, 16, 50, 80)
    out = flash_lora_attention(*inputs)
    _check(out, flash_lora_attention_ref(*inputs), flash_lora_attention_ref(*(tensor.float() for tensor in inputs)))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_low_rank_correction_into_cache(dtype, head_dim):
    generator = torch.Generator(device="cuda").manual_seed(1)
    heads, length, anchors, rank = 8, 1000, 10, 32
    c_src = torch.randn(heads, length, head_dim, generator=generator, device="cuda").to(dtype)
    u = torch.randn(anchors, heads, length, rank, generator=generator, device="cuda").to(dtype)
    v = (torch.randn(anchors, heads, rank, head_dim, generator=generator, device="cuda") / rank**0.5).to(dtype)
    w = torch.softmax(torch.randn(anchors, generator=generator, device="cuda"), 0)
    cache = torch.zeros(2, heads, length + 24, head_dim, dtype=dtype, device="cuda")
    out = low_rank_correction(c_src, u, v, w, out=cache[1, :, 24:])
    _check(
        out, low_rank_correction_ref(c_src, u, v, w), low_rank_correction_ref(c_src.float(), u.float(), v.float(), w)
    )
    assert torch.all(cache[0] == 0) and torch.all(cache[1, :, :24] == 0)


def test_registered_attention_through_the_kernel_on_cuda():
    from test_kernels_transformers import continuation_errors

    assert max(continuation_errors(head_dim=32, device="cuda")) < 1e-3


def test_bench_times_all_methods_with_do_bench():
    from kvprof.kernels.benchmark import DEVICE_PEAKS, BenchCase, run_case

    case = BenchCase("decode", 8192, 16, 1, 32, 8, 128, "shared")
    peak = DEVICE_PEAKS.get(torch.cuda.get_device_name())
    rows = run_case(
        case,
        torch.bfloat16,
        torch.device("cuda"),
        torch.Generator(device="cuda").manual_seed(0),
        warmup_ms=10,
        rep_ms=30,
        peak=peak,
    )
    assert [row["method"] for row in rows] == ["flash_lora", "naive", "sdpa"]
    for row in rows:
        assert row["runs"] >= 1 and 0 < row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]
        assert row["max_abs_diff_flash_vs_naive"] < 5e-2
