"""One table description, rendered to the terminal (rich) and to HTML (`kvprof.report.html`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table


def cell(value: object, fmt: str) -> str:
    """`value` formatted as `fmt` for a table cell, "–" where it is missing (None)."""
    return "–" if value is None else format(value, fmt)


@dataclass
class TableData:
    """A titled table of formatted cells (`rows`: one string per column); first column left-aligned, the rest right;
    `caption` under it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    caption: str = ""

    def add_row(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(cell) for cell in cells])

    def to_rich(self) -> Table:
        table = Table(title=self.title, caption=self.caption or None)
        for index, column in enumerate(self.columns):
            table.add_column(column, justify="left" if index == 0 else "right")
        for row in self.rows:
            table.add_row(*row)
        return table


def milliseconds(stats: dict | None, key: str) -> str:
    """Statistic `key` of a latency distribution (s) in ms: whole from 10 ms, three significant digits below; "-"
    without one."""
    if not stats:
        return "-"
    value = 1000 * stats[key]
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"
