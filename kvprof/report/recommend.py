"""The decision of a `kvprof recommend` result: the card (target, choice, runner-up, held-out verdict, where the
choice changes), every candidate with the bounds it misses, the sensitivity table and the held-out confirmation."""

from __future__ import annotations

from kvprof.report.html import Section
from kvprof.report.tables import TableData
from kvprof.results.recommend import CandidateRecord, RecommendResult, SensitivityRow, Spread
from kvprof.ui import describe_bytes

STEP_MODEL_TOLERANCE = 0.2  # simulate's validation holds it within 20 % (docs/commands/simulate.md)
OBJECTIVES = {"throughput": "trajectories/s", "ttft": "TTFT p90", "memory": "peak KV memory"}


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3g} s" if value >= 1 else f"{1e3 * value:.3g} ms"


def _bytes(value: float | None) -> str:
    return "–" if value is None else describe_bytes(value)


def _points(spread: Spread | None) -> str:
    """An accuracy drop in points with its interval."""
    if spread is None:
        return "–"
    return f"{100 * spread.value:.3g} pt [{100 * spread.low:.3g}, {100 * spread.high:.3g}]"


def _kl(spread: Spread) -> str:
    return f"{spread.value:.3g} [{spread.low:.3g}, {spread.high:.3g}]"


def _load(row: SensitivityRow | RecommendResult) -> str:
    load = row.load
    return f"{load.value:g} qps" if load.kind == "qps" else f"{load.value:g} in flight"


def objective_text(optimise: str, value: float | None) -> str:
    """The objective's value with its unit."""
    if value is None:
        return "–"
    if optimise == "throughput":
        return f"{value:.3g} traj/s"
    return _seconds(value) if optimise == "ttft" else _bytes(value)


def numbers(candidate: CandidateRecord) -> str:
    """A candidate's numbers in one line: serving at the load, then fidelity over tasks."""
    serving = candidate.serving
    accuracy = "" if candidate.accuracy is None else f"accuracy {candidate.accuracy.value:.0%}, "
    return (
        f"{serving.throughput or 0:.3g} traj/s, TTFT p50 {_seconds(serving.ttft_p50)} / p90 "
        f"{_seconds(serving.ttft_p90)}, TPOT p90 {_seconds(serving.tpot_p90)}, "
        f"peak KV {_bytes(serving.peak_kv_bytes)}; "
        f"{accuracy}accuracy drop {_points(candidate.accuracy_drop)}, KL {_kl(candidate.kl)} "
        f"(n = {candidate.tasks} tasks)"
    )


def decision_lines(result: RecommendResult) -> list[str]:
    """The card: target, choice (or the closest miss and what would meet the target), runner-up, tie, held-out
    verdict, and where the choice changes."""
    by_name = {c.name: c for c in result.candidates}
    decision = result.decision
    lines = [
        f"Target: {', '.join(result.target)} — {len(result.candidates)} candidates from {len(result.results)} "
        f"result(s); serving simulated at {_load(result)} ({result.step_model})."
    ]
    if decision.chosen is not None:
        lines.append(f"Recommended: {decision.chosen} — {numbers(by_name[decision.chosen])}.")
        if decision.runner_up is not None:
            lines.append(f"Runner-up: {decision.runner_up} — {numbers(by_name[decision.runner_up])}.")
        if decision.tie:
            lines.append(decision.tie)
    else:
        closest = by_name[decision.closest] if decision.closest else None
        missed = "; ".join(m.text for m in closest.misses) if closest else ""
        lines.append(f"Nothing meets the target. Closest: {decision.closest}, which misses {missed}.")
        lines += decision.suggestions
    if result.heldout is not None:
        lines.append(heldout_line(result))
    lines.append(sensitivity_line(result))
    return lines + step_model_warnings(result)


def step_model_warnings(result: RecommendResult) -> list[str]:
    """A line per calibration run the step model misses by more than `STEP_MODEL_TOLERANCE` (median TTFT or
    throughput): the serving numbers are no surer than that."""
    lines = []
    for row in result.step_model_errors:
        errors = [abs(e) for e in (row.get("ttft_error"), row.get("throughput_error")) if e is not None]
        if errors and max(errors) > STEP_MODEL_TOLERANCE:
            lines.append(
                f"Warning: the step model misses {row['run']} of {row['result']} by "
                f"{_signed(row.get('ttft_error'))} (median TTFT) and {_signed(row.get('throughput_error'))} "
                "(throughput): the serving numbers are no surer; calibrate on a quiet machine or with "
                "kvprof serve-bench (--calibration)."
            )
    return lines


def _signed(error: float | None) -> str:
    return "–" if error is None else f"{100 * error:+.0f} %"


def heldout_line(result: RecommendResult) -> str:
    """The choice's numbers on the held-out trajectories and the verdict."""
    heldout = result.heldout
    assert heldout is not None
    chosen, held = heldout.parts
    speedup = f"{held.speedup:.2f}×" if held.speedup else "–"
    before = f"{chosen.speedup:.2f}×" if chosen.speedup else "–"
    misses = f" ({'; '.join(heldout.misses)})" if heldout.misses else ""
    return (
        f"Held out ({held.tasks} trajectories, chosen on {chosen.tasks}, seed {heldout.seed}): accuracy drop "
        f"{_points(held.accuracy_drop)}, KL {_kl(held.kl)}, TTFT p90 {speedup} NonShared's (chosen on: {before}) "
        f"— the choice {heldout.verdict}{misses}."
    )


def sensitivity_line(result: RecommendResult) -> str:
    """Where the choice changes among the sensitivity rows (the first row is the target itself)."""
    first, *others = result.sensitivity
    changes = [
        ("at " if row.kv_budget is None else f"with {_bytes(row.kv_budget)} of KV memory at ")
        + f"{_load(row)} (→ {row.chosen or 'none'})"
        for row in others
        if row.chosen != first.chosen
    ]
    if not changes and first.chosen is None:
        return f"Nothing meets the target at the other loads and KV budgets tried either ({len(others)})."
    if not changes:
        return f"The choice is the same at every other load and KV budget tried ({len(others)})."
    return f"The choice changes {'; '.join(changes)}."


def candidates_table(result: RecommendResult) -> TableData:
    """Every candidate: fidelity with intervals, serving at the load, and the bounds it misses."""
    decision = result.decision
    table = TableData(
        title=f"candidates at {_load(result)} ({OBJECTIVES[result.optimise]} optimised)",
        columns=[
            "candidate",
            "accuracy drop",
            "KL",
            "TTFT p50",
            "TTFT p90",
            "TPOT p90",
            "traj/s",
            "peak KV",
            "verdict",
        ],  # fmt: skip
        caption="accuracy drop and KL against NonShared with bootstrap intervals over tasks (a bound is met only by "
        "the interval's upper end); serving numbers simulated at the load.",
    )
    for c in result.candidates:
        verdict = {decision.chosen: "chosen", decision.runner_up: "runner-up"}.get(c.name) or (
            "; ".join(m.text for m in c.misses) or "meets the target"
        )
        serving = c.serving
        table.add_row(
            c.name,
            _points(c.accuracy_drop),
            _kl(c.kl),
            _seconds(serving.ttft_p50),
            _seconds(serving.ttft_p90),
            _seconds(serving.tpot_p90),
            "–" if serving.throughput is None else f"{serving.throughput:.3g}",
            _bytes(serving.peak_kv_bytes),
            verdict,
        )
    return table


def sensitivity_table(result: RecommendResult) -> TableData:
    """The decision at the target (first row) and at other loads and KV budgets."""
    table = TableData(
        title="the decision at other loads and KV budgets",
        columns=["load", "KV budget", "choice", OBJECTIVES[result.optimise], "vs the target's"],
    )
    first = result.sensitivity[0]
    for index, row in enumerate(result.sensitivity):
        choice = row.chosen or f"none (closest: {row.closest})"
        same = "the target" if index == 0 else ("same" if row.chosen == first.chosen else "changes")
        budget = "device" if row.kv_budget is None else _bytes(row.kv_budget)
        table.add_row(_load(row), budget, choice, objective_text(result.optimise, row.objective), same)
    return table


def heldout_table(result: RecommendResult) -> TableData | None:
    """The choice on the trajectories it was chosen on and on the held-out ones; None without --split."""
    if result.heldout is None:
        return None
    table = TableData(
        title=f"held-out confirmation of {result.decision.chosen}: {result.heldout.verdict}",
        columns=["part", "tasks", "accuracy drop", "KL", "TTFT p90", "NonShared's", "speed-up"],
    )
    for part in result.heldout.parts:
        table.add_row(
            part.part,
            part.tasks,
            _points(part.accuracy_drop),
            _kl(part.kl),
            _seconds(part.ttft_p90),
            _seconds(part.nonshared_ttft_p90),
            "–" if part.speedup is None else f"{part.speedup:.2f}×",
        )
    return table


def sections(result: RecommendResult) -> list[Section]:
    """The recommendation section, placed before every other (`order` "recommendation")."""
    tables = [candidates_table(result), sensitivity_table(result)]
    heldout = heldout_table(result)
    return [
        Section(
            title="Recommendation",
            card=decision_lines(result),
            tables=tables if heldout is None else [tables[0], heldout, tables[1]],
            order="recommendation",
        )
    ]
