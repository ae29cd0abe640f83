"""KVComm: online anchor pools of full-dimensional deltas behind an entropy gate (KVCOMM, Ye et al., NeurIPS 2025,
arXiv:2510.12872), as the official public code runs it (delsiiin/KVCOMM, `KVCOMM/llm/gpt_chat.py` and
`KVCOMM/llm/kvcomm_engine.py`).

References. An agent's output is reused from its producer's own in-context cache, keys rotated back to position 0
(`LLMChat.agen_kvcomm`: the response cache after generation); an external input (the question, a tool result, a
cue) from its stand-alone encoding (`update_input_anchor`: the text encoded inside the template's header, the
header's tokens dropped; kvprof encodes it after `kvprof.policies.delta.NeutralContext`).

Gate. Once per segment (`predict_as_anchor`): the reference's values on every layer against each anchor of its slot
at least as long (the anchor's cache of the same owner), w = softmax(−‖X_V − A_V‖₂), accepted when at least two
anchors qualify and H(w) = −Σ w·log2(w + 1e-40) ≤ γ·log2 N, γ = 0.3; the top anchors up to 0.9 of the weight
count an activation. A refused segment becomes an anchor, and each agent that reads it prefills its whole call
densely (`has_active_anchor` → `dense_prefill`), its cache of the segment kept as the anchor's delta for it
(`set_anchor`).

Correction (`offset_kv_cache_pair`). A reader of an accepted segment gets reference + Σ w·Δ_reader with per-token
weights, separately for K and V, softmax over anchors of −mean |X − A| over layers, heads and dims (temperature 1,
`_compute_anchor_weight_entry`), layer 0 left as the reference. Anchors: full-dimensional, V = 20 per slot, the
slot trimmed when it holds more than V (so up to 21) by dropping the least-activated of its oldest 5
(`update_anchor`). The machinery is `kvprof.policies.delta` and `kvprof.policies.anchors`.

Remaining deviations from the public code:
- the first reader of an external input computes it densely in its own chunk (kvprof learns of a segment only after
  the turn that adds it), where the code may correct it for that reader too;
- keys are compared and deltas stored in the segment's own frame (positions 0..L−1); the code rotates the
  placeholder to its position in the reader's prompt first (`_rotate_segment_caches`);
- only shared segments are corrected: the code also corrects the template text after each placeholder (its
  `pf` deltas), which kvprof's agents read in their own chunk;
- slots are (producer, turn) placeholders (`AGENT.outK`); the code pools per producer's current response
  (`agent_<id>_current`);
- an anchor lacking the reader's delta is skipped (the code would fail on it); a segment no anchor covers is reused
  uncorrected, as the code does;
- the gate's matching FLOPs are charged to the first reader's turn (the code runs the gate after generation);
- `fallback=segment` (kvprof's) prefills only refused segments densely.
"""

from __future__ import annotations

from typing import ClassVar

from kvprof.claims.papers import KVCMAS_PAPER, KVCMAS_SETTING, KVCOMM, KVCOMM_SETTING, LLAMA_8B_KV_BYTES
from kvprof.claims.types import Published, ServingClaim
from kvprof.policies.anchors import Match
from kvprof.policies.delta import DeltaCorrection, fallback_option, pool_options, threshold_option
from kvprof.policies.options import Option


class KVComm(DeltaCorrection):
    name = "kvcomm"
    paper = KVCOMM
    options: ClassVar[dict[str, Option]] = {
        "gamma": threshold_option("0.3", "accept when the anchor weights' entropy ≤ gamma·log2(#anchors)"),
        "fallback": fallback_option(),
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
            serving=ServingClaim(
                "out_of_memory",
                1.0,
                1.0,
                "paper text: out of memory at 32K",
                (),
                32_768,
                8.0,
                kv_bytes_per_token=LLAMA_8B_KV_BYTES,
            ),
        ),
    )

    def accepts(self, match: Match) -> bool:
        return match.confident(float(self.values["gamma"]))
