"""Kernels for KV-cache sharing: Flash-LoRA-Attention (LRAgent) and the fused low-rank cache correction.

Every kernel has a torch reference that is also its CPU path (the low-rank view expansion's fused C kernel runs
instead where a C compiler builds it); the Triton versions load only when a CUDA tensor (or the Triton interpreter)
asks for them, so this package imports without Triton.

    attention                 Flash-LoRA-Attention reference, naive expansion, plain SDPA, dispatcher
    attention_triton          the Triton Flash-LoRA-Attention kernel, its tile table and launcher
    correction                low-rank correction C_src + Σ w_n·U_n·V_n: reference and dispatcher
    correction_triton         its Triton kernel and launcher
    transformers_attention    "kvprof_lora": Flash-LoRA-Attention as a transformers attention implementation
    expansion                 the low-rank view expansion on CPU, fused in C (`expansion.c`, built on first use)
    benchmark                 `kvprof bench`: cases, timers, FLOP and byte models
"""

from kvprof.kernels.attention import (
    flash_lora_attention,
    flash_lora_attention_ref,
    lora_b_per_head,
    naive_lora_attention,
    plain_attention,
)
from kvprof.kernels.correction import low_rank_correction, low_rank_correction_ref

__all__ = [
    "flash_lora_attention",
    "flash_lora_attention_ref",
    "lora_b_per_head",
    "low_rank_correction",
    "low_rank_correction_ref",
    "naive_lora_attention",
    "plain_attention",
]
