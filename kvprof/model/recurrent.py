"""A hybrid model's recurrent layers (Qwen 3.5 and Qwen3-Next's Gated DeltaNet `linear_attn`, Granite 4's `mamba`,
LFM2's short `conv`) as kvprof holds them.

Such a layer keeps no K/V per token: after n tokens it holds a state (a short convolution's last inputs, and for
linear attention and state spaces a recurrent state) that summarises all n, in place of a cache. A prefix is reused
by restoring the state at the prefix's end, as vLLM's hybrid cache does; a state cannot be cut at another length,
moved to other positions or taken from another agent's context, so only exact prefix reuse of one sequence's own
state is possible there.

kvprof holds a recurrent layer in its per-layer lists as zero-width K and V (B, 1, L, 0) — they take no memory and
every per-token operation on them (re-alignment, errors, slicing) is empty — and its state in a `StateBuffer` in
place of a `kvprof.model.buffers.KVBuffer`: the state after its first `length` tokens, from which a `StateLayer` (the
cache layer the model updates) starts a forward on a copy, so a repeated prefill starts from the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionLayer

from kvprof.model.buffers import KVBuffer, Rewrite
from kvprof.model.lora import decoder_layers, recurrent_of

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
    """One recurrent layer's state, as transformers' `LinearAttentionLayer` holds it: per state index its
    convolution state (B, channels, kernel) and recurrent state (B, heads, ...) or None, and the kernel size."""

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
    """A recurrent layer's buffer: its `state` after its sequence's first `length` tokens (None: no token yet), and
    zero-width K/V (B, 1, ·, 0) of any length for kvprof's per-layer lists. Nothing is written to it: a forward
    updates a copy (`StateLayer`), and `kvprof.model.runtime.Runtime.buffers_of` takes a new buffer of that."""

    def __init__(self, state: LayerState | None, length: int, template: torch.Tensor):
        self.state, self.length = state, length
        self.empty = template.new_zeros((template.shape[0], 1, 0, 0))

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-width K and V (B, 1, end, 0)."""
        width = self.empty.new_zeros((self.empty.shape[0], 1, end, 0))
        return width, width

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise RuntimeError("a recurrent layer holds a state, not K/V per token")

    def cache_layer(self, length: int, index: int, rewrite: Rewrite | None, latent: bool) -> StateLayer:
        return StateLayer(self, length)

    def tensors(self) -> list[torch.Tensor]:
        """The state's tensors (what this layer holds in memory)."""
        return self.state.tensors() if self.state is not None else []


class StateLayer(LinearAttentionLayer):
    """The cache layer of a recurrent layer for one forward (or one turn's forwards): starts from a copy of
    `buffer`'s state, which must be the state after exactly `length` tokens (the context the forward continues);
    the model updates the copy."""

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
