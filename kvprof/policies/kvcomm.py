"""KVComm: online anchor pools of full-dimensional deltas behind an entropy gate.

Paper: KVCOMM (Ye et al., NeurIPS 2025; arXiv:2510.12872); code: delsiiin/KVCOMM (`KVCOMM/llm/gpt_chat.py`,
`KVCOMM/llm/kvcomm_engine.py`). Walk-through: docs/policies/delta.md; machinery: `kvprof.policies.delta`,
`kvprof.policies.anchors`. As the code:

- References: an output from its producer's in-context cache, keys rotated to position 0 (`LLMChat.agen_kvcomm`); an
  external input from its stand-alone encoding (`update_input_anchor`; kvprof encodes it after
  `kvprof.policies.delta.NeutralContext`, the code inside the template's header, header tokens dropped).
- Gate once per segment (`predict_as_anchor`): values of every layer against each anchor of the slot at least as
  long, H(softmax(−‖X_V − A_V‖₂)) in bits (ε 1e-40) ≤ γ·log2 N, γ = 0.3, ≥ 2 anchors; the top anchors up to 0.9 of
  the weight count an activation. A refused segment becomes an anchor; its readers prefill their whole call
  (`has_active_anchor` → `dense_prefill`), their caches kept as its deltas (`set_anchor`).
- Correction (`offset_kv_cache_pair`): reference + Σ w·Δ_reader, per-token K and V weights (softmax of −mean |X − A|,
  temperature 1, `_compute_anchor_weight_entry`), layer 0 uncorrected. Pool: V = 20 per slot, trimmed above V (so up
  to 21) by the least-activated of the oldest 5 (`update_anchor`).

Remaining deviations from the public code:

- The first reader of an external input computes it densely in its own chunk (kvprof learns of a segment only after
  the turn that adds it); the code may correct it for that reader too.
- Keys are compared and deltas stored in the segment's own frame (positions 0..L−1); the code first rotates the
  placeholder to its position in the reader's prompt (`_rotate_segment_caches`).
- Only shared segments are corrected; the code also corrects the template text after each placeholder (`pf` deltas),
  which kvprof's agents read in their own chunk.
- Slots are (producer, turn) placeholders (`AGENT.outK`); the code pools per producer's current response
  (`agent_<id>_current`).
- An anchor lacking the reader's delta is skipped (the code would fail); a segment no anchor covers is reused
  uncorrected, as the code does.
- The gate's matching FLOPs are charged to the first reader's turn (the code gates after generation).
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
