"""PreLRShared (PReCache): shared base cache + LR caches precomputed for every agent by whoever processed a token.

When agent i processes tokens, it stores their base K/V (X_i·W0) and, in one GEMM over all agents' down-projections,
X_i·A_k for every agent k. Agent j later reuses the base cache and X_i·A_j, applying its own B_j at attention time:
V = X_i·W0 + s·(X_i·A_j)·B_j. Only new tokens go through the backbone. Approximate: X_i carries agent i's adapter
effects from earlier layers. Paper: "PReCache: Efficient KV Cache Sharing for Multi-LoRA Agents via Low-Rank
Precomputation and Neutral Reconstruction" (published: TTFT up to 3.1× lower than NonShared).
"""

from __future__ import annotations

import torch

from kvprof.policies.base import Chunk, Context, SharingPolicy
from kvprof.policies.lowrank import LowRankStore


class PreLRShared(SharingPolicy):
    name = "prelrshared"
    family = "PReCache"
    paper = "PReCache (PreLRShared)"
    approximate = True
    needs_hidden = True

    def reset(self) -> None:
        self.store = LowRankStore(self.runtime)

    def lr_name(self, agent: str) -> str:
        """The LR cache agent `agent` reads."""
        return agent

    def lr_caches(self) -> dict[str, str]:
        """The LR caches a processed token extends: cache name → the agent whose A computes it."""
        return {agent: agent for agent in self.runtime.agents.spec.names}

    def assemble(self, agent: str, shared: list[int]) -> Context:
        reused = min(len(self.store), len(shared) - 1)
        kv, flops, lora_values = self.store.assemble(agent, self.store.low_rank.get(self.lr_name(agent)), reused,
                                                     expand_values=not self.runtime.lora_attention)
        from_others = sum(producer != agent for producer in self.store.producers[:reused])
        return Context(kv=kv, reused=reused, from_others=from_others, extra_flops=flops, lora_values=lora_values)

    def commit(self, chunk: Chunk) -> float:
        skip = len(self.store) - chunk.start
        hidden = [x[:, skip:] for x in chunk.hidden]
        if hidden[0].shape[1] == 0:
            return 0.0
        flops = self.store.append_base(hidden, chunk.agent)
        caches = self.lr_caches()
        projections = LowRankStore.down_projections(self.runtime, hidden, list(caches.values()))
        for name, agent in caches.items():
            self.store.append_low_rank(name, projections[agent])
        rank_total = sum(t.shape[-1] for layers in projections.values() for layer in layers for t in layer.values())
        return flops + 2.0 * hidden[0].shape[1] * self.runtime.hidden_size * rank_total

    def live_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.store.live_tensors()

    def analytic_bytes(self) -> dict[str, int]:
        return self.store.analytic_bytes()
