"""The Triton kernels under the Triton interpreter, against the torch references.

TRITON_INTERPRET must be set before triton is imported, and another test module may already have imported it, so
every case runs in one subprocess (this file run as a script) with the variable set; the tests read its results.
Pass rule: max|out − ref_fp32| ≤ 2·max|ref_lowp − ref_fp32| + 1e-3, where ref_lowp is the torch reference in the
kernel's dtype and ref_fp32 the same reference on float32 copies of the inputs. Two interpreter defects are
worked around inside the kernels (their INTERPRETING flag) and checked here: its bfloat16 `tl.dot` is wrong (dots
run in float32) and it truncates float32 → bfloat16 (`round_to` rounds to nearest even, as the GPU does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "float16", "bfloat16")
SHAPES = ((1, 37), (5, 37), (37, 37), (16, 64), (3, 3))


def _attention_cases() -> list[dict]:
    base = dict(
        batch=2,
        kv_heads=2,
        group=2,
        head_dim=32,
        rank=8,
        shared=False,
        splits=1,
        causal=True,
        mask=None,
        blocks=(16, 16),
        factors=None,
    )
    cases = []
    for index, (dtype, (q_len, kv_len)) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        cases.append(
            {
                **base,
                "dtype": dtype,
                "q_len": q_len,
                "kv_len": kv_len,
                "group": (1, 2, 4)[index % 3],
                "rank": (8, 16, 40, 64)[index % 4],
                "shared": index % 2 == 0,
            }
        )
    decode, chunk = dict(q_len=1, kv_len=70), dict(q_len=6, kv_len=70)
    for dtype in DTYPES:
        cases += [
            {**base, **decode, "dtype": dtype, "group": 4, "splits": 3},
            {**base, **chunk, "dtype": dtype, "splits": 2, "shared": True, "rank": 64},
            {**base, **chunk, "dtype": dtype, "mask": "random"},
            {**base, **chunk, "dtype": dtype, "mask": "random", "splits": 3, "group": 1},
            {**base, **chunk, "dtype": dtype, "causal": False, "rank": 16},
            {**base, "q_len": 33, "kv_len": 33, "dtype": dtype, "blocks": None, "group": 4, "rank": 32},
            {**base, **decode, "dtype": dtype, "blocks": None, "group": 8, "rank": 16, "shared": True},
        ]
    cases += [
        {**base, "q_len": 9, "kv_len": 20, "dtype": dtype, "head_dim": head_dim, "blocks": None}
        for dtype in ("float32", "bfloat16")
        for head_dim in (64, 128)
    ]
    # Mask-free chunked prefill over several key blocks (blocks every row sees, then the causal diagonal), alone and
    # split; the combine with a padded split count (5 splits → 8, two chunks of 4) and with a mask and fully masked
    # rows; rank 16 and 32 (EVEN_R, no column mask) next to 8 and 24 (zero-padded); float32 factors with 16-bit q.
    long_chunk = dict(q_len=40, kv_len=100, group=2)
    for dtype in ("float32", "bfloat16"):
        cases += [
            {**base, **long_chunk, "dtype": dtype, "rank": 16},
            {**base, **long_chunk, "dtype": dtype, "rank": 24, "splits": 3, "shared": True},
            {**base, **decode, "dtype": dtype, "rank": 32, "splits": 5, "group": 2},
            {**base, **chunk, "dtype": dtype, "rank": 16, "splits": 5, "mask": "random"},
            {**base, **long_chunk, "dtype": dtype, "rank": 32, "blocks": None, "shared": True},
        ]
    cases += [
        {**base, **long_chunk, "dtype": dtype, "rank": 16, "factors": "float32"} for dtype in ("bfloat16", "float16")
    ]
    return cases


def _correction_cases() -> list[dict]:
    return [
        dict(dtype=dtype, rank=rank, anchors=anchors, length=70, head_dim=head_dim, in_place=in_place)
        for dtype in DTYPES
        for rank, anchors, head_dim, in_place in ((4, 1, 32, False), (16, 3, 64, True), (40, 2, 32, False))
    ]


ATTENTION_CASES = _attention_cases()
CORRECTION_CASES = _correction_cases()


def _case_id(case: dict) -> str:
    return "-".join(f"{key}={value}" for key, value in case.items())


def _tolerance_check(out, ref_low, ref_fp32) -> dict:
    error = (out.float() - ref_fp32).abs().max().item()
    tolerance = 2 * (ref_low.float() - ref_fp32).abs().max().item() + 1e-3
    return {"error": error, "tolerance": tolerance}


def _run_attention(case: dict) -> dict:
    import torch

    from kvprof.kernels.attention import flash_lora_attention_ref
    from kvprof.kernels.attention_triton import AttentionConfig, flash_lora_attention_triton

    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator().manual_seed(len(_case_id(case)))
    batch, kv_heads, head_dim = case["batch"], case["kv_heads"], case["head_dim"]
    q_heads = kv_heads * case["group"]

    def normal(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    q = normal(batch, q_heads, case["q_len"], head_dim)
    k = normal(batch, kv_heads, case["kv_len"], head_dim)
    v_base = normal(batch, kv_heads, case["kv_len"], head_dim)
    lr_shape = (
        (batch, case["kv_len"], case["rank"]) if case["shared"] else (batch, kv_heads, case["kv_len"], case["rank"])
    )
    v_lr = normal(*lr_shape)
    lora_b = normal(kv_heads, case["rank"], head_dim, std=case["rank"] ** -0.5)
    if case["factors"] is not None:
        v_lr, lora_b = v_lr.to(getattr(torch, case["factors"])), lora_b.to(getattr(torch, case["factors"]))
    mask = None
    if case["mask"] == "random":
        mask = torch.rand(batch, 1, case["q_len"], case["kv_len"], generator=generator) > 0.4
        mask[1, 0, 0] = False
    config = AttentionConfig(*case["blocks"], 4, 1) if case["blocks"] else None
    out = flash_lora_attention_triton(
        q, k, v_base, v_lr, lora_b, causal=case["causal"], attn_mask=mask, config=config, num_splits=case["splits"]
    )
    ref_low = flash_lora_attention_ref(q, k, v_base, v_lr, lora_b, causal=case["causal"], attn_mask=mask)
    ref_fp32 = flash_lora_attention_ref(
        q.float(), k.float(), v_base.float(), v_lr.float(), lora_b.float(), causal=case["causal"], attn_mask=mask
    )
    result = _tolerance_check(out, ref_low, ref_fp32)
    result["masked_row_zero"] = bool(mask is None or torch.all(out[1, :, 0] == 0))
    return result


def _run_correction(case: dict) -> dict:
    import torch

    from kvprof.kernels.correction import low_rank_correction_ref
    from kvprof.kernels.correction_triton import low_rank_correction_triton

    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator().manual_seed(case["rank"] * 7 + case["anchors"])
    heads, length, head_dim, rank = 2, case["length"], case["head_dim"], case["rank"]
    c_src = torch.randn(heads, length, head_dim, generator=generator).to(dtype)
    u = torch.randn(case["anchors"], heads, length, rank, generator=generator).to(dtype)
    v = (torch.randn(case["anchors"], heads, rank, head_dim, generator=generator) * rank**-0.5).to(dtype)
    w = torch.softmax(torch.randn(case["anchors"], generator=generator), 0)
    ref_low = low_rank_correction_ref(c_src, u, v, w)
    ref_fp32 = low_rank_correction_ref(c_src.float(), u.float(), v.float(), w)
    cache = torch.full((2, heads, length + 10, head_dim), 3.0, dtype=dtype)
    if case["in_place"]:
        cache[1, :, 4 : 4 + length] = c_src
        source = cache[1, :, 4 : 4 + length]
    else:
        source = c_src
    out = low_rank_correction_triton(source, u, v, w, out=cache[1, :, 4 : 4 + length])
    result = _tolerance_check(out, ref_low, ref_fp32)
    untouched = torch.cat([cache[0].flatten(), cache[1, :, :4].flatten(), cache[1, :, 4 + length :].flatten()])
    result["rest_untouched"] = bool(torch.all(untouched == 3.0))
    return result


def _run_transformers() -> dict:
    """A tiny Llama through the registered attention, with the interpreter's Triton kernel doing the attention;
    records the mask each kernel call got (the chunk after the cache must get none: the causal, mask-free path)."""
    from test_kernels_transformers import continuation_errors

    from kvprof.kernels import attention_triton

    launcher = attention_triton.flash_lora_attention_triton
    calls = []

    def recording(q, k, *args, **kwargs):
        attn_mask = args[5] if len(args) > 5 else kwargs.get("attn_mask")
        calls.append([q.shape[2], k.shape[2], attn_mask is None])
        return launcher(q, k, *args, **kwargs)

    attention_triton.flash_lora_attention_triton = recording
    try:
        errors = continuation_errors(head_dim=32)
    finally:
        attention_triton.flash_lora_attention_triton = launcher
    return {"max_error": max(errors), "calls": calls}


def _run_rounding() -> dict:
    """`round_to` under the interpreter against torch's float32 → bfloat16 rounding (nearest even), on ties,
    zeros and normal numbers (the interpreter's own subnormal conversion is wrong, and they do not occur here)."""
    import torch

    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0, 3.0])
    x = torch.cat([ties, torch.randn(1018, generator=torch.Generator().manual_seed(8)) * 5])
    y = torch.empty(1024, dtype=torch.bfloat16)
    round_kernel[(1,)](x, y, SIZE=1024)
    return {"mismatches": int((y.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)).sum())}


def _worker(results_path: str) -> None:
    import torch

    from kvprof.kernels.attention import triton_path_available

    assert triton_path_available(torch.zeros(1)), "the worker must run with TRITON_INTERPRET=1"
    results = {
        "attention": {_case_id(case): _run_attention(case) for case in ATTENTION_CASES},
        "correction": {_case_id(case): _run_correction(case) for case in CORRECTION_CASES},
        "transformers": _run_transformers(),
        "rounding": _run_rounding(),
    }
    Path(results_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict:
    results_path = tmp_path_factory.mktemp("interpreter") / "results.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, __file__, str(results_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(results_path.read_text())


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_flash_lora_attention_kernel_matches_reference(interpreter_results, case):
    result = interpreter_results["attention"][_case_id(case)]
    assert result["error"] <= result["tolerance"], result
    assert result["masked_row_zero"]


@pytest.mark.parametrize("case", CORRECTION_CASES, ids=_case_id)
def test_low_rank_correction_kernel_matches_reference(interpreter_results, case):
    result = interpreter_results["correction"][_case_id(case)]
    assert result["error"] <= result["tolerance"], result
    assert result["rest_untouched"]


def test_registered_attention_through_the_triton_kernel(interpreter_results):
    assert interpreter_results["transformers"]["max_error"] < 1e-4


def test_chunk_after_a_cache_reaches_the_kernel_without_a_mask(interpreter_results):
    """Prefill 10, chunk 5 after 10, decode 1 after 15, per layer: the chunk takes the kernel's causal path."""
    calls = interpreter_results["transformers"]["calls"]
    chunk_calls = [call for call in calls if call[:2] == [5, 15]]
    assert chunk_calls and all(mask_free for _, _, mask_free in chunk_calls), calls


def test_interpreter_rounding_emulates_the_gpu(interpreter_results):
    assert interpreter_results["rounding"]["mismatches"] == 0


if __name__ == "__main__":
    # The worker: triton is imported only here, after the parent set TRITON_INTERPRET=1. A jitted function
    # resolves names in its module's globals, so the rounding probe kernel is defined at module level.
    import triton
    import triton.language as tl

    from kvprof.kernels.attention_triton import round_to

    @triton.jit
    def round_kernel(x_ptr, y_ptr, SIZE: tl.constexpr):
        offsets = tl.arange(0, SIZE)
        tl.store(y_ptr + offsets, round_to(tl.load(x_ptr + offsets), tl.bfloat16, True))

    _worker(sys.argv[1])
