"""KVCMAS: low-rank anchor pools and chain correction (the KVCMAS paper), as its public code runs it (hjeon2k/KVCMAS,
`KVCMAS/llm/gpt_chat.py` and `KVCMAS/llm/kvcmas_engine.py`).

References. An agent's output is reused from its producer's own in-context cache, keys rotated back to position 0,
in both modes. An external input (the question) is never encoded on its own: its first reader computes it densely
(hop 0) and its cache is harvested (`_fs_harvest_question`); with `chain=chain` (the code's default,
`KVCMAS_CHAIN_DELTA=1`) every later reader corrects from the previous reader's cache of it (corrected or dense,
harvested again after every hop), with `chain=star` from hop 0's.

Gate. Only outputs are gated, once, when produced (`predict_as_anchor`, as KVComm's: values of every layer,
softmax(−‖X − A‖₂), accepted when H(w) ≤ τ·log2 N with at least two anchors, τ = 0.3); a refused output becomes an
anchor and every reader prefills its whole call densely. Inputs are never gated: they are always corrected, and an
input computed densely (hop 0, or inside a refused call) joins its slot while the slot holds fewer than V anchors
(`_admit_q`).

Correction. reference + Σ w·(Δ_reader − Δ_source) with per-token K and V weights, softmax of −mean |X − A| over
layers, heads and dims (temperature 1), layer 0 uncorrected; the candidate X is matched against each anchor's cache
of the same owner as the reference (its base, or base + Δ_source), so a chained reference is compared like for like.
Anchors keep their base and deltas as rank-r factors of each layer's (L × H_kv·D) matrix (r = 32): per matrix
layers·r·(L + H_kv·D) parameters; the correction is one fused GEMM per layer and side over the concatenated factors
(`kvprof.kernels.correction`). Pool: V = 10 per slot (the published runs), trimmed above V by the least-activated of
the oldest 5.

τ = 0.3: the code's default; its runners use 0.29–0.34 for the LLM tasks. `kvprof tune-tau` picks τ for a user's
own trajectories.

Remaining deviations from the public code:
- the candidate is compared with the anchor's cache of the reference's owner; the code compares it with the anchor's
  stored base, which each later dense writer overwrites with the reference it read (`set_anchor_streaming_raw`),
  and takes each reader's delta against the reference that reader read rather than as Δ_reader − Δ_source;
- the factors are an exact truncated SVD, where the code runs a randomized range finder (two iterations, seed 42)
  and stores them in the model's dtype;
- the per-layer top-10 "hot" anchor selection is not modelled (it only acts on a slot holding 11 anchors);
- hop 0's blank question anchor is not modelled;
- keys are compared in the segment's frame; the gate's FLOPs are charged to the first reader's turn; an anchor
  lacking the reader's delta is skipped, and a segment no anchor covers is reused uncorrected, as the code does;
- `fallback=segment` (kvprof's) prefills only refused segments densely.
"""

from __future__ import annotations

from typing import ClassVar

from kvprof.claims.papers import KVCMAS_PAPER, KVCMAS_SETTING
from kvprof.claims.types import Published, ServingClaim
from kvprof.policies.anchors import Match
from kvprof.policies.delta import DeltaCorrection, SharedSegment, fallback_option, pool_options, threshold_option
from kvprof.policies.options import Option, positive_int

CHAINED = (("chain", "chain"),)  # the serving figures are KVCMAS's default, chained correction
SERVING_TOKENS = 32_768  # the shared context of KVCMAS's serving setting (32K tokens)
KVCMAS_SERVING = KVCMAS_SETTING + "; vLLM, 4-agent schedule, 32K shared tokens, 8 QPS, A100 80GB"


class KVCMAS(DeltaCorrection):
    name = "kvcmas"
    paper = KVCMAS_PAPER
    admits_dense_inputs = True
    options: ClassVar[dict[str, Option]] = {
        "chain": Option(
            "chain",
            ("chain", "star"),
            sweep=("chain", "star"),
            help="chain: an input is corrected from its previous reader's cache (code default); star: from its "
            "first reader's (the code's non-chained mode)",
        ),
        "tau": threshold_option("0.3", "accept when the anchor weights' entropy ≤ tau·log2(#anchors)"),
        "rank": Option("32", parse=positive_int, help="the anchors' factor rank r (per layer)"),
        "fallback": fallback_option(),
        **pool_options("10"),
    }
    published: ClassVar[tuple[Published, ...]] = (
        Published(
            KVCMAS_PAPER,
            "serving",
            KVCMAS_SERVING,
            "at ρ = 0.8: TTFT 2.0× lower than NonShared",
            serving=ServingClaim(
                "ttft_p50",
                0.4,
                0.6,
                "kvprof: “2.0× lower” read as 1/2 ± 20 %, on median TTFT",
                ("nonshared",),
                SERVING_TOKENS,
                8.0,
                policy_options=CHAINED,
            ),
        ),
        Published(
            KVCMAS_PAPER,
            "serving",
            KVCMAS_SERVING,
            "at ρ = 0.8: TTFT 27 % lower than GraphFlow, the next fastest",
            serving=ServingClaim(
                "ttft_p50",
                0.68,
                0.78,
                "kvprof: 1 − ratio in 27 % ± 5 points, on median TTFT",
                ("graphflow",),
                SERVING_TOKENS,
                8.0,
                policy_options=CHAINED,
            ),
        ),
        Published(
            KVCMAS_PAPER,
            "serving",
            KVCMAS_SERVING,
            "chain correction: median TTFT 34 % below the non-chained variant",
            serving=ServingClaim(
                "ttft_p50",
                0.61,
                0.71,
                "kvprof: 1 − ratio in 34 % ± 5 points",
                ("kvcmas",),
                SERVING_TOKENS,
                8.0,
                reference_options=(("chain", "star"),),
                policy_options=CHAINED,
            ),
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
    def rank(self) -> int | None:
        return int(self.values["rank"])

    def source_of(self, reader: str, segment: SharedSegment) -> str | None:
        if segment.is_output or self.settings["chain"] == "star":
            return segment.producer
        return self.latest[segment.name]

    def moved_source(self, segment: SharedSegment) -> str | None:
        """A moved span is corrected from the turn it comes from, input or output: its producer's cache, or the
        cache of the first agent that read it (the star reference; the chain of readers is not followed across
        positions)."""
        return segment.producer

    def owner_of(self, segment: SharedSegment) -> str | None:
        return segment.producer

    def gated(self, segment: SharedSegment) -> bool:
        return segment.is_output

    def accepts(self, match: Match) -> bool:
        return match.confident(float(self.values["tau"]))
