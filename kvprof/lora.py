"""The cache-side algebra of LoRA: per-layer K/V projections split into base (X·W0) and low-rank (X·A)·B parts.

For a projection with LoRA, `Y = X·W0ᵀ + s·(X·Aᵀ)·Bᵀ` (peft stores A as (r, d_in), B as (d_out, r)). Values split
exactly: `V = V_base + V_lr·B̃` with `V_lr = X·Aᵀ` (L, r) and `B̃ = s·Bᵀ` (r, H_kv·D). Keys are stored after RoPE,
which is linear, so `K = RoPE(X·W0ᵀ) + RoPE(V_lr·B̃)`: the low-rank key part can be stored at rank r but must be
expanded to full width before rotation, costing `L·r·H_kv·D` multiply-adds per use (LRAgent and PReCache refuse
LoRA on k_proj; kvprof supports it at that cost).

`X` is the input of the attention projections (the output of the layer's input norm), captured by `HiddenTap`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvprof.errors import KvprofError
from kvprof.rope import apply_rope

CACHED_PROJECTIONS = ("k_proj", "v_proj")


@dataclass
class ProjectionWeights:
    """One cached projection (k_proj or v_proj) of one layer.

    base_weight: (H_kv·D, d_model); base_bias: (H_kv·D,) or None;
    down[agent]: A, (r, d_model); up[agent]: s·B, (H_kv·D, r) — only for agents whose adapter targets it.
    """

    base_weight: torch.Tensor
    base_bias: torch.Tensor | None
    down: dict[str, torch.Tensor] = field(default_factory=dict)
    up: dict[str, torch.Tensor] = field(default_factory=dict)

    def base(self, hidden: torch.Tensor) -> torch.Tensor:
        """X·W0ᵀ (+ bias): (..., L, d_model) → (..., L, H_kv·D)."""
        return torch.nn.functional.linear(hidden, self.base_weight, self.base_bias)

    def expand(self, low_rank: torch.Tensor, agent: str) -> torch.Tensor:
        """(X·Aᵀ)·s·Bᵀ: (..., L, r) → (..., L, H_kv·D)."""
        return low_rank @ self.up[agent].T


@dataclass
class LayerSplit:
    key: ProjectionWeights
    value: ProjectionWeights


def _linear_parts(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = getattr(module, "base_layer", module)
    return base.weight.detach(), None if base.bias is None else base.bias.detach()


def layer_splits(agents) -> list[LayerSplit]:
    """Per layer, the k/v projection weights of the base and of every agent's adapter (see `ProjectionWeights`)."""
    splits = []
    for layer in decoder_layers(agents.base_model):
        parts = {}
        for name in CACHED_PROJECTIONS:
            module = getattr(layer.self_attn, name)
            weight, bias = _linear_parts(module)
            split = ProjectionWeights(weight, bias)
            for agent in getattr(module, "lora_A", {}):
                if agent not in agents.spec.names:
                    continue
                scale = module.scaling[agent]
                split.down[agent] = module.lora_A[agent].weight.detach()
                split.up[agent] = module.lora_B[agent].weight.detach() * scale
            parts[name] = split
        splits.append(LayerSplit(key=parts["k_proj"], value=parts["v_proj"]))
    return splits


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (LoRA layers are injected in place, so this is the adapted
    model too)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise KvprofError(
            f"model {model.config.name_or_path!r} has no decoder layer list (model.layers); kvprof "
            "supports Llama-style decoders (Llama, Qwen2, Mistral)."
        )
    return layers


def shared_down_projection(splits: list[LayerSplit], agents: list[str]) -> bool:
    """True when every agent adapts the same projections with an identical A (BaseLRShared's requirement)."""
    for split in splits:
        for projection in (split.key, split.value):
            downs = [projection.down.get(agent) for agent in agents]
            if any(d is None for d in downs) and not all(d is None for d in downs):
                return False
            if downs[0] is not None and not all(torch.equal(downs[0], d) for d in downs[1:]):
                return False
    return True


class HiddenTap:
    """Captures, during forwards inside `capture()`, X, the input of each layer's attention projections, and the
    residual stream entering each decoder layer (what a policy recomputing layers from a stored state starts from).

    `hidden[i]` and `residual[i]` are (B, L, d_model) for layer i, from the last forward.
    """

    def __init__(self, model):
        self.layers = decoder_layers(model)
        self.hidden: list[torch.Tensor | None] = [None] * len(self.layers)
        self.residual: list[torch.Tensor | None] = [None] * len(self.layers)

    @contextlib.contextmanager
    def capture(self) -> Iterator[HiddenTap]:
        def hook(target, index):
            def grab(module, args, kwargs):
                target[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

            return grab

        handles = [
            module.register_forward_pre_hook(hook(target, i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
            for module, target in ((layer.self_attn, self.hidden), (layer, self.residual))
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def heads(flat: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, L, H·D) → (B, H, L, D)."""
    batch, length, width = flat.shape
    return flat.view(batch, length, width // head_dim, head_dim).transpose(1, 2)


def base_kv(
    split: LayerSplit,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Base cache of tokens with attention inputs `hidden` (B, L, d_model) at `positions` (L,):
    K_base = RoPE(X·W0_kᵀ), V_base = X·W0_vᵀ, each (B, H_kv, L, D)."""
    keys = heads(split.key.base(hidden), head_dim)
    values = heads(split.value.base(hidden), head_dim)
    return apply_rope(keys, positions, inv_freq, attention_scaling), values
