"""A self-contained HTML dashboard: titled sections of text, tables and plotly figures, written atomically.

plotly.js is embedded inline once per file (with the first figure), so the page works offline; no CDN.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.fileio import atomic_open
from kvprof.report.tables import TableData

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 0.2em; } .subtitle { color: #666; margin-top: 0; }
section { margin: 2em 0; border-top: 1px solid #ddd; padding-top: 1em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
caption { caption-side: top; font-weight: bold; text-align: left; padding-bottom: 0.4em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; } .note { color: #555; font-size: 0.9em; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; } .figures > div { flex: 1 1 520px; min-width: 420px; }
"""


@dataclass
class Section:
    """One part of the page: a heading, paragraphs of plain text, tables, then plotly figures."""

    title: str
    text: list[str] = field(default_factory=list)
    tables: list[TableData] = field(default_factory=list)
    figures: list = field(default_factory=list)


def _table_html(table: TableData) -> str:
    head = "".join(f"<th>{html.escape(column)}</th>" for column in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table.rows)
    caption = f'<p class="note">{html.escape(table.caption)}</p>' if table.caption else ""
    return (
        f"<table><caption>{html.escape(table.title)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>{caption}"
    )


def render_html(title: str, sections: list[Section], subtitle: str = "") -> str:
    """The whole page as a string; figure i gets the element id `fig-i`, so the output is deterministic."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    if subtitle:
        parts.append(f'<p class="subtitle">{html.escape(subtitle)}</p>')
    count = 0
    for section in sections:
        parts.append(f"<section><h2>{html.escape(section.title)}</h2>")
        parts.extend(f"<p>{html.escape(paragraph)}</p>" for paragraph in section.text)
        parts.extend(_table_html(table) for table in section.tables)
        if section.figures:
            parts.append('<div class="figures">')
            for figure in section.figures:
                parts.append(
                    figure.to_html(
                        full_html=False,
                        include_plotlyjs=count == 0,
                        div_id=f"fig-{count}",
                        config={"displaylogo": False},
                    )
                )
                count += 1
            parts.append("</div>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(path: str | os.PathLike, title: str, sections: list[Section], subtitle: str = "") -> Path:
    """Write the dashboard to `path` atomically and return the path."""
    with atomic_open(path) as handle:
        handle.write(render_html(title, sections, subtitle))
    return Path(path)
