"""The torch side of kvprof.kernels: references, input checks, the benchmark's models and `kvprof bench` on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvprof.errors import KvprofError
from kvprof.kernels.attention import (
    bottom_right_causal_mask,
    expand_lora_values,
    flash_lora_attention,
    flash_lora_attention_ref,
    lora_b_per_head,
    naive_lora_attention,
    plain_attention,
)
from kvprof.kernels.benchmark import BenchCase, build_cases, time_cpu
from kvprof.kernels.correction import low_rank_correction, low_rank_correction_ref


def _inputs(
    batch=2, q_heads=4, kv_heads=2, q_len=5, kv_len=11, head_dim=16, rank=8, shared=True, dtype=torch.float32, seed=0
):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    v_lr = normal(batch, kv_len, rank) if shared else normal(batch, kv_heads, kv_len, rank)
    return (
        normal(batch, q_heads, q_len, head_dim),
        normal(batch, kv_heads, kv_len, head_dim),
        normal(batch, kv_heads, kv_len, head_dim),
        v_lr,
        normal(kv_heads, rank, head_dim),
    )


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-head"])
@pytest.mark.parametrize("q_len,kv_len", [(1, 11), (5, 11), (11, 11)], ids=["decode", "chunk", "prefill"])
@pytest.mark.parametrize("q_heads", [2, 4, 8], ids=["g1", "g2", "g4"])
def test_reassociated_reference_equals_naive_expansion(shared, q_len, kv_len, q_heads):
    q, k, v_base, v_lr, lora_b = _inputs(q_heads=q_heads, q_len=q_len, kv_len=kv_len, shared=shared)
    reassociated = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b)
    expanded = naive_lora_attention(q, k, v_base, v_lr, lora_b)
    assert reassociated.shape == q.shape
    torch.testing.assert_close(reassociated, expanded, atol=1e-5, rtol=1e-5)


def test_lora_term_changes_the_output():
    q, k, v_base, v_lr, lora_b = _inputs()
    with_lora = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b)
    without = flash_lora_attention_ref(q, k, v_base, torch.zeros_like(v_lr), lora_b)
    torch.testing.assert_close(without, plain_attention(q, k, v_base), atol=1e-5, rtol=1e-5)
    assert (with_lora - without).abs().max() > 0.1


def test_bottom_right_causality_matches_the_tail_of_a_full_prefill():
    q, k, v_base, v_lr, lora_b = _inputs(q_len=11, kv_len=11)
    full = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b)
    chunk = flash_lora_attention_ref(q[:, :, 7:], k, v_base, v_lr, lora_b)
    decode = flash_lora_attention_ref(q[:, :, 10:], k, v_base, v_lr, lora_b)
    torch.testing.assert_close(chunk, full[:, :, 7:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(decode, full[:, :, 10:], atol=1e-6, rtol=1e-6)
    assert bottom_right_causal_mask(2, 4, torch.device("cpu")).tolist() == [
        [True, True, True, False],
        [True, True, True, True],
    ]


def test_mask_replaces_causality_and_fully_masked_rows_are_zero():
    q, k, v_base, v_lr, lora_b = _inputs(q_len=3, kv_len=6)
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    mask[1, 0, 2] = False
    mask[0, 0, 0, 4:] = False
    out = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b, causal=True, attn_mask=mask)
    expanded = expand_lora_values(v_base, v_lr, lora_b)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, expanded, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :, :2], expected[1, :, :2], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))


def test_scale_argument_is_the_softmax_temperature():
    q, k, v_base, v_lr, lora_b = _inputs()
    default = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b)
    explicit = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b, scale=1 / math.sqrt(q.shape[-1]))
    doubled_queries = flash_lora_attention_ref(2 * q, k, v_base, v_lr, lora_b, scale=0.5 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(default, explicit)
    torch.testing.assert_close(default, doubled_queries, atol=1e-6, rtol=1e-6)


def test_cpu_dispatch_is_the_reference():
    inputs = _inputs()
    torch.testing.assert_close(flash_lora_attention(*inputs), flash_lora_attention_ref(*inputs))


def test_lora_b_per_head_matches_the_peft_v_proj_delta():
    hidden, kv_heads, head_dim, rank, scaling = 12, 2, 4, 3, 2.0
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, hidden, generator=generator)
    lora_a = torch.randn(rank, hidden, generator=generator)
    lora_b = torch.randn(kv_heads * head_dim, rank, generator=generator)
    delta = scaling * (x @ lora_a.T @ lora_b.T)
    per_head = lora_b_per_head(lora_b, kv_heads, scaling)
    assert per_head.shape == (kv_heads, rank, head_dim)
    rebuilt = torch.einsum("lr,hrd->lhd", x @ lora_a.T, per_head).reshape(5, kv_heads * head_dim)
    torch.testing.assert_close(rebuilt, delta)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(lora_b=torch.zeros(2, 7, 16)), "lora_b (2, 7, 16) must be (H_kv=2, r=8, D=16)"),
        (lambda t: t.update(q=torch.zeros(2, 3, 5, 16)), "not a multiple of the 2 KV heads"),
        (lambda t: t.update(q=torch.zeros(2, 4, 12, 16)), "q has 12 positions but k only 11"),
        (lambda t: t.update(v_lr=torch.zeros(2, 10, 8)), "v_lr (2, 10, 8) must be"),
        (lambda t: t.update(v_lr=torch.zeros(2, 11, 80), lora_b=torch.zeros(2, 80, 16)), "LoRA rank 80 is outside"),
        (lambda t: t.update(lora_b=torch.zeros(2, 8, 16, dtype=torch.float16)), "cast lora_b to torch.float32"),
        (lambda t: t.update(k=torch.zeros(2, 2, 11, 8)), "k (2, 2, 11, 8) and v_base"),
    ],
)
def test_input_mistakes_name_the_input_and_the_fix(change, message):
    q, k, v_base, v_lr, lora_b = _inputs()
    tensors = dict(q=q, k=k, v_base=v_base, v_lr=v_lr, lora_b=lora_b)
    change(tensors)
    with pytest.raises(KvprofError) as raised:
        flash_lora_attention_ref(**tensors)
    assert message in str(raised.value)


def test_float_masks_are_refused():
    with pytest.raises(KvprofError, match="pass a boolean mask"):
        flash_lora_attention_ref(*_inputs(), attn_mask=torch.zeros(2, 1, 5, 11))


def test_triton_launcher_refuses_unsupported_head_dim():
    pytest.importorskip("triton")
    from kvprof.kernels.attention_triton import flash_lora_attention_triton

    with pytest.raises(KvprofError, match="head_dim 16 has no Flash-LoRA-Attention kernel"):
        flash_lora_attention_triton(*_inputs(head_dim=16))


def test_one_combine_compile_serves_every_split_count_the_heuristic_picks():
    """The split-KV combine's constants are the same for 2 to 64 splits (a decode whose context grows past a power
    of two must not recompile it mid-turn); only an override past 64 pads further."""
    pytest.importorskip("triton")
    from kvprof.kernels.attention_triton import MAX_SPLITS, attention_plan

    def plan(splits: int):
        return attention_plan(torch.bfloat16, torch.device("cpu"), 8, 4, 65536, 128, 16, True, False, None, splits)

    plans = [plan(splits) for splits in (2, 3, 5, 9, 17, 40, MAX_SPLITS)]
    assert [p.num_splits for p in plans] == [2, 3, 5, 9, 17, 40, 64]  # across every power of two up to 64
    assert all(p.combine_kwargs == plans[0].combine_kwargs for p in plans)
    assert plan(100).combine_kwargs["SPLITS_PAD"] == 128


def _correction_inputs(heads=2, length=9, head_dim=8, anchors=3, rank=4, dtype=torch.float32):
    generator = torch.Generator().manual_seed(2)
    return (
        torch.randn(heads, length, head_dim, generator=generator).to(dtype),
        torch.randn(anchors, heads, length, rank, generator=generator).to(dtype),
        torch.randn(anchors, heads, rank, head_dim, generator=generator).to(dtype),
        torch.softmax(torch.randn(anchors, generator=generator), 0),
    )


def test_correction_reference_is_the_weighted_sum_of_products():
    c_src, u, v, w = _correction_inputs()
    expected = c_src.clone()
    for anchor in range(u.shape[0]):
        expected += w[anchor] * (u[anchor] @ v[anchor])
    torch.testing.assert_close(low_rank_correction_ref(c_src, u, v, w), expected, atol=1e-5, rtol=1e-5)


def test_correction_writes_into_the_target_cache_slice_only():
    c_src, u, v, w = _correction_inputs()
    cache = torch.full((1, 2, 20, 8), 7.0)
    written = low_rank_correction(c_src, u, v, w, out=cache[0, :, 5:14])
    assert written.data_ptr() == cache[0, :, 5:14].data_ptr()
    torch.testing.assert_close(cache[0, :, 5:14], low_rank_correction_ref(c_src, u, v, w))
    assert torch.all(cache[0, :, :5] == 7.0) and torch.all(cache[0, :, 14:] == 7.0)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(v=torch.zeros(3, 2, 5, 8)), "v (3, 2, 5, 8) must be (N=3, H=2, r=4, D=8)"),
        (lambda t: t.update(w=torch.zeros(2)), "w (2,) must be (3,)"),
        (lambda t: t.update(u=torch.zeros(3, 2, 8, 4)), "u (3, 2, 8, 4) must be (N, H=2, L=9, r)"),
    ],
)
def test_correction_mistakes_name_the_input(change, message):
    c_src, u, v, w = _correction_inputs()
    tensors = dict(c_src=c_src, u=u, v=v, w=w)
    change(tensors)
    with pytest.raises(KvprofError) as raised:
        low_rank_correction_ref(**tensors)
    assert message in str(raised.value)


def test_bench_case_counts():
    prefill = BenchCase("prefill", 8, 4, 1, 4, 2, 16, "shared")
    decode = BenchCase("decode", 8, 4, 1, 4, 2, 16, "per-head")
    assert prefill.visible_pairs == 36 and decode.visible_pairs == 8
    assert prefill.flops("sdpa") == 4 * 4 * 16 * 36
    assert prefill.flops("flash_lora") == prefill.flops("sdpa") + 2 * 4 * 4 * (36 + 8 * 16)
    assert decode.flops("naive") == decode.flops("sdpa") + 2 * 2 * 8 * 4 * 16
    cache = 2 * 8 * 16
    assert decode.bytes_moved("sdpa", 2) == 2 * (2 * 4 * 1 * 16 + 2 * cache)
    assert decode.bytes_moved("naive", 2) - decode.bytes_moved("flash_lora", 2) == 2 * 2 * cache


def test_cpu_timer_warms_up_and_repeats():
    calls = []
    timing = time_cpu(lambda: calls.append(1), warmup_ms=0.0, rep_ms=0.0)
    assert timing.runs == 5 and len(calls) == 6
    assert timing.p20_ms <= timing.median_ms <= timing.p80_ms


def test_bench_cases_refuse_bad_options():
    with pytest.raises(KvprofError, match="--modes has 'warm'"):
        build_cases(["warm"], [8], [4], 1, 4, 2, 16, "shared")
    with pytest.raises(KvprofError, match="--q-heads 6 is not a multiple of --kv-heads 4"):
        build_cases(["decode"], [8], [4], 1, 6, 4, 16, "shared")
    with pytest.raises(KvprofError, match="--ranks has 65; Flash-LoRA-Attention supports ranks 1 to 64"):
        build_cases(["decode"], [8], [16, 65], 1, 4, 2, 16, "shared")


def test_bench_command_on_cpu(run_cli, tmp_path):
    code, out, err = run_cli(
        "bench",
        "--device",
        "cpu",
        "--seq-lens",
        "16,32",
        "--ranks",
        "4,16",
        "--q-heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "32",
        "--warmup-ms",
        "0",
        "--rep-ms",
        "0",
        "--out",
        tmp_path,
    )
    assert code == 0, err
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["schema"] == "kvprof.result.bench" and result["timer"] == "time.perf_counter"
    assert "torch reference" in result["implementations"]["flash_lora"]
    rows = result["results"]
    assert len(rows) == 2 * 2 * 2 * 3
    assert {(row["mode"], row["seq_len"], row["rank"]) for row in rows} == {
        (mode, length, rank) for mode in ("prefill", "decode") for length in (16, 32) for rank in (4, 16)
    }
    for row in rows:
        assert row["runs"] >= 5 and row["median_ms"] > 0 and row["fraction_of_peak_flops"] is None
        assert row["max_abs_diff_flash_vs_naive"] < 1e-4
    assert (tmp_path / "bench.html").read_text().count("plotly") > 1
    assert "torch reference" in out + err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seq-lens", "1k"], "--seq-lens '1k' is not a comma-separated list of integers"),
        (["--lr-layout", "diagonal"], "--lr-layout 'diagonal' is unknown"),
        (["--seq-lens", "100000"], "pass smaller --seq-lens"),
    ],
)
def test_bench_command_refuses_bad_options(run_cli, tmp_path, args, message):
    code, out, err = run_cli("bench", "--device", "cpu", "--out", tmp_path, *args)
    assert code == 2 and message in err
