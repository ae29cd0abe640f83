"""Caches that grow in place: preallocated storage appended to without copying what it already holds.

A transformers `DynamicCache` appends a forward's new K/V with `torch.cat`, which copies the whole cache: every
chunk and every decode step costs O(L) in memory traffic, and a policy that hands the model a context it assembled
pays that copy again. On long trajectories with short turns (ReAct: a few tokens of thought after 17k tokens of
context) those copies, not the policy, dominate a turn. Here the storage is allocated with room to spare:

- `GrowingTensor`: one tensor growing along one axis; `write(start, part)` copies `part` into place (O(n)), and the
  storage grows by `GROWTH` when full (one copy, amortised O(1) per token). `view(end)` is the valid prefix.
- `KVBuffer`: one layer's keys and values, (B, H_kv, capacity, D) each, growing along the token axis.
- `BufferCache`: a `DynamicCache` whose layers (`BufferLayer`) write the model's new K/V into `KVBuffer`s after a
  given length and return views. A policy whose stored cache *is* what the acting agent attends to (NonShared's own
  cache, FullShared's shared cache in lora mode) lets the turn append in place past the stored length: the stored
  prefix is never copied, and `commit` only advances the length. Tokens written past a holder's valid length are
  scratch until it advances, so a repeated prefill rewrites the same place.

All storage is allocated and written in inference mode (the model's caches are inference tensors); callers write
into `slot`s in inference mode too (a policy's turn runs in it).

Stored-memory figures count valid tokens (`view`), as a paged server would hold them; the spare capacity (at most
`GROWTH` − 1 of the valid size) is the harness's and shows only in the CUDA allocator's peak.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

GROWTH = 1.5  # capacity multiplier when a buffer is full
HEADROOM = 256  # slots allocated beyond what is asked for: a turn's output tokens fit without regrowing


class GrowingTensor:
    """A tensor growing along `axis`: storage of shape `shape` with `capacity` slots on that axis."""

    def __init__(self, template: torch.Tensor, axis: int, capacity: int):
        shape = list(template.shape)
        shape[axis] = capacity + HEADROOM
        self.axis = axis
        with torch.inference_mode():
            self.storage = torch.empty(shape, dtype=template.dtype, device=template.device)

    @classmethod
    def of(cls, tensor: torch.Tensor, axis: int, spare: int = 0) -> GrowingTensor:
        """A buffer holding a copy of `tensor`, with room for `spare` more slots along `axis`."""
        grown = cls(tensor, axis, tensor.shape[axis] + spare)
        grown.write(0, tensor)
        return grown

    @property
    def capacity(self) -> int:
        return int(self.storage.shape[self.axis])

    def reserve(self, end: int) -> None:
        """Make room for `end` slots; the first slots (all of them, valid or not) keep their contents."""
        if end <= self.capacity:
            return
        shape = list(self.storage.shape)
        shape[self.axis] = max(end, int(self.capacity * GROWTH))
        with torch.inference_mode():
            grown = torch.empty(shape, dtype=self.storage.dtype, device=self.storage.device)
            grown.narrow(self.axis, 0, self.capacity).copy_(self.storage)
        self.storage = grown

    def write(self, start: int, part: torch.Tensor) -> None:
        """Copy `part` into slots start..start + n (n = part's size along the axis), growing if needed."""
        count = int(part.shape[self.axis])
        self.reserve(start + count)
        with torch.inference_mode():
            self.storage.narrow(self.axis, start, count).copy_(part)

    def slot(self, start: int, count: int) -> torch.Tensor:
        """Slots start..start + count as a view to compute into (reserving them first)."""
        self.reserve(start + count)
        return self.storage.narrow(self.axis, start, count)

    def view(self, end: int) -> torch.Tensor:
        """The first `end` slots (a view: valid until the next growth)."""
        return self.storage.narrow(self.axis, 0, end)


class KVBuffer:
    """One layer's keys and values, each (B, H_kv, capacity, D), growing along the token axis (2)."""

    def __init__(self, keys: GrowingTensor, values: GrowingTensor):
        self.keys, self.values = keys, values

    @classmethod
    def like(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> KVBuffer:
        """An empty buffer for keys and values shaped like `keys` and `values` (B, H_kv, ·, D), with room for
        `capacity` tokens."""
        return cls(GrowingTensor(keys, 2, capacity), GrowingTensor(values, 2, capacity))

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, spare: int = 0) -> KVBuffer:
        """A buffer holding copies of `keys` and `values` (B, H_kv, L, D), with room for `spare` more tokens."""
        return cls(GrowingTensor.of(keys, 2, spare), GrowingTensor.of(values, 2, spare))

    @classmethod
    def of_parts(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], spare: int = 0) -> KVBuffer:
        """A buffer holding the token spans `parts` (each (K, V), (B, H_kv, L_i, D)) one after the other, with room
        for `spare` more tokens: the concatenation written once, in place."""
        length = sum(int(keys.shape[2]) for keys, _ in parts)
        buffer = cls.like(*parts[0], length + spare)
        start = 0
        for keys, values in parts:
            buffer.write(start, keys, values)
            start += int(keys.shape[2])
        return buffer

    @classmethod
    def of_rows(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], spare: int = 0) -> KVBuffer:
        """A buffer holding the batch rows `rows` (each (K, V), (b, H_kv, L, D)) stacked along the batch axis, with
        room for `spare` more tokens."""
        length = int(rows[0][0].shape[2])
        batch = sum(int(keys.shape[0]) for keys, _ in rows)
        grown = []
        for side in (0, 1):
            first = rows[0][side]
            target = GrowingTensor(first.new_empty((batch, first.shape[1], 0, first.shape[3])), 2, length + spare)
            offset = 0
            for row in rows:
                target.slot(0, length).narrow(0, offset, row[side].shape[0]).copy_(row[side])
                offset += int(row[side].shape[0])
            grown.append(target)
        return cls(grown[0], grown[1])

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.write(start, keys)
        self.values.write(start, values)

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.view(end), self.values.view(end)

    def cache_layer(self, length: int, index: int, rewrite: Rewrite | None, latent: bool) -> CacheLayerMixin:
        """The cache layer the model updates for decoder layer `index`, over this buffer's first `length` tokens."""
        return BufferLayer(self, length, index, rewrite, latent)


Rewrite = Callable[[int, "KVBuffer", int, int], None]
"""`rewrite(layer, buffer, start, count)`: called by a `BufferLayer` after it wrote a forward's `count` new tokens at
slots start.. of `buffer`, before attention reads them; may overwrite any of those slots in place."""


class BufferLayer(DynamicLayer):
    """A cache layer over a `KVBuffer`: the first `length` tokens are the context; `update` writes the new tokens
    in place after them (then lets `rewrite`, if any, overwrite some of them: `Rewrite`) and returns views of
    everything so far. `index`: the decoder layer's index, for `rewrite`. `latent`: an MLA layer, which the model
    updates with (latent, k_rot) and the buffer holds as (k_rot, latent) (`kvprof.model.latent`)."""

    def __init__(
        self, buffer: KVBuffer, length: int, index: int = 0, rewrite: Rewrite | None = None, latent: bool = False
    ):
        super().__init__()
        self.buffer, self.length = buffer, length
        self.index, self.rewrite, self.latent = index, rewrite, latent
        self.keys, self.values = buffer.view(length)
        self.device = self.keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's write, in its order (an MLA layer's (latent, k_rot)); returns everything so far in its order."""
        if self.latent:
            self.append(value_states, key_states)
            return self.values, self.keys
        self.append(key_states, value_states)
        return self.keys, self.values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write `keys` and `values` (B, H_kv, n, D), in kvprof's order, after the tokens so far."""
        self.buffer.write(self.length, keys, values)
        if self.rewrite is not None:
            self.rewrite(self.index, self.buffer, self.length, int(keys.shape[-2]))
        self.length += int(keys.shape[-2])
        self.keys, self.values = self.buffer.view(self.length)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of tokens to remove as a negative integer")
        self.length = max(self.length + tokens_to_remove, 0)
        self.keys, self.values = self.buffer.view(self.length)


class BufferCache(DynamicCache):
    """A `DynamicCache` whose layer i appends in place to `buffers[i]` after the first `length` tokens (each
    forward's new tokens passed to `rewrite` once written, when given); the layers in `latent` are MLA layers
    (`BufferLayer`); a hybrid's recurrent layer continues from its buffer's state
    (`kvprof.model.recurrent.StateBuffer`)."""

    def __init__(
        self,
        buffers: list[KVBuffer],
        length: int,
        rewrite: Rewrite | None = None,
        latent: Collection[int] = (),
    ):
        Cache.__init__(
            self,
            layers=[
                buffer.cache_layer(length, index, rewrite, index in latent) for index, buffer in enumerate(buffers)
            ],
        )
