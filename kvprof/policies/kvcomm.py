"""KVComm: online anchor pools of full-dimensional deltas over a context-free reference (KVCOMM, Ye et al., NeurIPS
2025, arXiv:2510.12872; the FastMAS/KVCOMM defaults).

Each new shared segment is encoded context-free (a reference prefill of its tokens alone, once per segment); a
reader matches that encoding's values against its slot's anchors (`kvprof.anchors.AnchorPool.match`: softmax over
−L2 distance) and, when the weights' entropy is below γ·log2(#anchors) — normalized entropy < γ, γ = 0.3 — gets
encoding + Σ w·Δ_reader, layer 0 uncorrected; otherwise it prefills the segment densely and the segment becomes an
anchor. Anchors are full-dimensional: V = 20 per slot, eviction of the least-activated of the oldest 5. The machinery
is `kvprof.policies.delta`.

Approximate: the reader's cache is estimated from other segments' deltas. Simplifications against the public code:
one weight vector per segment (from the values of every corrected layer) mixes both keys and values, where the code
weighs keys and values per token; only shared segments are corrected (a reader's own prefix is its own, so nothing
after a placeholder in a template needs an offset); the gate accepts strictly below the threshold, where the public
code also accepts an entropy exactly at it, so that γ = 0 accepts nothing.
"""

from __future__ import annotations

from typing import ClassVar

from kvprof.anchors import Match
from kvprof.policies.base import Option, Published
from kvprof.policies.delta import DeltaCorrection, pool_options, threshold_option
from kvprof.policies.papers import KVCMAS_PAPER, KVCMAS_SETTING, KVCOMM, KVCOMM_SETTING


class KVComm(DeltaCorrection):
    name = "kvcomm"
    paper = KVCOMM
    options: ClassVar[dict[str, Option]] = {
        "gamma": threshold_option("0.3", "accept when the anchor weights' entropy < gamma·log2(#anchors)"),
        **pool_options("20"),
    }
    published: ClassVar[tuple[Published, ...]] = (
        Published(KVCOMM, "abstract", KVCOMM_SETTING, "over 70 % reuse rate without quality degradation"),
        Published(
            KVCOMM,
            "abstract",
            "five fully connected agents, 1K input, 512 prefix and 512 output tokens each",
            "up to 7.8× speed-up; TTFT from 430 ms to 55 ms",
        ),
        Published(
            KVCMAS_PAPER,
            "memory comparison",
            KVCMAS_SETTING,
            "KVComm's full-dimensional anchors run out of memory at 8K and 32K shared tokens; KVCMAS needs up to 3.7× "
            "less peak GPU memory",
        ),
    )

    def accepts(self, match: Match) -> bool:
        return match.confident(float(self.values["gamma"]))
