"""PreLRShared (PReCache): shared base cache + LR caches precomputed for every agent by whoever processed a token.

When agent i processes tokens, it stores their base K/V (X_i·W0) and, in one GEMM over all agents' down-projections,
X_i·A_k for every agent k. Agent j later reuses the base cache and X_i·A_j, applying its own B_j at attention time:
V = X_i·W0 + s·(X_i·A_j)·B_j. Only new tokens go through the backbone. Approximate: X_i carries agent i's adapter
effects from earlier layers. Paper: PReCache (PreLRShared).

Phases: TTFT — the context from the store (expansions of the LR caches, or Flash-LoRA-Attention's rank-r values),
the chunk's forward, and the chunk's base K/V and down-projections for every agent (serving computes them while
prefilling the chunk); each decode step — the same for its token; after the turn — appending them to the store.
"""

from __future__ import annotations

from kvprof.policies.base import Published
from kvprof.policies.lowrank import VIEWS, LowRankContext, LowRankPolicy, LowRankStore
from kvprof.policies.papers import PRECACHE, PRECACHE_SETTING
from kvprof.runtime import ChunkForward


class PreLRShared(LowRankPolicy[LowRankContext]):
    name = "prelrshared"
    family = "PReCache"
    paper = f"{PRECACHE}, PreLRShared"
    approximate = True
    options = {"views": VIEWS}
    published = (
        Published(
            PRECACHE, "accuracy (Table 2)", PRECACHE_SETTING, "mean accuracy drop 1.0–3.3 points against NonShared"
        ),
        Published(
            PRECACHE,
            "single-stream efficiency",
            PRECACHE_SETTING,
            "TTFT up to 3.1× lower than NonShared, per-request throughput up to 2.3×",
        ),
    )

    def lr_name(self, agent: str) -> str:
        """The LR cache agent `agent` reads."""
        return agent

    def lr_caches(self) -> dict[str, str]:
        """The LR caches a processed token extends: cache name → the agent whose A computes it."""
        return {agent: agent for agent in self.runtime.agents.spec.names}

    def assemble(self, agent: str, shared: list[int]) -> LowRankContext:
        reused = self.reused_span(shared)
        return self.store_view(agent, self.store.lr(self.lr_name(agent)), reused, len(shared) - reused)

    def on_forward(self, agent: str, context: LowRankContext, forward: ChunkForward, start: int) -> float:
        """Base K/V and every agent's X·A_k of the forward's tokens the store does not hold yet."""
        assert forward.hidden is not None  # needs_hidden: every forward of the turn captures X
        new = self.new_tokens(context, forward.hidden, start)
        if new is None:
            return 0.0
        hidden, first = new
        update, flops = self.store.base_update(hidden, first, agent)
        caches = self.lr_caches()
        projections = LowRankStore.down_projections(self.runtime, hidden, list(dict.fromkeys(caches.values())))
        update.low_rank = {name: projections[source] for name, source in caches.items()}
        context.updates.append(update)
        return flops + LowRankStore.down_projection_flops(self.runtime, projections)
