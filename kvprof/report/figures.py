"""Small plotly figure builders every command shares: a per-layer line chart and a labelled heatmap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go


def line_figure(
    x: Sequence, series: Mapping[str, Sequence[float]], title: str, x_title: str, y_title: str, log_y: bool = False
) -> go.Figure:
    """One line (with markers) per entry of `series`, all against `x`."""
    figure = go.Figure()
    for name, values in series.items():
        figure.add_trace(go.Scatter(x=list(x), y=list(values), mode="lines+markers", name=name))
    figure.update_layout(
        title=title,
        xaxis_title=x_title,
        yaxis_title=y_title,
        template="plotly_white",
        height=380,
        margin=dict(l=60, r=20, t=50, b=50),
    )
    if log_y:
        figure.update_yaxes(type="log")
    return figure


def heatmap_figure(
    z: Sequence[Sequence[float | None]],
    x_labels: Sequence[str],
    y_labels: Sequence[str],
    title: str,
    zmin: float | None = None,
    zmax: float | None = None,
    colorscale: str = "Viridis",
) -> go.Figure:
    """A heatmap of `z` (rows = `y_labels`, columns = `x_labels`) with each cell's value written on it."""
    text = [["" if value is None else f"{value:.3f}" for value in row] for row in z]
    figure = go.Figure(
        go.Heatmap(
            z=[list(row) for row in z],
            x=list(x_labels),
            y=list(y_labels),
            zmin=zmin,
            zmax=zmax,
            colorscale=colorscale,
            text=text,
            texttemplate="%{text}",
        )
    )
    figure.update_layout(title=title, template="plotly_white", height=360, margin=dict(l=80, r=20, t=50, b=50))
    figure.update_yaxes(autorange="reversed")
    return figure
