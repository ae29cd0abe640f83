"""Flash-LoRA-Attention forward in Triton (LRAgent, arXiv:2602.01053, "Flash-LoRA-Attention").

One flash-attention pass with online softmax computes both accumulators from the same probabilities P:

    acc    = P·V_base   (BLOCK_M, D)
    acc_lr = P·V_lr     (BLOCK_M, r_pad)
    O      = acc / l + (acc_lr / l)·B

Layout of a program: the g query heads that share one KV head are packed into the row dimension
(row = query_position·g + head_in_group), so every K/V tile loaded serves all g heads; this keeps decode
(Lq = 1) tiles at least g rows full. Keys are visited in two stages: blocks every row of the tile may see
completely (no masking work), then the blocks on the causal diagonal, the ragged end and any user mask.
When there are fewer tiles than streaming multiprocessors (decode, short chunks over a long cache), the key
range is split across programs ("split-KV"): each finishes its own output O_s (B applied) and softmax statistics,
and `combine_splits` averages the O_s weighted by their softmax mass (the flash-decoding merge; B is linear, so
applying it per split is exact).

Shapes (GQA: H_q = g·H_kv): q (B, H_q, Lq, D); k, v_base (B, H_kv, Lk, D); v_lr (B, Lk, r) shared or
(B, H_kv, Lk, r) per KV head; lora_b (H_kv, r, D); out (B, H_q, Lq, D). The rank is zero-padded to
r_pad = max(16, next power of two) by masked loads (16-bit `tl.dot` needs K ≥ 16 on GPU).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvprof.errors import KvprofError
from kvprof.kernels.attention import SUPPORTED_HEAD_DIMS, check_lora_attention_inputs

LOG2_E = 1.4426950408889634
DECODE_MAX_ROWS = 16
COMBINE_BLOCK_M = 16
COMBINE_NUM_WARPS = 4
MIN_KEYS_PER_SPLIT = 512


@triton.jit
def dot_accumulate(a, b, acc, INTERPRETING: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a·b (acc may be None); under the interpreter in float32, as its bfloat16 dot is wrong."""
    if INTERPRETING:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        result = tl.dot(a, b, acc, input_precision=PRECISION)
    return result


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETING: tl.constexpr):
    """x.to(dtype) rounding to nearest even, as the GPU does; the interpreter truncates float32 → bfloat16, so
    there the rounding bias is added to the bits of normal numbers first (zeros and subnormals stay as they are)."""
    if INTERPRETING and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bias = tl.where((bits & 0x7F800000) != 0, 0x7FFF + ((bits >> 16) & 1), 0)
        result = (bits + bias).to(tl.float32, bitcast=True).to(dtype)
    else:
        result = x.to(dtype)
    return result


@triton.jit
def _attend_block(
    acc,
    acc_lr,
    row_max,
    row_sum,
    q,
    k_head_ptr,
    v_head_ptr,
    v_lr_head_ptr,
    mask_row_ptrs,
    start_n,
    keys_end,
    q_pos,
    mask_rows,
    diagonal,
    causal,
    rank,
    qk_scale,
    stride_kn,
    stride_vn,
    stride_lrn,
    stride_mk,
    offs_d,
    offs_r,
    offs_n0,
    MASKED: tl.constexpr,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold keys [start_n, start_n + BLOCK_N) into the online-softmax state of one tile."""
    offs_n = start_n + offs_n0
    lr_cols = offs_r[None, :] < rank
    if MASKED:
        key_valid = offs_n < keys_end
        k = tl.load(k_head_ptr + offs_n[None, :] * stride_kn + offs_d[:, None], mask=key_valid[None, :], other=0.0)
    else:
        k = tl.load(k_head_ptr + offs_n[None, :] * stride_kn + offs_d[:, None])
    qk = dot_accumulate(q, k, None, INTERPRETING, PRECISION) * qk_scale
    if MASKED:
        causal_ok = (offs_n[None, :] <= q_pos[:, None] + diagonal) | (causal == 0)
        user_ok = (
            tl.load(
                mask_row_ptrs[:, None] + offs_n[None, :] * stride_mk,
                mask=mask_rows[:, None] & key_valid[None, :],
                other=1,
            )
            != 0
        )
        qk = tl.where(key_valid[None, :] & causal_ok & user_ok, qk, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(qk, 1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.math.exp2(row_max - shift)
    p = tl.math.exp2(qk - shift[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc_lr = acc_lr * alpha[:, None]
    if MASKED:
        v = tl.load(v_head_ptr + offs_n[:, None] * stride_vn + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        v_lr = tl.load(
            v_lr_head_ptr + offs_n[:, None] * stride_lrn + offs_r[None, :], mask=key_valid[:, None] & lr_cols, other=0.0
        )
    else:
        v = tl.load(v_head_ptr + offs_n[:, None] * stride_vn + offs_d[None, :])
        v_lr = tl.load(v_lr_head_ptr + offs_n[:, None] * stride_lrn + offs_r[None, :], mask=lr_cols, other=0.0)
    p_low = round_to(p, v.dtype, INTERPRETING)
    acc = dot_accumulate(p_low, v, acc, INTERPRETING, PRECISION)
    acc_lr = dot_accumulate(p_low, v_lr, acc_lr, INTERPRETING, PRECISION)
    return acc, acc_lr, new_max, row_sum


@triton.jit
def _epilogue(
    acc,
    acc_lr,
    row_sum,
    lora_b_head_ptr,
    stride_br,
    rank,
    offs_r,
    offs_d,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """O = acc / l + (acc_lr / l)·B for one tile, in float32; rows that saw no key give zeros."""
    inv_sum = 1.0 / tl.where(row_sum == 0.0, 1.0, row_sum)
    lora_b = tl.load(
        lora_b_head_ptr + offs_r[:, None] * stride_br + offs_d[None, :], mask=offs_r[:, None] < rank, other=0.0
    )
    out_lr = round_to(acc_lr * inv_sum[:, None], lora_b.dtype, INTERPRETING)
    return dot_accumulate(out_lr, lora_b, acc * inv_sum[:, None], INTERPRETING, PRECISION)


@triton.jit(
    do_not_specialize=[
        "num_kv_heads",
        "group",
        "q_len",
        "kv_len",
        "rank",
        "causal",
        "has_mask",
        "num_splits",
        "split_len",
    ]
)
def flash_lora_attention_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    v_lr_ptr,
    lora_b_ptr,
    mask_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_lrb,
    stride_lrh,
    stride_lrn,
    stride_bh,
    stride_br,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    stride_ob,
    stride_oh,
    stride_om,
    num_kv_heads,
    group,
    q_len,
    kv_len,
    rank,
    qk_scale,
    causal,
    has_mask,
    num_splits,
    split_len,
    HEAD_DIM: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (query tile, batch·KV head, key split) program. Grid: (cdiv(Lq·g, BLOCK_M), B·H_kv, num_splits).

    With num_splits == 1 it writes O; otherwise its key range's own output (float32) and softmax statistics
    (log2-domain running max, sum) to part_out (B·H_kv, num_splits, Lq·g, D) and part_max, part_sum
    (B·H_kv, num_splits, Lq·g) for `combine_splits`.
    `qk_scale` is the softmax scale times log2(e); `causal` and `has_mask` are 0/1.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    batch = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_total = q_len * group
    row_valid = rows < rows_total
    q_pos = rows // group
    q_head = kv_head * group + rows % group
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, RANK_PAD)
    offs_n0 = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + batch * stride_qb + q_head[:, None] * stride_qh + q_pos[:, None] * stride_qm + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    k_head_ptr = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_head_ptr = v_ptr + batch * stride_vb + kv_head * stride_vh
    v_lr_head_ptr = v_lr_ptr + batch * stride_lrb + kv_head * stride_lrh
    mask_row_ptrs = mask_ptr + batch * stride_mb + q_head * stride_mh + q_pos * stride_mq
    mask_rows = row_valid & (tl.full((BLOCK_M,), has_mask, tl.int32) != 0)

    diagonal = kv_len - q_len
    first_pos = (pid_m * BLOCK_M) // group
    last_pos = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
    visible_end = tl.where(causal != 0, tl.minimum(kv_len, last_pos + diagonal + 1), kv_len)
    split_start = pid_split * split_len
    split_end = tl.minimum(split_start + split_len, visible_end)
    seen_by_all = tl.where(causal != 0, tl.minimum(split_end, first_pos + diagonal + 1), split_end)
    unmasked_end = split_start + tl.maximum(seen_by_all - split_start, 0) // BLOCK_N * BLOCK_N
    unmasked_end = tl.where(has_mask != 0, split_start, unmasked_end)

    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    acc_lr = tl.zeros((BLOCK_M, RANK_PAD), tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    for start_n in range(split_start, unmasked_end, BLOCK_N):
        acc, acc_lr, row_max, row_sum = _attend_block(
            acc,
            acc_lr,
            row_max,
            row_sum,
            q,
            k_head_ptr,
            v_head_ptr,
            v_lr_head_ptr,
            mask_row_ptrs,
            start_n,
            split_end,
            q_pos,
            mask_rows,
            diagonal,
            causal,
            rank,
            qk_scale,
            stride_kn,
            stride_vn,
            stride_lrn,
            stride_mk,
            offs_d,
            offs_r,
            offs_n0,
            False,
            INTERPRETING,
            PRECISION,
        )
    for start_n in range(unmasked_end, split_end, BLOCK_N):
        acc, acc_lr, row_max, row_sum = _attend_block(
            acc,
            acc_lr,
            row_max,
            row_sum,
            q,
            k_head_ptr,
            v_head_ptr,
            v_lr_head_ptr,
            mask_row_ptrs,
            start_n,
            split_end,
            q_pos,
            mask_rows,
            diagonal,
            causal,
            rank,
            qk_scale,
            stride_kn,
            stride_vn,
            stride_lrn,
            stride_mk,
            offs_d,
            offs_r,
            offs_n0,
            True,
            INTERPRETING,
            PRECISION,
        )

    out = _epilogue(
        acc, acc_lr, row_sum, lora_b_ptr + kv_head * stride_bh, stride_br, rank, offs_r, offs_d, INTERPRETING, PRECISION
    )
    if num_splits == 1:
        out_ptrs = (
            out_ptr + batch * stride_ob + q_head[:, None] * stride_oh + q_pos[:, None] * stride_om + offs_d[None, :]
        )
        tl.store(out_ptrs, round_to(out, out_ptr.dtype.element_ty, INTERPRETING), mask=row_valid[:, None])
    else:
        part = (pid_bh * num_splits + pid_split).to(tl.int64) * rows_total + rows
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(part_max_ptr + part, row_max, mask=row_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=row_valid)


@triton.jit(do_not_specialize=["num_kv_heads", "group", "q_len", "num_splits"])
def combine_splits(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_om,
    num_kv_heads,
    group,
    q_len,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INTERPRETING: tl.constexpr,
):
    """Merge the per-split outputs of `flash_lora_attention_fwd`, each weighted by its share of the softmax mass
    2^(m_s − M)·l_s. Grid: (cdiv(Lq·g, BLOCK_M), B·H_kv)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = pid_bh % num_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_total = q_len * group
    row_valid = rows < rows_total
    q_pos = rows // group
    q_head = kv_head * group + rows % group
    offs_d = tl.arange(0, HEAD_DIM)

    out = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_mass = tl.zeros((BLOCK_M,), tl.float32)
    for split in range(0, num_splits):
        part = (pid_bh * num_splits + split).to(tl.int64) * rows_total + rows
        part_max = tl.load(part_max_ptr + part, mask=row_valid, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + part, mask=row_valid, other=0.0)
        new_max = tl.maximum(run_max, part_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        keep = tl.math.exp2(run_max - shift) * run_mass
        take = tl.math.exp2(part_max - shift) * part_sum
        run_mass = keep + take
        part_out = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=row_valid[:, None], other=0.0
        )
        out = (out * keep[:, None] + part_out * take[:, None]) / tl.where(run_mass == 0.0, 1.0, run_mass)[:, None]
        run_max = new_max
    out_ptrs = out_ptr + batch * stride_ob + q_head[:, None] * stride_oh + q_pos[:, None] * stride_om + offs_d[None, :]
    tl.store(out_ptrs, round_to(out, out_ptr.dtype.element_ty, INTERPRETING), mask=row_valid[:, None])


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch options of one shipped `flash_lora_attention_fwd` configuration."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Chosen for sm_90 from the shared-memory budget (≤ 227 KiB with r_pad = 64) and the tile shapes of Triton's
# fused-attention tutorial; they have not been tuned on hardware. 16-bit "decode" tiles (Lq·g ≤ 16 rows) keep
# 16 rows; float32 (3xTF32 dots, a correctness path) has one tile for every shape.
ATTENTION_CONFIGS: dict[tuple[str, int, str], AttentionConfig] = {
    **{
        (dtype, head_dim, "prefill"): AttentionConfig(128, 64, 8 if head_dim == 128 else 4, 3)
        for dtype in ("float16", "bfloat16")
        for head_dim in SUPPORTED_HEAD_DIMS
    },
    **{
        (dtype, head_dim, "decode"): AttentionConfig(16, 64, 4, 3)
        for dtype in ("float16", "bfloat16")
        for head_dim in SUPPORTED_HEAD_DIMS
    },
    **{
        ("float32", head_dim, "any"): AttentionConfig(64, 64 if head_dim == 32 else 32, 4, 2)
        for head_dim in SUPPORTED_HEAD_DIMS
    },
}
RANK_PADS = (16, 32, 64)


def rank_pad(rank: int) -> int:
    """The padded rank the kernel computes with: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rank))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pick_config(dtype: torch.dtype, head_dim: int, rows: int) -> AttentionConfig:
    """The shipped configuration for a dtype, head_dim and Lq·g packed query rows."""
    if dtype == torch.float32:
        return ATTENTION_CONFIGS[("float32", head_dim, "any")]
    return ATTENTION_CONFIGS[(dtype_name(dtype), head_dim, "decode" if rows <= DECODE_MAX_ROWS else "prefill")]


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor passed for pointers the launch does not use (no mask, no split-KV partials)."""
    return torch.zeros((1,), dtype=dtype, device=device)


def pick_num_splits(programs: int, kv_len: int, device: torch.device) -> int:
    """Split the keys across programs when the tiles alone leave streaming multiprocessors idle."""
    if device.type != "cuda":
        return 1
    sm_count = _sm_count(device)
    if programs >= sm_count:
        return 1
    return max(1, min(triton.cdiv(2 * sm_count, programs), kv_len // MIN_KEYS_PER_SPLIT))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: 3xTF32 keeps float32 inputs near float32 accuracy; 16-bit inputs ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def flash_lora_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch Flash-LoRA-Attention (LRAgent, arXiv:2602.01053) and return O (B, H_q, Lq, D).

    q (B, H_q, Lq, D); k, v_base (B, H_kv, Lk, D); v_lr (B, Lk, r) or (B, H_kv, Lk, r); lora_b (H_kv, r, D);
    attn_mask boolean, broadcastable to (B, H_q, Lq, Lk), True = attend (replaces the causal rule).
    `config` and `num_splits` override the shipped tile configuration and the split-KV heuristic (tests).
    """
    check_lora_attention_inputs(q, k, v_base, v_lr, lora_b, attn_mask)
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KvprofError(
            f"head_dim {head_dim} has no Flash-LoRA-Attention kernel; supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}. Use the torch reference "
            "(flash_lora_attention_ref) for other head sizes."
        )
    q, k, v_base, v_lr, lora_b = map(_last_dim_contiguous, (q, k, v_base, v_lr, lora_b))
    group = q_heads // kv_heads
    rank = v_lr.shape[-1]
    padded_rank = rank_pad(rank)
    rows = q_len * group
    config = config or pick_config(q.dtype, head_dim, rows)
    m_blocks = triton.cdiv(rows, config.block_m)
    if num_splits is None:
        num_splits = pick_num_splits(m_blocks * batch * kv_heads, kv_len, q.device)
    split_len = triton.cdiv(triton.cdiv(kv_len, num_splits), config.block_n) * config.block_n
    num_splits = triton.cdiv(kv_len, split_len)

    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty((batch, q_heads, q_len, head_dim), dtype=q.dtype, device=q.device)
    if v_lr.dim() == 3:
        lr_strides = (v_lr.stride(0), 0, v_lr.stride(1))
    else:
        lr_strides = (v_lr.stride(0), v_lr.stride(1), v_lr.stride(2))
    if attn_mask is None:
        mask = _placeholder(q.device, torch.uint8)
        mask_strides = (0, 0, 0, 0)
    else:
        mask = attn_mask.expand(batch, q_heads, q_len, kv_len).view(torch.uint8)
        mask_strides = mask.stride()
    if num_splits > 1:
        part_rows = batch * kv_heads * num_splits * rows
        partials = torch.empty((part_rows * (head_dim + 2),), dtype=torch.float32, device=q.device)
        part_out, part_max, part_sum = partials.split([part_rows * head_dim, part_rows, part_rows])
    else:
        part_out = part_max = part_sum = _placeholder(q.device, torch.float32)
    interpreting = bool(triton.knobs.runtime.interpret)
    precision = dot_precision(q.dtype)

    flash_lora_attention_fwd[(m_blocks, batch * kv_heads, num_splits)](
        q,
        k,
        v_base,
        v_lr,
        lora_b,
        mask,
        out,
        part_out,
        part_max,
        part_sum,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v_base.stride(0),
        v_base.stride(1),
        v_base.stride(2),
        *lr_strides,
        lora_b.stride(0),
        lora_b.stride(1),
        *mask_strides,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        kv_heads,
        group,
        q_len,
        kv_len,
        rank,
        scale * LOG2_E,
        int(causal and attn_mask is None),
        int(attn_mask is not None),
        num_splits,
        split_len,
        HEAD_DIM=head_dim,
        RANK_PAD=padded_rank,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        INTERPRETING=interpreting,
        PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,
    )
    if num_splits > 1:
        combine_splits[(triton.cdiv(rows, COMBINE_BLOCK_M), batch * kv_heads)](
            part_out,
            part_max,
            part_sum,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            kv_heads,
            group,
            q_len,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_M=COMBINE_BLOCK_M,
            INTERPRETING=interpreting,
            num_warps=COMBINE_NUM_WARPS,
            enable_fp_fusion=True,
        )
    return out
