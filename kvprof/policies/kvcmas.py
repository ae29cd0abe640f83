"""KVCMAS: low-rank anchor pools and chain correction.

Paper: KVCMAS; code: hjeon2k/KVCMAS (`KVCMAS/llm/gpt_chat.py`, `KVCMAS/llm/kvcmas_engine.py`). Walk-through:
docs/policies/delta.md. As the code:

- References: an output from its producer's in-context cache, keys rotated to position 0 (both modes). An external
  input is never encoded alone: its first reader computes it densely (hop 0, harvested by `_fs_harvest_question`);
  `chain=chain` (default, `KVCMAS_CHAIN_DELTA=1`): later readers correct from the previous reader's cache (harvested
  after every hop); `chain=star`: from hop 0's.
- Gate: outputs only, once, when produced (`predict_as_anchor`, as KVComm's, τ = 0.3: the code's default, its runners
  use 0.29–0.34; `kvprof tune-tau` picks one); a refused output becomes an anchor and its readers prefill their whole
  call. Inputs are always corrected; one computed densely (hop 0, or in a refused call) joins its slot while the
  slot holds fewer than V (`_admit_q`).
- Correction: reference + Σ w·(Δ_reader − Δ_source), per-token K and V weights (softmax of −mean |X − A|,
  temperature 1), layer 0 uncorrected; one fused GEMM per layer and side (`kvprof.kernels.correction`). Anchors: base
  and deltas as rank-r factors of each layer's (L × H_kv·D) matrix, r = 32 (layers·r·(L + H_kv·D) per matrix); V = 10
  per slot (the published runs), trimmed above V by the least-activated of the oldest 5.

Remaining deviations from the public code:

- The candidate is compared with the anchor's cache of the reference's owner (base, or base + Δ_source: like for
  like); the code compares it with the anchor's stored base, which each later dense writer overwrites with the
  reference it read (`set_anchor_streaming_raw`), and takes each reader's delta against the reference that reader
  read rather than as Δ_reader − Δ_source.
- The factors are an exact truncated SVD; the code runs a randomized range finder (two iterations, seed 42) and
  stores them in the model's dtype.
- The per-layer top-10 "hot" anchor selection is not modelled (it only acts on a slot holding 11 anchors).
- Hop 0's blank question anchor is not modelled.
- Keys are compared in the segment's frame; the gate's FLOPs are charged to the first reader's turn; an anchor
  lacking the reader's delta is skipped, and a segment no anchor covers is reused uncorrected, as the code does.
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
