"""RelayCaching: reuse earlier agents' decode-phase KV and rectify the few tokens that deviate or matter most.

Paper: RelayCaching, as the selective-recompute baseline of PReCache (30 % recompute ratio) and KVCMAS (KV reuse
ρ = 0.9 and 0.8). An agent that reads another agent's output reuses the K/V that agent produced while decoding it,
instead of prefilling the text again, and rectifies a sparse set of tokens in staged layer bands. The public
description is partial; kvprof's choices, each with its source:

- what is reused: FullShared's store (`kvprof.policies.selective`), in which an earlier agent's output is exactly
  the K/V of its decode phase (the relay); tokens an earlier agent prefilled (the question, observations) are
  reused from the same store, where RelayCaching leaves them to the server's prefix cache — a prefix cache cannot
  share them across adapters or role prompts, so in this setting they are relayed too (kvprof's choice);
- which tokens are rectified (RelayCaching's rule): those whose deviation 1 − cos(v_reuse, v_full) is at least
  1.5 × the mean deviation, or whose attention influence on the last 10 tokens is high. kvprof measures both at the
  check layer (`check_layer`, default 1): v_full are the values projected there from the recomputed hidden
  states, v_reuse the reused values, the cosine taken per token over all heads; influence is the attention mass the
  last 10 reused tokens' queries (at the check layer, from the recomputed states) put on each token, summed over
  heads, and "high" is kvprof's reading: at least 1.5 × the mean influence, as for the deviation. To make R the one
  knob of the selective-recompute family, the tokens the rule flags are ranked first and the budget R of the reused
  tokens is filled from the ranking (deviation ÷ its mean + influence ÷ its mean): at small R it is the rule's most
  flagrant tokens, at R = 1 every token;
- the staged layer bands (kvprof's placement; the description names the kinds, not where they sit): full
  recompute of every reused token in layers 0 .. check − 1 (the states the deviation is measured from), sparse
  rectification of the selected tokens from the check layer on, and a skip band of the last `skip_layers` layers
  (default 0) whose reused K/V are kept as they are.

At R = 0 nothing is rectified (FullShared); at R = 1 with no skip band everything is recomputed (NonShared).

Phases: TTFT — FullShared's context, the blend (the full band, the check-layer projections and attention
influence, the rectified tokens' layers); each decode step — one token; after the turn — FullShared's commit.

Moved spans (`kvprof.policies.moved`): served re-aligned from FullShared's extension, the new tokens between them
computed there and then again in the blend with the moved spans (the reused tokens are the kept prefix and the
moved spans; at R = 1 the turn is the dense run).
"""

from __future__ import annotations

import torch

from kvprof.claims.papers import RELAYCACHING
from kvprof.claims.types import Published
from kvprof.errors import KvprofError
from kvprof.model.lora import ProjectionNorm, attention_of, projection_norm
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
        """Attention mass (n,) the last `WINDOW` reused tokens put on each reused token at `layer`: their queries
        (RoPE'd as the layer does) over the agent's prefix keys and the reused tokens' recomputed keys, causal,
        summed over query heads and the window."""
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
