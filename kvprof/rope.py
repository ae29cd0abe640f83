"""Moving cached keys to new positions: RoPE re-rotation with the model's own rotary embedding.

transformers stores keys **after** RoPE. RoPE rotates pairs of channels by an angle `p·θ_i`, so a key cached at
position p moves to position p + δ by one more rotation of `δ·θ_i`: R(p + δ) = R(δ)·R(p). A `Rope` holds what that
takes, read from the model:

- the frequencies θ_i, from the model's `rotary_emb.inv_freq`, which already includes static rope scaling (llama3,
  linear, yarn's frequency part); yarn's attention scaling multiplies cos/sin at both positions and so cancels in a
  re-rotation. Dynamic (length-dependent) scaling is not a rotation by a fixed angle and is refused;
- the rotated channels: the first `rotary_dim` = 2·len(θ) of each head, the rest passing through unrotated (partial
  rotary: Phi, StableLM, GPT-NeoX, GLM);
- the pairing: channel i with i + rotary_dim/2 (Llama's `rotate_half`), or channels 2i and 2i + 1 (`interleaved`:
  GLM, Cohere), read from the model's own `rotate_half`.

`model_rope` checks the result on the model itself: shifting every position of an input by δ leaves a RoPE model's
hidden states unchanged, so each layer's keys at p + δ must be R(δ) times its keys at p. A model where that fails
(RoPE that differs per layer, layers without RoPE, absolute positions) is refused in one sentence rather than
re-aligned wrongly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kvprof.errors import KvprofError

PROBE_TOKENS = 12  # length of the input `model_rope` checks the RoPE on
PROBE_SHIFT = 23  # positions it moves that input by
FLOAT32_TOLERANCE = 1e-3  # relative error of the re-rotated keys against the shifted ones, float32 models
# 16-bit models: rounding differs between the two runs and grows with depth, so a layer also passes when re-rotating
# explains most of the shift: an error at most this share of the error of not re-rotating (a wrong layout is off by
# as much as no rotation at all)
HALF_TOLERANCE, HALF_SHARE = 0.05, 0.25


def rotary_embedding(model) -> torch.nn.Module:
    """The rotary embedding module of a transformers decoder (PEFT-wrapped or not)."""
    name = model.config.name_or_path
    for path, module in model.named_modules():
        if not path.endswith("rotary_emb"):
            continue
        if not hasattr(module, "inv_freq"):
            raise KvprofError(
                f"model {name!r} has a RoPE per layer type (its rotary embedding has no single inv_freq, as in "
                "Gemma 3's local and global layers); kvprof re-aligns cached keys with one RoPE for every layer, so "
                "it cannot profile this model."
            )
        if getattr(module, "rope_type", "default") == "dynamic":
            raise KvprofError(
                "this model uses dynamic RoPE scaling, which cannot be re-aligned by a fixed "
                "rotation; use a model with static rope scaling."
            )
        return module
    raise KvprofError(
        f"model {name!r} has no rotary embedding (rotary_emb with inv_freq); kvprof re-aligns cached keys by RoPE, "
        "so it needs a RoPE decoder such as Llama, Qwen2, Mistral or Phi."
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved layout's `rotate_half`: (x0, x1, x2, x3, …) → (−x1, x0, −x3, x2, …)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@dataclass(frozen=True)
class Rope:
    """A model's RoPE as kvprof applies it to (..., L, D) states (see module docstring).

    inv_freq: (R/2,) fp32, R = `rotary_dim` ≤ D; interleaved: channel pairs (2i, 2i+1) instead of (i, i + R/2);
    attention_scaling: the factor the model's cos/sin carry (1.0 for plain RoPE; yarn's attention factor).
    """

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

    def rotate(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`states` (..., L, D) rotated by tables (L, R) from `tables`, in `states`' dtype (compute in fp32 by
        passing fp32 states); channels past R pass through."""
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


def _interleaved(model) -> bool:
    """Whether the model's modeling code pairs channels (2i, 2i+1): its module-level `rotate_half`, if it has one,
    applied to (0, 1, 2, 3)."""
    module = sys.modules.get(type(model.get_decoder()).__module__)
    swap = getattr(module, "rotate_half", None)
    if swap is None:
        return False
    probe = torch.arange(4, dtype=torch.float32)
    return bool(torch.equal(swap(probe), rotate_pairs(probe)))


def model_rope(model) -> Rope:
    """The `Rope` of a transformers decoder (PEFT-wrapped or not), checked on the model (see module docstring)."""
    rotary = rotary_embedding(model)
    rope = Rope(
        inv_freq=rotary.inv_freq.detach().float(),
        interleaved=_interleaved(model),
        attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
    )
    check_rope(model, rope)
    return rope


def check_rope(model, rope: Rope) -> None:
    """Refuse a model whose keys at shifted positions are not `rope`'s re-rotation of its keys (every layer)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device)[None] % model.config.vocab_size
    keys = []
    for start in (0, PROBE_SHIFT):
        positions = torch.arange(start, start + PROBE_TOKENS, device=device)[None]
        with torch.inference_mode():
            out = model(input_ids=ids, position_ids=positions, cache=DynamicCache(config=model.config), use_cache=True)
        keys.append([layer.keys.float() for layer in out.cache.layers])
    half = model.dtype != torch.float32
    for index, (at_start, shifted) in enumerate(zip(*keys)):
        error = _relative(rotate_keys(at_start, PROBE_SHIFT, rope), shifted)
        if error <= (HALF_TOLERANCE if half else FLOAT32_TOLERANCE):
            continue
        if not half or error > HALF_SHARE * _relative(at_start, shifted):
            raise KvprofError(
                f"model {model.config.name_or_path!r}: layer {index}'s cached keys do not move with positions as "
                f"one RoPE (relative error {error:.2g} after a {PROBE_SHIFT}-position shift; RoPE that differs per "
                "layer, layers without RoPE, or absolute positions); kvprof re-aligns cached keys by RoPE, so it "
                "cannot profile this model."
            )


def _relative(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    return float((estimate - reference).norm() / reference.norm().clamp_min(1e-30))
