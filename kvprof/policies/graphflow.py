"""GraphFlow: a shared segment corrected by the mean delta earlier edges of the same workflow graph showed.

Approximated: GraphFlow has no public code; this follows its public description as the KVCMAS paper compares against
it. References as KVComm's code (`kvprof.policies.kvcomm`): an output from its producer's in-context cache, an
external input from its context-free encoding (a reference prefill, once per segment). Reader j's correction is the
mean Δ_j of the segments observed before in the same slot (placeholder and reader), with no gate: a slot with an
observed delta for j is always corrected, one without is prefilled densely (that segment only) and its delta kept
(`kvprof.policies.anchors.AnchorPool`, full-dimensional, V = 20 per slot).

Approximated: how GraphFlow learns the correction from observed edges (kvprof averages them uniformly, no learned
parameters) and which cache an edge carries.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvprof.claims.papers import GRAPHFLOW, KVCMAS_PAPER, KVCMAS_SETTING
from kvprof.claims.types import Published
from kvprof.policies.anchors import Match
from kvprof.policies.delta import Decision, DeltaContext, DeltaCorrection, SharedSegment, Stacked, pool_options
from kvprof.policies.options import Option


class GraphFlow(DeltaCorrection):
    name = "graphflow"
    paper = GRAPHFLOW
    per_token = False
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

    def judge(
        self, agent: str, segment: SharedSegment, source: str | None, reference: Stacked, context: DeltaContext
    ) -> Decision:
        assert self.pool is not None
        anchors = self.pool.eligible(segment.slot, segment.length, source, (agent,), exclude=segment.name)
        weights = torch.full((len(anchors),), 1.0 / max(len(anchors), 1))
        match = Match(anchors, source, weights, 1.0)
        return Decision(segment, source, reference, True, self.accepts(match), match=match)
