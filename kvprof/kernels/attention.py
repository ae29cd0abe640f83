"""Flash-LoRA-Attention: attention over V = V_base + V_lr·B without expanding V_lr to full width.

Paper: LRAgent (Jeon, Ha, Kim, 2026; arXiv:2602.01053), "Flash-LoRA-Attention": O = P·V_base + (P·V_lr)·B, one extra
rank-r accumulator, B applied once per query row. Causal attention is bottom-right (Lq ≤ Lk: query i sees
j ≤ i + Lk − Lq); a boolean mask (broadcastable to (B, H_q, Lq, Lk), True = attend) replaces it. Torch reference (the
CPU path) and dispatcher here; the Triton kernel (`kvprof.kernels.attention_triton`) is imported only on demand.

Shapes (H_q = g·H_kv): q (B, H_q, Lq, D); k, v_base (B, H_kv, Lk, D); v_lr (B, Lk, r) shared or (B, H_kv, Lk, r);
lora_b (H_kv, r, D), scaling folded in; out (B, H_q, Lq, D).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from kvprof.errors import KvprofError

MAX_RANK = 64
SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# How the low-rank policies attend their rank-r values (`kvprof replay --lora-attention`, resolved for a device):
# Flash-LoRA-Attention in every forward; expanded views and SDPA; or as stored in the forwards where that pays
# (`values_as_stored_pay`) and expanded in the others (auto on CPU).
LoraAttention = Literal["kernel", "expand", "short"]
KERNEL: LoraAttention = "kernel"
EXPAND: LoraAttention = "expand"
SHORT: LoraAttention = "short"


# Fewer cached keys than this: a view is cheap to expand (≤ 0.3 ms a layer on 2 CPU cores at 4k keys) and SDPA over
# it decodes faster than the stored path's separate operations (23–35 µs a layer and step at 0.5–4k keys, which
# overtake the expansion after 3–12 decode steps); from ~8k keys the stored path decodes faster too.
MIN_STORED_KEYS = 4096


def values_as_stored_pay(group: int, tokens: int, head_dim: int, keys: int) -> bool:
    """Whether a forward of `tokens` queries (`group` query heads per KV head) over `keys` cached keys moves fewer
    bytes attending the rank-r values as stored than expanding them: the probabilities it materialises per KV head
    (group·tokens rows per key, `flash_lora_attention_ref`) are no more than the D channels per key the expanded
    values write and read back, and the context is long enough for that to outweigh the extra operations
    (`MIN_STORED_KEYS`)."""
    return group * tokens <= head_dim and keys >= MIN_STORED_KEYS


def check_lora_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
) -> None:
    """Raise `KvprofError` naming the offending input when the shapes, dtypes or devices do not fit together."""
    _check_qkv(q, k, v_base)
    _check_low_rank(q, k, v_lr, lora_b)
    tensors = {"q": q, "k": k, "v_base": v_base, "v_lr": v_lr, "lora_b": lora_b}
    for name, tensor in tensors.items():
        if tensor.dtype != q.dtype:
            raise KvprofError(f"{name} is {tensor.dtype} but q is {q.dtype}; cast {name} to {q.dtype}.")
        if tensor.device != q.device:
            raise KvprofError(f"{name} is on {tensor.device} but q is on {q.device}; move {name} to {q.device}.")
    if q.dtype not in SUPPORTED_DTYPES:
        raise KvprofError(f"dtype {q.dtype} is not supported; use float16, bfloat16 or float32.")
    if attn_mask is not None:
        _check_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v_base: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v_base.dim() != 4:
        raise KvprofError(
            f"q, k and v_base must be 4-D (B, H, L, D); got {tuple(q.shape)}, {tuple(k.shape)} and "
            f"{tuple(v_base.shape)}: transpose the (B, L, H, D) layout to (B, H, L, D)."
        )
    batch, q_heads, q_len, head_dim = q.shape
    _, kv_heads, kv_len, _ = k.shape
    if k.shape != v_base.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise KvprofError(
            f"k {tuple(k.shape)} and v_base {tuple(v_base.shape)} must both be (B={batch}, H_kv, Lk, "
            f"D={head_dim}) to match q {tuple(q.shape)}; pass the base cache of the same layer."
        )
    if q_heads % kv_heads:
        raise KvprofError(
            f"q has {q_heads} heads, not a multiple of the {kv_heads} KV heads of k; pass the "
            "query and key heads of the same attention layer."
        )
    if q_len > kv_len:
        raise KvprofError(
            f"q has {q_len} positions but k only {kv_len}; the keys must include the queries "
            "(Lq ≤ Lk): append the new tokens to the cache before attending."
        )


def _check_low_rank(q: torch.Tensor, k: torch.Tensor, v_lr: torch.Tensor, lora_b: torch.Tensor) -> None:
    batch, _, _, head_dim = q.shape
    _, kv_heads, kv_len, _ = k.shape
    if v_lr.dim() == 3:
        lr_ok = v_lr.shape[:2] == (batch, kv_len)
    elif v_lr.dim() == 4:
        lr_ok = v_lr.shape[:3] == (batch, kv_heads, kv_len)
    else:
        lr_ok = False
    if not lr_ok:
        raise KvprofError(
            f"v_lr {tuple(v_lr.shape)} must be (B={batch}, Lk={kv_len}, r) shared by the KV heads or "
            f"(B={batch}, H_kv={kv_heads}, Lk={kv_len}, r) per head; pass the LR cache of the same "
            "tokens as k."
        )
    rank = v_lr.shape[-1]
    if lora_b.dim() != 3 or lora_b.shape != (kv_heads, rank, head_dim):
        raise KvprofError(
            f"lora_b {tuple(lora_b.shape)} must be (H_kv={kv_heads}, r={rank}, D={head_dim}) to match "
            f"v_lr's rank {rank}; pass the B of the adapter whose A produced v_lr "
            "(see `lora_b_per_head`)."
        )
    if not 1 <= rank <= MAX_RANK:
        raise KvprofError(
            f"LoRA rank {rank} is outside 1..{MAX_RANK}; Flash-LoRA-Attention supports ranks up to "
            f"{MAX_RANK}: use the naive expansion for larger adapters."
        )


def _check_mask(attn_mask: torch.Tensor, shape: tuple[int, int, int, int]) -> None:
    """attn_mask must be boolean and broadcast to (B, H_q, Lq, Lk) = `shape`."""
    if attn_mask.dtype != torch.bool:
        raise KvprofError(
            f"attn_mask is {attn_mask.dtype}; pass a boolean mask (True = attend), as "
            "transformers' sdpa mask function builds."
        )
    try:
        torch.broadcast_shapes(attn_mask.shape, shape)
    except RuntimeError:
        raise KvprofError(
            f"attn_mask {tuple(attn_mask.shape)} does not broadcast to (B, H_q, Lq, Lk) = "
            f"{shape}; build it for these query and key lengths."
        ) from None


def lora_factors_like(q: torch.Tensor, v_lr: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v_lr, lora_b as the kernels take them: float32 factors (peft's) cast to a 16-bit q's dtype; else as is."""
    if q.dtype in (torch.float16, torch.bfloat16):
        v_lr = v_lr.to(q.dtype) if v_lr.dtype == torch.float32 else v_lr
        lora_b = lora_b.to(q.dtype) if lora_b.dtype == torch.float32 else lora_b
    return v_lr, lora_b


def bottom_right_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """(Lq, Lk) boolean mask, True where query i may attend key j, i.e. j ≤ i + Lk − Lq."""
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return cols <= rows + (kv_len - q_len)


def _attention_probabilities(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax probabilities P (B, H_kv, g·Lq, Lk) in q's dtype, the g query heads of a KV head stacked as rows (no
    copy of the keys per query head); rows with no visible key are all zero."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group * q_len, head_dim), k.transpose(-1, -2)).mul_(scale)
    if attn_mask is not None:
        visible = attn_mask.expand(batch, q_heads, q_len, kv_len).reshape(batch, kv_heads, group * q_len, kv_len)
        scores.masked_fill_(~visible, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores.float(), dim=-1), nan=0.0)
    else:
        if causal and q_len > 1:  # bottom-right: only the last Lq keys are hidden from some rows, none from all
            own = bottom_right_causal_mask(q_len, q_len, q.device).repeat(group, 1)
            scores[..., kv_len - q_len :].masked_fill_(~own, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1)
    return probs.to(q.dtype)


def flash_lora_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference (and CPU path): O = P·V_base + (P·V_lr)·B (B, H_q, Lq, D) in q's dtype, softmax in float32
    as transformers' eager. Materialises P (`values_as_stored_pay`: short forwards). Shapes: module docstring."""
    v_lr, lora_b = lora_factors_like(q, v_lr, lora_b)
    check_lora_attention_inputs(q, k, v_base, v_lr, lora_b, attn_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    probs = _attention_probabilities(q, k, scale, causal, attn_mask)  # (B, H_kv, g·Lq, Lk)
    per_head_lr = v_lr if v_lr.dim() == 4 else v_lr[:, None]
    out = torch.matmul(probs, v_base)
    out += torch.matmul(torch.matmul(probs, per_head_lr), lora_b)
    return out.reshape(q.shape[0], q.shape[1], q.shape[2], v_base.shape[-1])


def expand_lora_values(v_base: torch.Tensor, v_lr: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """V = V_base + V_lr·B at full width, (B, H_kv, Lk, D): the expansion Flash-LoRA-Attention avoids."""
    if v_lr.dim() == 3:
        return v_base + torch.einsum("blr,hrd->bhld", v_lr, lora_b)
    return v_base + torch.matmul(v_lr, lora_b)


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA with GQA and bottom-right causality: q (B, H_q, Lq, D), k, v (B, H_kv, Lk, D) → (B, H_q, Lq, D).
    Other causal shapes than Lq = Lk or 1 pass a mask; KV heads repeated unless FlashAttention takes GQA."""
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = attn_mask
    is_causal = False
    if mask is None and causal and q_len > 1:
        if q_len == kv_len:
            is_causal = True
        else:
            mask = bottom_right_causal_mask(q_len, kv_len, q.device)
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.is_cuda and (mask is not None or q.dtype == torch.float32):
        k, v, group = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), 1
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
    )


def naive_lora_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The baseline Flash-LoRA-Attention replaces: expand V = V_base + V_lr·B, then SDPA. Same shapes as
    `flash_lora_attention_ref`."""
    v_lr, lora_b = lora_factors_like(q, v_lr, lora_b)
    check_lora_attention_inputs(q, k, v_base, v_lr, lora_b, attn_mask)
    return plain_attention(q, k, expand_lora_values(v_base, v_lr, lora_b), scale, causal, attn_mask)


def lora_b_per_head(lora_b_weight: torch.Tensor, num_kv_heads: int, scaling: float) -> torch.Tensor:
    """PEFT's `lora_B.weight` of a `v_proj` (H_kv·D, r) times the LoRA scaling, as (H_kv, r, D)."""
    out_features, rank = lora_b_weight.shape
    if out_features % num_kv_heads:
        raise KvprofError(
            f"lora_B has {out_features} output features, not a multiple of {num_kv_heads} KV heads; "
            "pass the B of a v_proj adapter and the model's num_key_value_heads."
        )
    head_dim = out_features // num_kv_heads
    return (scaling * lora_b_weight).T.reshape(rank, num_kv_heads, head_dim).transpose(0, 1).contiguous()


def triton_path_available(tensor: torch.Tensor) -> bool:
    """Whether Triton can run on `tensor`: CUDA with Triton, or any under TRITON_INTERPRET=1."""
    try:
        import triton
    except ImportError:
        return False
    return tensor.is_cuda or bool(triton.knobs.runtime.interpret)


def flash_lora_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flash-LoRA-Attention → (B, H_q, Lq, D): Triton on CUDA (head sizes 32, 64, 128; others expand), the torch
    reference elsewhere. `scale` 1/sqrt(D) by default; shapes and masks: module docstring."""
    if triton_path_available(q) and q.shape[-1] in SUPPORTED_HEAD_DIMS:
        from kvprof.kernels.attention_triton import flash_lora_attention_triton

        return flash_lora_attention_triton(q, k, v_base, v_lr, lora_b, scale, causal, attn_mask)
    if q.is_cuda:
        return naive_lora_attention(q, k, v_base, v_lr, lora_b, scale, causal, attn_mask)
    return flash_lora_attention_ref(q, k, v_base, v_lr, lora_b, scale, causal, attn_mask)
