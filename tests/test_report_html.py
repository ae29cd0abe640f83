"""kvprof.report: tables render to rich and HTML; the dashboard is self-contained (plotly.js inline, once)."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from kvprof.report import Section, TableData, heatmap_figure, line_figure, render_html, write_html


def _sections():
    table = TableData(title="t <1>", columns=["layer", "value"], caption="a & b")
    table.add_row("0 K", "1.5")
    figures = [
        line_figure([0, 1], {"a": [1.0, 2.0]}, "lines", "layer", "v"),
        heatmap_figure([[1.0, None], [0.5, 1.0]], ["x", "y"], ["x", "y"], "heat", zmin=-1, zmax=1),
    ]
    return [
        Section("first", text=["plain <b>text</b>"], tables=[table], figures=figures[:1]),
        Section("second", figures=figures[1:]),
    ]


def test_html_is_offline_and_embeds_plotly_once(tmp_path):
    path = write_html(tmp_path / "r.html", "title", _sections(), subtitle="sub")
    page = path.read_text()
    assert page.count("Plotly.newPlot") == 2
    assert page.count("plotly.js v") == 1  # the library banner: embedded exactly once
    assert re.search(r"<script[^>]*\bsrc=", page) is None  # nothing is loaded from outside the file
    assert "&lt;b&gt;text&lt;/b&gt;" in page and "t &lt;1&gt;" in page and "a &amp; b" in page
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temporary file left behind


def test_html_is_deterministic():
    assert render_html("t", _sections()) == render_html("t", _sections())


def test_table_renders_to_rich_and_checks_width():
    table = TableData(title="demo", columns=["a", "b"])
    table.add_row("x", 1)
    console = Console(record=True, width=60)
    console.print(table.to_rich())
    text = console.export_text()
    assert "demo" in text and "│ x │ 1 │" in text
    with pytest.raises(ValueError):
        table.add_row("only one")
