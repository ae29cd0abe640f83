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
from kvprof.model.agents import head_dim, kv_heads

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

    def expand(self, low_rank: torch.Tensor, agent: str) -> torch.Tensor:
        """(X·Aᵀ)·s·Bᵀ: (..., L, r) → (..., L, H_kv·D)."""
        return low_rank @ self.up[agent].T


@dataclass
class LayerSplit:
    key: ProjectionWeights
    value: ProjectionWeights


FUSED_QKV = "qkv_proj"  # Phi-3's fused projection: output columns q (H·D) | k (H_kv·D) | v (H_kv·D)
QKV = ("q_proj", "k_proj", "v_proj")


def projection_columns(attention: torch.nn.Module, name: str, index: int) -> tuple[torch.nn.Module, slice | None]:
    """The module that computes projection `name` (q_proj, k_proj or v_proj) of layer `index`'s attention, and which
    columns of its output are that projection: the projection itself (None: every column), or its block of a fused
    `qkv_proj` (Phi-3). Refuses any other layout in one sentence."""
    from kvprof.model.latent import latent_shape

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
    """Per layer, the k/v projection weights of the base and of every agent's adapter (see `ProjectionWeights`).

    A fused qkv_proj (Phi-3) splits by its column blocks: its k and v rows of W0 and of every B, its one A shared by
    both. Refuses a model whose attention has neither layout, or normalises its values (v_norm), and an adapter that
    is not plain LoRA (DoRA, a bias on B): their cached values are not X·W0 plus a low-rank part."""
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
    """A layer's query or key norm (`q_norm` / `k_norm`: Qwen3, OLMo 2, Gemma 3, Cohere), applied as the layer
    applies it, between the projection and RoPE: on the projection's output laid out (B, L, H, D) — per head, with
    D weights (Qwen3) or H × D (Cohere) — or over the whole projection (OLMo 2: H·D weights)."""

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
    """The invocation sequence of `agent`'s adapter when it is an Activated LoRA (peft's `alora_invocation_tokens`:
    the adapter acts from the last occurrence of these ids in a call's input on), else None."""
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
    """Per layer the key `ProjectionNorm` of a model that normalises its keys before RoPE; None for a model that does
    not. A layer without one in a model that normalises others (Llama 4's NoPE layers) gets the identity, so every
    layer's stored keys are kept the same way (un-normalised, un-rotated). Llama 4 normalises its keys after RoPE:
    its norm (an RMS over each head's channels, no weight) commutes with RoPE's rotation, so before is the same."""
    layers = decoder_layers(model)
    norms = [projection_norm(attention_of(layer, index), "k_proj") for index, layer in enumerate(layers)]
    if all(norm is None for norm in norms):
        return None
    width = kv_heads(model.config) * head_dim(model.config)
    return [ProjectionNorm(torch.nn.Identity() if norm is None else norm, width) for norm in norms]


ATTENTION_NAMES = ("self_attn", "attention", "attn")  # a decoder layer's attention module, by architecture
RECURRENT_NAMES = ("linear_attn", "mamba", "conv", "mixer")  # a hybrid's recurrent layer: Qwen 3.5, Granite 4, LFM2


def recurrent_of(layer: torch.nn.Module) -> str | None:
    """The name of a hybrid's recurrent decoder layer's token mixer (`linear_attn`, `mamba`, `conv`, `mixer`), None
    for a layer that holds an attention module."""
    if any(isinstance(getattr(layer, name, None), torch.nn.Module) for name in ATTENTION_NAMES):
        return None
    return next((name for name, _ in layer.named_children() if name in RECURRENT_NAMES), None)


def mixer_of(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """Decoder layer `index`'s token mixer: its attention module, or a hybrid's recurrent module in its place."""
    recurrent = recurrent_of(layer)
    return getattr(layer, recurrent) if recurrent is not None else attention_of(layer, index)


def attention_of(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """The attention module of decoder layer `index` (`self_attn` in Llama-style decoders, `attention` in GPT-NeoX).
    Refuses a layer without one (a hybrid's recurrent layer: callers that walk every layer skip those first)."""
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    recurrent = recurrent_of(layer)
    if recurrent is not None:
        raise KvprofError(
            f"decoder layer {index} is a recurrent layer ({recurrent}: linear attention, a state space or a short "
            "convolution), which keeps a state rather than a K/V cache per token, and kvprof needed its attention."
        )
    raise KvprofError(
        f"decoder layer {index} has no attention module ({', '.join(ATTENTION_NAMES)}); kvprof supports decoders "
        "whose layers hold one."
    )


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (LoRA layers are injected in place, so this is the adapted
    model too)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:  # a causal LM whose get_decoder() is itself (Llama 4): its decoder is `model`
        layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise KvprofError(
            f"model {model.config.name_or_path!r} has no decoder layer list (model.layers); kvprof supports "
            "decoders that keep one, as Llama, Qwen, Mistral, Gemma and Phi do."
        )
    return layers


def unshared_down_projections(splits: list[LayerSplit], agents: list[str]) -> list[str]:
    """The cached projections (k_proj, v_proj of each layer) whose down-projection A the agents do not share: adapted
    by some agents only, or with different A ("layer 0 k_proj", ...). BaseLRShared shares one LR cache X·A for
    exactly these projections, so this asks nothing of the others: a projection no agent adapts (K in PReCache's
    and LRAgent's q/v setting, where A is shared on v_proj only) and the projections outside the cache (q_proj,
    o_proj), whose A may differ per agent."""
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
    """Captures, during forwards inside `capture()`, X, the input of each layer's attention projections, the
    residual stream entering each decoder layer (what a policy recomputing layers from a stored state starts from),
    and what the cached projections (k_proj, v_proj, or their blocks of a fused qkv_proj) computed on X: their base
    outputs X·W0ᵀ (+ bias), from the LoRA layer's `base_layer` (or the projection itself when it has no adapter),
    and each adapter's down-projection X·Aᵀ, from its `lora_A` module — the forward's own results, which policies
    store instead of recomputing them.

    From the last forward: `hidden[i]` and `residual[i]` are (B, L, d_model) for layer i; `base[i]` is
    {"key"|"value": (B, L, H_kv·D)} (keys before any key norm and RoPE); `down[i]` is {"key"|"value": {agent:
    (B_a, L, r)}} for the adapters that ran there, in the adapter's dtype (B_a: the rows of a mixed batch that
    adapter ran on, all rows otherwise; a fused qkv_proj's one A serves both sides). Entries are set as the layer
    runs, so they are readable from inside the forward once the layer has projected (the cache's `update`). A model
    whose k/v outputs cannot be found (`taps_projections` False: GPT-NeoX) leaves `base` and `down` empty.
    """

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
