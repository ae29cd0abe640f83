"""BaseShared (LRAgent): one shared base cache; each agent extends its own rank-r LR cache by an "LR prefill".

Paper: LRAgent (BaseShared); code: hjeon2k/LRAgent, branch `baseshared`. The base cache X_i·W0 is stored once, by
whichever agent processed a token first; agent j keeps its LR cache X_j·A_j and attends to
V = X_i·W0 + s·(X_j·A_j)·B_j. Approximate (agent i shaped the base part). Memory ≈ 1× + N·r/d.

`lr_prefill` (option origins):

- `code` (default, the authors' code): one forward over the tokens after the agent's LR cache (the gap: others'
  tokens since its last turn, then its chunk), timed as prefill. Gap tokens attend to the shared K_base / V_base
  plus their own LR term, not to their own fresh K/V; base K/V are appended only past the base cache's end; X·A_j of
  every token extends the LR cache (`fastchat/serve/inference.py` `generate_stream`: `input_ids[past_seq_length:]`;
  `modeling_llama.py` `LlamaAttention.forward`: keys sliced to those past the base cache; `peft/tuners/lora/layer.py`
  `Linear.forward`: `base_layer` on those tokens only, `past_lr_cache.update(lora_A(x))` on all). Compute ≈
  NonShared's.
- `full` (paper text): the whole context re-run from position 0 into a fresh cache; compute ≥ NonShared.
- `incremental` (kvprof): the code's extent, the gap tokens in a separate forward attending to their own fresh K/V.

Deviations from the code:

- LRAgent adapts v_proj only; an adapter on k_proj here adds RoPE(s·(X·A_k)·B_k) to the shared base keys (kvprof).
- The code runs Flash-LoRA-Attention over V_base and rank-r values; kvprof expands the values unless
  `--lora-attention` (same result), and always writes the gap tokens' values expanded.
- Moved spans are computed as new tokens: the LR prefill runs the backbone over them anyway, so re-aligning their
  base K/V would save nothing and replace the agent's own K/V by another's.

Phases: TTFT — the context (the agent's view of what its LR cache covers), the forward over gap and chunk (with
`full` / `incremental`: the separate LR prefill, then the chunk's forward), the new tokens' down-projections and base
K/V; decode — the same per token; after the turn — storing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvprof.claims.papers import LRAGENT, LRAGENT_SETTING
from kvprof.claims.types import MemoryClaim, Published
from kvprof.model.buffers import KVBuffer, Rewrite
from kvprof.model.lora import SPLIT_SIDES
from kvprof.model.runtime import ChunkForward
from kvprof.policies.lowrank import LowRankContext, LowRankPolicy, LowRankStore
from kvprof.policies.options import Option
from kvprof.policies.turns import Chunk

LowRank = list[dict[str, torch.Tensor]]  # per layer {"key"|"value": (1, n, r)}

LRAGENT_MEMORY = Published(
    LRAGENT,
    "main results, memory",
    LRAGENT_SETTING,
    "KV cache memory nearly 1/3 of NonShared's with three agents, slightly above FullShared's",
    MemoryClaim("kv_blocks", ("nonshared",), 0.8 / 3, 1.2 / 3, "kvprof: “nearly 1/3” read as 1/3 ± 20 %", agents=3),
)  # LRAgent's memory figure, for BaseShared and BaseLRShared


@dataclass
class BaseSharedContext(LowRankContext):
    """low_rank: the agent's LR cache over the reused span (None before it has one); own: its down-projections of
    the turn's tokens, appended by `commit`."""

    low_rank: LowRank | None = None
    own: list[LowRank] = field(default_factory=list)


class BaseShared(LowRankPolicy[BaseSharedContext]):
    name = "baseshared"
    family = "LRAgent"
    paper = f"{LRAGENT}, BaseShared"
    approximate = True
    exact_setting = "one agent"  # its split of one agent's own cache is that agent's K/V
    options = {
        "lr_prefill": Option(
            "code",
            ("code", "full", "incremental"),
            sweep=("code", "full", "incremental"),
            help="code: one forward over the tokens after the agent's own LR cache (others' tokens since its last "
            "turn, then its chunk), those tokens attending to the shared base K/V plus their own LR term "
            "(LRAgent's code); full: the whole context re-run from position 0 into a fresh cache (paper text); "
            "incremental: the code's extent, its tokens attending to their own fresh K/V in a separate pass (kvprof)",
            origins={"code": "code", "full": "paper text", "incremental": "kvprof"},
        )
    }
    moves_spans = False
    published = (
        Published(
            LRAGENT, "main results, accuracy", LRAGENT_SETTING, "mean accuracy drop ≤ 0.7 points against NonShared"
        ),
        Published(LRAGENT, "main results, throughput", LRAGENT_SETTING, "throughput up to 1.42× NonShared"),
        LRAGENT_MEMORY,
    )

    def assemble(self, agent: str, shared: list[int]) -> BaseSharedContext:
        if self.settings["lr_prefill"] == "code":
            return self._assemble_code(agent, shared)
        runtime, store = self.runtime, self.store
        reused = self.reused_span(shared)
        own = store.lr(agent)
        have = 0 if self.settings["lr_prefill"] == "full" else min(store.lr_length(agent), reused)
        low_rank, flops, working = own, 0.0, 0
        if reused > have:
            own_view = store.assemble(agent, own, have, spare=reused - have, slot="own")
            cache = runtime.cache_over(own_view.kv, own_view.buffers, reused - have)
            out = runtime.forward(agent, shared[have:reused], cache, have, capture=True, last_logits_only=True)
            gap = LowRankStore.forward_down_projections(runtime, out, agent)
            low_rank = (
                gap
                if have == 0 or own is None
                else [{p: torch.cat([old[p][:, :have], new[p]], 1) for p in new} for old, new in zip(own, gap)]
            )
            flops = own_view.flops + runtime.flops(reused - have, have)
            working = runtime.kv_bytes(reused) + runtime.hidden_bytes_per_token * (reused - have)
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

    def _assemble_code(self, agent: str, shared: list[int]) -> BaseSharedContext:
        """`lr_prefill=code`: the context covers the agent's LR cache; the gap tokens are refreshed by the turn's own
        forward (`Context.refreshed`), their K/V replaced before attention by base K/V + B over that forward's X·Aᵀ
        (`kvprof.model.lora.HiddenTap.down`), as `inference.py`, `modeling_llama.py` and `LRCache.update` do."""
        runtime, store = self.runtime, self.store
        reused = self.reused_span(shared)
        have = min(store.lr_length(agent), reused)
        own = store.lr(agent) if have else None
        view = self.store_view(agent, own, have, len(shared) - have)
        context = BaseSharedContext(
            kv=view.kv,
            reused=reused,
            extra_prefill=reused - have,
            extra_flops=view.extra_flops + runtime.flops(reused - have, have),
            working_bytes=runtime.hidden_bytes_per_token * (reused - have),
            lora_values=view.lora_values,
            buffers=view.buffers,
            low_rank=own,
            refreshed=reused - have,
        )
        if reused > have:
            context.rewrite = self._gap_rewrite(agent, context, have, reused)
        return context

    def _gap_rewrite(self, agent: str, context: BaseSharedContext, have: int, reused: int) -> Rewrite:
        """Rewrite slots have..reused (the gap) of each layer to base K/V + `agent`'s B over the forward's X·Aᵀ; the
        expansions' FLOPs go to `extra_flops`."""
        store, tap, splits = self.store, self.runtime.tap, self.runtime.splits

        def rewrite(layer: int, buffer: KVBuffer, start: int, count: int) -> None:
            if start >= reused:  # a decode step: past the gap
                return
            down = tap.down[layer]
            sides = {
                side: down[side][agent][:, : reused - have]
                for side in SPLIT_SIDES
                if agent in down.get(side, {}) and agent in getattr(splits[layer], side).up
            }
            context.extra_flops += store.write_expanded(layer, agent, sides, buffer, have, reused, offset=have)

        return rewrite

    def on_forward(self, agent: str, context: BaseSharedContext, forward: ChunkForward, start: int) -> float:
        """Keep the forward's own X·A, and base K/V of tokens the store lacks (`LowRankStore.base_update`)."""
        context.own.append(LowRankStore.forward_down_projections(self.runtime, forward, agent))
        skip = self.new_tokens(context, forward, start)
        if skip is None:
            return 0.0
        update, flops = self.store.base_update(forward, start + skip, agent, agent, skip=skip)
        context.updates.append(update)
        return flops

    def commit(self, chunk: Chunk[BaseSharedContext]) -> float:
        self.store.apply(chunk.context.updates)
        earlier, own = chunk.context.low_rank, chunk.context.own
        keep = chunk.start - chunk.context.refreshed  # the tokens `earlier` serves; `own` starts there
        if not self.store.adapts_cache(chunk.agent):
            return 0.0
        if keep and not earlier:
            raise RuntimeError("baseshared reused tokens without an LR cache for them")
        pieces = ([[{p: t[:, :keep] for p, t in layer.items()} for layer in earlier]] if earlier else []) + own
        start = 0
        for piece in pieces:
            self.store.write_low_rank(chunk.agent, start, piece)
            start = self.store.lr_length(chunk.agent)
        return 0.0
