"""Anchor-based low-rank cache correction: out = C_src + Σ_n w_n·U_n·V_n, written into the target cache.

KVCMAS's anchor deltas are rank-r factors, so one layer's K or V correction is a weighted sum of N low-rank products;
fused, each output tile is produced once from the factors instead of materialising (H, L, D) per term. Shapes:

    c_src  (H, L, D)     source cache of one segment (one layer, keys or values)
    u      (N, H, L, r)  left factors of the N anchor deltas
    v      (N, H, r, D)  right factors
    w      (N,)          mixing weights (softmax over anchors), any float dtype
    out    (H, L, D)     may be a view into the target cache, e.g. cache[b, :, start:start + L, :], or c_src itself

Torch reference (CPU path) and dispatcher; the Triton kernel is `kvprof.kernels.correction_triton`.
"""

from __future__ import annotations

import torch

from kvprof.errors import KvprofError
from kvprof.kernels.attention import MAX_RANK, SUPPORTED_DTYPES, triton_path_available


def check_correction_inputs(
    c_src: torch.Tensor, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """Raise `KvprofError` naming the offending input when the shapes, dtypes or devices do not fit together."""
    if c_src.dim() != 3:
        raise KvprofError(f"c_src {tuple(c_src.shape)} must be (H, L, D): pass one batch element of one layer.")
    heads, length, head_dim = c_src.shape
    if u.dim() != 4 or u.shape[1:3] != (heads, length):
        raise KvprofError(
            f"u {tuple(u.shape)} must be (N, H={heads}, L={length}, r) to match c_src "
            f"{tuple(c_src.shape)}; pass the left factors of the same segment."
        )
    anchors, rank = u.shape[0], u.shape[3]
    if v.shape != (anchors, heads, rank, head_dim):
        raise KvprofError(
            f"v {tuple(v.shape)} must be (N={anchors}, H={heads}, r={rank}, D={head_dim}) to match u "
            f"{tuple(u.shape)}; pass the right factors of the same anchors and rank."
        )
    if w.shape != (anchors,):
        raise KvprofError(f"w {tuple(w.shape)} must be ({anchors},), one weight per anchor in u and v.")
    if not 1 <= rank <= MAX_RANK:
        raise KvprofError(
            f"anchor rank {rank} is outside 1..{MAX_RANK}; refit the anchors with a rank up to {MAX_RANK}."
        )
    if c_src.dtype not in SUPPORTED_DTYPES:
        raise KvprofError(f"c_src is {c_src.dtype}; use float16, bfloat16 or float32.")
    for name, tensor in {"u": u, "v": v}.items():
        if tensor.dtype != c_src.dtype:
            raise KvprofError(f"{name} is {tensor.dtype} but c_src is {c_src.dtype}; cast {name} to {c_src.dtype}.")
    for name, tensor in {"u": u, "v": v, "w": w}.items():
        if tensor.device != c_src.device:
            raise KvprofError(f"{name} is on {tensor.device} but c_src is on {c_src.device}; move {name} there.")
    if out is not None and (out.shape != c_src.shape or out.dtype != c_src.dtype or out.device != c_src.device):
        raise KvprofError(
            f"out {tuple(out.shape)} {out.dtype} must match c_src {tuple(c_src.shape)} {c_src.dtype} "
            f"on {c_src.device}; pass the target cache slice of the same segment."
        )


def low_rank_correction_ref(c_src: torch.Tensor, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch reference (and CPU path): C_src + Σ_n w_n·U_n·V_n, computed in float32 and rounded once to c_src's
    dtype. c_src (H, L, D), u (N, H, L, r), v (N, H, r, D), w (N,) → (H, L, D)."""
    check_correction_inputs(c_src, u, v, w)
    correction = torch.einsum("n,nhlr,nhrd->hld", w.float(), u.float(), v.float())
    return (c_src.float() + correction).to(c_src.dtype)


def low_rank_correction(
    c_src: torch.Tensor, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """C_src + Σ_n w_n·U_n·V_n into `out` (allocated when None) and return it: the fused Triton kernel on CUDA,
    the torch reference elsewhere. c_src (H, L, D), u (N, H, L, r), v (N, H, r, D), w (N,), out (H, L, D)."""
    check_correction_inputs(c_src, u, v, w, out)
    if triton_path_available(c_src):
        from kvprof.kernels.correction_triton import low_rank_correction_triton

        return low_rank_correction_triton(c_src, u, v, w, out)
    result = low_rank_correction_ref(c_src, u, v, w)
    if out is None:
        return result
    out.copy_(result)
    return out
