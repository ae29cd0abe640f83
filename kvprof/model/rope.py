"""Moving cached keys to new positions: RoPE re-rotation with the model's own rotary embedding, per layer.

A `Rope` holds, read from the model, the frequencies θ_i (`inv_freq`, or one per layer type as in Gemma 3 / 4; static
scaling included, dynamic refused), the rotated channels (the first `rotary_dim`; partial rotary) and the pairing
(`rotate_half` or `interleaved`). A NoPE layer gets `NO_ROPE`, the identity. `model_ropes` finds and checks each
layer's RoPE on the model (shifted input ⇒ rotated keys), refusing a layer no candidate explains. Background:
docs/models.md.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprof.errors import KvprofError
from kvprof.model.latent import latent_layers, oriented

PROBE_TOKENS = 12  # length of the input `model_rope` checks the RoPE on
PROBE_SHIFT = 23  # positions it moves that input by
FLOAT32_TOLERANCE = 1e-3  # relative error of the re-rotated keys against the shifted ones, float32 models
# 16-bit models: rounding differs between the two runs and grows with depth, so a layer also passes when re-rotating
# explains most of the shift: an error at most this share of the error of not re-rotating (a wrong layout is off by
# as much as no rotation at all)
HALF_TOLERANCE, HALF_SHARE = 0.05, 0.25


def rotary_embedding(model) -> torch.nn.Module | None:
    """A decoder's rotary embedding module (None without; dynamic scaling refused)."""
    for path, module in model.named_modules():
        if not path.endswith("rotary_emb"):
            continue
        types = getattr(module, "rope_type", "default")
        if "dynamic" in (types.values() if isinstance(types, dict) else [types]):
            raise KvprofError(
                "this model uses dynamic RoPE scaling, which cannot be re-aligned by a fixed "
                "rotation; use a model with static rope scaling."
            )
        return module
    return None


def layer_position_embeddings(rotary: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, layer_type):
    """`position_embeddings` for `layer_type`'s layers at `positions` (1, L) (per type: Gemma 3 / 4)."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(hidden, positions, layer_type)
    return rotary(hidden, positions)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved layout's `rotate_half`: (x0, x1, x2, x3, …) → (−x1, x0, −x3, x2, …)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@dataclass(frozen=True)
class Rope:
    """A model's RoPE on (..., L, D): inv_freq (R/2,) fp32, R = `rotary_dim` ≤ D; interleaved pairs (2i, 2i+1)
    instead of (i, i + R/2); attention_scaling of cos/sin (yarn's; 1.0 plain)."""

    inv_freq: torch.Tensor
    interleaved: bool = False
    attention_scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(L,) positions (or shifts) → (L, R) fp32 angles, laid out as the channels they rotate."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device, torch.float32)[None, :]
        return freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)

    def tables(self, positions: torch.Tensor, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` (L,), each (L, R) fp32, times the attention scaling when `scaled`."""
        angles = self.angles(positions)
        scale = self.attention_scaling if scaled else 1.0
        return angles.cos() * scale, angles.sin() * scale

    def swap(self, states: torch.Tensor) -> torch.Tensor:
        """The channel swap `rotate` multiplies by sin, of `states`' rotary channels: (..., D) → (..., R). Linear
        (a permutation and signs), so swap(x·W) = x·swap(W) exactly."""
        swap = rotate_pairs if self.interleaved else rotate_half
        return swap(states[..., : self.rotary_dim])

    def rotate(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`states` (..., L, D) rotated by `tables` (L, R), in their dtype; channels past R pass through."""
        rotary = self.rotary_dim
        turned, passed = states[..., :rotary], states[..., rotary:]
        swap = rotate_pairs if self.interleaved else rotate_half
        rotated = turned * cos + swap(turned) * sin
        return rotated if rotary == states.shape[-1] else torch.cat((rotated, passed), dim=-1)


def rotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, rope: Rope) -> torch.Tensor:
    """Re-rotate post-RoPE keys by `delta` positions.

    keys: (B, H_kv, L, D) (or any (..., L, D)); delta: an int or a (L,) tensor of per-token position shifts.
    Computed in fp32, returned in `keys.dtype`.
    """
    length = keys.shape[-2]
    shift = torch.as_tensor(delta, dtype=torch.float32, device=keys.device).expand(length)
    cos, sin = rope.tables(shift, scaled=False)
    return rope.rotate(keys.float(), cos, sin).to(keys.dtype)


def apply_rope(states: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """RoPE of un-rotated states (B, H, L, D) at absolute `positions` (L,), as the model applies it to keys
    (including its attention scaling). Computed in fp32, returned in `states.dtype`."""
    cos, sin = rope.tables(positions.to(states.device))
    return rope.rotate(states.float(), cos, sin).to(states.dtype)


def _pairings(model) -> tuple[bool, ...]:
    """Pairings the modeling code may use: its `rotate_half`'s, or both without one (Llama 4)."""
    module = sys.modules.get(type(model.get_decoder()).__module__)
    swap = getattr(module, "rotate_half", None)
    if swap is None:
        return (False, True)
    probe = torch.arange(4, dtype=torch.float32)
    return (bool(torch.equal(swap(probe), rotate_pairs(probe))),)


NO_ROPE = Rope(inv_freq=torch.zeros(0))  # a NoPE layer: rotary_dim 0, every channel passes through


@dataclass(frozen=True)
class LayerRopes:
    """Each layer's `Rope` and its name ("rope", "rope (sliding_attention)", "NoPE")."""

    layers: tuple[Rope, ...]
    names: tuple[str, ...]

    def __getitem__(self, layer: int) -> Rope:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def rotate_kv(self, kv: list[tuple[torch.Tensor, torch.Tensor]], delta: int | torch.Tensor) -> list:
        """Per-layer (K, V) with each layer's keys re-rotated by `delta` (see `rotate_keys`), values as they are."""
        return [(rotate_keys(keys, delta, rope), values) for rope, (keys, values) in zip(self.layers, kv)]

    def rotate_stacked(self, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Keys stacked over layers (layers, ..., L, D), each layer's re-rotated by `delta`."""
        return torch.stack([rotate_keys(k, delta, rope) for rope, k in zip(self.layers, keys)])


def rope_candidates(model) -> dict[str, Rope]:
    """Every RoPE the rotary embedding holds, by name ("rope", "rope (<layer type>)"), and "NoPE"."""
    candidates = {"NoPE": NO_ROPE}
    rotary = rotary_embedding(model)
    if rotary is None:
        return candidates
    pairings = _pairings(model)
    for name, buffer in rotary.named_buffers(recurse=False):
        if not name.endswith("inv_freq") or "original" in name:
            continue
        layer_type = name.removesuffix("inv_freq").removesuffix("_")
        scaling = getattr(rotary, f"{layer_type}_attention_scaling" if layer_type else "attention_scaling", 1.0)
        label = f"rope ({layer_type})" if layer_type else "rope"
        for interleaved in pairings:
            suffix = " interleaved" if len(pairings) > 1 and interleaved else ""
            candidates[label + suffix] = Rope(buffer.detach().float(), interleaved, float(scaling))
    return candidates


def model_ropes(model) -> LayerRopes:
    """Each layer's RoPE, found and checked on the model (PEFT-wrapped or not)."""
    candidates = rope_candidates(model)
    shifts = _shifted_keys(model)
    half = model.dtype != torch.float32
    layers, names = [], []
    for index, (at_start, shifted) in enumerate(shifts):
        if at_start is None:  # a hybrid's recurrent layer: no keys
            layers.append(NO_ROPE)
            names.append("no keys (recurrent)")
            continue
        errors = {
            name: _relative(rotate_keys(at_start, PROBE_SHIFT, rope), shifted)
            for name, rope in candidates.items()
            if rope.rotary_dim <= at_start.shape[-1]  # a RoPE wider than the layer's heads is another layer's
        }
        best = min(errors, key=lambda name: errors[name])
        _accept(model, index, errors[best], at_start, shifted, half)
        layers.append(candidates[best])
        names.append(best)
    return LayerRopes(tuple(layers), tuple(names))


def check_ropes(model, ropes: LayerRopes) -> None:
    """Refuse a model whose keys at shifted positions are not `ropes`' re-rotation of its keys, layer by layer."""
    half = model.dtype != torch.float32
    for index, (at_start, shifted) in enumerate(_shifted_keys(model)):
        if at_start is None:
            continue
        _accept(
            model, index, _relative(rotate_keys(at_start, PROBE_SHIFT, ropes[index]), shifted), at_start, shifted, half
        )


def _shifted_keys(model) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per layer float32 keys of a probe at 0.. and at `PROBE_SHIFT`.. (None: recurrent layer)."""
    latent = latent_layers(model)
    device = next(model.parameters()).device
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device)[None] % model.config.vocab_size
    keys = []
    for start in (0, PROBE_SHIFT):
        positions = torch.arange(start, start + PROBE_TOKENS, device=device)[None]
        with torch.inference_mode():
            out = model(
                input_ids=ids,
                position_ids=positions,
                cache=oriented(DynamicCache(config=model.config), latent),
                use_cache=True,
            )
        keys.append([layer.keys.float() if hasattr(layer, "keys") else None for layer in out.cache.layers])
    return list(zip(*keys))


def _accept(model, index: int, error: float, at_start: torch.Tensor, shifted: torch.Tensor, half: bool) -> None:
    """Refuse layer `index` when re-rotating its keys leaves `error` (relative) against the shifted run: above
    `FLOAT32_TOLERANCE` in float32; in 16 bits above `HALF_TOLERANCE` and above `HALF_SHARE` of not re-rotating."""
    if error <= (HALF_TOLERANCE if half else FLOAT32_TOLERANCE):
        return
    if not half or error > HALF_SHARE * _relative(at_start, shifted):
        raise KvprofError(
            f"model {model.config.name_or_path!r}: layer {index}'s cached keys do not move with positions as any RoPE "
            f"its rotary embedding holds, nor as a layer without RoPE (relative error {error:.2g} after a "
            f"{PROBE_SHIFT}-position shift: absolute positions, or a RoPE kvprof does not read); kvprof re-aligns "
            "cached keys by RoPE, so it cannot profile this model."
        )


def _relative(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    return float((estimate - reference).norm() / reference.norm().clamp_min(1e-30))
