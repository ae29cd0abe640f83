"""The cache-side algebra of LoRA: per-layer K/V projections split into base (X·W0) and low-rank (X·A)·B parts.

`Y = X·W0ᵀ + s·(X·Aᵀ)·Bᵀ` (peft: A (r, d_in), B (d_out, r)). Values split exactly: `V = V_base + V_lr·B̃`,
`V_lr = X·Aᵀ` (L, r), `B̃ = s·Bᵀ` (r, H_kv·D). Keys are post-RoPE: `K = RoPE(X·W0ᵀ) + RoPE(V_lr·B̃)`, the low-rank
part expanded before rotation (`L·r·H_kv·D` multiply-adds per use; LRAgent and PReCache refuse LoRA on k_proj,
kvprof supports it at that cost). `X`, the attention projections' input, is captured by `HiddenTap`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvprof.errors import KvprofError
from kvprof.model.architecture import attention_of, decoder_layers, head_dim, kv_heads, mixer_of, recurrent_of
from kvprof.model.latent import latent_shape

CACHED_PROJECTIONS = ("k_proj", "v_proj")
SPLIT_SIDES = ("key", "value")  # the fields of a `LayerSplit`, in the order of CACHED_PROJECTIONS


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

    def up_per_head(self, agent: str, head_dim: int) -> torch.Tensor:
        """`agent`'s s·B per KV head, (H_kv, r, D): (X·Aᵀ)·s·Bᵀ of head h is (X·Aᵀ) @ result[h]."""
        up = self.up[agent]
        return up.T.reshape(up.shape[1], -1, head_dim).transpose(0, 1).contiguous()


@dataclass
class LayerSplit:
    key: ProjectionWeights
    value: ProjectionWeights


FUSED_QKV = "qkv_proj"  # Phi-3's fused projection: output columns q (H·D) | k (H_kv·D) | v (H_kv·D)
QKV = ("q_proj", "k_proj", "v_proj")


def projection_columns(attention: torch.nn.Module, name: str, index: int) -> tuple[torch.nn.Module, slice | None]:
    """The module computing projection `name` of layer `index` and its columns (None: all; a block of Phi-3's
    `qkv_proj`); refuses other layouts."""
    if latent_shape(attention) is not None:
        raise KvprofError(
            f"layer {index} is a multi-head latent attention layer, whose cached latent is a norm of X·W_DKV (an "
            "adapter on kv_a_proj_with_mqa acts through that norm, one on kv_b_proj at every read), so its cache "
            "cannot be split into base and adapter parts."
        )
    if hasattr(attention, name):
        return getattr(attention, name), None
    fused = getattr(attention, FUSED_QKV, None)
    config = attention.config
    size = head_dim(config)
    query, kv = config.num_attention_heads * size, kv_heads(config) * size
    width = getattr(getattr(fused, "base_layer", fused), "out_features", None)
    if fused is None or name not in QKV or width != query + 2 * kv:
        raise KvprofError(
            f"layer {index}'s attention has no {name} and no fused qkv_proj laid out q | k | v, so kvprof cannot "
            f"find its {name} output; this model's cache cannot be split into base and adapter parts."
        )
    start = {"q_proj": 0, "k_proj": query, "v_proj": query + kv}[name]
    return fused, slice(start, start + (query if name == "q_proj" else kv))


def _linear_parts(module, rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = getattr(module, "base_layer", module)
    return base.weight.detach()[rows], None if base.bias is None else base.bias.detach()[rows]


def _check_plain_adapter(module: torch.nn.Module, agent: str, where: str) -> None:
    """Refuse an adapter whose output on `module` is not s·(X·Aᵀ)·Bᵀ: a LoRA variant (DoRA rescales the whole
    projection) or a bias on B."""
    variant = getattr(module, "lora_variant", {}).get(agent)
    if variant is not None:
        kind = type(variant).__name__.removesuffix("LinearVariant")
        if kind == "ALora":
            raise KvprofError(
                f"agent {agent}'s adapter is an Activated LoRA, which acts only from its invocation on, while the "
                "low-rank policies apply an agent's adapter to every token it reads (its LR cache); its caches are "
                "shared exactly by policy alorashared, approximately by fullshared."
            )
        raise KvprofError(
            f"agent {agent}'s adapter on {where} is a LoRA variant ({kind}), whose output is not X·A·B, so its cache "
            "does not split into base and LR parts; pick a policy that does not split the cache, or a plain LoRA "
            "adapter."
        )
    if module.lora_B[agent].bias is not None:
        raise KvprofError(
            f"agent {agent}'s adapter on {where} has a bias on B (lora_bias), which kvprof's LR caches do not carry; "
            "pick a policy that does not split the cache, or an adapter without lora_bias."
        )


def layer_splits(agents) -> list[LayerSplit]:
    """Per layer, base and adapter weights of k/v projections (`ProjectionWeights`; Phi-3's `qkv_proj` by column
    blocks, one A for both). Refuses other layouts, v_norm, and adapters that are not plain LoRA (DoRA, bias on B)."""
    splits = []
    model_name = agents.base_model.config.name_or_path
    for index, layer in enumerate(decoder_layers(agents.base_model)):
        attention = attention_of(layer, index)
        if getattr(attention, "v_norm", None) is not None:
            raise KvprofError(
                f"model {model_name!r} normalises its values (v_norm) in layer {index}, so its cached values do not "
                "split into base and adapter parts; pick a policy that does not split the cache."
            )
        parts = {}
        for name in CACHED_PROJECTIONS:
            module, columns = projection_columns(attention, name, index)
            rows = columns or slice(None)
            weight, bias = _linear_parts(module, rows)
            split = ProjectionWeights(weight, bias)
            for agent in getattr(module, "lora_A", {}):
                if agent not in agents.spec.names:
                    continue
                _check_plain_adapter(module, agent, f"layer {index} {name}")
                scale = module.scaling[agent]
                split.down[agent] = module.lora_A[agent].weight.detach()
                split.up[agent] = module.lora_B[agent].weight.detach()[rows] * scale
            parts[name] = split
        splits.append(LayerSplit(key=parts["k_proj"], value=parts["v_proj"]))
    return splits


class ProjectionNorm:
    """A layer's `q_norm` / `k_norm` between projection and RoPE, as the layer applies it: per head (D weights:
    Qwen3; H × D: Cohere) or over the projection (H·D: OLMo 2)."""

    def __init__(self, norm: torch.nn.Module, width: int):
        self.norm = norm
        weight = getattr(norm, "weight", None)
        self.flat = weight is not None and weight.dim() == 1 and weight.numel() == width

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """(B, H, L, D) pre-RoPE queries or keys → normalised, same shape and dtype."""
        batch, heads_count, length, dim = states.shape
        per_token = states.transpose(1, 2)
        if self.flat:
            normed = self.norm(per_token.reshape(batch, length, heads_count * dim)).view_as(per_token)
        else:
            normed = self.norm(per_token)
        return normed.transpose(1, 2)


def invocation_tokens(model, agent: str) -> list[int] | None:
    """The aLoRA invocation ids of `agent`'s adapter (peft's `alora_invocation_tokens`), else None."""
    config = getattr(model, "peft_config", {}).get(agent)
    tokens = getattr(config, "alora_invocation_tokens", None)
    return list(tokens) if tokens else None


NORM_NAMES = {  # a projection's output norm before RoPE and the cache, by architecture
    "q_proj": ("q_norm", "q_layernorm", "qk_norm"),
    "k_proj": ("k_norm", "k_layernorm", "qk_norm"),  # Qwen3, OLMo 2, Gemma 3 / LFM2 / Llama 4 (an L2 norm after
    # RoPE there, which commutes with RoPE's rotation)
    "v_proj": ("v_norm",),
}


def projection_norm(attention: torch.nn.Module, projection: str) -> torch.nn.Module | None:
    """The norm an attention module applies to `projection`'s output before RoPE and the cache (`NORM_NAMES`), or
    None."""
    for name in NORM_NAMES.get(projection, ()):
        norm = getattr(attention, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    return None


def key_norms(model) -> list[ProjectionNorm] | None:
    """Per layer the key `ProjectionNorm` (identity for a layer without one, e.g. Llama 4's NoPE layers), or None
    for a model without key norms. Llama 4's weightless per-head RMS after RoPE commutes with it, so counts."""
    layers = decoder_layers(model)
    norms = [projection_norm(attention_of(layer, index), "k_proj") for index, layer in enumerate(layers)]
    if all(norm is None for norm in norms):
        return None
    width = kv_heads(model.config) * head_dim(model.config)
    return [ProjectionNorm(torch.nn.Identity() if norm is None else norm, width) for norm in norms]


def unshared_down_projections(splits: list[LayerSplit], agents: list[str]) -> list[str]:
    """Cached projections ("layer 0 k_proj", ...) whose A the agents do not share (adapted by some only, or with
    different A): what BaseLRShared refuses; unadapted projections and q_proj / o_proj are free."""
    unshared = []
    for index, split in enumerate(splits):
        for side, projection in (("k_proj", split.key), ("v_proj", split.value)):
            downs = [projection.down.get(agent) for agent in agents]
            if all(d is None for d in downs):
                continue
            if any(d is None for d in downs) or not all(torch.equal(downs[0], d) for d in downs[1:]):
                unshared.append(f"layer {index} {side}")
    return unshared


class HiddenTap:
    """Captures inside `capture()` the forward's own results, which policies store instead of recomputing.

    Per layer i of the last forward: `hidden[i]` (attention input X) and `residual[i]` (entering the layer),
    (B, L, d_model); `base[i]` {"key"|"value": (B, L, H_kv·D)}, X·W0ᵀ (+ bias) from `base_layer`, before key norm
    and RoPE; `down[i]` {"key"|"value": {agent: (B_a, L, r)}}, X·Aᵀ from `lora_A` in the adapter's dtype (B_a: its
    rows of a mixed batch). Set as the layer runs (readable from the cache's `update`); empty `base` / `down` when
    `taps_projections` is False (GPT-NeoX)."""

    def __init__(self, model):
        self.layers = decoder_layers(model)
        self.hidden: list[torch.Tensor | None] = [None] * len(self.layers)
        self.residual: list[torch.Tensor | None] = [None] * len(self.layers)
        self.base: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        self.down: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in self.layers]
        try:  # GPT-NeoX's per-head interleaved query_key_value has no k/v outputs to tap (the split refuses it)
            for index, layer in enumerate(self.layers):
                if recurrent_of(layer) is not None:  # a hybrid's: the split refuses it
                    raise KvprofError(f"layer {index} is recurrent")
                for name in CACHED_PROJECTIONS:
                    projection_columns(attention_of(layer, index), name, index)
            self.taps_projections = True
        except KvprofError:
            self.taps_projections = False

    def _projection_hooks(self, index: int, layer: torch.nn.Module) -> list:
        """Forward hooks on layer `index`'s cached projections: base outputs into `base`, X·Aᵀ into `down`."""
        attention = attention_of(layer, index)
        handles = []
        for side, name in zip(SPLIT_SIDES, CACHED_PROJECTIONS):
            module, columns = projection_columns(attention, name, index)
            rows = columns or slice(None)

            def keep_base(module, args, output, side=side, rows=rows):
                self.base[index][side] = output[..., rows]

            handles.append(getattr(module, "base_layer", module).register_forward_hook(keep_base))
            for agent, down in getattr(module, "lora_A", {}).items():

                def keep_down(module, args, output, side=side, agent=agent):
                    self.down[index].setdefault(side, {})[agent] = output

                handles.append(down.register_forward_hook(keep_down))
        return handles

    @contextlib.contextmanager
    def capture(self) -> Iterator[HiddenTap]:
        def hook(target, index):
            def grab(module, args, kwargs):
                target[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

            return grab

        self.base = [{} for _ in self.layers]
        self.down = [{} for _ in self.layers]
        handles = [
            module.register_forward_pre_hook(hook(target, i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
            for module, target in ((mixer_of(layer, i), self.hidden), (layer, self.residual))
        ]
        if self.taps_projections:
            handles += [handle for i, layer in enumerate(self.layers) for handle in self._projection_hooks(i, layer)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def heads(flat: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, L, H·D) → (B, H, L, D)."""
    batch, length, width = flat.shape
    return flat.view(batch, length, width // head_dim, head_dim).transpose(1, 2)
