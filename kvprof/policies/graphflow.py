"""GraphFlow: a context-free encoding of each shared segment, corrected by what earlier edges of the same workflow
graph showed (approximated: GraphFlow has no public code; this follows its public description as the KVCMAS paper
compares against it).

Each new shared segment is encoded context-free (a reference prefill, once per segment, keys re-aligned). For reader
j the correction is the mean delta Δ_j of the segments observed before in the same slot — the same edge of the
workflow graph (the placeholder and the reading agent) — with no confidence gate: a slot with an observed delta for
j is always corrected; one without is prefilled densely and its delta observed (kept as in
`kvprof.anchors.AnchorPool`, full-dimensional, up to 20 per slot). What is approximated: how GraphFlow learns the
correction from observed edges (kvprof averages them uniformly, with no learned parameters).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvprof.anchors import Match
from kvprof.policies.base import Option, Published
from kvprof.policies.delta import Decision, DeltaContext, DeltaCorrection, SharedSegment, pool_options
from kvprof.policies.papers import GRAPHFLOW, KVCMAS_PAPER, KVCMAS_SETTING


class GraphFlow(DeltaCorrection):
    name = "graphflow"
    paper = GRAPHFLOW
    options: ClassVar[dict[str, Option]] = pool_options("20")
    published: ClassVar[tuple[Published, ...]] = (
        Published(
            KVCMAS_PAPER,
            "serving (GraphFlow as a baseline)",
            KVCMAS_SETTING + "; 32K shared tokens, 8 QPS, ρ = 0.8",
            "the fastest baseline after KVCMAS, whose TTFT is 27 % lower",
        ),
    )

    def accepts(self, match: Match) -> bool:
        return bool(match.anchors)

    def decide(self, agent: str, segment: SharedSegment, shared: list[int], context: DeltaContext) -> Decision:
        assert self.pool is not None
        base = self.base_of(segment, shared, context)
        anchors = self.pool.eligible(segment.slot, segment.length, (agent,), exclude=segment.name)
        weights = torch.full((len(anchors),), 1.0 / max(len(anchors), 1))
        match = Match(anchors, weights, 1.0)
        return Decision(segment, self.accepts(match), match, None, base)
