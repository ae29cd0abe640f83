"""The library's findings as the typed result (`kvprof.results.recommend`): candidates, the decision, the held-out
confirmation and its verdict, sensitivity rows; and loads scaled for the sensitivity table."""

from __future__ import annotations

import dataclasses

from kvprof.recommend.candidates import Quality, ResultGroup
from kvprof.recommend.select import Candidate, Choice, Miss
from kvprof.recommend.serving import Serving
from kvprof.recommend.target import Target
from kvprof.report.uncertainty import Interval
from kvprof.results import recommend as typed
from kvprof.serving.traffic import Load

HOLDS = "holds"
HOLDS_ON_POINTS = "holds on point values, not within the intervals"
FAILS = "does not hold"


def scaled(load: Load, factor: float) -> Load:
    """`load` × `factor` (trajectories in flight: rounded, at least 1)."""
    if load.kind == "concurrency":
        return Load(load.kind, float(max(1, round(load.value * factor))))
    return Load(load.kind, load.value * factor)


def _spread(interval: Interval | None) -> typed.Spread | None:
    if interval is None:
        return None
    return typed.Spread(value=interval.value, low=interval.low, high=interval.high, n=interval.n)


def _load(load: Load) -> typed.Load:
    return typed.Load(kind=load.kind, value=load.value)


def _miss(miss: Miss) -> typed.MissRecord:
    return typed.MissRecord(bound=miss.bound, value=miss.value, limit=miss.limit, text=miss.text)


def _serving(serving: Serving) -> typed.ServingNumbers:
    return typed.ServingNumbers(**dataclasses.asdict(serving))


def candidate_record(candidate: Candidate, group: ResultGroup, found: list[Miss]) -> typed.CandidateRecord:
    """One candidate's row of the result."""
    fidelity: Quality = candidate.quality
    kl, speedup = _spread(fidelity.kl), _spread(fidelity.ttft_speedup)
    assert kl is not None and speedup is not None
    return typed.CandidateRecord(
        name=candidate.name,
        result=str(group.path),
        label=candidate.label,
        tasks=fidelity.tasks,
        accuracy=_spread(fidelity.accuracy),
        accuracy_drop=_spread(fidelity.accuracy_drop),
        kl=kl,
        ttft_speedup=speedup,
        serving=_serving(candidate.serving),
        misses=[_miss(m) for m in found],
    )


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """The choice and NonShared's serving on the part it was chosen on and on the held-out part, and the bounds the
    held-out numbers miss with their intervals and on point values alone."""

    chosen: tuple[Candidate, Serving]
    held_out: tuple[Candidate, Serving]
    misses: list[Miss]
    point_misses: list[Miss]

    @property
    def verdict(self) -> str:
        if not self.misses:
            return HOLDS
        return FAILS if self.point_misses else HOLDS_ON_POINTS


def _part(name: str, candidate: Candidate, nonshared: Serving) -> typed.ConfirmationPart:
    mine, theirs = candidate.serving.ttft_p90, nonshared.ttft_p90
    kl = _spread(candidate.quality.kl)
    assert kl is not None
    return typed.ConfirmationPart(
        part=name,
        tasks=candidate.quality.tasks,
        accuracy_drop=_spread(candidate.quality.accuracy_drop),
        kl=kl,
        ttft_p90=mine,
        nonshared_ttft_p90=theirs,
        speedup=theirs / mine if mine and theirs else None,
    )


def heldout_record(confirmation: Confirmation, fraction: float, seed: int) -> typed.HeldOut:
    return typed.HeldOut(
        fraction=fraction,
        seed=seed,
        parts=[_part("chosen on", *confirmation.chosen), _part("held out", *confirmation.held_out)],
        verdict=confirmation.verdict,
        misses=[m.text for m in confirmation.misses],
    )


def sensitivity_row(target: Target, choice: Choice) -> typed.SensitivityRow:
    """The decision for `target` (its load and budget) in one row."""
    assert target.load is not None
    chosen = choice.chosen
    return typed.SensitivityRow(
        load=_load(target.load),
        kv_budget=target.kv_memory,
        chosen=chosen.name if chosen else None,
        objective=chosen.objective(target.optimise) if chosen else None,
        closest=choice.closest.name if choice.closest else None,
    )


def decision_record(choice: Choice, suggestions: list[str]) -> typed.Decision:
    return typed.Decision(
        chosen=choice.chosen.name if choice.chosen else None,
        runner_up=choice.runner_up.name if choice.runner_up else None,
        tie=choice.tie,
        closest=choice.closest.name if choice.closest else None,
        suggestions=suggestions,
    )


def result_record(
    groups: list[ResultGroup],
    target: Target,
    candidates: list[Candidate],
    choice: Choice,
    decision: typed.Decision,
    **rest,
) -> typed.RecommendResult:
    """The result: `rest` holds step_model, settings, heldout and sensitivity as the result declares them."""
    assert target.load is not None
    by_name = {(g.name, label): g for g in groups for label in g.labels}
    return typed.RecommendResult(
        results=[
            {
                "name": g.name,
                "path": str(g.path),
                "trace": g.replay.trace,
                "mode": g.replay.mode,
                "trajectories": len(g.trajectories),
            }
            for g in groups
        ],  # fmt: skip
        target=target.clauses(),
        load=_load(target.load),
        kv_budget=target.kv_memory,
        optimise=target.optimise,
        candidates=[
            candidate_record(c, by_name[(c.group, c.label)], choice.rejected.get(c.name, [])) for c in candidates
        ],
        decision=decision,
        **rest,
    )
