"""BaseShared (LRAgent): one shared base cache; each agent rebuilds its own rank-r LR cache by an "LR prefill".

The base cache X_i·W0 is stored once, by whichever agent processed a token first. Before its turn agent j passes
the accumulated context through the backbone with its adapter again to rebuild its LR cache X_j·A_j (the published
LR prefill, `lr_prefill=full`); `lr_prefill=incremental` only passes the tokens j has not yet down-projected, over
its own view of the earlier ones (a kvprof extra). Agent j attends to V = X_i·W0 + s·(X_j·A_j)·B_j. Compute ≥
NonShared with the full LR prefill; memory ≈ 1× + N·r/d. Approximate: the base part was shaped by agent i.
Paper: LRAgent (BaseShared).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvprof.policies.base import Chunk, Context, Option, Published
from kvprof.policies.lowrank import LowRankPolicy, LowRankStore
from kvprof.policies.papers import LRAGENT, LRAGENT_SETTING


@dataclass
class BaseSharedContext(Context):
    """low_rank: the acting agent's LR cache over the reused span after its LR prefill, per layer
    {"key"|"value": (1, reused, r)} (None before it has any), which `commit` extends with the turn's tokens."""

    low_rank: list[dict[str, torch.Tensor]] | None = None


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
            help="full: the published LR prefill over the whole context; incremental: "
            "only the tokens the agent has not down-projected yet",
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
        own = store.low_rank.get(agent)
        have = 0 if self.settings["lr_prefill"] == "full" else min(store.lr_length(agent), reused)
        low_rank, flops = own, 0.0
        if reused > have:
            view, view_flops, _ = store.assemble(agent, own, have)
            out = runtime.forward(
                agent, shared[have:reused], runtime.cache_from(view), have, capture=True, last_logits_only=True
            )
            assert out.hidden is not None
            gap = LowRankStore.down_projections(runtime, out.hidden, [agent])[agent]
            low_rank = (
                gap
                if have == 0 or own is None
                else [{p: torch.cat([old[p][:, :have], new[p]], 1) for p in new} for old, new in zip(own, gap)]
            )
            rank = sum(t.shape[-1] for layer in gap for t in layer.values())
            flops = view_flops + runtime.flops(reused - have, have) + 2.0 * (reused - have) * runtime.hidden_size * rank
        base = self.store_context(agent, low_rank, reused, self.from_others(agent, reused))
        return BaseSharedContext(
            kv=base.kv,
            reused=reused,
            from_others=base.from_others,
            extra_prefill=reused - have,
            extra_flops=flops + base.extra_flops,
            lora_values=base.lora_values,
            low_rank=low_rank,
        )

    def commit(self, chunk: Chunk[BaseSharedContext]) -> float:
        store, hidden = self.store, chunk.hidden
        assert hidden is not None
        skip = len(store) - chunk.start
        flops = 0.0
        if hidden[0].shape[1] > skip:
            flops += store.append_base([x[:, skip:] for x in hidden], chunk.agent)
        new = LowRankStore.down_projections(self.runtime, hidden, [chunk.agent])[chunk.agent]
        earlier = chunk.context.low_rank
        if earlier is not None and chunk.start:
            new = [{p: torch.cat([old[p][:, : chunk.start], add[p]], 1) for p in add} for old, add in zip(earlier, new)]
        store.low_rank[chunk.agent] = new
        rank = sum(t.shape[-1] for t in new[0].values()) * self.runtime.num_layers
        return flops + 2.0 * hidden[0].shape[1] * self.runtime.hidden_size * rank
