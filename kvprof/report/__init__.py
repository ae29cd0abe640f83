"""The shared report layer: tables for the terminal and HTML, plotly figures, and a self-contained HTML dashboard.

Commands describe what to show (`TableData`, plotly figures, `Section`s); this package renders it the same way
everywhere. Nothing here knows about a particular command.
"""

from kvprof.report.figures import heatmap_figure, line_figure
from kvprof.report.html import Section, render_html, write_html
from kvprof.report.tables import TableData

__all__ = ["Section", "TableData", "heatmap_figure", "line_figure", "render_html", "write_html"]
