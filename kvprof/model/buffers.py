"""Caches that grow in place: preallocated storage appended to without copying what it already holds.

transformers' `DynamicCache` appends with `torch.cat`, copying the whole cache every chunk and decode step; on long
trajectories with short turns those copies would dominate a turn (docs/design.md#sharing-policies). `GrowingTensor`
grows along one axis (by `GROWTH` when full: amortised O(1) per token); `KVBuffer` is one layer's K and V
(B, H_kv, capacity, D); `BufferCache` is a `DynamicCache` whose `BufferLayer`s write new K/V in place after a given
length. Tokens past a holder's valid length are scratch (a repeated prefill rewrites them). Storage is allocated and
written in inference mode. Stored-memory figures count valid tokens, as a paged server holds them; the spare
capacity (< `GROWTH` − 1 of the valid size) shows only in the CUDA allocator's peak.
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
        if end > self.capacity:
            self._grow_to(max(end, int(self.capacity * GROWTH)))

    def _grow_to(self, capacity: int) -> torch.Tensor:
        """New storage of `capacity` slots, the old ones' contents first; the slots after them (a view)."""
        shape = list(self.storage.shape)
        shape[self.axis] = capacity
        with torch.inference_mode():
            grown = torch.empty(shape, dtype=self.storage.dtype, device=self.storage.device)
            grown.narrow(self.axis, 0, self.capacity).copy_(self.storage)
        added = grown.narrow(self.axis, self.capacity, capacity - self.capacity)
        self.storage = grown
        return added

    def make_room(self, end: int) -> None:
        """Before a turn, untimed: hold exactly `end` slots if it holds fewer (the first keep their contents), every
        one written once now (a timed write then finds its pages touched): the turn writes no further, so it grows
        nothing, and nothing is spare between turns."""
        if end > self.capacity:
            added = self._grow_to(end)
            with torch.inference_mode():
                added.zero_()

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
        """An empty buffer shaped like `keys`, `values` (B, H_kv, ·, D) for `capacity` tokens."""
        return cls(GrowingTensor(keys, 2, capacity), GrowingTensor(values, 2, capacity))

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, spare: int = 0) -> KVBuffer:
        """A buffer holding copies of `keys` and `values` (B, H_kv, L, D), with room for `spare` more tokens."""
        return cls(GrowingTensor.of(keys, 2, spare), GrowingTensor.of(values, 2, spare))

    @classmethod
    def of_parts(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], spare: int = 0) -> KVBuffer:
        """A buffer of the spans `parts` ((K, V) each (B, H_kv, L_i, D)) in order, written once, `spare` room."""
        length = sum(int(keys.shape[2]) for keys, _ in parts)
        buffer = cls.like(*parts[0], length + spare)
        start = 0
        for keys, values in parts:
            buffer.write(start, keys, values)
            start += int(keys.shape[2])
        return buffer

    def make_room(self, end: int) -> None:
        """`GrowingTensor.make_room` of keys and values: exactly `end` tokens, before a turn, untimed."""
        self.keys.make_room(end)
        self.values.make_room(end)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.write(start, keys)
        self.values.write(start, values)

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.view(end), self.values.view(end)

    def fits(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether this buffer holds tensors like `keys`, `values` (batch, heads, head size, dtype, device)."""
        return all(
            held.storage.shape[:2] == side.shape[:2]
            and held.storage.shape[3:] == side.shape[3:]
            and held.storage.dtype == side.dtype
            and held.storage.device == side.device
            for held, side in ((self.keys, keys), (self.values, values))
        )

    def cache_layer(self, length: int, index: int, rewrite: Rewrite | None, latent: bool) -> CacheLayerMixin:
        """The cache layer the model updates for decoder layer `index`, over this buffer's first `length` tokens."""
        return BufferLayer(self, length, index, rewrite, latent)


class Workspace:
    """Buffers a policy writes a call's context into (per name and layer, grown by `GROWTH`), reused by the call's
    repeated prefills and decode, and released when the call ends (`release`): a replay's runs take turns, so only
    the running one holds its workspace, and the allocator hands the freed memory to the next (on CPU glibc keeps it,
    `kvprof.profiling.keep_freed_memory`; on a GPU the caching allocator). Contents are scratch: valid for the call
    that wrote them."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], KVBuffer] = {}

    def release(self) -> None:
        """Let go of every buffer (a tensor still viewing one keeps its storage alive until it is dropped)."""
        self.held.clear()

    def buffer(self, name: str, layer: int, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> KVBuffer:
        """Buffer `name` of `layer`, shaped like `keys`, `values` (B, H_kv, ·, D), with room for `capacity` tokens."""
        held = self.held.get((name, layer))
        if held is None or not (held.fits(keys, values) and capacity <= held.keys.capacity):
            size = capacity if held is None else max(capacity, int(held.keys.capacity * GROWTH))
            held = self.held[(name, layer)] = KVBuffer.like(keys, values, size)
        return held

    def copy(self, name: str, layer: int, keys: torch.Tensor, values: torch.Tensor, spare: int = 0) -> KVBuffer:
        """`KVBuffer.of` into buffer `name` of `layer`: copies of `keys`, `values` (B, H_kv, L, D), `spare` room."""
        buffer = self.buffer(name, layer, keys, values, int(keys.shape[2]) + spare)
        buffer.write(0, keys, values)
        return buffer

    def rows(self, name: str, layer: int, rows: list[tuple[torch.Tensor, torch.Tensor]], spare: int = 0) -> KVBuffer:
        """Batch `rows` ((K, V) each (b, H_kv, L, D)) stacked on the batch axis in buffer `name` of `layer`, `spare`
        room."""
        keys, values = rows[0]
        batch = sum(int(row_keys.shape[0]) for row_keys, _ in rows)
        like = [side.new_empty((batch, *side.shape[1:2], 0, side.shape[3])) for side in (keys, values)]
        buffer = self.buffer(name, layer, like[0], like[1], int(keys.shape[2]) + spare)
        with torch.inference_mode():
            for side, grown in enumerate((buffer.keys, buffer.values)):
                offset = 0
                for row in rows:
                    grown.slot(0, int(row[side].shape[2])).narrow(0, offset, row[side].shape[0]).copy_(row[side])
                    offset += int(row[side].shape[0])
        return buffer


Rewrite = Callable[[int, "KVBuffer", int, int], None]
"""`rewrite(layer, buffer, start, count)`: called by a `BufferLayer` after it wrote a forward's `count` new tokens at
slots start.. of `buffer`, before attention reads them; may overwrite any of those slots in place."""


class BufferLayer(DynamicLayer):
    """A cache layer over a `KVBuffer` (context: its first `length` tokens): `update` writes in place after them,
    applies `rewrite` (for layer `index`), returns views. `latent`: an MLA layer, held as (k_rot, latent)."""

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
    """A `DynamicCache` whose layer i appends in place to `buffers[i]` after `length` tokens (`rewrite` after each
    write); recurrent layers continue from their `StateBuffer`."""

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
