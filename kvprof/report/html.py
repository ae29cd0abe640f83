"""A self-contained HTML dashboard, written atomically: title, environment panel, table of contents, then sections
by `Section.order`; plotly.js inlined once per file (offline, no CDN).
"""

from __future__ import annotations

import html
import os
import re
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
.figures > div.wide { flex-basis: 100%; }
.card { background: #f4f8fb; border-left: 4px solid #0072B2; padding: 0.6em 1em; margin: 1em 0; }
.card p { margin: 0.3em 0; } .card p:last-child { font-weight: bold; }
nav.toc { font-size: 0.9em; columns: 2; background: #fafafa; padding: 0.5em 1em; border: 1px solid #eee; }
nav.toc a { display: block; color: #0072B2; text-decoration: none; padding: 0.1em 0; }
table.env { font-size: 0.8em; color: #444; }
table.env td, table.env th { padding: 0.15em 0.5em; text-align: left; white-space: nowrap; }
"""
# Section.order values, top to bottom: a recommendation for a target (`kvprof recommend`), each replay's decision,
# the tables behind it, diagnostics, what was measured on.
ORDER = {"recommendation": 0, "decision": 1, "details": 2, "diagnostics": 3, "inputs": 4}


@dataclass
class Section:
    """A heading, a highlighted conclusion card, text, tables, figures. `order`: a key of `ORDER`; `wide`: how many
    first figures span the page."""

    title: str
    text: list[str] = field(default_factory=list)
    tables: list[TableData] = field(default_factory=list)
    figures: list = field(default_factory=list)
    card: list[str] = field(default_factory=list)
    order: str = "diagnostics"
    wide: int = 0


def anchors(sections: list[Section]) -> list[str]:
    """One unique, deterministic element id per section, from its title."""
    ids, seen = [], set()
    for section in sections:
        slug = re.sub(r"[^a-z0-9]+", "-", section.title.lower()).strip("-")[:60] or "section"
        unique, count = slug, 1
        while unique in seen:
            count += 1
            unique = f"{slug}-{count}"
        seen.add(unique)
        ids.append(unique)
    return ids


def ordered(sections: list[Section]) -> list[Section]:
    """`sections` by `ORDER` of their `order` (stable within one kind)."""
    return sorted(sections, key=lambda section: ORDER.get(section.order, len(ORDER)))


def _table_html(table: TableData) -> str:
    head = "".join(f"<th>{html.escape(column)}</th>" for column in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table.rows)
    caption = f'<p class="note">{html.escape(table.caption)}</p>' if table.caption else ""
    return (
        f"<table><caption>{html.escape(table.title)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>{caption}"
    )


def render_html(title: str, sections: list[Section], subtitle: str = "", environment: TableData | None = None) -> str:
    """The page as a string, `sections` `ordered` under `environment` and a table of contents; figure i has id
    `fig-i` (deterministic)."""
    sections = ordered(sections)
    ids = anchors(sections)
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    if subtitle:
        parts.append(f'<p class="subtitle">{html.escape(subtitle)}</p>')
    if environment is not None:
        parts.append(_table_html(environment).replace("<table>", '<table class="env">', 1))
    if len(sections) > 1:
        links = "".join(f'<a href="#{i}">{html.escape(s.title)}</a>' for i, s in zip(ids, sections))
        parts.append(f'<nav class="toc" id="contents">{links}</nav>')
    count = 0
    for anchor, section in zip(ids, sections):
        parts.append(f'<section id="{anchor}"><h2>{html.escape(section.title)}</h2>')
        if section.card:
            parts.append('<div class="card">' + "".join(f"<p>{html.escape(p)}</p>" for p in section.card) + "</div>")
        parts.extend(f"<p>{html.escape(paragraph)}</p>" for paragraph in section.text)
        parts.extend(_table_html(table) for table in section.tables)
        if section.figures:
            parts.append('<div class="figures">')
            for index, figure in enumerate(section.figures):
                rendered = figure.to_html(
                    full_html=False,
                    include_plotlyjs=count == 0,
                    div_id=f"fig-{count}",
                    config={"displaylogo": False, "responsive": True},
                )
                wide = ' class="wide"' if index < section.wide else ""
                parts.append(f"<div{wide}>{rendered}</div>")
                count += 1
            parts.append("</div>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(
    path: str | os.PathLike,
    title: str,
    sections: list[Section],
    subtitle: str = "",
    environment: TableData | None = None,
) -> Path:
    """Write the dashboard to `path` atomically and return the path."""
    with atomic_open(path) as handle:
        handle.write(render_html(title, sections, subtitle, environment))
    return Path(path)
