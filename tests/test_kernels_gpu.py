"""The Triton kernels on a CUDA GPU: every shipped configuration against the torch reference, the registered
attention through the kernel (random values and a peft adapter), and the benchmark's timer; then what only
hardware shows: registers and spills of the launched kernels, 32k-token ragged prefill and decode, a transformers
chunk mask over 32k keys, masks with split-KV, offsets past 2³¹ elements, a decode step captured in a CUDA graph.
Skipped without CUDA (tests/conftest.py).

Pass rule, as in the interpreter tests: max|out − ref_fp32| ≤ 2·max|ref_lowp − ref_fp32| + 1e-3. Long cases are
checked on sampled query rows: attention rows are independent, so the reference runs on those rows only, with the
causal rule as an explicit mask of the same rows.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvprof.kernels.attention import bottom_right_causal_mask, flash_lora_attention, flash_lora_attention_ref
from kvprof.kernels.attention_triton import RANK_PADS, attention_launches, flash_lora_attention_triton
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


def _compare_rows(inputs, rows, out, mask=None, causal=True):
    """Check rows `rows` of out (B, H_q, Lq, D) against the reference run on those query rows only."""
    q, k, v_base, v_lr, lora_b = inputs
    q_len, kv_len = q.shape[2], k.shape[2]
    if mask is None and causal:
        mask = bottom_right_causal_mask(q_len, kv_len, q.device)[None, None]
    row_mask = None if mask is None else mask[:, :, rows]
    sub = (q[:, :, rows], k, v_base, v_lr, lora_b)
    ref_low = flash_lora_attention_ref(*sub, causal=False, attn_mask=row_mask)
    ref_fp32 = flash_lora_attention_ref(*(tensor.float() for tensor in sub), causal=False, attn_mask=row_mask)
    _check(out[:, :, rows], ref_low, ref_fp32)


def _sample_rows(q_len: int, count: int = 48) -> torch.Tensor:
    generator = torch.Generator().manual_seed(q_len)
    picked = torch.randint(0, q_len, (count,), generator=generator).tolist()
    return torch.tensor(sorted({0, 1, q_len // 2, q_len - 2, q_len - 1, *picked}), device="cuda")


def _llama_inputs(q_len, kv_len, rank=16, seed=0):
    """Llama-3.1-8B attention shapes: H_q 32, H_kv 8, D 128, bfloat16, one shared (B, Lk, r) LR cache."""
    return _inputs(torch.bfloat16, 128, rank, q_len, kv_len, group=4, kv_heads=8, batch=1, shared=True, seed=seed)


def test_launched_kernels_registers_and_spills():
    """The hardware's own register and spill counts of the launched kernels (printed); mask-free prefill and
    decode must not spill."""
    cases = {
        "prefill, no mask": dict(q_len=2048, kv_len=2048, mask=False),
        "prefill, mask": dict(q_len=512, kv_len=2048, mask=True),
        "decode, split-KV": dict(q_len=1, kv_len=32768, mask=False),
    }
    for name, case in cases.items():
        inputs = _llama_inputs(case["q_len"], case["kv_len"])
        mask = None
        if case["mask"]:
            mask = bottom_right_causal_mask(case["q_len"], case["kv_len"], torch.device("cuda"))[None, None]
        _, launches = attention_launches(*inputs, attn_mask=mask)
        with torch.cuda.device(inputs[0].device):
            kernels = [launch.run() for launch in launches]
        for launch, kernel in zip(launches, kernels, strict=True):
            print(f"{name}: {launch.kernel.__name__} n_regs={kernel.n_regs} n_spills={kernel.n_spills}")
        if not case["mask"]:
            assert kernels[0].n_spills == 0, (name, kernels[0].n_regs, kernels[0].n_spills)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_peft_llama_bfloat16_through_the_registered_attention(head_dim):
    """A bfloat16 tiny Llama with a peft v_proj adapter (factors in float32, as peft keeps them): the low-rank
    path through the kernel against the adapter under sdpa, both measured against the float32 adapter run."""
    from test_kernels_transformers import peft_continuation_logits

    exact = peft_continuation_logits(head_dim, "adapter", dtype=torch.float32, device="cuda")
    sdpa = peft_continuation_logits(head_dim, "adapter", dtype=torch.bfloat16, device="cuda")
    kernel = peft_continuation_logits(head_dim, "low_rank", dtype=torch.bfloat16, device="cuda")
    for got, baseline, want in zip(kernel, sdpa, exact, strict=True):
        error, baseline_error = (got - want).abs().max().item(), (baseline - want).abs().max().item()
        assert error <= 2 * baseline_error + 1e-2, (error, baseline_error)


def test_chunk_with_a_transformers_mask_over_32k_keys():
    """A 2k chunk after 30k cached keys: with transformers' (B, 1, Lq, Lk) mask, and mask-free (the causal path
    `chunk_mask` selects); both against the reference on sampled rows, and against each other."""
    from transformers.masking_utils import sdpa_mask

    q_len, kv_len = 2048, 32768
    inputs = _llama_inputs(q_len, kv_len)
    mask = sdpa_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=kv_len - q_len,
        allow_is_causal_skip=False,
        device="cuda",
    )
    assert mask is not None and mask.shape == (1, 1, q_len, kv_len)
    masked = flash_lora_attention_triton(*inputs, attn_mask=mask)
    mask_free = flash_lora_attention_triton(*inputs)
    rows = _sample_rows(q_len)
    _compare_rows(inputs, rows, masked, mask=mask)
    _compare_rows(inputs, rows, mask_free)
    assert (masked.float() - mask_free.float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("length", [32767, 32769])
def test_ragged_32k_prefill_and_decode(length):
    inputs = _llama_inputs(length, length, seed=length)
    _compare_rows(inputs, _sample_rows(length), flash_lora_attention_triton(*inputs))
    decode = (_llama_inputs(1, length, seed=length + 1)[0], *inputs[1:])
    _compare(decode)
    _compare(decode, causal=False)


@pytest.mark.parametrize("num_splits", [None, 1, 4, 13])
def test_mask_with_split_kv_and_fully_masked_rows(num_splits):
    for q_len, kv_len in ((1, 5000), (40, 5000)):
        inputs = _inputs(torch.bfloat16, 128, 16, q_len, kv_len, seed=q_len)
        mask = torch.rand(2, 1, q_len, kv_len, device="cuda") > 0.5
        mask[:, :, :, 4096:] = False
        mask[1, 0, 0] = False
        out = flash_lora_attention_triton(*inputs, attn_mask=mask, num_splits=num_splits)
        ref_low = flash_lora_attention_ref(*inputs, attn_mask=mask)
        ref_fp32 = flash_lora_attention_ref(*(tensor.float() for tensor in inputs), attn_mask=mask)
        _check(out, ref_low, ref_fp32)
        assert torch.all(out[1, :, 0] == 0)


def test_offsets_past_2_31_elements():
    """A per-head (1, 32, 8192, 8256) mask has 2.16·10⁹ elements: the last head's rows sit past 2³¹."""
    q_len, kv_len, heads = 8192, 8256, 32
    assert heads * q_len * kv_len > 2**31
    inputs = _inputs(torch.bfloat16, 64, 16, q_len, kv_len, group=4, kv_heads=8, batch=1)
    head_index = torch.arange(heads, device="cuda")[:, None, None]
    keys = torch.arange(kv_len, device="cuda")[None, None, :]
    mask = (keys % 3 != head_index % 3) & bottom_right_causal_mask(q_len, kv_len, torch.device("cuda"))[None]
    mask = mask[None]
    out = flash_lora_attention_triton(*inputs, attn_mask=mask)
    rows = torch.tensor([0, q_len // 2, q_len - 1], device="cuda")
    q, k, v_base, v_lr, lora_b = inputs
    for head in (0, heads - 1):
        kv_head = head // 4
        sub = (q[:, head : head + 1], k[:, kv_head : kv_head + 1], v_base[:, kv_head : kv_head + 1], v_lr)
        sub = (*sub, lora_b[kv_head : kv_head + 1])
        _compare_rows(sub, rows, out[:, head : head + 1], mask=mask[:, head : head + 1])


def test_decode_step_in_a_cuda_graph():
    inputs = _llama_inputs(1, 8191)
    static_q = inputs[0].clone()
    flash_lora_attention_triton(static_q, *inputs[1:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_lora_attention_triton(static_q, *inputs[1:])
    fresh_q = torch.randn_like(static_q)
    static_q.copy_(fresh_q)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, flash_lora_attention_triton(fresh_q, *inputs[1:]), rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_launches_on_the_inputs_device():
    with torch.cuda.device(0):
        inputs = tuple(tensor.to("cuda:1") for tensor in _inputs(torch.bfloat16, 64, 16, 33, 900))
        out = flash_lora_attention_triton(*inputs)
    assert out.device == torch.device("cuda:1")
    _check(out, flash_lora_attention_ref(*inputs), flash_lora_attention_ref(*(tensor.float() for tensor in inputs)))
