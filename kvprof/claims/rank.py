"""The rank analysis's verdicts on the papers' rank and similarity claims (LRAgent: base caches alike, adapter outputs
nearly orthogonal; KVCMAS: low-rank deltas), from per-layer means over the analysed spans (`kvprof.rank.analysis`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvprof.claims.papers import KVCMAS_DELTA_RANK, LRAGENT_BASE_COSINE, LRAGENT_ORTHOGONAL

KV_NAMES = ("K", "V")  # the two cache tensors, as result keys
EXTENSION = "kvprof's extension (not the paper's quantity)"
CONTEXT_FREE_QUANTITY = (
    "Δ_j = C_j,seg − R(C_ref,seg): an agent's cache of a shared segment minus the segment encoded context-free "
    "(alone, no prefix), keys re-aligned to the agent's positions (the paper's quantity)"
)
BETWEEN_AGENTS_QUANTITY = (
    "Δ_j←i = C_j − C_i: the difference of two agents' caches of their shared span, "
    f"{EXTENSION}; the paper's Δ_j is against the context-free encoding of a segment read after an agent's prefix, "
    "and lora-mode agents read the shared span after identical tokens"
)


@dataclass
class Claim:
    """A published claim and whether this run reproduces it (None: not applicable); `quantity`: what was measured
    and whether it is the paper's."""

    paper: str
    statement: str
    holds: bool | None
    measured: str
    detail: str = ""
    quantity: str = ""


def lragent_claims(mode: str, means: dict[int, dict[str, dict[str, float]]], layers: Sequence[int]) -> list[Claim]:
    """LRAgent's two claims in lora mode; one not-applicable claim in prompt mode."""
    if mode != "lora":
        cache = {kv: _mean(_over_layers(means, layers, "cache_cosine", kv)) for kv in KV_NAMES}
        return [
            Claim(
                "LRAgent",
                "base caches agree across agents and adapter outputs are nearly orthogonal",
                None,
                f"cache cosine K {cache['K']:.4f}, V {cache['V']:.4f}",
                "not applicable: prompt-mode agents have no adapters (the cache cosine after re-alignment is shown)",
                "the caches C_i, C_j of two agents on their shared span, keys re-aligned",
            )
        ]
    base = {kv: _over_layers(means, layers, "base_cosine", kv) for kv in KV_NAMES}
    lowest = min(((kv, layer, v) for kv in KV_NAMES for layer, v in base[kv]), key=lambda item: item[2])
    adapter = {kv: _over_layers(means, layers, "adapter_cosine", kv) for kv in KV_NAMES}
    largest = max(((kv, layer, v) for kv in KV_NAMES for layer, v in adapter[kv]), key=lambda item: abs(item[2]))
    return [
        Claim(
            "LRAgent",
            f"base caches of different agents have cosine similarity > {LRAGENT_BASE_COSINE}",
            all(_mean(base[kv]) > LRAGENT_BASE_COSINE for kv in KV_NAMES),
            f"K {_mean(base['K']):.4f}, V {_mean(base['V']):.4f}",
            f"mean token cosine over layers; lowest: layer {lowest[1]} {lowest[0]} {lowest[2]:.4f}",
            "the base parts X·W0 of two agents' caches on their shared span (the paper's quantity)",
        ),
        Claim(
            "LRAgent",
            f"adapter outputs of different agents are nearly orthogonal (|cosine| < {LRAGENT_ORTHOGONAL})",
            all(abs(_mean(adapter[kv])) < LRAGENT_ORTHOGONAL for kv in KV_NAMES),
            f"K {_mean(adapter['K']):+.4f}, V {_mean(adapter['V']):+.4f}",
            f"mean token cosine over layers; largest |cosine|: layer {largest[1]} {largest[0]} {largest[2]:+.4f}",
            "the adapter outputs s·X·A·B of two agents on their shared span (the paper's quantity)",
        ),
    ]


def _over_layers(
    means: dict[int, dict[str, dict[str, float]]], layers: Sequence[int], metric: str, kv: str
) -> list[tuple[int, float]]:
    return [(layer, means[layer][kv][metric]) for layer in layers if metric in means[layer][kv]]


def _mean(values: list[tuple[int, float]]) -> float:
    return sum(v for _, v in values) / len(values)


def kvcmas_claims(
    means: dict[int, dict[str, dict[str, float]]],
    layers: Sequence[int],
    bound: int,
    scope: str,
    delta: str,
    cache: str,
    quantity: str,
    label: str = "",
) -> list[Claim]:
    """KVCMAS's two claims on `means` ("delta_rank", "cache_rank") over `scope`'s records; `bound`, names, `label`."""
    trivial = (
        f"; no matrix here can have rank above {bound} (its tokens or columns), so the threshold says "
        "little on this trace"
        if bound <= KVCMAS_DELTA_RANK
        else ""
    )
    deltas = {kv: _over_layers(means, layers, "delta_rank", kv) for kv in KV_NAMES}
    highest = max(((kv, layer, v) for kv in KV_NAMES for layer, v in deltas[kv]), key=lambda item: item[2])
    caches = {kv: _mean(_over_layers(means, layers, "cache_rank", kv)) for kv in KV_NAMES}
    delta_means = {kv: _mean(deltas[kv]) for kv in KV_NAMES}
    return [
        Claim(
            "KVCMAS",
            f"{delta} have effective rank < {KVCMAS_DELTA_RANK:g}{label}",
            highest[2] < KVCMAS_DELTA_RANK,
            f"K {delta_means['K']:.2f}, V {delta_means['V']:.2f}",
            f"mean over layers of {scope}; highest: layer {highest[1]} {highest[0]} {highest[2]:.2f} (every layer "
            f"must be < {KVCMAS_DELTA_RANK:g}){trivial}",
            quantity,
        ),
        Claim(
            "KVCMAS",
            f"{cache} have higher effective rank than their deltas{label}",
            all(caches[kv] > delta_means[kv] for kv in KV_NAMES),
            f"C: K {caches['K']:.2f}, V {caches['V']:.2f}; Δ: K {delta_means['K']:.2f}, V {delta_means['V']:.2f}",
            f"means over layers of {scope}",
            quantity,
        ),
    ]
