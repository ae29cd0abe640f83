"""What each decoder layer of a model caches and how its keys carry positions, read from the model itself.

Attention full, sliding (its last W) or chunked (within chunks of W); keys with one RoPE, one per layer type, or NoPE
(`kvprof.model.rope.model_ropes`); an MLA layer caches a latent and a RoPE key (`kvprof.model.latent`); a hybrid's
recurrent layer a state (`kvprof.model.recurrent`). What sharing a layer's cache means depends on all of these:
docs/models.md. Each kind is a `LayerKind` subclass answering what the runtime, the replay and the selective policies
ask of a layer (tokens held, (query, key) pairs attended, keys visible, bytes per token); `KINDS` reads layers as them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

import torch

from kvprof.model.architecture import attention_of, decoder_layers, head_dim, kv_heads, recurrent_of
from kvprof.model.latent import latent_shape
from kvprof.model.rope import LayerRopes


@dataclass(frozen=True)
class LayerKind(ABC):
    """One layer's kind and the questions the runtime, the replay and the selective policies ask it.

    Fields as results record them (`to_json`): `attention` the kind's name ("full", "sliding", "chunked",
    "recurrent"), `window` its W (None without one), `position` its keys' RoPE name ("rope", "rope (<type>)",
    "NoPE"; a recurrent layer's token mixer), `latent` an MLA layer's latent and RoPE key. A kind is a subclass that
    answers `held`, `attended`, `attended_at` and `first_attended` (and `visible` where its mask is not causal), and
    says in `read` which layers it is; `KINDS` lists them, tried in order. What a layer caches per token
    (`cache_shape`, `token_bytes`) and one (query, key) pair's FLOPs (`pair_flops`) are an attention layer's unless
    a kind says otherwise."""

    attention: str
    window: int | None
    position: str
    latent: str | None = None

    def describe(self) -> str:
        attention = "full attention" if self.window is None else f"{self.attention} attention, W = {self.window}"
        if self.latent is not None:
            attention = f"multi-head latent {attention} ({self.latent})"
        return f"{attention}, {self.position}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    @abstractmethod
    def read(cls, model, index: int, layer: torch.nn.Module, position: str) -> LayerKind | None:
        """Decoder layer `index` (`layer`) of `model` as this kind, its keys' RoPE named `position`; None when it is
        not one."""

    @abstractmethod
    def held(self, length: int) -> int:
        """Of `length` tokens, how many this layer keeps for the next."""

    @abstractmethod
    def attended(self, start: int, count: int) -> int:
        """(query, key) pairs this layer computes for `count` tokens at positions start.. (causal)."""

    @abstractmethod
    def attended_at(self, positions: torch.Tensor) -> int:
        """`attended` for tokens at cache positions `positions` (m,), not necessarily contiguous."""

    @abstractmethod
    def first_attended(self, position: int) -> int:
        """The first cache position a token at `position` attends (and so every later token)."""

    def limits(self, length: int) -> bool:
        """Whether the last of `length` tokens attends fewer than all of them (a window or chunk shorter than
        `length`): then only `visible` keys may be attended."""
        return self.first_attended(length - 1) > 0

    def visible(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Which of cache positions `keys` (L,) each token at `positions` (m,) attends: bool (m, L); causal here."""
        return keys[None, :] <= positions[:, None]

    def cache_shape(self, layer: torch.nn.Module, index: int, config) -> tuple[int, int, int]:
        """(H_kv, D_k, D_v) of the layer's K (B, H_kv, L, D_k) and V (B, H_kv, L, D_v), from its attention module
        (Gemma 4's global heads differ); (1, R, C) for MLA."""
        attention = attention_of(layer, index)
        latent = latent_shape(attention)
        if latent is not None:
            return (1, latent.rope_dim, latent.latent_dim)
        size = getattr(attention, "head_dim", None)
        size = size if isinstance(size, int) else head_dim(config)
        keys = getattr(attention, "k_proj", None)
        width = getattr(getattr(keys, "base_layer", keys), "out_features", None)
        return (width // size if isinstance(width, int) else kv_heads(config), size, size)

    def token_bytes(self, shape: tuple[int, int, int], itemsize: int) -> int:
        """Bytes one token's K and V take in a layer of `cache_shape` `shape`: H_kv·(D_k + D_v)·itemsize."""
        heads, key_dim, value_dim = shape
        return heads * (key_dim + value_dim) * itemsize

    def pair_flops(self, layer: torch.nn.Module, index: int, shape: tuple[int, int, int], query_heads: int) -> float:
        """FLOPs of one (query, key) pair: 2·H_q·(D_qk + D_v), D from the module where it says (MLA), else D_k."""
        attention = attention_of(layer, index)
        size = shape[1]
        query = getattr(attention, "qk_head_dim", None) or size
        value = getattr(attention, "v_head_dim", None) or size
        return 2.0 * query_heads * (query + value)


def _latent(layer: torch.nn.Module, index: int) -> str | None:
    """An MLA layer's `LayerKind.latent`, else None."""
    shape = latent_shape(attention_of(layer, index))
    return f"latent C = {shape.latent_dim} + RoPE key R = {shape.rope_dim}" if shape else None


def _layer_types(config) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


@dataclass(frozen=True)
class FullAttention(LayerKind):
    """Every token attends every earlier one and the layer keeps them all."""

    attention: str = field(default="full", init=False)
    window: None = field(default=None, init=False)

    @classmethod
    def read(cls, model, index: int, layer: torch.nn.Module, position: str) -> LayerKind | None:
        return cls(position, _latent(layer, index))

    def held(self, length: int) -> int:
        return length

    def attended(self, start: int, count: int) -> int:
        first, last = start + 1, start + count  # keys seen by the first and the last token
        return (first + last) * count // 2

    def attended_at(self, positions: torch.Tensor) -> int:
        return int((positions + 1).sum())

    def first_attended(self, position: int) -> int:
        return 0


@dataclass(frozen=True)
class SlidingAttention(LayerKind):
    """A token attends its last W keys (itself included); the layer keeps the last W tokens. W from the module's
    `sliding_window`, else the config's where `layer_types` says sliding_attention (or has none, as Mistral reads
    it)."""

    attention: str = field(default="sliding", init=False)
    window: int

    @classmethod
    def read(cls, model, index: int, layer: torch.nn.Module, position: str) -> LayerKind | None:
        attention = attention_of(layer, index)
        types = _layer_types(model.config)
        if hasattr(attention, "sliding_window"):
            window = attention.sliding_window
        elif not types or types[index] == "sliding_attention":
            window = getattr(model.config, "sliding_window", None)
        else:
            window = None
        return cls(window, position, _latent(layer, index)) if window else None

    def held(self, length: int) -> int:
        return min(length, self.window)

    def attended(self, start: int, count: int) -> int:
        window = self.window
        first, last = start + 1, start + count  # keys seen by the first and the last token without a window
        capped = max(0, last - max(first, window + 1) + 1)  # tokens that see a full window
        below = min(last, window) - first + 1 if first <= window else 0
        return capped * window + max(below, 0) * (first + min(last, window)) // 2

    def attended_at(self, positions: torch.Tensor) -> int:
        return int((positions + 1).clamp(max=self.window).sum())

    def first_attended(self, position: int) -> int:
        return max(position - self.window + 1, 0)

    def visible(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        allowed = super().visible(keys, positions)
        allowed &= keys[None, :] > positions[:, None] - self.window
        return allowed


@dataclass(frozen=True)
class ChunkedAttention(LayerKind):
    """A token attends the keys of its own chunk of W (⌊k/W⌋ = ⌊p/W⌋, Llama 4's chunked layers); the layer keeps
    the current chunk's. Layers `layer_types` names chunked_attention, W the config's `attention_chunk_size`."""

    attention: str = field(default="chunked", init=False)
    window: int

    @classmethod
    def read(cls, model, index: int, layer: torch.nn.Module, position: str) -> LayerKind | None:
        types = _layer_types(model.config)
        size = getattr(model.config, "attention_chunk_size", None)
        if index < len(types) and types[index] == "chunked_attention" and size:
            return cls(size, position, _latent(layer, index))
        return None

    def held(self, length: int) -> int:
        return length % self.window

    def attended(self, start: int, count: int) -> int:
        window = self.window

        def upto(end: int) -> int:  # pairs of the tokens at positions 0..end−1
            return (end // window) * window * (window + 1) // 2 + (end % window) * (end % window + 1) // 2

        return upto(start + count) - upto(start)

    def attended_at(self, positions: torch.Tensor) -> int:
        return int((positions % self.window + 1).sum())

    def first_attended(self, position: int) -> int:
        return self.window * (position // self.window)

    def visible(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        allowed = super().visible(keys, positions)
        allowed &= keys[None, :] // self.window == positions[:, None] // self.window
        return allowed


@dataclass(frozen=True)
class RecurrentLayer(LayerKind):
    """A hybrid's recurrent layer (`kvprof.model.recurrent`): a state covering every token, no K/V per token
    (`position`: its token mixer's name)."""

    attention: str = field(default="recurrent", init=False)
    window: None = field(default=None, init=False)
    latent: None = field(default=None, init=False)

    @classmethod
    def read(cls, model, index: int, layer: torch.nn.Module, position: str) -> LayerKind | None:
        mixer = recurrent_of(layer)
        return cls(mixer) if mixer is not None else None

    def describe(self) -> str:
        return f"recurrent ({self.position}: a state, no K/V per token)"

    def held(self, length: int) -> int:
        return length  # its state covers them all (and takes no bytes per token)

    def attended(self, start: int, count: int) -> int:
        return 0

    def attended_at(self, positions: torch.Tensor) -> int:
        return 0

    def first_attended(self, position: int) -> int:
        return 0

    def cache_shape(self, layer: torch.nn.Module, index: int, config) -> tuple[int, int, int]:
        return (1, 0, 0)  # zero-width K and V (B, 1, L, 0)

    def pair_flops(self, layer: torch.nn.Module, index: int, shape: tuple[int, int, int], query_heads: int) -> float:
        return 0.0


# The kinds a layer is read as, in order: the first whose `read` takes it (a chunked layer type over a module's
# sliding window; full attention takes every attention layer left). Adding a kind: its subclass, and its place here.
KINDS: tuple[type[LayerKind], ...] = (RecurrentLayer, ChunkedAttention, SlidingAttention, FullAttention)


def layer_kinds(model, ropes: LayerRopes) -> list[LayerKind]:
    """Each layer's `LayerKind` (the first of `KINDS` that reads it), its keys' position encoding from `ropes`."""
    kinds = []
    for index, layer in enumerate(decoder_layers(model)):
        read = (kind.read(model, index, layer, ropes.names[index]) for kind in KINDS)
        kinds.append(next(kind for kind in read if kind is not None))
    return kinds


def cache_shapes(model, kinds: list[LayerKind]) -> list[tuple[int, int, int]]:
    """Per layer (H_kv, D_k, D_v) of its cache as its kind reads it (`LayerKind.cache_shape`): (1, R, C) for MLA,
    (1, 0, 0) for a recurrent layer."""
    return [
        kind.cache_shape(layer, index, model.config)
        for index, (layer, kind) in enumerate(zip(decoder_layers(model), kinds))
    ]


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
