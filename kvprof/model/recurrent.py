"""A hybrid model's recurrent layers (Gated DeltaNet `linear_attn` of Qwen 3.5 / Qwen3-Next, Granite 4's `mamba`,
LFM2's short `conv`) as kvprof holds them.

Such a layer keeps a state summarising its n tokens instead of per-token K/V: only exact prefix reuse of one
sequence's own state is possible (restored at the prefix's end, as vLLM's hybrid cache; docs/models.md). kvprof's
per-layer lists hold zero-width K and V (B, 1, L, 0), so per-token operations on them are empty, and the state in a
`StateBuffer`; a `StateLayer` starts each forward from a copy, so a repeated prefill starts from the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionLayer

from kvprof.model.architecture import decoder_layers, recurrent_of
from kvprof.model.buffers import KVBuffer, Rewrite

RECURRENT_STATES = "recurrent states"  # what a policy's memory names an agent's states (not token-indexed)


def recurrent_layers(model) -> dict[int, str]:
    """The decoder layers of `model` that are recurrent, by index, with their token mixer's name."""
    found = {}
    for index, layer in enumerate(decoder_layers(model)):
        name = recurrent_of(layer)
        if name is not None:
            found[index] = name
    return found


def _copied(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {index: None if state is None else state.clone() for index, state in states.items()}


@dataclass
class LayerState:
    """A recurrent layer's state as `LinearAttentionLayer` holds it: conv (B, channels, kernel), recurrent
    (B, heads, ...) or None, kernel size."""

    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    kernel: dict[int, int | None]

    @classmethod
    def of(cls, layer: LinearAttentionLayer) -> LayerState:
        """A copy of what `layer` holds now."""
        conv = {i: s if layer.has_previous_state[i] else None for i, s in layer.conv_states.items()}
        recurrent = {
            i: s if layer.is_recurrent_states_initialized[i] else None for i, s in layer.recurrent_states.items()
        }
        return cls(_copied(conv), _copied(recurrent), dict(layer.conv_kernel_size))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.conv.values(), *self.recurrent.values()) if t is not None]


class StateBuffer(KVBuffer):
    """The `state` after `length` tokens (None: none yet) and zero-width K/V (B, 1, ·, 0); never written (forwards
    update a copy, `Runtime.buffers_of` takes a new buffer)."""

    def __init__(self, state: LayerState | None, length: int, template: torch.Tensor):
        self.state, self.length = state, length
        self.empty = template.new_zeros((template.shape[0], 1, 0, 0))

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-width K and V (B, 1, end, 0)."""
        width = self.empty.new_zeros((self.empty.shape[0], 1, end, 0))
        return width, width

    def make_room(self, end: int) -> None:
        """Nothing: a state has no slot per token."""

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise RuntimeError("a recurrent layer holds a state, not K/V per token")

    def cache_layer(self, length: int, index: int, rewrite: Rewrite | None, latent: bool) -> StateLayer:
        return StateLayer(self, length)

    def tensors(self) -> list[torch.Tensor]:
        """The state's tensors (what this layer holds in memory)."""
        return self.state.tensors() if self.state is not None else []


class StateLayer(LinearAttentionLayer):
    """A recurrent layer's cache for a forward or turn: a copy of `buffer`'s state after exactly `length` tokens."""

    def __init__(self, buffer: StateBuffer, length: int):
        super().__init__()
        if length not in (0, buffer.length):
            raise RuntimeError(
                f"a recurrent layer's state covers {buffer.length} tokens, not the {length}-token context asked for"
            )
        self.buffer = buffer
        state = buffer.state if length else None
        if state is None:
            return
        if isinstance(getattr(self, "cumulative_length_linear", None), torch.Tensor):  # transformers ≥ 5.25's count
            self.cumulative_length_linear.fill_(length)
        self.device, self.dtype = buffer.empty.device, buffer.empty.dtype
        for index, conv in state.conv.items():
            if conv is not None:
                self.conv_states[index] = conv.clone()
                self.is_conv_states_initialized[index] = self.has_previous_state[index] = True
                self.conv_kernel_size[index] = state.kernel[index]
        for index, recurrent in state.recurrent.items():
            if recurrent is not None:
                self.recurrent_states[index] = recurrent.clone()
                self.is_recurrent_states_initialized[index] = self.has_previous_state[index] = True
