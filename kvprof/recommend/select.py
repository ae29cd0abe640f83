"""The choice among candidates for a target: the bounds each one misses, by how much, and the best of those that
miss none.

- Accuracy drop and KL are tested at the upper end of their interval over tasks (a candidate meets them only if its
  whole interval does); TTFT, TPOT and KV memory are the simulated numbers at the load (one seeded run: no interval).
- A candidate that runs out of KV memory at the load misses the memory bound, budget given or not.
- Among those meeting every bound, the best objective (highest requests/s, lowest TTFT p90, lowest peak KV memory)
  wins; objectives within `OBJECTIVE_TIE` of the best are a tie, decided by the intervals: the lowest upper end of the
  accuracy drop, then of the KL, then the lowest peak KV memory, then the name.
- With none meeting every bound, the closest candidate misses the fewest bounds, then by the smallest largest
  relative excess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprof.recommend.candidates import Quality
from kvprof.recommend.serving import Serving
from kvprof.recommend.target import MEMORY_BOUND, SERVING_BOUNDS, Target, bound_text

OBJECTIVE_TIE = 0.02  # objectives within 2 % of the best are tied: the intervals decide
HIGHER_IS_BETTER = {"throughput": True, "ttft": False, "memory": False}
LABELS = {
    "accuracy-drop": "accuracy drop",
    "kl": "KL",
    "ttft-p50": "TTFT p50",
    "ttft-p90": "TTFT p90",
    "tpot-p50": "TPOT p50",
    "tpot-p90": "TPOT p90",
    MEMORY_BOUND: "KV memory",
}


@dataclass(frozen=True)
class Candidate:
    """A replayed policy setting: its name (`NAME/label` or `label`), result name, label, fidelity and serving."""

    name: str
    group: str
    label: str
    quality: Quality
    serving: Serving

    def objective(self, optimise: str) -> float | None:
        """Its value of the objective: requests/s, TTFT p90 (s) or peak KV bytes."""
        serving = self.serving
        return {"throughput": serving.throughput, "ttft": serving.ttft_p90, "memory": serving.peak_kv_bytes}[optimise]


@dataclass(frozen=True)
class Miss:
    """A bound a candidate misses: its value (the interval's upper end for accuracy and KL; None: not measured), the
    limit, the excess over it relative to the limit (inf: the limit is 0, or it ran out of memory), a sentence."""

    bound: str
    value: float | None
    limit: float | None
    relative: float
    text: str


def _excess(bound: str, value: float, limit: float) -> Miss:
    relative = (value - limit) / limit if limit > 0 else math.inf
    shown = f"{LABELS[bound]} {'up to ' if bound in ('accuracy-drop', 'kl') else ''}{bound_text(bound, value)}"
    by = bound_text(bound, value - limit)
    percent = f", +{relative:.0%}" if math.isfinite(relative) else ""
    return Miss(bound, value, limit, relative, f"{shown} > {bound_text(bound, limit)} (+{by}{percent})")


def misses(candidate: Candidate, target: Target) -> list[Miss]:
    """The bounds of `target` that `candidate` misses, in the target's order (memory first when out of memory)."""
    serving, quality = candidate.serving, candidate.quality
    if serving.out_of_memory:
        budget = target.kv_memory
        where = f"the {bound_text(MEMORY_BOUND, budget)} budget" if budget is not None else "the device's KV memory"
        found = [Miss(MEMORY_BOUND, None, budget, math.inf, f"out of {where}: {serving.out_of_memory}")]
    else:
        found = []
    values: dict[str, float | None] = {
        "accuracy-drop": quality.accuracy_drop.high if quality.accuracy_drop else None,
        "kl": quality.kl.high,
        "ttft-p50": serving.ttft_p50,
        "ttft-p90": serving.ttft_p90,
        "tpot-p50": serving.tpot_p50,
        "tpot-p90": serving.tpot_p90,
    }
    for bound, limit in target.bounds.items():
        if bound == MEMORY_BOUND:
            continue
        value = values[bound]
        if value is None:
            if not serving.out_of_memory or bound not in SERVING_BOUNDS:
                found.append(Miss(bound, None, limit, math.inf, f"{LABELS[bound]} not measured"))
        elif value > limit + 1e-12:
            found.append(_excess(bound, value, limit))
    return found


@dataclass(frozen=True)
class Choice:
    """Candidates meeting every bound, best first (`ranked`), the misses of the others by name, how a tie for the
    first place was decided (None: no tie), and the closest candidate when none meets the target."""

    ranked: list[Candidate]
    rejected: dict[str, list[Miss]]
    tie: str | None
    closest: Candidate | None

    @property
    def chosen(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def runner_up(self) -> Candidate | None:
        return self.ranked[1] if len(self.ranked) > 1 else None


def _tie_key(candidate: Candidate) -> tuple:
    """Lower is better among candidates tied on the objective: accuracy-drop and KL upper ends, peak memory, name."""
    quality = candidate.quality
    drop = quality.accuracy_drop.high if quality.accuracy_drop else 0.0
    return drop, quality.kl.high, candidate.serving.peak_kv_bytes or 0.0, candidate.name


def _best(pool: list[Candidate], optimise: str) -> tuple[Candidate, list[Candidate]]:
    """The best of `pool` and the candidates tied with the best objective (itself included)."""
    measured = {c.name: value for c in pool if (value := c.objective(optimise)) is not None}
    if not measured:
        return min(pool, key=_tie_key), pool
    sign = 1.0 if HIGHER_IS_BETTER[optimise] else -1.0
    top = max(sign * value for value in measured.values())
    tied = [c for c in pool if c.name in measured and sign * measured[c.name] >= top - OBJECTIVE_TIE * abs(top)]
    return min(tied, key=_tie_key), tied


def choose(candidates: list[Candidate], target: Target) -> Choice:
    """Rank the candidates meeting every bound of `target` (module docstring) and record the others' misses."""
    found = {c.name: misses(c, target) for c in candidates}
    pool = [c for c in candidates if not found[c.name]]
    ranked: list[Candidate] = []
    tie = None
    while pool:
        best, tied = _best(pool, target.optimise)
        if not ranked and len(tied) > 1:
            tie = _tie_text(best, tied, target.optimise)
        ranked.append(best)
        pool.remove(best)
    rejected = {name: found_misses for name, found_misses in found.items() if found_misses}
    closest = None
    if not ranked and candidates:
        closest = min(candidates, key=lambda c: (len(found[c.name]), max(m.relative for m in found[c.name]), c.name))
    return Choice(ranked, rejected, tie, closest)


def _tie_text(best: Candidate, tied: list[Candidate], optimise: str) -> str:
    """How the intervals decided a tie on the objective."""
    others = ", ".join(c.name for c in tied if c is not best)
    keys = ", ".join(
        f"{c.name} {100 * (c.quality.accuracy_drop.high if c.quality.accuracy_drop else 0):.3g} pt, "
        f"KL {c.quality.kl.high:.3g}"
        for c in sorted(tied, key=_tie_key)
    )
    return (
        f"{best.name} ties on {optimise} with {others} (within {OBJECTIVE_TIE:.0%}); the intervals decide: lowest "
        f"upper end of accuracy drop, then of KL ({keys})."
    )
