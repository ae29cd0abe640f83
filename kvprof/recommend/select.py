"""The choice among candidates for a target: the bounds each one misses, by how much, and the best of those that
miss none.

- Accuracy drop and KL are tested at the upper end of their interval over tasks (a candidate meets them only if its
  whole interval does); TTFT, TPOT and KV memory are the simulated numbers at the load (one seeded run: no interval).
- A candidate that runs out of KV memory at the load misses the memory bound, budget given or not.
- Among those meeting every bound, the best objective (most trajectories finished per second, lowest TTFT p90,
  lowest peak KV memory) wins; objectives within `OBJECTIVE_TIE` of the best are a tie, decided by the intervals: the
  lowest upper end of the accuracy drop, then of the KL (ends within `KL_TIE` of the lowest tie, as on the decision
  card), then the lowest peak KV memory, then the name.
- With none meeting every bound, the closest candidate misses the fewest bounds, then by the smallest largest
  relative excess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprof.recommend.candidates import Quality
from kvprof.recommend.serving import Serving
from kvprof.recommend.target import MEMORY_BOUND, SERVING_BOUNDS, Target, bound_text
from kvprof.report.decision import KL_TIE

# Objectives within 5 % of the best are tied, and the intervals decide: a simulated run's trajectories/s is its
# finished trajectories over its length, drain included, which at an unsaturated load understates the load by the
# last trajectories' latency over the run (a few % at the demo's 60 s of arrivals).
OBJECTIVE_TIE = 0.05
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
        """Its value of the objective: trajectories/s, TTFT p90 (s) or peak KV bytes."""
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


def _drop_high(candidate: Candidate) -> float:
    drop = candidate.quality.accuracy_drop
    return drop.high if drop else 0.0


def _settle(tied: list[Candidate]) -> tuple[Candidate, list[str]]:
    """The winner among candidates tied on the objective, and the steps that decided it: the lowest upper end of the
    accuracy drop, then KL upper ends within `KL_TIE` of the lowest (as the decision card ties KLs), then the lowest
    peak KV memory, then the name."""
    steps = []
    lowest = min(_drop_high(c) for c in tied)
    tied = [c for c in tied if _drop_high(c) <= lowest + 1e-12]
    steps.append(f"accuracy drop up to {100 * lowest:.3g} pt: {', '.join(c.name for c in tied)}")
    lowest = min(c.quality.kl.high for c in tied)
    tied = [c for c in tied if c.quality.kl.high <= lowest * (1 + KL_TIE) + 1e-15]
    steps.append(f"KL up to {lowest:.3g} (within {KL_TIE:.0%}): {', '.join(c.name for c in tied)}")
    winner = min(tied, key=lambda c: (c.serving.peak_kv_bytes or 0.0, c.name))
    if len(tied) > 1:
        steps.append(f"the lowest peak KV memory, then the name: {winner.name}")
    return winner, steps


def _best(pool: list[Candidate], optimise: str) -> tuple[Candidate, list[Candidate], list[str]]:
    """The best of `pool`, the candidates tied with the best objective (itself included) and how the tie was settled."""
    measured = {c.name: value for c in pool if (value := c.objective(optimise)) is not None}
    tied = pool
    if measured:
        sign = 1.0 if HIGHER_IS_BETTER[optimise] else -1.0
        top = max(sign * value for value in measured.values())
        tied = [c for c in pool if c.name in measured and sign * measured[c.name] >= top - OBJECTIVE_TIE * abs(top)]
    winner, steps = _settle(tied)
    return winner, tied, steps


def choose(candidates: list[Candidate], target: Target) -> Choice:
    """Rank the candidates meeting every bound of `target` (module docstring) and record the others' misses."""
    found = {c.name: misses(c, target) for c in candidates}
    pool = [c for c in candidates if not found[c.name]]
    ranked: list[Candidate] = []
    tie = None
    while pool:
        best, tied, steps = _best(pool, target.optimise)
        if not ranked and len(tied) > 1:
            others = ", ".join(c.name for c in tied if c is not best)
            tie = (
                f"{best.name} ties on {target.optimise} with {others} (within {OBJECTIVE_TIE:.0%}); the intervals "
                f"decide: {'; then '.join(steps)}."
            )
        ranked.append(best)
        pool.remove(best)
    rejected = {name: found_misses for name, found_misses in found.items() if found_misses}
    closest = None
    if not ranked and candidates:
        closest = min(candidates, key=lambda c: (len(found[c.name]), max(m.relative for m in found[c.name]), c.name))
    return Choice(ranked, rejected, tie, closest)
