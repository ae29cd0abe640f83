"""Flash-LoRA-Attention forward in Triton (LRAgent, arXiv:2602.01053, "Flash-LoRA-Attention").

One online-softmax pass computes acc = P·V_base (BLOCK_M, D) and acc_lr = P·V_lr (BLOCK_M, r_pad), then
O = acc / l + (acc_lr / l)·B. The g query heads of a KV head are packed into rows (row = position·g + head); full key
blocks are visited unmasked, then the diagonal / ragged / masked ones; with fewer tiles than SMs the keys are split
(`combine_splits`: the flash-decoding merge, exact since B is linear). Rank, causality and mask are compile-time
constants; prefill ranks below r_pad are zero-padded on the host (EVEN_R); offsets past 2³¹ are int64. Design:
docs/kernels.md, docs/design.md#kernels-kvprofkernels.

Shapes (H_q = g·H_kv): q (B, H_q, Lq, D); k, v_base (B, H_kv, Lk, D); v_lr (B, Lk, r) or (B, H_kv, Lk, r); lora_b
(H_kv, r, D); out (B, H_q, Lq, D), stored as (B, Lq, H_q, D).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvprof.errors import KvprofError
from kvprof.kernels.attention import SUPPORTED_HEAD_DIMS, check_lora_attention_inputs, lora_factors_like

LOG2_E = 1.4426950408889634
DECODE_MAX_ROWS = 16
COMBINE_BLOCK_M = 16
COMBINE_SPLIT_CHUNK = 4
COMBINE_NUM_WARPS = 4
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64
# The combine's statistics tile holds MAX_SPLITS rows for any count the heuristic picks (masked past it), so one
# compile serves them all: a tile padded to the count's power of two recompiled when a decode's growing context
# crossed one (e.g. 9 splits at 4608 keys), a compile that landed in that step's timing. Only a larger `num_splits`
# override pads further.
COMBINE_SPLITS_PAD = triton.next_power_of_2(MAX_SPLITS)


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
    """x.to(dtype) rounding to nearest even as the GPU does (the interpreter truncates, so the bias is added first)."""
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
    row_valid,
    diagonal,
    qk_scale,
    stride_kn,
    stride_vn,
    stride_lrn,
    stride_mk,
    offs_d,
    offs_r,
    offs_n0,
    BOUNDARY: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold keys [start_n, start_n + BLOCK_N) into the online-softmax state of one tile. A BOUNDARY block checks
    the key range, the causal rule and the user mask; any other block is seen completely by every row."""
    offs_n = start_n + offs_n0
    k_ptrs = k_head_ptr + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = v_head_ptr + offs_n[:, None] * stride_vn + offs_d[None, :]
    v_lr_ptrs = v_lr_head_ptr + offs_n[:, None] * stride_lrn + offs_r[None, :]
    if BOUNDARY:
        key_valid = offs_n < keys_end
        k = tl.load(k_ptrs, mask=key_valid[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = dot_accumulate(q, k, None, INTERPRETING, PRECISION) * qk_scale
    if BOUNDARY:
        visible = key_valid[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None] + diagonal)
        if HAS_MASK:
            allowed = tl.load(
                mask_row_ptrs[:, None] + offs_n[None, :] * stride_mk,
                mask=row_valid[:, None] & key_valid[None, :],
                other=1,
            )
            visible = visible & (allowed != 0)
        qk = tl.where(visible, qk, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(qk, 1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.math.exp2(row_max - shift)
    p = tl.math.exp2(qk - shift[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc_lr = acc_lr * alpha[:, None]
    if BOUNDARY:
        v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
        if RANK == RANK_PAD:
            v_lr = tl.load(v_lr_ptrs, mask=key_valid[:, None], other=0.0)
        else:
            v_lr = tl.load(v_lr_ptrs, mask=key_valid[:, None] & (offs_r[None, :] < RANK), other=0.0)
    else:
        v = tl.load(v_ptrs)
        if RANK == RANK_PAD:
            v_lr = tl.load(v_lr_ptrs)
        else:
            v_lr = tl.load(v_lr_ptrs, mask=offs_r[None, :] < RANK, other=0.0)
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
    offs_r,
    offs_d,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """O = acc / l + (acc_lr / l)·B for one tile, in float32; rows that saw no key give zeros."""
    inv_sum = 1.0 / tl.where(row_sum == 0.0, 1.0, row_sum)
    lora_b_ptrs = lora_b_head_ptr + offs_r[:, None] * stride_br + offs_d[None, :]
    if RANK == RANK_PAD:
        lora_b = tl.load(lora_b_ptrs)
    else:
        lora_b = tl.load(lora_b_ptrs, mask=offs_r[:, None] < RANK, other=0.0)
    out_lr = round_to(acc_lr * inv_sum[:, None], lora_b.dtype, INTERPRETING)
    return dot_accumulate(out_lr, lora_b, acc * inv_sum[:, None], INTERPRETING, PRECISION)


@triton.jit(do_not_specialize=["num_kv_heads", "group", "q_len", "kv_len", "num_splits", "split_len"])
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
    qk_scale,
    num_splits,
    split_len,
    HEAD_DIM: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (query tile, batch·KV head, key split) program; grid (cdiv(Lq·g, BLOCK_M), B·H_kv, num_splits).

    One split writes O; several write part_out (B·H_kv, splits, Lq·g, D) float32 and log2-domain part_max, part_sum
    (B·H_kv, splits, Lq·g). `qk_scale`: softmax scale · log2(e); CAUSAL bottom-right; HAS_MASK: mask
    (B, H_q, Lq, Lk), nonzero = attend."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    batch = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = (pid_bh % num_kv_heads).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_total = q_len * group
    row_valid = rows < rows_total
    q_pos = rows // group
    q_row = q_pos.to(tl.int64)
    q_head = kv_head * group + rows % group
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, RANK_PAD)
    offs_n0 = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + batch * stride_qb + q_head[:, None] * stride_qh + q_row[:, None] * stride_qm + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    k_head_ptr = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_head_ptr = v_ptr + batch * stride_vb + kv_head * stride_vh
    v_lr_head_ptr = v_lr_ptr + batch * stride_lrb + kv_head * stride_lrh
    mask_row_ptrs = mask_ptr + batch * stride_mb + q_head * stride_mh + q_row * stride_mq

    diagonal = kv_len - q_len
    first_pos = (pid_m * BLOCK_M) // group
    last_pos = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
    split_start = pid_split * split_len
    if CAUSAL:
        split_end = tl.minimum(split_start + split_len, tl.minimum(kv_len, last_pos + diagonal + 1))
        seen_by_all = tl.minimum(split_end, first_pos + diagonal + 1)
    else:
        split_end = tl.minimum(split_start + split_len, kv_len)
        seen_by_all = split_end
    if HAS_MASK:
        unmasked_end = split_start
    else:
        unmasked_end = split_start + tl.maximum(seen_by_all - split_start, 0) // BLOCK_N * BLOCK_N

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
            row_valid,
            diagonal,
            qk_scale,
            stride_kn,
            stride_vn,
            stride_lrn,
            stride_mk,
            offs_d,
            offs_r,
            offs_n0,
            False,
            CAUSAL,
            HAS_MASK,
            RANK,
            RANK_PAD,
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
            row_valid,
            diagonal,
            qk_scale,
            stride_kn,
            stride_vn,
            stride_lrn,
            stride_mk,
            offs_d,
            offs_r,
            offs_n0,
            True,
            CAUSAL,
            HAS_MASK,
            RANK,
            RANK_PAD,
            INTERPRETING,
            PRECISION,
        )

    out = _epilogue(
        acc,
        acc_lr,
        row_sum,
        lora_b_ptr + kv_head * stride_bh,
        stride_br,
        offs_r,
        offs_d,
        RANK,
        RANK_PAD,
        INTERPRETING,
        PRECISION,
    )
    if num_splits == 1:
        out_ptrs = (
            out_ptr + batch * stride_ob + q_head[:, None] * stride_oh + q_row[:, None] * stride_om + offs_d[None, :]
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
    SPLITS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INTERPRETING: tl.constexpr,
):
    """Merge per-split outputs weighted by 2^(m_s − M)·l_s; grid (cdiv(Lq·g, BLOCK_M), B·H_kv). Statistics load as
    one (SPLITS_PAD, BLOCK_M) tile; outputs are summed SPLIT_CHUNK splits at a time."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = (pid_bh % num_kv_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_total = q_len * group
    row_valid = rows < rows_total
    q_row = (rows // group).to(tl.int64)
    q_head = kv_head * group + rows % group
    offs_d = tl.arange(0, HEAD_DIM)
    first_part = (pid_bh * num_splits).to(tl.int64)

    offs_s = tl.arange(0, SPLITS_PAD)
    stats = (first_part + offs_s[:, None]) * rows_total + rows[None, :]
    stats_valid = (offs_s[:, None] < num_splits) & row_valid[None, :]
    part_max = tl.load(part_max_ptr + stats, mask=stats_valid, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + stats, mask=stats_valid, other=0.0)
    top = tl.max(part_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    mass = tl.sum(tl.math.exp2(part_max - shift[None, :]) * part_sum, 0)
    inv_mass = 1.0 / tl.where(mass == 0.0, 1.0, mass)

    out = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    for split in range(0, num_splits, SPLIT_CHUNK):
        chunk = split + offs_c
        part = (first_part + chunk[:, None]) * rows_total + rows[None, :]
        valid = (chunk[:, None] < num_splits) & row_valid[None, :]
        weight = tl.math.exp2(tl.load(part_max_ptr + part, mask=valid, other=float("-inf")) - shift[None, :])
        weight = weight * tl.load(part_sum_ptr + part, mask=valid, other=0.0)
        tile = tl.load(
            part_out_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=valid[:, :, None], other=0.0
        )
        out += tl.sum(weight[:, :, None] * tile, 0)
    out = out * inv_mass[:, None]
    out_ptrs = out_ptr + batch * stride_ob + q_head[:, None] * stride_oh + q_row[:, None] * stride_om + offs_d[None, :]
    tl.store(out_ptrs, round_to(out, out_ptr.dtype.element_ty, INTERPRETING), mask=row_valid[:, None])


@dataclass(frozen=True)
class AttentionConfig:
    """One shipped configuration's tiles and launch options (rank padded to ≥ `min_rank_pad`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_rank_pad: int = 16


RANK_PADS = (16, 32, 64)
ROW_BUCKETS = ("decode", "prefill")


def _shipped_config(dtype: str, head_dim: int, padded_rank: int, masked: bool, bucket: str) -> AttentionConfig:
    """The tile for one (dtype, head_dim, padded rank, mask flag, row bucket); see `ATTENTION_CONFIGS`."""
    if dtype == "float32":
        return AttentionConfig(64, 64 if head_dim == 32 else 32, 4, 2)
    if bucket == "decode":
        return AttentionConfig(16, 64, 4, 2, min_rank_pad=32)
    if masked:
        if head_dim == 128:
            return AttentionConfig(128, 32, 8, 2)
        return AttentionConfig(128, 32 if head_dim == 32 else 64, 8, 3)
    return AttentionConfig(128, 64, 8, 3)


# Chosen for sm_90 from the ahead-of-time compile of candidate tiles (registers, spills and shared memory per
# block; tests/test_kernels_aot.py prints the shipped ones, docs/kernels.md lists them) starting from the tile shapes
# of Triton's fused-attention tutorial, then timed on an H200 at D = 128 (scripts/kernel_config_sweep.py; numbers in
# docs/kernels.md). Mask-free prefill 128×64 with 8 warps, 3 stages (no spills; 4 warps spill at D = 32, 64; the
# fastest timed tile, 128×128 with 2 stages, was 5 % faster in one run, within its noise); masked prefill at D = 128
# 128×32, 8 warps, 2 stages: 1.7× faster than the 64×64 tile the compile chose (12.6 against 21.7 ms for a 2k chunk
# over 32k keys; no spills at r = 16, 8 and 60 bytes at r_pad 32 and 64, where the 64×64 tile had none in this
# compile but spilled 14 bytes at r = 16 under the GPU's Triton 3.6); other head dims' masked tiles are untimed
# (smaller key blocks at D = 32, as the mask tile costs registers); decode (Lq·g ≤ 16 packed query rows) 16×64,
# 4 warps, 2 stages and the rank padded to ≥ 32 (2 warps, 3 stages or r_pad = 16 spill at D = 128; timed candidates
# differed within the run's noise). Keyed on (dtype, head_dim, padded rank, user mask, row bucket; no shipped tile
# depends on the padded rank yet, the AOT table shows it need not); float32 (3xTF32 dots, a correctness path: it
# spills, see the table) has one bucket, "any".
ATTENTION_CONFIGS: dict[tuple[str, int, int, bool, str], AttentionConfig] = {
    (dtype, head_dim, padded_rank, masked, bucket): _shipped_config(dtype, head_dim, padded_rank, masked, bucket)
    for dtype in ("float16", "bfloat16", "float32")
    for head_dim in SUPPORTED_HEAD_DIMS
    for padded_rank in RANK_PADS
    for masked in (False, True)
    for bucket in (("any",) if dtype == "float32" else ROW_BUCKETS)
}


def rank_pad(rank: int) -> int:
    """The padded rank the kernel computes with: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rank))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pick_config(dtype: torch.dtype, head_dim: int, padded_rank: int, masked: bool, rows: int) -> AttentionConfig:
    """The shipped configuration for a dtype, head_dim, padded rank, mask flag and Lq·g packed query rows."""
    if dtype == torch.float32:
        bucket = "any"
    else:
        bucket = "decode" if rows <= DECODE_MAX_ROWS else "prefill"
    return ATTENTION_CONFIGS[(dtype_name(dtype), head_dim, padded_rank, masked, bucket)]


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor passed for pointers the launch does not use (no mask, no split-KV partials)."""
    return torch.zeros((1,), dtype=dtype, device=device)


def pick_num_splits(programs: int, kv_len: int, device: torch.device) -> int:
    """Key splits when the tiles alone leave SMs idle (at most MAX_SPLITS)."""
    if device.type != "cuda":
        return 1
    sm_count = _sm_count(device)
    if programs >= sm_count:
        return 1
    return max(1, min(triton.cdiv(2 * sm_count, programs), kv_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: 3xTF32 keeps float32 inputs near float32 accuracy; 16-bit inputs ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch under `device`'s CUDA device (else another GPU's memory would be read); nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch (grid, arguments, constants): what launchers run and the AOT test compiles."""

    kernel: triton.runtime.JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def run(self):
        """Launch; returns Triton's compiled kernel (its `n_regs` and `n_spills` are the hardware's numbers)."""
        return self.kernel[self.grid](*self.args, **self.kwargs)


@dataclass(frozen=True)
class AttentionPlan:
    """A launch's shape-dependent tiles, grids, splits and constants, cached per combination."""

    config: AttentionConfig
    m_blocks: int
    num_splits: int
    split_len: int
    kernel_kwargs: dict
    combine_m_blocks: int
    combine_kwargs: dict


@functools.lru_cache(maxsize=4096)
def attention_plan(
    dtype: torch.dtype,
    device: torch.device,
    batch_kv_heads: int,
    rows: int,
    kv_len: int,
    head_dim: int,
    rank: int,
    causal: bool,
    masked: bool,
    config: AttentionConfig | None,
    num_splits: int | None,
) -> AttentionPlan:
    """The tile configuration, grid and split-KV partition of one launch shape."""
    config = config or pick_config(dtype, head_dim, rank_pad(rank), masked, rows)
    padded_rank = max(rank_pad(rank), config.min_rank_pad)
    m_blocks = triton.cdiv(rows, config.block_m)
    if num_splits is None:
        num_splits = pick_num_splits(m_blocks * batch_kv_heads, kv_len, device)
    split_len = triton.cdiv(triton.cdiv(kv_len, num_splits), config.block_n) * config.block_n
    num_splits = triton.cdiv(kv_len, split_len)
    kernel_kwargs = dict(
        HEAD_DIM=head_dim,
        RANK=rank,
        RANK_PAD=padded_rank,
        CAUSAL=causal and not masked,
        HAS_MASK=masked,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        INTERPRETING=bool(triton.knobs.runtime.interpret),
        PRECISION=dot_precision(dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,
    )
    combine_kwargs = dict(
        HEAD_DIM=head_dim,
        SPLITS_PAD=max(COMBINE_SPLITS_PAD, triton.next_power_of_2(num_splits)),
        SPLIT_CHUNK=COMBINE_SPLIT_CHUNK,
        BLOCK_M=COMBINE_BLOCK_M,
        INTERPRETING=kernel_kwargs["INTERPRETING"],
        num_warps=COMBINE_NUM_WARPS,
        enable_fp_fusion=True,
    )
    return AttentionPlan(
        config, m_blocks, num_splits, split_len, kernel_kwargs, triton.cdiv(rows, COMBINE_BLOCK_M), combine_kwargs
    )


def attention_launches(
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
) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """The output O (B, H_q, Lq, D), allocated, and the launches that fill it; see `flash_lora_attention_triton`."""
    v_lr, lora_b = lora_factors_like(q, v_lr, lora_b)
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
    rows = q_len * group
    rank, padded_rank = v_lr.shape[-1], rank_pad(v_lr.shape[-1])
    if rows > DECODE_MAX_ROWS and rank != padded_rank:
        # Zero columns of V_lr and zero rows of B change nothing and make the prefill loop's V_lr tile EVEN_R: loaded
        # without a column mask, it is pipelined like K and V (O(Lk·r_pad) copy, small next to the attention).
        v_lr = F.pad(v_lr, (0, padded_rank - rank))
        lora_b = F.pad(lora_b, (0, 0, 0, padded_rank - rank))
    plan = attention_plan(
        q.dtype,
        q.device,
        batch * kv_heads,
        rows,
        kv_len,
        head_dim,
        v_lr.shape[-1],
        causal,
        attn_mask is not None,
        config,
        num_splits,
    )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty((batch, q_len, q_heads, head_dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    if v_lr.dim() == 3:
        lr_strides = (v_lr.stride(0), 0, v_lr.stride(1))
    else:
        lr_strides = (v_lr.stride(0), v_lr.stride(1), v_lr.stride(2))
    if attn_mask is None:
        mask = _placeholder(q.device, torch.uint8)
        mask_strides: tuple[int, ...] = (0, 0, 0, 0)
    else:
        mask = attn_mask.expand(batch, q_heads, q_len, kv_len).view(torch.uint8)
        mask_strides = mask.stride()
    splits = plan.num_splits
    if splits > 1:
        part_rows = batch * kv_heads * splits * rows
        partials = torch.empty((part_rows * (head_dim + 2),), dtype=torch.float32, device=q.device)
        part_out, part_max, part_sum = partials.split([part_rows * head_dim, part_rows, part_rows])
    else:
        part_out = part_max = part_sum = _placeholder(q.device, torch.float32)
    out_strides = (out.stride(0), out.stride(1), out.stride(2))
    launches = [
        KernelLaunch(
            flash_lora_attention_fwd,
            (plan.m_blocks, batch * kv_heads, splits),
            (
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
                *q.stride()[:3],
                *k.stride()[:3],
                *v_base.stride()[:3],
                *lr_strides,
                *lora_b.stride()[:2],
                *mask_strides,
                *out_strides,
                kv_heads,
                group,
                q_len,
                kv_len,
                scale * LOG2_E,
                splits,
                plan.split_len,
            ),
            plan.kernel_kwargs,
        )
    ]
    if splits > 1:
        launches.append(
            KernelLaunch(
                combine_splits,
                (plan.combine_m_blocks, batch * kv_heads),
                (part_out, part_max, part_sum, out, *out_strides, kv_heads, group, q_len, splits),
                plan.combine_kwargs,
            )
        )
    return out, launches


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
    """Launch Flash-LoRA-Attention; O (B, H_q, Lq, D), a view of (B, Lq, H_q, D) memory. Shapes: module docstring.

    `attn_mask` (True = attend) replaces causality; float32 factors with 16-bit q are cast; `config`, `num_splits`
    override the shipped tile and split heuristic (tests)."""
    out, launches = attention_launches(q, k, v_base, v_lr, lora_b, scale, causal, attn_mask, config, num_splits)
    with on_device(q.device):
        for launch in launches:
            launch.run()
    return out
