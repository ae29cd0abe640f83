"""PreLRShared (PReCache): shared base cache + LR caches precomputed for every agent by whoever processed a token.

Paper: PReCache (PreLRShared); code: hjeon2k/PReCache. Agent i stores the base K/V X_i·W0 of the tokens it
processes and, in one GEMM over all agents' down-projections, X_i·A_k for every agent k; agent j attends to
V = X_i·W0 + s·(X_i·A_j)·B_j. Only new tokens go through the backbone. Approximate (X_i carries agent i's adapter).

Deviation: PReCache adapts v_proj only (K shared); an adapter on k_proj here costs a rotation of the base keys and an
expansion of the key LR caches in every view (kvprof).

Phases: TTFT — the context from the store (LR expansions, or Flash-LoRA-Attention's rank-r values), the chunk's
forward and its down-projections for every other agent (as PReCache's `precache_value` runs every `lora_A` while
prefilling); the base K/V and own X·A come from the forward; decode — the same per token; after the turn — storing.
"""

from __future__ import annotations

from typing import ClassVar

from kvprof.claims.papers import PRECACHE, PRECACHE_SETTING
from kvprof.claims.types import MemoryClaim, Published, ServingClaim
from kvprof.model.runtime import ChunkForward
from kvprof.policies.lowrank import VIEWS, LowRankContext, LowRankPolicy, LowRankStore

PRECACHE_SERVING = PRECACHE_SETTING + "; vLLM on an A100 80GB, concurrent requests"
PRECACHE_CONTEXT = 66_400  # tokens: the longest trajectory of PReCache's setting, where its memory figures are read
PRECACHE_MEMORY = (
    Published(
        PRECACHE,
        "memory",
        PRECACHE_SETTING,
        "peak memory within 2 % of FullShared at 66.4k tokens",
        MemoryClaim(
            "allocator", ("fullshared",), 0.98, 1.02, "paper text: |ratio − 1| ≤ 0.02", context_tokens=PRECACHE_CONTEXT
        ),
    ),
    Published(
        PRECACHE,
        "memory",
        PRECACHE_SETTING,
        "peak memory 17–23 % below the selective-recompute baselines (30 % recompute) at 66.4k tokens",
        MemoryClaim(
            "allocator",
            ("droidspeak", "cacheblend", "relaycaching"),
            0.77,
            0.83,
            "paper text: 1 − ratio in [0.17, 0.23]",
            context_tokens=PRECACHE_CONTEXT,
            reference_options=(("ratio", "0.3"),),
        ),
    ),
)  # the memory figures of PReCache's two methods (PreLRShared, ReBaseShared)


class PreLRShared(LowRankPolicy[LowRankContext]):
    name = "prelrshared"
    family = "PReCache"
    paper = f"{PRECACHE}, PreLRShared"
    approximate = True
    exact_setting = "one agent"  # its split of one agent's own cache is that agent's K/V
    options = {"views": VIEWS}
    published: ClassVar[tuple[Published, ...]] = (
        Published(
            PRECACHE, "accuracy (Table 2)", PRECACHE_SETTING, "mean accuracy drop 1.0–3.3 points against NonShared"
        ),
        Published(
            PRECACHE,
            "single-stream efficiency",
            PRECACHE_SETTING,
            "TTFT up to 3.1× lower than NonShared, per-request throughput up to 2.3×",
        ),
        Published(
            PRECACHE,
            "concurrent serving",
            PRECACHE_SERVING,
            "per-request throughput 1.6× NonShared's at an unsaturated load",
            serving=ServingClaim(
                "request_throughput",
                1.28,
                1.92,
                "kvprof: 1.6× read ± 20 %, at the lowest simulated load",
                ("nonshared",),
            ),
        ),
        *PRECACHE_MEMORY,
    )

    def lr_caches(self, agent: str) -> dict[str, str]:
        """The LR caches a token `agent` processes extends: cache name → the agent whose A computes it."""
        return {agent: agent for agent in self.runtime.agents.spec.names}

    def assemble(self, agent: str, shared: list[int]) -> LowRankContext:
        reused = self.reused_span(shared)
        context = self.store_view(agent, self.store.lr(self.lr_name(agent)), reused, len(shared) - reused)
        self.extend_over_moved_store(agent, shared, context)
        return context

    def on_forward(self, agent: str, context: LowRankContext, forward: ChunkForward, start: int) -> float:
        """Base K/V and every agent's X·A_k of the forward's new tokens: own from the forward, others' in one GEMM."""
        skip = self.new_tokens(context, forward, start)
        if skip is None:
            return 0.0
        assert forward.hidden is not None  # needs_hidden
        update, flops = self.store.base_update(forward, start + skip, agent, agent, skip=skip)
        caches = self.lr_caches(agent)
        others = [source for source in dict.fromkeys(caches.values()) if source != agent]
        projections = LowRankStore.down_projections(self.runtime, [x[:, skip:] for x in forward.hidden], others)
        if agent in caches.values():
            projections[agent] = LowRankStore.forward_down_projections(self.runtime, forward, agent, skip)
        update.low_rank = {name: projections[source] for name, source in caches.items()}
        context.updates.append(update)
        return flops + LowRankStore.down_projection_flops(self.runtime, {k: projections[k] for k in others})
