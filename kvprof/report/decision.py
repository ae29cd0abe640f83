"""The decision view of a replay result: per policy label accuracy, KL, TTFT ×, TPOT, latency × and memory ÷ dense
with spreads over tasks, a recommendation for a stated target, Pareto scatter, bars and per-turn TTFT boxes. The
NonShared row: the `nonshared` re-run of the dense run if replayed (its speed-ups are timing noise), else the dense
run at 1× (docs/commands/report.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvprof.report.figures import Reference, add_references, base_layout, box_figure
from kvprof.report.styles import DENSE, policy_style
from kvprof.report.uncertainty import Interval, bootstrap, proportion, ratio_of_sums
from kvprof.results.replay import ReplayResult, TurnRecord, measured, summary_of

TOLERANCE = 0.01  # the target: within one accuracy point of NonShared
KL_TIE = 0.10  # KLs within 10 % of the lowest count as tied
DENSE_ONLINE = "dense"  # the dense run's key in a replay's online results


@dataclass(frozen=True)
class Outcome:
    """One policy label's numbers against the dense run; intervals over `ttft.n` tasks."""

    label: str
    accuracy: Interval | None  # online exact match; None when the replay ran without --online
    kl: float  # KL(dense ‖ policy), nats per output token, teacher-forced
    ttft: Interval  # dense ÷ policy summed TTFT
    tpot_ms: Interval | None  # decode time per output token
    latency: Interval  # dense ÷ policy summed latency
    memory: Interval  # peak stored bytes ÷ dense; low/high: the range of per-task ratios (analytic, no noise)


def _by_task(turns: list[TurnRecord]) -> dict[str, list[TurnRecord]]:
    tasks: dict[str, list[TurnRecord]] = {}
    for turn in turns:
        tasks.setdefault(turn.trajectory, []).append(turn)
    return tasks


def kl_over_tasks(turns: list[TurnRecord]) -> Interval:
    """KL(dense ‖ policy) per output token of `turns` (Σ KL ÷ Σ output tokens: the replay summary's KL), with its
    interval over tasks."""
    tasks = _by_task(turns).values()
    sums = [[sum(measured(t.kl_sum) for t in x), sum(t.output_tokens for t in x)] for x in tasks]
    return ratio_of_sums(np.array(sums))


def _outcome(
    label: str,
    turns: list[TurnRecord],
    dense: list[TurnRecord],
    memory: float | None,
    kl: float,
    accuracy: Interval | None,
) -> Outcome:
    """Outcome of a run's `turns` against the dense run's; `memory`: peak stored bytes ÷ dense."""
    mine, reference = _by_task(turns), _by_task(dense)
    tasks = [task for task in reference if task in mine]
    ratio = float("nan") if memory is None else memory  # None: a dense run that stores nothing has no ratio

    def paired(seconds: Callable[[TurnRecord], float | None]) -> np.ndarray:
        return np.array(
            [
                [sum(measured(seconds(t)) for t in reference[x]), sum(measured(seconds(t)) for t in mine[x])]
                for x in tasks
            ]
        )

    decode = np.array(  # results written before kvprof measured TPOT have no decode times: no TPOT then
        [[sum(t.decode_s or 0.0 for t in mine[x]), sum(t.decode_steps or 0 for t in mine[x])] for x in tasks]
    )
    peaks = [
        max(measured(t.memory_bytes) for t in mine[x]) / max(max(measured(t.memory_bytes) for t in reference[x]), 1)
        for x in tasks
    ]
    tpot = bootstrap(decode, lambda sums: 1e3 * sums[..., 0] / sums[..., 1]) if decode[:, 1].sum() > 0 else None
    return Outcome(
        label=label,
        accuracy=accuracy,
        kl=kl,
        ttft=ratio_of_sums(paired(lambda t: t.ttft_s)),
        tpot_ms=tpot,
        latency=ratio_of_sums(paired(lambda t: t.latency_s)),
        memory=Interval(ratio, min(peaks, default=ratio), max(peaks, default=ratio), len(tasks)),
    )


def outcomes(result: ReplayResult) -> list[Outcome]:
    """NonShared first, then every policy of the replay result in its order."""
    online = result.online or {}

    def accuracy(label: str) -> Interval | None:
        entry = online.get(label)
        return proportion(entry["correct"], entry["tasks"]) if entry and entry["tasks"] else None

    dense = result.dense.turns
    policies = {label: (run.turns, summary_of(label, run)) for label, run in result.policies.items()}
    if DENSE in policies:
        turns, summary = policies[DENSE]
        first = _outcome(DENSE, turns, dense, summary.memory_ratio, 0.0, accuracy(DENSE))
    else:
        first = _outcome(DENSE, dense, dense, 1.0, 0.0, accuracy(DENSE_ONLINE))
    rest = [
        _outcome(label, turns, dense, summary.memory_ratio, summary.kl, accuracy(label))
        for label, (turns, summary) in policies.items()
        if label != DENSE
    ]
    return [first, *rest]


def _pct(interval: Interval) -> str:
    return f"{interval.value:.0%}"


def target_text(tasks: int | None) -> str:
    if tasks is None:
        return "Target: the fastest TTFT (this replay ran without --online, so there is no accuracy to hold)."
    return (
        f"Target: the fastest TTFT among policies within {TOLERANCE * 100:.0f} accuracy point of NonShared "
        f"(online exact match over n = {tasks} tasks)."
    )


def eligible(items: Sequence[Outcome]) -> list[Outcome]:
    """The outcomes that meet the target's accuracy condition (all of them when accuracy was not measured)."""
    reference = items[0].accuracy
    if reference is None:
        return list(items)
    return [o for o in items if o.accuracy is not None and o.accuracy.value >= reference.value - TOLERANCE - 1e-12]


@dataclass(frozen=True)
class Decision:
    """The fastest outcome meeting the target, the recommended one (differs only after a tie-break), and why."""

    fastest: Outcome
    recommended: Outcome
    lines: list[str]


def decide(items: Sequence[Outcome]) -> Decision:
    """The target, the fastest policy meeting it, and on ties (overlapping TTFT × intervals) accuracy, then KL
    (within `KL_TIE`), then memory."""
    tasks = items[0].accuracy.n if items[0].accuracy else None
    lines = [target_text(tasks)]
    candidates = eligible(items)
    fastest = max(candidates, key=lambda o: o.ttft.value)
    accuracy = f", accuracy {_pct(fastest.accuracy)}" if fastest.accuracy else ""
    lines.append(
        f"Fastest: {fastest.label} — TTFT {fastest.ttft.text(unit='×')} (n = {fastest.ttft.n} tasks){accuracy}, "
        f"KL {fastest.kl:.2g}, latency {fastest.latency.value:.2f}×, memory {fastest.memory.value:.2f}× dense."
    )
    tied = [o for o in candidates if o.ttft.overlaps(fastest.ttft)]
    if len(tied) == 1:
        lines.append(_recommended(fastest) + " No other policy meeting the target is as fast within its interval.")
        return Decision(fastest, fastest, lines)
    names = ", ".join(o.label for o in tied if o is not fastest)
    steps = [f"its TTFT × interval overlaps {names}'s"]
    if fastest.accuracy:
        best = max(o.accuracy.value for o in tied if o.accuracy)
        tied = [o for o in tied if o.accuracy and o.accuracy.value >= best - 1e-12]
        steps.append(f"{'accuracy ties' if len(tied) > 1 else 'accuracy decides'} ({best:.0%})")
    if len(tied) > 1:
        listed = ", ".join(f"{o.label} {o.kl:.3g}" for o in sorted(tied, key=lambda o: o.kl))
        lowest = min(o.kl for o in tied)
        tied = [o for o in tied if o.kl <= lowest * (1 + KL_TIE) + 1e-15]
        steps.append(
            f"so KL breaks it ({listed}): lowest {', '.join(o.label for o in tied)}"
            + (f" (within {KL_TIE:.0%} of each other)" if len(tied) > 1 else "")
        )
    if len(tied) > 1:
        tied = [min(tied, key=lambda o: o.memory.value)]
        steps.append(f"then lowest memory: {tied[0].label} {tied[0].memory.value:.2f}× dense")
    reason = "; ".join(steps)
    lines.append(f"{reason[0].upper()}{reason[1:]}.")
    lines.append(_recommended(tied[0]))
    return Decision(fastest, tied[0], lines)


def _recommended(choice: Outcome) -> str:
    return (
        f"Recommended: {choice.label} — TTFT {choice.ttft.text(unit='×')}, latency {choice.latency.value:.2f}×, "
        f"memory {choice.memory.value:.2f}× dense, KL {choice.kl:.3g}"
        + (f", accuracy {_pct(choice.accuracy)}." if choice.accuracy else ".")
    )


def _error(interval: Interval, scale: float = 1.0) -> dict:
    return dict(
        type="data",
        symmetric=False,
        array=[(interval.high - interval.value) * scale],
        arrayminus=[(interval.value - interval.low) * scale],
        thickness=1.2,
        width=3,
    )


def _size(memory: float) -> float:
    """Marker diameter for a memory ratio: area ∝ memory ÷ dense (1× = 22 px)."""
    return 22.0 * max(memory, 0.02) ** 0.5


def _point_to(figure: go.Figure, o: Outcome, text: str, y: float, offset: tuple[int, int], col: int) -> None:
    """An arrow from `text`, `offset` (x, y) px away, to outcome `o` drawn at `y` in subplot `col` (log x)."""
    figure.add_annotation(
        x=float(np.log10(o.ttft.value)),
        y=y,
        text=text,
        showarrow=True,
        arrowhead=2,
        arrowwidth=1,
        arrowcolor="#444",
        ax=offset[0],
        ay=offset[1],
        font=dict(size=11, color="#222"),
        bgcolor="rgba(255,255,255,0.85)",
        row=1,
        col=col,
    )


def pareto_figure(items: Sequence[Outcome], chosen: Decision | None = None) -> go.Figure:
    """Accuracy (if measured) and log KL against TTFT ×, marker area ∝ memory ÷ dense, bootstrap error bars; with
    `chosen`, arrows to the fastest and the recommended policy."""
    dense_accuracy = items[0].accuracy
    has_accuracy = dense_accuracy is not None
    titles = ([f"online accuracy (n = {dense_accuracy.n} tasks)"] if dense_accuracy is not None else []) + [
        "KL(dense ‖ policy), teacher-forced"
    ]
    figure = make_subplots(rows=1, cols=len(titles), subplot_titles=titles, horizontal_spacing=0.1)
    positive = [o.kl for o in items if o.kl > 0]
    floor = min(positive, default=1e-6) / 10  # where KL = 0 is drawn on the log axis
    for o in items:
        _add_outcome(figure, o, floor, kl_col=len(titles), legend_on_kl=not has_accuracy)
    _speed_up_axes(figure, items, len(titles))
    if dense_accuracy is not None:
        _accuracy_band(figure, dense_accuracy.value)
    decades = [np.log10(floor) - 0.3, np.log10(max(positive, default=floor * 10)) + 0.3]  # explicit: see _speed_up_axes
    figure.update_yaxes(
        type="log", range=decades, exponentformat="power", title_text="nats / output token", row=1, col=len(titles)
    )
    if floor < min(positive, default=floor * 10):
        exact = Reference(floor, "KL = 0 (exact) drawn on this line")
        add_references(figure, [exact], log_x=True, log_y=True, row=1, col=len(titles))
    if chosen is not None:
        _name_choices(figure, chosen, has_accuracy, floor)
    measured = "Accuracy and KL" if has_accuracy else "KL"
    base_layout(figure, f"{measured} against measured TTFT speed-up — marker area ∝ memory ÷ dense", height=470)
    figure.update_layout(legend=dict(y=-0.2), margin=dict(l=60, r=20, t=90, b=50))
    return figure


def _add_outcome(figure: go.Figure, o: Outcome, floor: float, kl_col: int, legend_on_kl: bool) -> None:
    """One policy's markers: accuracy (column 1, if measured) and KL (column `kl_col`, 0 drawn at `floor`)."""
    marker = policy_style(o.label).marker(_size(o.memory.value)) | {"opacity": 0.85}
    hover = f"{o.label}<br>TTFT {o.ttft.text(unit='×')}<br>KL {o.kl:.3g}<br>memory {o.memory.value:.2f}× dense" + (
        f"<br>accuracy {o.accuracy.text('.0%')}" if o.accuracy else ""
    )
    common = dict(
        x=[o.ttft.value],
        error_x=_error(o.ttft),
        mode="markers",
        marker=marker,
        name=o.label,
        legendgroup=o.label,
        hovertext=[hover],
        hoverinfo="text",
    )
    if o.accuracy:
        figure.add_trace(
            go.Scatter(y=[100 * o.accuracy.value], error_y=_error(o.accuracy, 100), **common), row=1, col=1
        )
    kl = go.Scatter(y=[o.kl if o.kl > 0 else floor], showlegend=legend_on_kl, **common)
    figure.add_trace(kl, row=1, col=kl_col)


def _speed_up_axes(figure: go.Figure, items: Sequence[Outcome], columns: int) -> None:
    """Every column's x axis: TTFT speed-up on a log axis with the dense run's line at 1."""
    low = min(o.ttft.low for o in items)
    high = max(o.ttft.high for o in items)
    # Log axes get explicit ranges (in decades): plotly's autorange reads a reference line's value on a log axis
    # as a power of ten and would stretch the axis to it.
    span = [np.log10(min(low, 1.0) / 1.15), np.log10(max(high, 1.0) * 1.15)]
    title = f"TTFT speed-up × (dense ÷ policy, n = {items[0].ttft.n} tasks)"
    for col in range(1, columns + 1):
        add_references(figure, [Reference(1.0, "dense", axis="x")], log_x=True, row=1, col=col)
        figure.update_xaxes(type="log", range=span, title_text=title, row=1, col=col)


def _accuracy_band(figure: go.Figure, dense_accuracy: float) -> None:
    """The accuracy column's axis and the band within the tolerance of the dense run's accuracy."""
    bar = 100 * (dense_accuracy - TOLERANCE)
    figure.add_hrect(y0=bar, y1=104, fillcolor="#009E73", opacity=0.12, line_width=0, row=1, col=1)
    figure.add_annotation(
        text="shaded: within 1 point of NonShared",
        xref="x domain",
        yref="y",
        x=0.02,
        y=bar - 2,
        yanchor="top",
        xanchor="left",
        showarrow=False,
        font=dict(size=10, color="#555"),
        row=1,
        col=1,
    )
    figure.update_yaxes(title_text="exact-match accuracy %", range=[-5, 105], row=1, col=1)


def _name_choices(figure: go.Figure, chosen: Decision, has_accuracy: bool, floor: float) -> None:
    """Arrows to the fastest policy meeting the target and, when another, the recommended one."""

    def y_of(o: Outcome) -> float:
        if has_accuracy and o.accuracy is not None:
            return 100 * o.accuracy.value
        return float(np.log10(o.kl if o.kl > 0 else floor))  # a log axis takes annotation positions in decades

    fastest, recommended = chosen.fastest, chosen.recommended
    same = fastest is recommended
    within = f" within {TOLERANCE * 100:.0f} point" if has_accuracy else ""
    first = f"fastest{within}{' and recommended' if same else ''}: {fastest.label} {fastest.ttft.value:.2f}×"
    _point_to(figure, fastest, first, y_of(fastest), (0, 45), 1)
    if not same:
        second = f"recommended: {recommended.label} {recommended.ttft.value:.2f}×"
        _point_to(figure, recommended, second, y_of(recommended), (-80, 95), 1)


def bars_figure(items: Sequence[Outcome]) -> go.Figure:
    """Per policy, fastest on top: accuracy, TTFT ×, TPOT, latency ×, memory ÷ dense with spreads; target misses
    hatched."""
    order = sorted(items, key=lambda o: o.ttft.value)
    ok = {o.label for o in eligible(items)}
    n = items[0].ttft.n
    panels: list[tuple[str, object]] = []
    if items[0].accuracy:
        panels.append((f"accuracy % (n = {items[0].accuracy.n})", lambda o: (o.accuracy, 100.0)))
    panels += [
        (f"TTFT × ↑ (n = {n})", lambda o: (o.ttft, 1.0)),
        ("TPOT ms ↓", lambda o: (o.tpot_ms, 1.0)),
        ("latency × ↑", lambda o: (o.latency, 1.0)),
        ("memory ÷ dense ↓ (range)", lambda o: (o.memory, 1.0)),
    ]
    figure = make_subplots(
        rows=1, cols=len(panels), shared_yaxes=True, subplot_titles=[t for t, _ in panels], horizontal_spacing=0.02
    )
    for col, (_, pick) in enumerate(panels, start=1):
        for o in order:
            interval, scale = pick(o)  # type: ignore[operator]
            if interval is None:
                continue
            look = policy_style(o.label)
            figure.add_trace(
                go.Bar(
                    x=[interval.value * scale],
                    y=[o.label],
                    orientation="h",
                    error_x=_error(interval, scale),
                    marker=dict(
                        color=look.color,
                        opacity=0.85 if o.label in ok else 0.45,
                        pattern=dict(shape="" if o.label in ok else "/", fgcolor="#fff"),
                    ),
                    name=o.label,
                    legendgroup=o.label,
                    showlegend=False,
                    hovertemplate=f"{o.label}: %{{x:.3g}}<extra></extra>",
                    text=[f"{interval.value * scale:.{0 if scale == 100.0 else 2}f}"],
                    textposition="inside",
                    insidetextanchor="start",
                    textfont=dict(color="#fff", size=10),
                ),
                row=1,
                col=col,
            )
    reference = items[0]
    lines = {f"TTFT × ↑ (n = {n})": 1.0, "latency × ↑": 1.0, "memory ÷ dense ↓ (range)": 1.0}
    if reference.tpot_ms:
        lines["TPOT ms ↓"] = reference.tpot_ms.value
    if reference.accuracy:
        lines[panels[0][0]] = 100 * (reference.accuracy.value - TOLERANCE)
    for col, (title, _) in enumerate(panels, start=1):
        if title in lines:
            add_references(figure, [Reference(lines[title], "", axis="x")], row=1, col=col)
    height = 140 + 34 * len(order)
    title = "Cost and gain per policy, fastest TTFT on top"
    base_layout(figure, title + (" (hatched: misses the accuracy target)" if items[0].accuracy else ""), height)
    figure.update_layout(bargap=0.3, margin=dict(l=150, r=20, t=70, b=40), uniformtext=dict(minsize=9, mode="hide"))
    return figure


def ttft_box_figure(result: ReplayResult) -> go.Figure:
    """Per-turn TTFT (median of repeats) of the dense run (as nonshared) and every policy, by acting agent."""
    runs = {DENSE: result.dense.turns} | {label: run.turns for label, run in result.policies.items() if label != DENSE}
    groups = {
        label: ([t.agent for t in turns], [1e3 * measured(t.ttft_s) for t in turns]) for label, turns in runs.items()
    }
    turns = len(result.dense.turns)
    return box_figure(
        groups,
        f"TTFT per turn by acting agent ({turns} turns per policy; median of {result.repeats or 1} repeats each)",
        "TTFT ms (log)",
        log_y=True,
        style=policy_style,
        x_title="acting agent",
    )
