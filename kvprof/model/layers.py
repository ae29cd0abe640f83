"""What each decoder layer of a model caches and how its keys carry positions, read from the model itself.

Attention full, sliding (its last W) or chunked (within chunks of W); keys with one RoPE, one per layer type, or NoPE
(`kvprof.model.rope.model_ropes`); an MLA layer caches a latent and a RoPE key (`kvprof.model.latent`); a hybrid's
recurrent layer a state (`kvprof.model.recurrent`). What sharing a layer's cache means depends on all of these:
docs/models.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvprof.model.architecture import attention_of, decoder_layers, head_dim, kv_heads, recurrent_of
from kvprof.model.latent import latent_shape
from kvprof.model.rope import LayerRopes


@dataclass(frozen=True)
class LayerKind:
    """One layer: `attention` "full" / "sliding" / "chunked" (`window` W, None for full) or "recurrent" (then
    `position` is its mixer); `position` its keys' RoPE name ("rope", "rope (<type>)", "NoPE"); `latent` for MLA."""

    attention: str
    window: int | None
    position: str
    latent: str | None = None

    def describe(self) -> str:
        if self.attention == "recurrent":
            return f"recurrent ({self.position}: a state, no K/V per token)"
        attention = "full attention" if self.window is None else f"{self.attention} attention, W = {self.window}"
        if self.latent is not None:
            attention = f"multi-head latent {attention} ({self.latent})"
        return f"{attention}, {self.position}"

    def to_json(self) -> dict:
        return asdict(self)


def layer_kinds(model, ropes: LayerRopes) -> list[LayerKind]:
    """Each layer's `LayerKind`: window from the module's `sliding_window` (or the config's, as Mistral reads it),
    chunks from `layer_types` / `attention_chunk_size`, position from `ropes`."""
    config = model.config
    types = list(getattr(config, "layer_types", None) or [])
    configured = getattr(config, "sliding_window", None)
    kinds = []
    for index, layer in enumerate(decoder_layers(model)):
        mixer = recurrent_of(layer)
        if mixer is not None:
            kinds.append(LayerKind("recurrent", None, mixer))
            continue
        attention_module = attention_of(layer, index)
        if hasattr(attention_module, "sliding_window"):
            window = attention_module.sliding_window
        else:
            window = configured if not types or types[index] == "sliding_attention" else None
        attention = "sliding" if window else "full"
        if index < len(types) and types[index] == "chunked_attention":
            attention, window = "chunked", getattr(config, "attention_chunk_size", None)
        shape = latent_shape(attention_module)
        latent = f"latent C = {shape.latent_dim} + RoPE key R = {shape.rope_dim}" if shape else None
        kinds.append(LayerKind(attention, window or None, ropes.names[index], latent))
    return kinds


def cache_shapes(model) -> list[tuple[int, int, int]]:
    """Per layer (H_kv, D_k, D_v) of its K (B, H_kv, L, D_k) and V (B, H_kv, L, D_v), from its attention module
    (Gemma 4's global heads differ); (1, R, C) for MLA; (1, 0, 0) for a recurrent layer."""
    shapes = []
    for index, layer in enumerate(decoder_layers(model)):
        if recurrent_of(layer) is not None:
            shapes.append((1, 0, 0))
            continue
        attention = attention_of(layer, index)
        latent = latent_shape(attention)
        if latent is not None:
            shapes.append((1, latent.rope_dim, latent.latent_dim))
            continue
        size = getattr(attention, "head_dim", None)
        size = size if isinstance(size, int) else head_dim(model.config)
        keys = getattr(attention, "k_proj", None)
        width = getattr(getattr(keys, "base_layer", keys), "out_features", None)
        shapes.append((width // size if isinstance(width, int) else kv_heads(model.config), size, size))
    return shapes


def describe_layers(kinds: list[LayerKind]) -> str:
    """The layers by kind, each kind once with its layers as ranges: "sliding attention, W = 1024, rope
    (sliding_attention): layers 0–4, 6–10; full attention, rope (full_attention): layers 5, 11"."""
    by_kind: dict[LayerKind, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    if len(by_kind) == 1:
        return f"all {len(kinds)} layers: {kinds[0].describe()}"
    return "; ".join(f"{kind.describe()}: {layer_list(indices)}" for kind, indices in by_kind.items())


def layer_list(indices: list[int]) -> str:
    """Layer indices (ascending) as ranges: "layer 5", "layers 0–4, 6", "layers 0–2, 4–6, …, 44–46 (36 layers)"."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    shown = [str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs]
    if len(shown) > 4:  # a repeating pattern over many layers: its start, its end and the count
        return f"layers {', '.join(shown[:2])}, …, {shown[-1]} ({len(indices)} layers)"
    return f"layer{'s' if len(indices) > 1 else ''} {', '.join(shown)}"
