"""`kvprof recommend`'s result (recommend.json): the target, every candidate's numbers and misses, the decision, its
held-out confirmation and its sensitivity to the load and the KV-memory budget. Seconds, bytes, fractions (an
accuracy drop of 0.01 is one point), nats per output token.
"""

from __future__ import annotations

import dataclasses

from kvprof.results.base import NUMBER, OPTIONAL, Record, ResultFile, json_field, record_reader, records_in_list

FIX = "pass the recommend.json a `kvprof recommend` run wrote, unchanged (or rerun `kvprof recommend`)"
MAYBE_NUMBER = (*NUMBER, OPTIONAL)


@dataclasses.dataclass(kw_only=True)
class Spread(Record):
    """A statistic over `n` tasks with its bootstrap interval [low, high] (`kvprof.report.uncertainty`)."""

    value: float = json_field(NUMBER)
    low: float = json_field(NUMBER)
    high: float = json_field(NUMBER)
    n: int = json_field(int)


@dataclasses.dataclass(kw_only=True)
class Load(Record):
    """Trajectories per second (`qps`) or in flight (`concurrency`)."""

    kind: str = json_field(str)
    value: float = json_field(NUMBER)


@dataclasses.dataclass(kw_only=True)
class ServingNumbers(Record):
    """A candidate simulated at the load: TTFT and TPOT percentiles, trajectories finished per second, peak KV bytes
    (None: not measured), and why it ran out of memory (None: it did not)."""

    ttft_p50: float | None = json_field(MAYBE_NUMBER)
    ttft_p90: float | None = json_field(MAYBE_NUMBER)
    tpot_p50: float | None = json_field(MAYBE_NUMBER)
    tpot_p90: float | None = json_field(MAYBE_NUMBER)
    throughput: float | None = json_field(MAYBE_NUMBER)
    peak_kv_bytes: float | None = json_field(MAYBE_NUMBER)
    out_of_memory: str | None = json_field((str, OPTIONAL))


@dataclasses.dataclass(kw_only=True)
class MissRecord(Record):
    """A bound a candidate misses: its value and the limit (None: not measured, no budget), and a sentence."""

    bound: str = json_field(str)
    value: float | None = json_field(MAYBE_NUMBER)
    limit: float | None = json_field(MAYBE_NUMBER)
    text: str = json_field(str)


@dataclasses.dataclass(kw_only=True)
class CandidateRecord(Record):
    """A replayed policy setting of result `result`: fidelity over `tasks` tasks (accuracy None without --online,
    its drop None without per-task results), replayed TTFT speed-up, serving at the load, the bounds it misses."""

    name: str = json_field(str)
    result: str = json_field(str)
    label: str = json_field(str)
    tasks: int = json_field(int)
    accuracy: Spread | None = json_field((dict, OPTIONAL), read=record_reader(Spread))
    accuracy_drop: Spread | None = json_field((dict, OPTIONAL), read=record_reader(Spread))
    kl: Spread = json_field(dict, read=record_reader(Spread))
    ttft_speedup: Spread = json_field(dict, read=record_reader(Spread))
    serving: ServingNumbers = json_field(dict, read=record_reader(ServingNumbers))
    misses: list[MissRecord] = json_field(list, read=records_in_list(MissRecord))


@dataclasses.dataclass(kw_only=True)
class Decision(Record):
    """The choice and the runner-up (None: none), how a tie was decided, and, when nothing meets the target, the
    closest candidate and what would make it meet the target."""

    chosen: str | None = json_field((str, OPTIONAL))
    runner_up: str | None = json_field((str, OPTIONAL))
    tie: str | None = json_field((str, OPTIONAL))
    closest: str | None = json_field((str, OPTIONAL))
    suggestions: list[str] = json_field(list)


@dataclasses.dataclass(kw_only=True)
class ConfirmationPart(Record):
    """The chosen candidate on one part of the trajectories: accuracy drop, KL, simulated TTFT p90 and NonShared's
    (same result, same load) and their ratio."""

    part: str = json_field(str)
    tasks: int = json_field(int)
    accuracy_drop: Spread | None = json_field((dict, OPTIONAL), read=record_reader(Spread))
    kl: Spread = json_field(dict, read=record_reader(Spread))
    ttft_p90: float | None = json_field(MAYBE_NUMBER)
    nonshared_ttft_p90: float | None = json_field(MAYBE_NUMBER)
    speedup: float | None = json_field(MAYBE_NUMBER)


@dataclasses.dataclass(kw_only=True)
class HeldOut(Record):
    """The choice confirmed on held-out trajectories: the split, both parts, a verdict (holds, holds on point values,
    does not hold) and the bounds missed on the held-out part."""

    fraction: float = json_field(NUMBER)
    seed: int = json_field(int)
    parts: list[ConfirmationPart] = json_field(list, read=records_in_list(ConfirmationPart))
    verdict: str = json_field(str)
    misses: list[str] = json_field(list)


@dataclasses.dataclass(kw_only=True)
class SensitivityRow(Record):
    """The decision at another load or KV budget (None: the device's memory): the choice (None: none, then the
    closest) and its objective."""

    load: Load = json_field(dict, read=record_reader(Load))
    kv_budget: float | None = json_field(MAYBE_NUMBER)
    chosen: str | None = json_field((str, OPTIONAL))
    objective: float | None = json_field(MAYBE_NUMBER)
    closest: str | None = json_field((str, OPTIONAL))


@dataclasses.dataclass(kw_only=True)
class RecommendResult(ResultFile):
    """A recommendation: result files (name, path, trace, trajectories), the target (its clauses, load, objective),
    the step model and its errors on its calibration's runs (result, run, ttft_error, throughput_error, as
    simulate.json's `calibration_errors`), the simulation's settings, candidates, decision, held-out check (None
    without --split) and sensitivity rows."""

    KIND = "recommend"
    FIX = FIX

    results: list[dict] = json_field(list)
    target: list[str] = json_field(list)
    load: Load = json_field(dict, read=record_reader(Load))
    kv_budget: float | None = json_field(MAYBE_NUMBER)
    optimise: str = json_field(str)
    step_model: str = json_field(str)
    step_model_errors: list[dict] = json_field(list)
    settings: dict = json_field(dict)
    candidates: list[CandidateRecord] = json_field(list, read=records_in_list(CandidateRecord))
    decision: Decision = json_field(dict, read=record_reader(Decision))
    heldout: HeldOut | None = json_field((dict, OPTIONAL), read=record_reader(HeldOut))
    sensitivity: list[SensitivityRow] = json_field(list, read=records_in_list(SensitivityRow))
