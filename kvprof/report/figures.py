"""Shared plotly builders: line charts, box plots, labelled heatmaps. `style` maps a series name to its
`PolicyStyle`; a styled series carries its name as `legendgroup` (how tests find a policy's traces). Legends sit
under the plot.
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
    """A labelled reference line at `value` on `axis` ("x" or "y"): a claim's threshold, the dense run."""

    value: float
    label: str
    axis: str = "y"


def cycle_style(names: Sequence[str]) -> StyleOf:
    """Styles for non-policy series: the colour-blind-safe colours in order, a new dash per wrap-around."""
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
    """Grey dotted labelled reference lines; `log_x`/`log_y`: logarithmic axes (labels are placed in decades);
    `where`: a subplot (row=, col=)."""
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
    """One line per `series` against `x`. With `log_y`, values ≤ 0 are gaps and the range is explicit (plotly's
    autorange reads a log-axis reference's value as a power of ten)."""
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
    """Boxes per `groups` entry ((categories, values) pairs), side by side per category, with every sample as a
    point; `log_y` drops values ≤ 0."""
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
    """Heatmap of `z` (rows `y_labels`, columns `x_labels`), values written on cells, None blank; colour range the
    measured cells' unless `zmin`/`zmax`."""
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
