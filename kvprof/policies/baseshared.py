"""BaseShared (LRAgent): one shared base cache; each agent rebuilds its own rank-r LR cache by an "LR prefill".

The base cache X_i·W0 is stored once, by whichever agent processed a token first. Before its turn agent j passes
the accumulated context through the backbone with its adapter again to rebuild its LR cache X_j·A_j (the published
LR prefill, `lr_prefill=full`); `lr_prefill=incremental` only passes the tokens j has not yet down-projected, over
its own view of the earlier ones (a kvprof extra). Agent j attends to V = X_i·W0 + s·(X_j·A_j)·B_j. Compute ≥
NonShared with the full LR prefill; memory ≈ 1× + N·r/d. Approximate: the base part was shaped by agent i.
Paper: LRAgent (BaseShared).

Phases: TTFT — the LR prefill (its cache and hidden states are the turn's transients), the context, the chunk's
forward, and the chunk's own down-projections and base K/V; each decode step — the same for its token; after the
turn — storing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvprof.policies.base import Chunk, Option, Published
from kvprof.policies.lowrank import LowRankContext, LowRankPolicy, LowRankStore
from kvprof.policies.papers import LRAGENT, LRAGENT_SETTING
from kvprof.runtime import ChunkForward

LowRank = list[dict[str, torch.Tensor]]  # per layer {"key"|"value": (1, n, r)}


@dataclass
class BaseSharedContext(LowRankContext):
    """low_rank: the acting agent's LR cache over the reused span after its LR prefill (None before it has any);
    own: its down-projections of the turn's tokens (chunk, then each output token), which `commit` appends."""

    low_rank: LowRank | None = None
    own: list[LowRank] = field(default_factory=list)


class BaseShared(LowRankPolicy[BaseSharedContext]):
    name = "baseshared"
    family = "LRAgent"
    paper = f"{LRAGENT}, BaseShared"
    approximate = True
    options = {
        "lr_prefill": Option(
            "full",
            ("full", "incremental"),
            sweep=("full", "incremental"),
            help="full: the published LR prefill over the whole context; incremental: only the tokens the agent "
            "has not down-projected yet",
        )
    }
    published = (
        Published(
            LRAGENT, "main results, accuracy", LRAGENT_SETTING, "mean accuracy drop ≤ 0.7 points against NonShared"
        ),
        Published(LRAGENT, "main results, throughput", LRAGENT_SETTING, "throughput up to 1.42× NonShared"),
    )

    def assemble(self, agent: str, shared: list[int]) -> BaseSharedContext:
        runtime, store = self.runtime, self.store
        reused = self.reused_span(shared)
        own = store.lr(agent)
        have = 0 if self.settings["lr_prefill"] == "full" else min(store.lr_length(agent), reused)
        low_rank, flops, working = own, 0.0, 0
        if reused > have:
            own_view = store.assemble(agent, own, have, spare=reused - have)
            cache = runtime.cache_over(own_view.kv, own_view.buffers, reused - have)
            out = runtime.forward(agent, shared[have:reused], cache, have, capture=True, last_logits_only=True)
            assert out.hidden is not None  # captured: capture=True
            gap = LowRankStore.down_projections(runtime, out.hidden, [agent])
            low_rank = (
                gap[agent]
                if have == 0 or own is None
                else [{p: torch.cat([old[p][:, :have], new[p]], 1) for p in new} for old, new in zip(own, gap[agent])]
            )
            flops = own_view.flops + runtime.flops(reused - have, have)
            flops += LowRankStore.down_projection_flops(runtime, gap)
            working = runtime.kv_bytes_per_token * reused + runtime.hidden_bytes_per_token * (reused - have)
        view = self.store_view(agent, low_rank, reused, len(shared) - reused)
        return BaseSharedContext(
            kv=view.kv,
            reused=reused,
            extra_prefill=reused - have,
            extra_flops=flops + view.extra_flops,
            working_bytes=working,
            lora_values=view.lora_values,
            low_rank=low_rank,
        )

    def on_forward(self, agent: str, context: BaseSharedContext, forward: ChunkForward, start: int) -> float:
        """The agent's own X·A of the forward's tokens, and the base K/V of those the store does not hold yet."""
        assert forward.hidden is not None  # needs_hidden: every forward of the turn captures X
        own = LowRankStore.down_projections(self.runtime, forward.hidden, [agent])
        context.own.append(own[agent])
        flops = LowRankStore.down_projection_flops(self.runtime, own)
        new = self.new_tokens(context, forward.hidden, start)
        if new is not None:
            update, base_flops = self.store.base_update(*new, agent)
            context.updates.append(update)
            flops += base_flops
        return flops

    def commit(self, chunk: Chunk[BaseSharedContext]) -> float:
        self.store.apply(chunk.context.updates)
        earlier, own = chunk.context.low_rank, chunk.context.own
        if chunk.start and not earlier:
            raise RuntimeError("baseshared reused tokens without an LR cache for them")
        pieces = ([[{p: t[:, : chunk.start] for p, t in layer.items()} for layer in earlier]] if earlier else []) + own
        start = 0
        for piece in pieces:
            self.store.write_low_rank(chunk.agent, start, piece)
            start = self.store.lr_length(chunk.agent)
        return 0.0
