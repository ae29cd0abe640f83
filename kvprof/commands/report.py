"""`kvprof report`: one HTML dashboard and terminal tables from result files of any kvprof command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console
from kvprof.report import write_html
from kvprof.report.dashboard import dashboard_sections


def command(
    results: Annotated[list[Path], typer.Argument(help="Result JSON files written by kvprof commands.")],
    out: Annotated[Path, typer.Option("--out", help="Path of the HTML dashboard to write.")] = Path(
        "runs/report.html"),
) -> None:
    """Merge result files into one dashboard (plotly, offline) and print their tables."""
    sections = dashboard_sections(results)
    for section in sections:
        console.rule(section.title)
        for line in section.text:
            console.print(line)
        for table in section.tables:
            console.print(table.to_rich())
    path = write_html(out, "kvprof report", sections, subtitle=", ".join(map(str, results)))
    console.print(f"wrote {path} ({len(sections)} sections from {len(results)} result files)")
