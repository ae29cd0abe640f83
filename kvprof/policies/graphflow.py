"""GraphFlow: a shared segment corrected by what earlier edges of the same workflow graph showed (approximated:
GraphFlow has no public code; this follows its public description as the KVCMAS paper compares against it).

Reference: the same as KVComm's public code (`kvprof.policies.kvcomm`): an output is reused from its producer's
in-context cache (an edge of the graph carries the producer's cache to its reader), an external input from its
context-free encoding (a reference prefill, once per segment). For reader j the correction is the mean delta Δ_j of
the segments observed before in the same slot — the same edge of the workflow graph (the placeholder and the reading
agent) — with no confidence gate: a slot with an observed delta for j is always corrected; one without is prefilled
densely (only that segment) and its delta observed (kept as in `kvprof.policies.anchors.AnchorPool`, full-dimensional,
V = 20 per slot). What is approximated: how GraphFlow learns the correction from observed edges (kvprof averages them
uniformly, with no learned parameters) and which cache an edge carries.
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
