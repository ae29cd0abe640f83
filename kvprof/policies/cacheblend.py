"""CacheBlend: reuse the shared cache; recompute the tokens whose K/V deviate most at a check layer.

Paper: CacheBlend (Yao et al., EuroSys 2025; arXiv:2405.16444); code: YaoJiayi/CacheBlend, and LMCache's blender for
the `lmcache` / `key` choices. The selective-recompute baseline of PReCache (30 % ratio) and KVCMAS (ρ = 0.9, 0.8).
Blends FullShared's store (keys re-rotated in prompt mode, `kvprof.policies.selective`): layers before `check_layer`
recomputed for every reused token; at the check layer the top R reused tokens by deviation are selected and carried
through the remaining layers; the query suffix (the chunk) is computed after the blend. R = 0: FullShared; R = 1:
NonShared. Walk-through: docs/policies/selective.md.

Deviations and option origins:

- The reused span is one shared cache computed by earlier agents in their own contexts (adapters, prefixes), the
  multi-agent papers' setting, not chunks each precomputed on its own.
- Tokens are selected once, at the check layer, as both public codes do; the paper filters gradually per layer.
- Default ratio 0.16, the original code's (paper text: 15 %; PReCache compares at 30 %, swept by `--policy all`). The
  ratio counts reused tokens only (LMCache's counts the suffix too).
- `deviation=value` (default): the paper's Σ(V_new − V_old)² over heads and channels; `key`: Σ(ΔK)², LMCache's.
- `check_update=original` (default, the original code): every reused token's check-layer K/V become the newly
  projected ones; `lmcache`: only the selected tokens' (LMCache's blender, though it projects all).
- Moved spans (`kvprof.policies.moved`) are served re-aligned and blended, the check layer run over the whole input
  (CacheBlend's RAG setting). The new tokens between them hold placeholder slots the blend computes through every
  layer, outside the ratio's budget (so R = 1 is the dense run), attending to the input before them; CacheBlend's
  code would prefill a chunk missing from its store on its own.

Phases: TTFT — FullShared's context, the blend (full layers, check-layer projections, selected tokens' layers), the
chunk's forward; decode — one token per step; after the turn — FullShared's commit (the producers' K/V, not this
blend).
"""

from __future__ import annotations

import torch

from kvprof.claims.papers import CACHEBLEND, CACHEBLEND_SETTING
from kvprof.claims.types import Published
from kvprof.model.runtime import Runtime
from kvprof.policies.fullshared import FullSharedContext
from kvprof.policies.options import Option, layer_index
from kvprof.policies.selective import Blend, SelectiveRecompute, budget, ratio_option, select_top


class CacheBlend(SelectiveRecompute):
    name = "cacheblend"
    paper = CACHEBLEND
    options = {
        "ratio": ratio_option("0.16", "the share of reused tokens recomputed after the check layer"),
        "check_layer": Option(
            "1", parse=layer_index, help="the layer at which tokens are selected (layers before it: recomputed in full)"
        ),
        "deviation": Option(
            "value", ("value", "key"), help="value: Σ(V_new − V_old)² (the paper); key: Σ(K_new − K_old)² (LMCache)"
        ),
        "check_update": Option(
            "original",
            ("original", "lmcache"),
            help="original: at the check layer every reused token's K/V become the newly projected ones (the "
            "original CacheBlend code); lmcache: only the selected tokens' (LMCache's blender keeps the old K/V of "
            "the others there)",
            origins={"original": "code", "lmcache": "code"},
        ),
    }
    published = (
        Published(
            CACHEBLEND,
            "abstract / evaluation",
            CACHEBLEND_SETTING,
            "recompute ratio 15 % by default; TTFT 2.2–3.3× lower than full prefill without quality loss",
        ),
    )

    def check(self, runtime: Runtime) -> None:
        super().check(runtime)
        self.check_layer_option(runtime, "check_layer", self.layer_setting("check_layer"))

    def computes_new_tokens_later(self) -> bool:
        return self.recomputes()

    def recompute(self, blend: Blend, ids: list[int], context: FullSharedContext) -> None:
        check = self.layer_setting("check_layer")
        hidden, positions, probe = blend.full_then_probe(ids, check)
        side = 0 if self.settings["deviation"] == "key" else 1
        new = probe.keys if side == 0 else probe.values
        deviation = (new.float() - blend.reused(check, side, len(ids)).float()).pow(2).sum(dim=(0, 1, 3))
        fresh = torch.zeros(len(ids), dtype=torch.bool, device=deviation.device)
        for begin, end in context.placeholders:  # new tokens between moved spans: no cache, always computed
            fresh[begin:end] = True
        candidates = int((~fresh).sum())
        chosen = select_top(deviation.masked_fill(fresh, -1.0), budget(self.ratio, candidates))
        chosen = torch.cat([chosen, fresh.nonzero().flatten()]).sort().values
        if self.settings["check_update"] == "original":  # every token's check-layer K/V from the probe
            keys, values = blend.kv[check]
            keys.index_copy_(2, positions, probe.keys)
            values.index_copy_(2, positions, probe.values)
            blend.recomputed += len(ids) - len(chosen)  # the chosen ones' are counted by the carry below
        blend.carry(check, self.runtime.num_layers, hidden[:, chosen], positions[chosen])
