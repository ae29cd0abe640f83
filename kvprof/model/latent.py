"""Multi-head latent attention (MLA: DeepSeek V2 / V3, Kimi K2) as kvprof holds its cache.

An MLA layer caches per token one compressed latent c = norm(X·W_DKV), (B, 1, L, C) with C = `kv_lora_rank`, and
one RoPE key k_rot shared by every head, (B, 1, L, R) with R = `qk_rope_head_dim`, rotated at the token's position;
each head's key and value are expanded from the latent at every forward (`kv_b_proj`). transformers 5 caches exactly
these two (the model calls `cache.update(latent, k_rot)`), as serving engines do.

kvprof holds every layer's cache as (K, V) with the position-carrying part first, so re-aligning a cache to other
positions is one rule for every layer (rotate K with the layer's RoPE, leave V): for an MLA layer its K is k_rot
(B, 1, L, R) and its V the latent (B, 1, L, C). The cache layers kvprof hands the model (`LatentOrderLayer`, and
`kvprof.model.buffers.BufferLayer` for these layers) take the model's order and store kvprof's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvprof.model.lora import attention_of, decoder_layers, recurrent_of

MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # an MLA layer's, before o_proj


@dataclass(frozen=True)
class LatentShape:
    """An MLA layer's cache per token: `rope_dim` R channels of k_rot, `latent_dim` C channels of the latent."""

    rope_dim: int
    latent_dim: int


def latent_shape(attention: torch.nn.Module) -> LatentShape | None:
    """The `LatentShape` of an attention module that caches an MLA latent (it holds `kv_a_proj_with_mqa` and the
    latent's rank), None for one that caches K and V per head."""
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
    """A growing cache layer for an MLA layer that stores (k_rot, latent) as kvprof's K and V while the model updates
    and reads it in its own order (latent, k_rot)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rope_keys, latent = super().update(value_states, key_states, *args, **kwargs)
        return latent, rope_keys


def oriented(cache: DynamicCache, latent: dict[int, LatentShape]) -> DynamicCache:
    """`cache` (a fresh transformers cache) with its MLA layers replaced by `LatentOrderLayer`s, so that
    `cache.layers[i].keys` is each layer's position-carrying part (see module docstring)."""
    for index in latent:
        cache.layers[index] = LatentOrderLayer()
    return cache
