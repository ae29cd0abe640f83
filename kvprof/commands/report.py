"""`kvprof report`: one HTML dashboard and terminal tables from result files of any kvprof command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def command(
    results: Annotated[list[Path], typer.Argument(help="Result JSON files written by kvprof commands.")],
    out: Annotated[Path, typer.Option("--out", help="Path of the HTML dashboard to write.")] = Path("runs/report.html"),
) -> None:
    """Merge result files into one dashboard (plotly, offline) and print their tables."""
    from kvprof.report.dashboard import build_dashboard
    from kvprof.report.terminal import show_report

    path, sections = build_dashboard(results, out)
    show_report(path, sections, results)
