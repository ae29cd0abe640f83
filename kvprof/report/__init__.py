"""The shared report layer: tables for the terminal and HTML, plotly figures, a self-contained HTML dashboard.
Commands describe what to show (`TableData`, figures, `Section`s); nothing here knows a particular command.
"""

from kvprof.report.figures import heatmap_figure, line_figure
from kvprof.report.html import Section, render_html, write_html
from kvprof.report.tables import TableData

__all__ = ["Section", "TableData", "heatmap_figure", "line_figure", "render_html", "write_html"]
