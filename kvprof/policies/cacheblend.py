"""CacheBlend: reuse the shared cache and recompute the tokens whose K/V deviate most, selected at a check layer.

Paper: CacheBlend (Yao et al., EuroSys 2025; arXiv:2405.16444), as the selective-recompute baseline of PReCache
(30 % recompute ratio) and KVCMAS (KV reuse ρ = 0.9 and 0.8). For the acting agent, the reused span of the shared
cache (FullShared's store, keys re-rotated in prompt mode) is blended (`kvprof.policies.selective`):

1. layers 0 .. check − 1 are recomputed for every reused token from the input embeddings (CacheBlend recomputes
   the first layer in full; `check_layer`, default 1, is its check layer);
2. at the check layer the reused tokens' new values (`deviation=value`, the paper's Σ(V_new − V_old)² over heads
   and channels) or keys (`deviation=key`, what LMCache's blender scores) are projected from the new hidden
   states, and the top R of them by that deviation are selected (R = `ratio`, a share of the reused tokens);
3. at the check layer, with `check_update=original` (the default, the original CacheBlend code,
   YaoJiayi/CacheBlend), every reused token's K/V become the ones just projected; with `check_update=lmcache`
   only the selected tokens' do and the others keep the reused K/V there (LMCache's blender, though it projected
   theirs too);
4. the selected tokens are carried through the check layer and every layer after it, attending to the blended
   cache, their K/V scattered over the reused ones; the other tokens keep the reused K/V after the check layer.

The query suffix (the turn's new input tokens) is always recomputed: it is the turn's chunk, computed after the
blend (see `kvprof.policies.selective`). At R = 0 nothing is selected and the policy is FullShared; at R = 1 it
recomputes everything (NonShared).

Moved spans (`kvprof.policies.moved`): ids other turns processed at other positions are served re-aligned and
blended with the reused span — the check layer runs over the whole input, as in CacheBlend's RAG setting. The new
tokens between moved spans have no cache: they hold placeholder slots until the blend computes them through every
layer (always among the recomputed tokens, outside the ratio's budget), so at R = 1 the turn is the dense run.
CacheBlend's code would prefill a chunk missing from its store on its own; here they attend to the input before
them.

Approximate, and where kvprof departs from the paper: CacheBlend fuses chunks each precomputed on its own
(positions re-aligned); here the reused span is one shared cache of tokens computed by earlier agents in their own
contexts (with their adapters, after their prefixes), which is the setting of the multi-agent papers that compare
against it. The paper picks the ratio per layer with a gradual filtering schedule; kvprof selects once, at the
check layer, as both public implementations do. The default ratio is the original code's, 0.16 (the paper's text
says 15 %; PReCache compares at 30 %, which `--policy all` sweeps). The ratio counts reused tokens only (LMCache's
counts the suffix too).

Phases: TTFT — FullShared's context, the blend (the full layers, the check-layer projections and the selected
tokens' layers: all of the selection work), the chunk's forward; each decode step — one token; after the turn —
FullShared's commit (the store keeps the producers' K/V, not this agent's blend).
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
