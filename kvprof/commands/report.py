"""`kvprof report`: one HTML dashboard and terminal tables from result files of any kvprof command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.commands.common import console, print_sections


def command(
    results: Annotated[list[Path], typer.Argument(help="Result JSON files written by kvprof commands.")],
    out: Annotated[Path, typer.Option("--out", help="Path of the HTML dashboard to write.")] = Path("runs/report.html"),
) -> None:
    """Merge result files into one dashboard (plotly, offline) and print their tables."""
    from kvprof.report.dashboard import dashboard_sections, write_dashboard

    sections, environment = dashboard_sections(results)
    print_sections(sections)
    path = write_dashboard(out, sections, results, environment)
    console.print(f"wrote {path} ({len(sections)} sections from {len(results)} result files)")
