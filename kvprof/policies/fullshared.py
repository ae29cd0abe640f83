"""FullShared: one cache of the shared timeline, whichever agent computed each token; new tokens only.

The naive-sharing baseline of LRAgent, PReCache and KVCOMM. Each token's K/V is computed once, by the first agent
to process it (its adapter, after its role prompt), and reused as is; in prompt mode keys are re-rotated to the
reader's positions (`kvprof.model.rope.rotate_keys`). Approximate; memory 1× plus each agent's private prefix.
Moved spans (`kvprof.policies.moved`) are served from the K/V their source turn held, re-rotated; the new tokens
between them are computed over the cache so far, and the store keeps the sequence as the reader attended it.

Phases: TTFT — the role prompt on the agent's first turn, the context, the chunk's forward; decode — one token;
after the turn — appending the new K/V to the shared cache. Without private prefixes (lora mode) the turn appends
in place (`kvprof.model.buffers`) and `commit` only extends the stored length; with prefixes each turn builds its
context (prefix, then re-rotated shared keys) and `commit` copies the new K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvprof.claims.papers import LRAGENT, LRAGENT_SETTING
from kvprof.claims.types import Published
from kvprof.model.buffers import KVBuffer
from kvprof.model.rope import rotate_keys
from kvprof.model.runtime import KV, ChunkForward
from kvprof.policies.base import SharingPolicy
from kvprof.policies.turns import Chunk, Context


@dataclass
class FullSharedContext(Context):
    """prefix: the acting agent's private-prefix cache, per layer (K, V) (1, H_kv, len(prefix), D), kept by
    `commit` the first time the agent acts."""

    prefix: list[KV] | None = None


class FullShared(SharingPolicy[FullSharedContext]):
    name = "fullshared"
    family = "baseline"
    paper = "naive sharing baseline of LRAgent / PReCache / KVCOMM"
    approximate = True
    modes: ClassVar[tuple[str, ...]] = ("lora", "prompt")
    published: ClassVar[tuple[Published, ...]] = (
        Published(
            LRAGENT, "main results, accuracy", LRAGENT_SETTING, "accuracy drop up to 5.3 points against NonShared"
        ),
    )
    timeline_state: ClassVar[tuple[str, ...]] = ("shared", "offsets", "producers", "prefixes")
    moves_spans = True
    context_type: ClassVar[type[FullSharedContext]] = FullSharedContext  # a subclass's own context fields

    def reset(self) -> None:
        self.shared: list[KVBuffer] | None = None  # per layer (K, V), (1, H_kv, ≥ N, D), keys at producer positions
        self.offsets: list[int] = []  # per shared token: the producer's prefix length (its position offset)
        self.producers: list[str] = []
        self.prefixes: dict[str, list[KV]] = {}

    def assemble(self, agent: str, shared: list[int]) -> FullSharedContext:
        prefix_len = len(self.runtime.prefix(agent))
        extra_prefill, flops = 0, 0.0
        prefix_kv = self.prefixes.get(agent)
        if prefix_kv is None:
            prefix_kv, flops = self.prefix_context(agent)
            extra_prefill = prefix_len
        reused = min(len(self.producers), len(shared) - 1)
        kv, buffers, realigned = prefix_kv, None, 0
        if self.shared is not None and prefix_len == 0 and reused == len(self.producers):
            kv, buffers = [buffer.view(reused) for buffer in self.shared], self.shared
        elif reused and self.shared is not None:
            delta = torch.tensor([prefix_len - offset for offset in self.offsets[:reused]])
            realigned = int(delta.count_nonzero())
            buffers = []
            for layer, (prefix_part, buffer) in enumerate(zip(prefix_kv, self.shared)):
                keys, values = buffer.view(reused)
                if bool(delta.any()):
                    keys = rotate_keys(keys, delta.to(keys.device), self.runtime.ropes[layer])
                    flops += 6.0 * keys.numel()
                buffers.append(KVBuffer.of_parts([prefix_part, (keys, values)], self.with_output(len(shared) - reused)))
            kv = [buffer.view(prefix_len + reused) for buffer in buffers]
        context = self.context_type(
            kv=kv,
            reused=reused,
            extra_prefill=extra_prefill,
            extra_flops=flops,
            buffers=buffers,
            realigned=realigned,
            prefix=prefix_kv,
        )
        self.extend_context(agent, shared, context, self.computes_new_tokens_later(), self.piece_hook(context))
        return context

    def make_room(self, agent: str, shared: list[int]) -> None:
        for buffer in self.shared or []:
            buffer.make_room(self.with_output(len(shared)))

    def piece_hook(self, context: FullSharedContext) -> Callable[[int, ChunkForward], None] | None:
        """What sees each forward of new tokens between moved spans (`extend_over_moved`'s `on_piece`); None."""
        return None

    def computes_new_tokens_later(self) -> bool:
        """Whether this turn's new tokens between moved spans are left for the policy to compute after `assemble`'s
        extension (a selective recompute over the whole input) rather than computed there."""
        return False

    def commit(self, chunk: Chunk[FullSharedContext]) -> float:
        prefix_len = len(self.runtime.prefix(chunk.agent))
        if chunk.context.prefix is not None:
            self.prefixes.setdefault(chunk.agent, chunk.context.prefix)
        known = len(self.producers)
        in_place = self.shared is not None and chunk.buffers[0] is self.shared[0]  # new tokens stored already
        if self.shared is None and prefix_len == 0:
            self.shared = chunk.buffers  # the turn's cache is the timeline from its start
        elif not in_place:
            begin = prefix_len + known
            new = [(k[:, :, begin:], v[:, :, begin:]) for k, v in chunk.kv]
            if self.shared is None:
                self.shared = [KVBuffer.of(keys, values) for keys, values in new]
            else:
                for buffer, (keys, values) in zip(self.shared, new):
                    buffer.write(known, keys, values)
        added = chunk.start + len(chunk.ids) - known
        self.offsets += [prefix_len] * added
        self.producers += [chunk.agent] * added
        return 0.0

    def truncate(self, keep: int) -> None:
        del self.offsets[keep:], self.producers[keep:]

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = {"shared cache": self.runtime.held(self.shared or [], len(self.producers))}
        tensors.update({f"prefix:{agent}": [t for pair in kv for t in pair] for agent, kv in self.prefixes.items()})
        return tensors

    def analytic_bytes(self) -> dict[str, int]:
        runtime = self.runtime
        sizes = {"shared cache": runtime.kv_bytes(len(self.producers))}
        per_token = runtime.kv_bytes_per_token
        sizes.update({f"prefix:{agent}": per_token * len(runtime.prefix(agent)) for agent in self.prefixes})
        return sizes
