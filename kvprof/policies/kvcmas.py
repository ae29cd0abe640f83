"""KVCMAS: low-rank anchor pools and chain correction (the KVCMAS paper; τ and the pool defaults as published).

Anchors keep their context-free base and per-agent deltas as rank-r truncated-SVD factors (r = 32, V = 10 anchors
per slot; `kvprof.anchors.Stored`): O(V·N·L·D) → O(V·N·r·(L + D)). Chain correction (`chain=true`, the method):
the first agent to read a segment computes it densely (it is that agent's own input or output); every later reader
j starts from the segment's latest materialised cache C_i (the last reader's, corrected or dense, keys re-aligned),
matches its values against the slot's anchors' reconstructed bases (softmax over −L2 distance), and when the
weights' normalized entropy is below τ gets C_i + Σ w·(Δ_j − Δ_i) — one fused GEMM over the concatenated factors
per layer and side (`kvprof.kernels.correction`), layer 0 uncorrected — which then becomes the next edge's
reference. No reference prefill is needed for a correction; a refused segment is prefilled densely and becomes an
anchor (its context-free encoding is computed then, for the anchor's base). `chain=false` is the paper's ablation:
the context-free encoding is the reference, as in KVComm, with low-rank anchors.

τ = 0.3: the paper reports thresholds of 0.29–0.34 for its LLM tasks; 0.3 lies inside that range. `kvprof tune-tau`
picks τ for a user's own trajectories.

Approximate: the correction is estimated from other segments' deltas, truncated to rank r.
"""

from __future__ import annotations

from typing import ClassVar

from kvprof.anchors import Match
from kvprof.policies.base import Option, Published, positive_int
from kvprof.policies.delta import DeltaCorrection, pool_options, threshold_option
from kvprof.policies.papers import KVCMAS_PAPER, KVCMAS_SETTING


class KVCMAS(DeltaCorrection):
    name = "kvcmas"
    paper = KVCMAS_PAPER
    options: ClassVar[dict[str, Option]] = {
        "chain": Option(
            "chain",
            ("chain", "nochain"),
            sweep=("chain", "nochain"),
            help="chain: correct from the latest materialised cache; nochain: from the context-free encoding",
        ),
        "tau": threshold_option("0.3", "accept when the anchor weights' normalized entropy < tau"),
        "rank": Option("32", parse=positive_int, help="the anchors' factor rank r"),
        **pool_options("10"),
    }
    published: ClassVar[tuple[Published, ...]] = (
        Published(
            KVCMAS_PAPER,
            "serving",
            KVCMAS_SETTING + "; 32K shared tokens, 8 QPS",
            "at ρ = 0.8: TTFT 2.0× lower than NonShared and 27 % lower than GraphFlow",
        ),
        Published(
            KVCMAS_PAPER, "serving", KVCMAS_SETTING, "chain correction: median TTFT 34 % below the non-chained variant"
        ),
        Published(
            KVCMAS_PAPER,
            "accuracy",
            KVCMAS_SETTING,
            "best accuracy of the KV-sharing methods on 3 of 5 benchmarks, at ρ ≈ 0.8",
        ),
        Published(KVCMAS_PAPER, "ablation", KVCMAS_SETTING, "r = 32 and V = 10 give most of the accuracy gain"),
    )

    @property
    def chain(self) -> bool:
        return self.settings["chain"] == "chain"

    @property
    def rank(self) -> int | None:
        return int(self.values["rank"])

    def accepts(self, match: Match) -> bool:
        return match.confident(float(self.values["tau"]))
