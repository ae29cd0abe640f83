"""ReBaseShared (PReCache): a neutral base cache and LR caches from adapter-free hidden states.

Paper: PReCache (ReBaseShared); code: hjeon2k/PReCache. The context is also processed adapter-free, giving X_neut;
the store keeps X_neut·W0 and, for every other agent k, X_neut·A_k. Agent j attends to V = X_neut·W0 + s·(X·A_j)·B_j,
whichever agent processed the token first. Approximate (X_neut ≠ X_j).

- `own_lr=adapted` (default, the paper): the processing agent's own LR cache is X_i·A_i from its adapted forward;
  `own_lr=neutral` (kvprof) builds it from X_neut too.
- `schedule=lp` (lazy prefill): TTFT holds the context, the chunk's forward and the agent's own down-projections;
  after the turn (end-to-end latency only) its tokens are re-processed adapter-free and the neutral caches stored.
  `db` (double batching): an adapted and an adapter-free row in one 2-row batch at prefill and every decode step,
  the neutral caches computed right after each forward. Both give the same cache state.
- Moved spans (`LowRankPolicy`): neutral base K/V re-aligned, LR caches copied; the new tokens between them are
  computed in the turn and, with `lp`, passed adapter-free after it, span by span.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvprof.claims.papers import PRECACHE, PRECACHE_SETTING
from kvprof.claims.types import Published, ServingClaim
from kvprof.model.runtime import ChunkForward
from kvprof.policies.lowrank import VIEWS, LowRankContext, LowRankPolicy, LowRankStore, StoreUpdate
from kvprof.policies.options import Option
from kvprof.policies.prelrshared import PRECACHE_MEMORY, PRECACHE_SERVING
from kvprof.policies.turns import Chunk

NEUTRAL = "neutral"


@dataclass
class ReBaseSharedContext(LowRankContext):
    """own: the agent's X_i·A_i of the turn's new tokens per forward, in timeline order (per layer {"key"|"value":
    (1, n, r)}); `lp` stores them with the after-turn pass."""

    own: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)


class ReBaseShared(LowRankPolicy[ReBaseSharedContext]):
    name = "rebaseshared"
    family = "PReCache"
    paper = f"{PRECACHE}, ReBaseShared"
    approximate = True
    options = {
        "schedule": Option(
            "lp", ("lp", "db"), sweep=("lp", "db"), help="lp: lazy prefill after decoding; db: double batching"
        ),
        "own_lr": Option(
            "adapted",
            ("adapted", "neutral"),
            help="adapted: the processing agent's own LR cache from its adapted hidden states (the paper); "
            "neutral: from the adapter-free ones",
        ),
        "views": VIEWS,
    }
    published = (
        Published(PRECACHE, "accuracy (Table 2)", PRECACHE_SETTING, "mean accuracy drop 1.1 points against NonShared"),
        Published(
            PRECACHE,
            "single-stream efficiency",
            PRECACHE_SETTING,
            "LP: TTFT up to 3.0× lower than NonShared, throughput up to 1.6×",
        ),
        Published(
            PRECACHE,
            "concurrent serving",
            PRECACHE_SERVING,
            "DB: per-request throughput 1.3× NonShared's at an unsaturated load",
            serving=ServingClaim(
                "request_throughput",
                1.04,
                1.56,
                "kvprof: 1.3× read ± 20 %, at the lowest simulated load",
                ("nonshared",),
                policy_options=(("schedule", "db"),),
            ),
        ),
        *PRECACHE_MEMORY,
    )

    @property
    def needs_hidden(self) -> bool:
        return self.settings["schedule"] == "db" or self.settings["own_lr"] == "adapted"

    def adapter_rows(self, agent: str) -> list[str] | None:
        return [agent, "__base__"] if self.settings["schedule"] == "db" else None

    def assemble(self, agent: str, shared: list[int]) -> ReBaseSharedContext:
        reused = self.reused_span(shared)
        view = self.store_view(agent, self.store.lr(agent), reused, len(shared) - reused)
        kv, buffers = view.kv, view.buffers
        if self.settings["schedule"] == "db":
            neutral = self.store.assemble(None, None, reused, slot="neutral").kv
            spare = self.with_output(len(shared) - reused)
            buffers = [
                self.workspace.rows("rows", layer, [row, neutral_row], spare)
                for layer, (row, neutral_row) in enumerate(zip(kv, neutral))
            ]
            kv = [buffer.view(reused) for buffer in buffers]
        context = ReBaseSharedContext(
            kv=kv,
            reused=reused,
            adapter_free=reused,
            extra_flops=view.extra_flops,
            lora_values=view.lora_values,
            buffers=buffers,
            view=view.view,
        )
        self.extend_over_moved_store(agent, shared, context)
        return context

    def on_forward(self, agent: str, context: ReBaseSharedContext, forward: ChunkForward, start: int) -> float:
        """For the forward's tokens new to the store: the agent's own X_i·A_i (own_lr=adapted, from the forward's
        own LoRA layer), and with double batching the neutral base and LR caches from the adapter-free row."""
        if forward.hidden is None:
            return 0.0
        skip = self.new_tokens(context, forward, start)
        if skip is None:
            return 0.0
        own = None
        if self.settings["own_lr"] == "adapted":
            own = LowRankStore.forward_down_projections(self.runtime, forward, agent, skip)
            context.own.append(own)
        if self.settings["schedule"] == "db":
            update, flops = self._neutral_update(forward, 1, skip, start + skip, agent, own)
            context.updates.append(update)
            return flops
        return 0.0

    def _neutral_update(
        self,
        forward: ChunkForward,
        row: int,
        skip: int,
        start: int,
        agent: str,
        own: list[dict[str, torch.Tensor]] | None,
    ) -> tuple[StoreUpdate, float]:
        """Neutral base K/V and LR caches of the tokens batch row `row` computed adapter-free, from the `skip`-th on
        (timeline start..); others' X_neut·A_k in one GEMM; `agent`'s own is `own` when given."""
        assert forward.hidden is not None  # captured
        update, flops = self.store.base_update(forward, start, NEUTRAL, None, row=row, skip=skip)
        names = self.runtime.agents.spec.names
        others = [name for name in names if own is None or name != agent]
        neutral = [x[row : row + 1, skip:] for x in forward.hidden]
        projections = LowRankStore.down_projections(self.runtime, neutral, others)
        flops += LowRankStore.down_projection_flops(self.runtime, projections)
        update.low_rank = {name: (own if own is not None and name == agent else projections[name]) for name in names}
        return update, flops

    def commit(self, chunk: Chunk[ReBaseSharedContext]) -> float:
        self.keep_view(chunk)
        context = chunk.context
        if self.settings["schedule"] == "db":
            self.store.apply(context.updates + context.moved_updates)
            return 0.0
        own = None
        if context.own:
            pieces = context.own
            own = [
                {p: torch.cat([piece[layer][p] for piece in pieces], 1) for p in pieces[0][layer]}
                for layer in range(self.runtime.num_layers)
            ]
        # the turn's new tokens (between moved spans, then the chunk and outputs) and its moved spans, in order
        segments: list[tuple[int, list[int] | StoreUpdate]] = [*context.pieces, (chunk.start, chunk.ids)]
        segments += [(update.start, update) for update in context.moved_updates]
        flops, used = 0.0, 0
        for start, segment in sorted(segments, key=lambda item: item[0]):
            if isinstance(segment, StoreUpdate):
                self.store.apply([segment])
                continue
            if start > len(self.store):
                raise RuntimeError(f"rebaseshared: new tokens at {start} leave a gap after {len(self.store)}")
            new_ids = segment[len(self.store) - start :]
            if not new_ids:
                continue
            own_part = (
                None
                if own is None
                else [{p: t[:, used : used + len(new_ids)] for p, t in layer.items()} for layer in own]
            )
            used += len(new_ids)
            flops += self._lazy_prefill(chunk.agent, new_ids, own_part)
        return flops

    def _lazy_prefill(self, agent: str, new_ids: list[int], own: list[dict[str, torch.Tensor]] | None) -> float:
        """The after-turn adapter-free pass over the new tokens, storing their neutral caches; its FLOPs."""
        runtime, store = self.runtime, self.store
        context_len = len(store)
        base = store.assemble(None, None, context_len, spare=len(new_ids), slot="neutral")
        cache = runtime.cache_over(base.kv, base.buffers, len(new_ids))
        out = runtime.forward(None, new_ids, cache, context_len, capture=True, last_logits_only=True)
        update, flops = self._neutral_update(out, 0, 0, context_len, agent, own)
        store.apply([update])
        return flops + runtime.flops(len(new_ids), context_len)
