"""One `kvprof recommend` run: results read and checked, every candidate evaluated at the target's load and budget,
the choice (`select`), its confirmation on held-out trajectories, the decision at other loads and budgets, and the
typed result (`kvprof.results.recommend.RecommendResult`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.recommend import records
from kvprof.recommend.candidates import Quality, ResultGroup, quality, read_groups, split_trajectories
from kvprof.recommend.select import Candidate, Choice, choose, misses
from kvprof.recommend.serving import ServingModel, StepModel
from kvprof.recommend.target import MEMORY_BOUND, QUALITY_BOUNDS, Target, bound_text
from kvprof.report.styles import DENSE
from kvprof.report.uncertainty import Interval
from kvprof.results.recommend import RecommendResult, SensitivityRow
from kvprof.serving.traffic import Load

SENSITIVITY_LOADS = (0.5, 2.0, 4.0)  # × the target's load
SENSITIVITY_BUDGETS = (0.25, 0.5, 2.0)  # × the target's KV budget; without one, × the choice's peak (below 1 only)
LOWER_LOADS = (0.5, 0.25, 0.125)  # × the load, tried for the closest candidate when nothing meets the target
MIN_BLOCKS = 16  # a KV budget must hold at least this many tokens (`kvprof.simulate.sweep.Settings.engine`)
CHOOSE, HOLD_OUT = 0, 1  # the parts of a split


@dataclasses.dataclass
class RecommendRequest:
    """What to recommend from: RESULT arguments (`NAME=PATH` or `PATH`), the target, where step times come from,
    seconds of arrivals per simulation, device memory (GiB, without a KV budget), the share of trajectories to choose
    on (None: all, no held-out check), seed (arrivals and split)."""

    results: list[str]
    target: Target
    step_model: StepModel
    duration: float
    memory_gib: float = 80.0
    split: float | None = None
    seed: int = 0


def prepare(request: RecommendRequest) -> Recommendation:
    """Check `request` and read its inputs; refused in one sentence before anything is simulated."""
    request.step_model.check()
    groups = read_groups(request.results)
    if "accuracy-drop" in request.target.bounds:
        for group in groups:
            online = group.replay.online
            if not online or not all("exact" in entry for entry in online.values()):
                raise KvprofError(
                    f"the target bounds the accuracy drop, but {group.path} holds no per-task online accuracy; rerun "
                    "`kvprof replay --online` with this kvprof, or drop the accuracy-drop clause."
                )
    parts = split_trajectories(groups, request.split, request.seed) if request.split is not None else None
    models = {
        group.path: ServingModel.of(group.path, request.step_model, request.memory_gib, request.duration, request.seed)
        for group in groups
    }
    budget = request.target.kv_memory
    for group in groups:
        smallest = MIN_BLOCKS * models[group.path].simulation.work.kv_bytes_per_token
        if budget is not None and budget < smallest:
            raise KvprofError(
                f"--target kv-memory<={bound_text(MEMORY_BOUND, budget)} holds fewer than {MIN_BLOCKS} tokens of "
                f"{group.path}'s KV cache ({bound_text(MEMORY_BOUND, smallest)}); pass a larger budget."
            )
    return Recommendation(request, groups, models, parts)


@dataclasses.dataclass
class Recommendation:
    """A checked request with its results read and their serving models prepared."""

    request: RecommendRequest
    groups: list[ResultGroup]
    models: dict[Path, ServingModel]
    parts: dict[Path, tuple[set, set]] | None
    qualities: dict[tuple[Path, int | None], dict[str, Quality]] = dataclasses.field(default_factory=dict)

    def _tasks(self, group: ResultGroup, part: int | None) -> set[str] | None:
        return None if self.parts is None or part is None else self.parts[group.path][part]

    def quality(self, group: ResultGroup, part: int | None) -> dict[str, Quality]:
        """Every candidate's fidelity on a part of `group`'s trajectories (computed once)."""
        key = (group.path, part)
        if key not in self.qualities:
            self.qualities[key] = quality(group, self._tasks(group, part))
        return self.qualities[key]

    def candidates(self, load: Load, budget: float | None, part: int | None) -> list[Candidate]:
        """Every candidate of every result at `load` with `budget` bytes of KV memory, on a part of the trajectories
        (None: all)."""
        found = []
        for group in self.groups:
            fidelity = self.quality(group, part)
            serving = self.models[group.path].serve(group.labels, load, budget, self._tasks(group, part))
            found += [Candidate(group.candidate(x), group.name, x, fidelity[x], serving[x]) for x in group.labels]
        return found

    def run(self, on_step: Callable[[str], None] | None = None) -> RecommendResult:
        """The recommendation (module docstring); `on_step` is told each simulation round as it starts."""
        step = on_step or (lambda _: None)
        request, target = self.request, self.request.target
        assert target.load is not None
        step(f"every candidate at {target.load.label}")
        candidates = self.candidates(target.load, target.kv_memory, None if self.parts is None else CHOOSE)
        choice = choose(candidates, target)
        suggestions = self._suggestions(choice, target) if choice.chosen is None else []
        heldout = None
        if self.parts is not None and choice.chosen is not None and request.split is not None:
            step("the choice on held-out trajectories")
            confirmation = self._confirm(choice.chosen, target)
            heldout = records.heldout_record(confirmation, request.split, request.seed)
        sensitivity = [records.sensitivity_row(target, choice), *self._sensitivity(choice, step)]
        return records.result_record(
            self.groups,
            target,
            candidates,
            choice,
            records.decision_record(choice, suggestions),
            step_model=request.step_model.description,
            step_model_errors=[
                {"result": str(group.path)} | row for group in self.groups for row in self.models[group.path].errors
            ],
            settings={
                "memory_gib": request.memory_gib,
                "duration_s": request.duration,
                "split": request.split,
                "seed": request.seed,
            },
            heldout=heldout,
            sensitivity=sensitivity,
        )

    def group_of(self, candidate: Candidate) -> ResultGroup:
        """The result a candidate comes from (its labels are unique across unnamed results of one trace)."""
        return next(g for g in self.groups if g.name == candidate.group and candidate.label in g.labels)

    def _suggestions(self, choice: Choice, target: Target) -> list[str]:
        """What would make the closest candidate meet the target: looser bounds (or more KV memory), and a lower
        load when no accuracy or KL bound is missed."""
        closest = choice.closest
        assert closest is not None and target.load is not None
        missed = choice.rejected[closest.name]
        looser = [f"{m.bound}<={bound_text(m.bound, _round_up(m.value))}" for m in missed if m.value is not None]
        if len(looser) == len(missed):
            lines = [f"{closest.name} meets the target with {', '.join(looser)}."]
        else:
            lines = [f"{closest.name} needs more KV memory first (a larger kv-memory budget, or --memory)."]
        if any(m.bound in QUALITY_BOUNDS for m in missed):
            return lines
        group = self.group_of(closest)
        tasks = self._tasks(group, None if self.parts is None else CHOOSE)
        for factor in LOWER_LOADS:
            lower = records.scaled(target.load, factor)
            if lower == target.load:
                continue
            serving = self.models[group.path].serve([closest.label], lower, target.kv_memory, tasks)
            if not misses(dataclasses.replace(closest, serving=serving[closest.label]), target.with_load(lower)):
                return [*lines, f"{closest.name} meets the target at {lower.label} ({factor:g}× the load)."]
        lowest = records.scaled(target.load, LOWER_LOADS[-1])
        return [*lines, f"{closest.name} misses the target at {lowest.label} too ({LOWER_LOADS[-1]:g}× the load)."]

    def _confirm(self, chosen: Candidate, target: Target) -> records.Confirmation:
        """The choice on the trajectories it was chosen on and on the held-out ones, against its result's NonShared
        at the same load and budget."""
        assert target.load is not None
        group = self.group_of(chosen)
        labels = list(dict.fromkeys([DENSE, chosen.label]))
        model = self.models[group.path]
        before = model.serve(labels, target.load, target.kv_memory, self._tasks(group, CHOOSE))
        after = model.serve(labels, target.load, target.kv_memory, self._tasks(group, HOLD_OUT))
        held = Candidate(
            chosen.name, chosen.group, chosen.label, self.quality(group, HOLD_OUT)[chosen.label], after[chosen.label]
        )
        point = dataclasses.replace(held, quality=_point_values(held.quality))
        return records.Confirmation(
            chosen=(chosen, before[DENSE]),
            held_out=(held, after[DENSE]),
            misses=misses(held, target),
            point_misses=misses(point, target),
        )

    def _sensitivity(self, choice: Choice, step: Callable[[str], None]) -> list[SensitivityRow]:
        """The decision at `SENSITIVITY_LOADS` × the load and at a few KV budgets around the target's."""
        target = self.request.target
        assert target.load is not None
        part = None if self.parts is None else CHOOSE
        loads = dict.fromkeys(records.scaled(target.load, factor) for factor in SENSITIVITY_LOADS)
        targets = [target.with_load(load) for load in loads if load != target.load]
        targets += [target.with_kv_memory(budget) for budget in self._budgets(choice)]
        rows = []
        for other in targets:
            assert other.load is not None
            budget = other.kv_memory
            step(
                f"every candidate at {other.load.label}"
                + (f", {bound_text(MEMORY_BOUND, budget)} of KV memory" if budget else "")
            )
            rows.append(records.sensitivity_row(other, choose(self.candidates(other.load, budget, part), other)))
        return rows

    def _budgets(self, choice: Choice) -> list[float]:
        """KV budgets to try: `SENSITIVITY_BUDGETS` × the target's, else × the peak KV memory of the choice (or the
        closest candidate) for factors below 1; those too small for any result left out."""
        budget = self.request.target.kv_memory
        factors: tuple[float, ...] = SENSITIVITY_BUDGETS
        if budget is None:
            reference = choice.chosen or choice.closest
            budget = reference.serving.peak_kv_bytes if reference else None
            factors = tuple(f for f in factors if f < 1)
        if not budget:
            return []
        smallest = max(MIN_BLOCKS * m.simulation.work.kv_bytes_per_token for m in self.models.values())
        return [budget * f for f in factors if budget * f >= smallest]


def _point_values(fidelity: Quality) -> Quality:
    """`fidelity` with every interval collapsed to its value: the bounds tested on point values alone."""

    def point(interval: Interval | None) -> Interval | None:
        return None if interval is None else Interval(interval.value, interval.value, interval.value, interval.n)

    kl = point(fidelity.kl)
    assert kl is not None
    return dataclasses.replace(fidelity, accuracy_drop=point(fidelity.accuracy_drop), kl=kl)


def _round_up(value: float) -> float:
    """`value` rounded up to three significant digits (a looser bound that the value meets)."""
    if value <= 0:
        return value
    scale = 10 ** (math.floor(math.log10(value)) - 2)
    return math.ceil(value / scale - 1e-9) * scale
