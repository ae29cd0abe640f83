"""Small plotly figure builders every command shares: line charts, box plots and labelled heatmaps.

Series are keyed by name; `style` maps a name to its `PolicyStyle` (for policies: `kvprof.report.styles.policy_style`,
so a policy looks the same in every figure). A series drawn with a style carries its name as `legendgroup`, which is
how the report tests find every trace of one policy across figures. Legends sit under the plot, so they do not eat
its width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from kvprof.report.styles import DASHES, PolicyStyle

StyleOf = Callable[[str], PolicyStyle]
QUALITATIVE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#882255", "#999933")


@dataclass(frozen=True)
class Reference:
    """A reference line: `value` on the `axis` ("x" or "y"), with a short label (a claim's threshold, the dense
    run)."""

    value: float
    label: str
    axis: str = "y"


def cycle_style(names: Sequence[str]) -> StyleOf:
    """Styles for series that are not policies (quantities, layers): the colour-blind-safe colours in order, a new
    dash each time the colours wrap around."""
    index = {name: i for i, name in enumerate(dict.fromkeys(names))}

    def style(name: str) -> PolicyStyle:
        i = index[name]
        return PolicyStyle(QUALITATIVE[i % len(QUALITATIVE)], "circle", DASHES[i // len(QUALITATIVE) % len(DASHES)])

    return style


def base_layout(figure: go.Figure, title: str, height: int = 380) -> go.Figure:
    """The layout every figure shares: white template, title, legend under the plot."""
    figure.update_layout(
        title=title,
        template="plotly_white",
        height=height,
        margin=dict(l=60, r=20, t=50, b=50),
        legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0),
    )
    return figure


def add_references(
    figure: go.Figure, references: Sequence[Reference], log_x: bool = False, log_y: bool = False, **where
) -> None:
    """Draw each reference as a grey dotted line with its label at the plot's edge; `log_x`/`log_y` say which axes
    are logarithmic (a label's position on a log axis is in decades, the line's is not); `where` picks a subplot
    (row=, col=)."""
    for reference in references:
        line = dict(color="#777", dash="dot", width=1)
        horizontal = reference.axis == "y"
        (figure.add_hline if horizontal else figure.add_vline)(reference.value, line=line, **where)
        if not reference.label:
            continue
        position = math.log10(reference.value) if (log_y if horizontal else log_x) else reference.value
        placement = (
            dict(xref="x domain", x=1, y=position, xanchor="right", yanchor="bottom")
            if horizontal
            else dict(yref="y domain", y=0, x=position, xanchor="left", yanchor="bottom")
        )
        figure.add_annotation(
            text=reference.label, showarrow=False, font=dict(size=10, color="#555"), **placement, **where
        )


def line_figure(
    x: Sequence,
    series: Mapping[str, Sequence[float | None]],
    title: str,
    x_title: str,
    y_title: str,
    log_y: bool = False,
    style: StyleOf | None = None,
    markers: bool = True,
    references: Sequence[Reference] = (),
    log_x: bool = False,
) -> go.Figure:
    """One line per entry of `series`, all against `x` (with markers unless `markers` is False). With `log_y`,
    values ≤ 0 cannot be drawn and are left as gaps. A log axis gets an explicit range: plotly's autorange reads a
    reference line's value on a log axis as a power of ten and would stretch the axis to it."""
    style = style or cycle_style(list(series))
    figure = go.Figure()
    for name, values in series.items():
        look = style(name)
        drawn = [None if v is None or (log_y and v <= 0) else v for v in values]
        figure.add_trace(
            go.Scatter(
                x=list(x),
                y=drawn,
                mode="lines+markers" if markers else "lines",
                name=name,
                legendgroup=name,
                line=look.line(),
                marker=look.marker(7),
            )
        )
    base_layout(figure, title)
    figure.update_layout(xaxis_title=x_title, yaxis_title=y_title)
    points = list(x)
    if points and all(isinstance(value, int) for value in points) and max(points) - min(points) <= 32:
        figure.update_xaxes(dtick=1)  # a few whole numbers (layers): no fractional ticks
    if log_y:
        drawn_values = [v for values in series.values() for v in values if v is not None and v > 0]
        decades = [math.log10(min(drawn_values)) - 0.3, math.log10(max(drawn_values)) + 0.3] if drawn_values else None
        figure.update_yaxes(type="log", exponentformat="power", range=decades)
    if log_x:
        positive = [v for v in points if v > 0]
        figure.update_xaxes(type="log", range=[math.log10(min(positive)), math.log10(max(positive))])
    add_references(figure, references, log_x=log_x, log_y=log_y)
    return figure


def box_figure(
    groups: Mapping[str, tuple[Sequence[str], Sequence[float]]],
    title: str,
    y_title: str,
    log_y: bool = False,
    style: StyleOf | None = None,
    x_title: str = "",
) -> go.Figure:
    """One box per entry of `groups` — (categories, values), one pair per sample — grouped side by side within
    each category, every sample drawn as a point next to its box. With `log_y`, values ≤ 0 are left out."""
    style = style or cycle_style(list(groups))
    figure = go.Figure()
    for name, (categories, values) in groups.items():
        look = style(name)
        kept = [(c, v) for c, v in zip(categories, values) if v is not None and not (log_y and v <= 0)]
        figure.add_trace(
            go.Box(
                x=[c for c, _ in kept],
                y=[v for _, v in kept],
                name=name,
                legendgroup=name,
                marker=dict(color=look.color, size=3),
                line=dict(color=look.color, width=1.5),
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
            )
        )
    base_layout(figure, title, height=420)
    figure.update_layout(boxmode="group", yaxis_title=y_title, xaxis_title=x_title)
    if log_y:
        figure.update_yaxes(type="log", exponentformat="power")
    return figure


def heatmap_figure(
    z: Sequence[Sequence[float | None]],
    x_labels: Sequence[str],
    y_labels: Sequence[str],
    title: str,
    zmin: float | None = None,
    zmax: float | None = None,
    colorscale: str = "Viridis",
    colorbar_title: str = "",
    digits: int = 3,
) -> go.Figure:
    """A heatmap of `z` (rows = `y_labels`, columns = `x_labels`) with each cell's value written on it; None cells
    (not measured) stay blank. Without `zmin`/`zmax` the colour range is the measured cells' own range."""
    measured = [value for row in z for value in row if value is not None and math.isfinite(value)]
    text = [["" if value is None else f"{value:.{digits}f}" for value in row] for row in z]
    figure = go.Figure(
        go.Heatmap(
            z=[list(row) for row in z],
            x=list(x_labels),
            y=list(y_labels),
            zmin=zmin if zmin is not None else min(measured, default=None),
            zmax=zmax if zmax is not None else max(measured, default=None),
            colorscale=colorscale,
            text=text,
            texttemplate="%{text}",
            hoverongaps=False,
            colorbar=dict(title=dict(text=colorbar_title, side="right")),
        )
    )
    base_layout(figure, title, height=360)
    figure.update_yaxes(autorange="reversed")
    return figure
