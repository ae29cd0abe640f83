"""ReBaseShared (PReCache): a neutral base cache and LR caches from adapter-free hidden states.

The shared context is also processed with adapters disabled, giving neutral hidden states X_neut; the store keeps
X_neut·W0 (the neutral base cache) and X_neut·A_k for every agent k. Agent j attends to
V = X_neut·W0 + s·(X_neut·A_j)·B_j — no dependence on which agent processed a token first. Schedules:
`lp` (lazy prefill): after the turn's decoding, its tokens are re-processed once adapter-free (outside TTFT, inside
end-to-end latency); `db` (double batching): the adapted row and an adapter-free row run in one 2-row batch during
prefill and decode. Both give the same cache state. Approximate (X_neut ≠ X_j). Paper: PReCache (ReBaseShared).
"""

from __future__ import annotations

import torch

from kvprof.policies.base import Chunk, Context, Option, Published
from kvprof.policies.lowrank import LowRankPolicy, LowRankStore
from kvprof.policies.papers import PRECACHE, PRECACHE_SETTING

NEUTRAL = "neutral"


class ReBaseShared(LowRankPolicy[Context]):
    name = "rebaseshared"
    family = "PReCache"
    paper = f"{PRECACHE}, ReBaseShared"
    approximate = True
    options = {
        "schedule": Option(
            "lp", ("lp", "db"), sweep=("lp", "db"), help="lp: lazy prefill after decoding; db: double batching"
        )
    }
    published = (
        Published(PRECACHE, "accuracy (Table 2)", PRECACHE_SETTING, "mean accuracy drop 1.1 points against NonShared"),
        Published(
            PRECACHE,
            "single-stream efficiency",
            PRECACHE_SETTING,
            "LP: TTFT up to 3.0× lower than NonShared, throughput up to 1.6×",
        ),
    )

    @property
    def needs_hidden(self) -> bool:
        return self.settings["schedule"] == "db"

    def adapter_rows(self, agent: str) -> list[str] | None:
        return [agent, "__base__"] if self.settings["schedule"] == "db" else None

    def assemble(self, agent: str, shared: list[int]) -> Context:
        reused = self.reused_span(shared)
        context = self.store_context(agent, self.store.low_rank.get(agent), reused, from_others=reused)
        if self.settings["schedule"] == "db":
            neutral, _, _ = self.store.assemble(None, None, reused)
            context.kv = [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(context.kv, neutral)]
        return context

    def commit(self, chunk: Chunk[Context]) -> float:
        runtime, store = self.runtime, self.store
        skip = len(store) - chunk.start
        new_ids = chunk.ids[skip:]
        if not new_ids:
            return 0.0
        if self.settings["schedule"] == "lp":
            base, _, _ = store.assemble(None, None, len(store))
            out = runtime.forward(
                None, new_ids, runtime.cache_from(base), len(store), capture=True, last_logits_only=True
            )
            hidden = out.hidden
        else:
            assert chunk.hidden is not None
            hidden = [x[1:2, skip:] for x in chunk.hidden]
        assert hidden is not None
        flops = runtime.flops(len(new_ids), len(store))
        flops += store.append_base(hidden, NEUTRAL)
        names = runtime.agents.spec.names
        projections = LowRankStore.down_projections(runtime, hidden, names)
        for agent in names:
            store.append_low_rank(agent, projections[agent])
        rank = sum(t.shape[-1] for layers in projections.values() for layer in layers for t in layer.values())
        return flops + 2.0 * len(new_ids) * runtime.hidden_size * rank
