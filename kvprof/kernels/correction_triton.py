"""Fused low-rank cache correction in Triton: out = C_src + Σ_n w_n·U_n·V_n (KVCOMM / KVCMAS anchors).

One program owns a (BLOCK_L, D) tile of one head: it loads the source tile once, accumulates every anchor's
U_n·V_n in float32 (the rank, a compile-time constant, in chunks of 16, so 16-bit `tl.dot` always has K = 16) and
stores the corrected tile straight into the target cache. Shapes: c_src (H, L, D), u (N, H, L, r), v (N, H, r, D),
w (N,), out (H, L, D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvprof.errors import KvprofError
from kvprof.kernels.attention import SUPPORTED_HEAD_DIMS
from kvprof.kernels.attention_triton import (
    KernelLaunch,
    dot_accumulate,
    dot_precision,
    dtype_name,
    on_device,
    round_to,
)
from kvprof.kernels.correction import check_correction_inputs

RANK_CHUNK = 16


@triton.jit(do_not_specialize=["seq_len", "num_anchors"])
def low_rank_correction_fwd(
    c_src_ptr,
    u_ptr,
    v_ptr,
    w_ptr,
    out_ptr,
    stride_ch,
    stride_cl,
    stride_un,
    stride_uh,
    stride_ul,
    stride_vn,
    stride_vh,
    stride_vr,
    stride_oh,
    stride_ol,
    seq_len,
    num_anchors,
    HEAD_DIM: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    RANK_CHUNK: tl.constexpr,
    INTERPRETING: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid: (cdiv(L, BLOCK_L), H). Every pointer's last dimension is contiguous; w is float32. The rank is a
    compile-time constant: its chunks unroll, and only a last partial chunk masks its columns. Anchor, head and
    row offsets are int64 (N·H·L·r passes 2³¹ for long segments)."""
    pid_l = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    rows = offs_l.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, RANK_CHUNK)
    row_valid = offs_l < seq_len

    acc = tl.load(
        c_src_ptr + head * stride_ch + rows[:, None] * stride_cl + offs_d[None, :], mask=row_valid[:, None], other=0.0
    ).to(tl.float32)
    for anchor in range(0, num_anchors):
        anchor64 = tl.full((), anchor, tl.int64)
        u_rows = u_ptr + anchor64 * stride_un + head * stride_uh + rows * stride_ul
        v_head = v_ptr + anchor64 * stride_vn + head * stride_vh
        term = tl.zeros((BLOCK_L, HEAD_DIM), tl.float32)
        for r0 in tl.static_range(0, RANK, RANK_CHUNK):
            cols = r0 + offs_r
            if r0 + RANK_CHUNK <= RANK:
                u = tl.load(u_rows[:, None] + cols[None, :], mask=row_valid[:, None], other=0.0)
                v = tl.load(v_head + cols[:, None] * stride_vr + offs_d[None, :])
            else:
                u = tl.load(
                    u_rows[:, None] + cols[None, :], mask=row_valid[:, None] & (cols[None, :] < RANK), other=0.0
                )
                v = tl.load(v_head + cols[:, None] * stride_vr + offs_d[None, :], mask=cols[:, None] < RANK, other=0.0)
            term = dot_accumulate(u, v, term, INTERPRETING, PRECISION)
        acc += tl.load(w_ptr + anchor) * term
    out_ptrs = out_ptr + head * stride_oh + rows[:, None] * stride_ol + offs_d[None, :]
    tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty, INTERPRETING), mask=row_valid[:, None])


@dataclass(frozen=True)
class CorrectionConfig:
    """Tile size and launch options of one shipped `low_rank_correction_fwd` configuration."""

    block_l: int
    num_warps: int
    num_stages: int


# Not tuned on hardware: the kernel streams C_src, U and V once, so one moderate tile per dtype and head_dim.
CORRECTION_CONFIGS: dict[tuple[str, int], CorrectionConfig] = {
    (dtype, head_dim): CorrectionConfig(64, 4, 2)
    for dtype in ("float16", "bfloat16", "float32")
    for head_dim in SUPPORTED_HEAD_DIMS
}


def correction_launch(
    c_src: torch.Tensor, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, KernelLaunch]:
    """`out` (allocated when None) and the launch that fills it; see `low_rank_correction_triton`."""
    check_correction_inputs(c_src, u, v, w, out)
    heads, length, head_dim = c_src.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KvprofError(
            f"head_dim {head_dim} has no low-rank correction kernel; supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}. Use low_rank_correction_ref instead."
        )
    if out is None:
        out = torch.empty_like(c_src, memory_format=torch.contiguous_format)
    if out.stride(-1) != 1:
        raise KvprofError(
            "out must have a contiguous last (head_dim) dimension, as a cache slice "
            "cache[b, :, start:end, :] has; pass such a view."
        )
    c_src, u, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (c_src, u, v))
    weights = w.to(device=c_src.device, dtype=torch.float32).contiguous()
    config = CORRECTION_CONFIGS[(dtype_name(c_src.dtype), head_dim)]
    launch = KernelLaunch(
        low_rank_correction_fwd,
        (triton.cdiv(length, config.block_l), heads),
        (
            c_src,
            u,
            v,
            weights,
            out,
            c_src.stride(0),
            c_src.stride(1),
            u.stride(0),
            u.stride(1),
            u.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            out.stride(0),
            out.stride(1),
            length,
            u.shape[0],
        ),
        dict(
            HEAD_DIM=head_dim,
            RANK=u.shape[3],
            BLOCK_L=config.block_l,
            RANK_CHUNK=RANK_CHUNK,
            INTERPRETING=bool(triton.knobs.runtime.interpret),
            PRECISION=dot_precision(c_src.dtype),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            enable_fp_fusion=True,
        ),
    )
    return out, launch


def low_rank_correction_triton(
    c_src: torch.Tensor, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch the fused correction; `out` (H, L, D) may be a strided view into the target cache or c_src itself
    (each tile is read before it is written). Returns `out`."""
    out, launch = correction_launch(c_src, u, v, w, out)
    with on_device(c_src.device):
        launch.run()
    return out
