"""Moving cached keys to new positions: RoPE re-rotation with the model's own rotary embedding.

transformers stores keys **after** RoPE. RoPE rotates each pair of channels by an angle `p·θ_i`, so a key cached at
position p moves to position p + δ by one more rotation of `δ·θ_i`: R(p + δ) = R(δ)·R(p). The frequencies θ_i are
read from the model's `rotary_emb.inv_freq`, which already includes static rope scaling (llama3, linear, yarn's
frequency part); yarn's attention scaling multiplies cos/sin at both positions and so cancels in a re-rotation.
Dynamic (length-dependent) scaling is not a rotation by a fixed angle and is refused.
"""

from __future__ import annotations

import torch

from kvprof.errors import KvprofError


def rotary_embedding(model) -> torch.nn.Module:
    """The rotary embedding module of a transformers decoder (PEFT-wrapped or not)."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
            if getattr(module, "rope_type", "default") == "dynamic":
                raise KvprofError(
                    "this model uses dynamic RoPE scaling, which cannot be re-aligned by a fixed "
                    "rotation; use a model with static rope scaling."
                )
            return module
    raise KvprofError(
        "the model has no rotary embedding (rotary_emb with inv_freq); kvprof needs a RoPE model "
        "such as Llama, Qwen2 or Mistral."
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Re-rotate post-RoPE keys by `delta` positions.

    keys: (B, H_kv, L, D) (or any (..., L, D)); delta: an int or a (L,) tensor of per-token position shifts;
    inv_freq: (D/2,) from `rotary_embedding(model).inv_freq`. Computed in fp32, returned in `keys.dtype`.
    """
    length = keys.shape[-2]
    shift = torch.as_tensor(delta, dtype=torch.float32, device=keys.device).expand(length)
    angles = shift[:, None] * inv_freq.to(device=keys.device, dtype=torch.float32)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    keys32 = keys.float()
    rotated = keys32 * angles.cos() + rotate_half(keys32) * angles.sin()
    return rotated.to(keys.dtype)


def apply_rope(
    states: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """RoPE of un-rotated states (B, H, L, D) at absolute `positions` (L,), as the model applies it to keys
    (including its `attention_scaling`, 1.0 for plain RoPE)."""
    rotated = rotate_keys(states, positions, inv_freq)
    return rotated if attention_scaling == 1.0 else rotated * attention_scaling
