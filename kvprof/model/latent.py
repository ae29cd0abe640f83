"""Multi-head latent attention (MLA: DeepSeek V2 / V3, Kimi K2) as kvprof holds its cache.

An MLA layer caches per token a latent (B, 1, L, C), C = `kv_lora_rank`, and a shared RoPE key k_rot (B, 1, L, R),
R = `qk_rope_head_dim` (transformers: `cache.update(latent, k_rot)`). kvprof holds it as K = k_rot, V = latent —
position-carrying part first, so re-alignment is one rule for every layer (rotate K, keep V); `LatentOrderLayer` and
`kvprof.model.buffers.BufferLayer` take the model's order and store kvprof's. Background: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvprof.model.architecture import attention_of, decoder_layers, recurrent_of

MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # an MLA layer's, before o_proj


@dataclass(frozen=True)
class LatentShape:
    """An MLA layer's cache per token: `rope_dim` R channels of k_rot, `latent_dim` C channels of the latent."""

    rope_dim: int
    latent_dim: int


def latent_shape(attention: torch.nn.Module) -> LatentShape | None:
    """The `LatentShape` of an MLA attention module (`kv_a_proj_with_mqa`), else None."""
    rank = getattr(attention, "kv_lora_rank", None)
    if not hasattr(attention, "kv_a_proj_with_mqa") or not isinstance(rank, int):
        return None
    return LatentShape(rope_dim=int(attention.qk_rope_head_dim), latent_dim=rank)


def latent_layers(model) -> dict[int, LatentShape]:
    """The decoder layers of `model` that cache an MLA latent, by index, with their `LatentShape`."""
    shapes = {}
    for index, layer in enumerate(decoder_layers(model)):
        if recurrent_of(layer) is not None:
            continue
        shape = latent_shape(attention_of(layer, index))
        if shape is not None:
            shapes[index] = shape
    return shapes


class LatentOrderLayer(DynamicLayer):
    """An MLA cache layer storing (k_rot, latent) while the model uses (latent, k_rot)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rope_keys, latent = super().update(value_states, key_states, *args, **kwargs)
        return latent, rope_keys


def oriented(cache: DynamicCache, latent: dict[int, LatentShape]) -> DynamicCache:
    """`cache` with MLA layers as `LatentOrderLayer`s (`.keys`: the position-carrying part)."""
    for index in latent:
        cache.layers[index] = LatentOrderLayer()
    return cache
