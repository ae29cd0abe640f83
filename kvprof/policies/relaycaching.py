"""RelayCaching: reuse earlier agents' decode-phase KV; rectify the few tokens that deviate or matter most.

Paper: RelayCaching, the selective-recompute baseline of PReCache (30 % ratio) and KVCMAS (ρ = 0.9, 0.8). A reader
of another agent's output reuses the K/V that agent produced while decoding it and rectifies a sparse set of tokens
in staged layer bands. The public description is partial; kvprof's choices, each with its source:

- Reused: FullShared's store (`kvprof.policies.selective`), where an earlier agent's output is its decode-phase K/V
  (the relay). Tokens an earlier agent prefilled are relayed too (kvprof): RelayCaching leaves them to the server's
  prefix cache, which cannot share them across adapters or role prompts.
- Rectified (RelayCaching's rule): deviation 1 − cos(v_reuse, v_full) ≥ 1.5 × its mean, or high attention influence
  on the last 10 tokens. Both measured at `check_layer` (default 1; kvprof): v_full projected from the recomputed
  states, cosine per token over all heads; influence = attention mass of the last 10 reused tokens' queries, summed
  over heads; "high" read as ≥ 1.5 × the mean (kvprof).
- Budget (kvprof, so R is the family's one knob): flagged tokens ranked first, then R of the reused tokens filled by
  deviation ÷ its mean + influence ÷ its mean.
- Bands (kvprof's placement; the description names only the kinds): full recompute of layers before the check
  layer, sparse rectification from it on, a skip band of the last `skip_layers` (default 0) kept as reused.
- Moved spans (`kvprof.policies.moved`): served re-aligned; the new tokens between them are computed in FullShared's
  extension and again in the blend with the moved spans.

R = 0: FullShared; R = 1 without a skip band: NonShared.

Phases: TTFT — FullShared's context, the blend (full band, check-layer projections and influence, rectified tokens'
layers); decode — one token; after the turn — FullShared's commit.
"""

from __future__ import annotations

import torch

from kvprof.claims.papers import RELAYCACHING
from kvprof.claims.types import Published
from kvprof.errors import KvprofError
from kvprof.model.architecture import attention_of
from kvprof.model.lora import ProjectionNorm, projection_norm
from kvprof.model.rope import apply_rope
from kvprof.model.runtime import Runtime
from kvprof.policies.fullshared import FullSharedContext
from kvprof.policies.options import Option, layer_index
from kvprof.policies.selective import (
    Blend,
    Probe,
    SelectiveRecompute,
    budget,
    query_projection,
    ratio_option,
    select_top,
)

THRESHOLD = 1.5  # × the mean deviation (RelayCaching) and × the mean influence (kvprof's reading of "high")
WINDOW = 10  # the last tokens whose attention defines influence (RelayCaching)


class RelayCaching(SelectiveRecompute):
    name = "relaycaching"
    stacks_layers = True
    paper = RELAYCACHING
    options = {
        "ratio": ratio_option("0.2", "the share of reused tokens rectified from the check layer on"),
        "check_layer": Option(
            "1", parse=layer_index, help="the layer at which deviation and influence are measured (full band before it)"
        ),
        "skip_layers": Option("0", parse=layer_index, help="the last layers whose reused K/V are kept (skip band)"),
    }
    published = (
        Published(
            RELAYCACHING, "reported reuse", "multi-agent pipelines relaying decode-phase KV", "> 80 % of KV reused"
        ),
    )

    def check(self, runtime: Runtime) -> None:
        super().check(runtime)
        check, skip = self.layer_setting("check_layer"), self.layer_setting("skip_layers")
        self.check_layer_option(runtime, "check_layer", check)
        self.check_layer_option(runtime, "check_layer + skip_layers", check + skip)
        if check in runtime.latent:
            raise KvprofError(
                f"policy {self.name} scores tokens by the check layer's queries against its cached keys per head, and "
                f"layer {check} of model {runtime.agents.base_model.config.name_or_path!r} is a multi-head latent "
                "attention layer, which caches a latent rather than keys per head; pick another policy."
            )
        if query_projection(attention_of(self.stack.layers[check], check)) is None:
            raise KvprofError(
                f"policy {self.name} measures attention influence from the check layer's queries, and model "
                f"{runtime.agents.base_model.config.name_or_path!r} has neither q_proj nor a fused qkv_proj there; "
                "pick another policy."
            )

    def recompute(self, blend: Blend, ids: list[int], context: FullSharedContext) -> None:
        check, skip = self.layer_setting("check_layer"), self.layer_setting("skip_layers")
        count = len(ids)
        hidden, positions, probe = blend.full_then_probe(ids, check, queries=True)
        deviation = 1.0 - torch.nn.functional.cosine_similarity(
            _per_token(probe.values), _per_token(blend.reused(check, 1, count)), dim=-1
        )
        influence = self._influence(blend, check, probe, positions)
        flagged = (deviation >= THRESHOLD * deviation.mean()) | (influence >= THRESHOLD * influence.mean())
        score = deviation / deviation.mean().clamp_min(1e-12) + influence / influence.mean().clamp_min(1e-12)
        chosen = select_top(score + flagged.float() * (score.max() + 1.0), budget(self.ratio, count))
        blend.carry(check, self.runtime.num_layers - skip, hidden[:, chosen], positions[chosen])

    def _influence(self, blend: Blend, layer: int, probe: Probe, positions: torch.Tensor) -> torch.Tensor:
        """Attention mass (n,) the last `WINDOW` reused tokens' queries put on each reused token at `layer` (causal,
        over prefix and recomputed keys, summed over query heads and the window)."""
        runtime = self.runtime
        attention = attention_of(self.stack.layers[layer], layer)
        window = positions[-WINDOW:]
        assert probe.queries is not None  # probed with queries=True
        queries = probe.queries[:, -len(window) :].view(1, len(window), -1, runtime.head_dim).transpose(1, 2)
        query_norm = projection_norm(attention, "q_proj")
        if query_norm is not None:  # as the layer applies it, before RoPE
            queries = ProjectionNorm(query_norm, runtime.query_heads * runtime.head_dim)(queries)
        queries = apply_rope(queries, window, runtime.ropes[layer]).float()
        keys = torch.cat((blend.kv[layer][0][:, :, : blend.prefix_len], probe.keys), dim=2).float()
        keys = keys.repeat_interleave(runtime.query_heads // runtime.kv_heads, dim=1)
        scores = queries @ keys.transpose(-1, -2) * attention.scaling
        visible = torch.arange(keys.shape[2], device=keys.device)[None, :] <= window[:, None]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        blend.flops += 4.0 * runtime.query_heads * runtime.head_dim * len(window) * keys.shape[2]
        return weights.sum(dim=(0, 1, 2))[blend.prefix_len :]


def _per_token(states: torch.Tensor) -> torch.Tensor:
    """(1, H_kv, n, D) → (n, H_kv·D) in float32: one vector per token over all heads."""
    return states[0].transpose(0, 1).reshape(states.shape[2], -1).float()
