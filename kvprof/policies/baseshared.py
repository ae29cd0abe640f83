"""BaseShared (LRAgent): one shared base cache; each agent rebuilds its own rank-r LR cache by an "LR prefill".

The base cache X_i·W0 is stored once, by whichever agent processed a token first. Before its turn agent j passes
the accumulated context through the backbone with its adapter again to rebuild its LR cache X_j·A_j (the published
LR prefill, `lr_prefill=full`); `lr_prefill=incremental` only passes the tokens j has not yet down-projected, over
its own view of the earlier ones (a kvprof extra). Agent j attends to V = X_i·W0 + s·(X_j·A_j)·B_j. Compute ≥
NonShared with the full LR prefill; memory ≈ 1× + N·r/d. Approximate: the base part was shaped by agent i.
Paper: LRAgent (BaseShared).
"""

from __future__ import annotations

import torch

from kvprof.policies.base import Chunk, Context, SharingPolicy
from kvprof.policies.lowrank import LowRankStore


class BaseShared(SharingPolicy):
    name = "baseshared"
    family = "LRAgent"
    paper = "LRAgent (BaseShared)"
    approximate = True
    needs_hidden = True
    options = {"lr_prefill": ("full", "incremental")}

    def reset(self) -> None:
        self.store = LowRankStore(self.runtime)

    def assemble(self, agent: str, shared: list[int]) -> Context:
        runtime, store = self.runtime, self.store
        reused = min(len(store), len(shared) - 1)
        own = store.low_rank.get(agent)
        have = 0 if self.settings["lr_prefill"] == "full" else min(store.lr_length(agent), reused)
        low_rank, flops = own, 0.0
        if reused > have:
            view, view_flops, _ = store.assemble(agent, own, have)
            out = runtime.forward(agent, shared[have:reused], runtime.cache_from(view), have, capture=True,
                                  last_logits_only=True)
            gap = LowRankStore.down_projections(runtime, out.hidden, [agent])[agent]
            low_rank = gap if have == 0 else [{p: torch.cat([old[p][:, :have], new[p]], 1) for p in new}
                                              for old, new in zip(own, gap)]
            rank = sum(t.shape[-1] for layer in gap for t in layer.values())
            flops = view_flops + runtime.flops(reused - have, have) + 2.0 * (reused - have) * runtime.hidden_size * rank
        kv, expand_flops, lora_values = store.assemble(agent, low_rank, reused,
                                                       expand_values=not runtime.lora_attention)
        from_others = sum(producer != agent for producer in store.producers[:reused])
        return Context(kv=kv, reused=reused, from_others=from_others, extra_prefill=reused - have,
                       extra_flops=flops + expand_flops, pending={"low_rank": low_rank}, lora_values=lora_values)

    def commit(self, chunk: Chunk) -> float:
        store = self.store
        skip = len(store) - chunk.start
        flops = 0.0
        if chunk.hidden[0].shape[1] > skip:
            flops += store.append_base([x[:, skip:] for x in chunk.hidden], chunk.agent)
        new = LowRankStore.down_projections(self.runtime, chunk.hidden, [chunk.agent])[chunk.agent]
        earlier = chunk.context.pending["low_rank"]
        if earlier is not None and chunk.start:
            new = [{p: torch.cat([old[p][:, :chunk.start], add[p]], 1) for p in add} for old, add in zip(earlier, new)]
        store.low_rank[chunk.agent] = new
        rank = sum(t.shape[-1] for t in new[0].values()) * self.runtime.num_layers
        return flops + 2.0 * chunk.hidden[0].shape[1] * self.runtime.hidden_size * rank

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.store.live_tensors()

    def analytic_bytes(self) -> dict[str, int]:
        return self.store.analytic_bytes()
