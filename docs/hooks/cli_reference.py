"""MkDocs hook: the CLI reference page, generated at build time from the typer app (so it never goes stale).

Every command the app registers gets its usage line, its help and a table of its arguments and options (name, type,
default, help), read from the command typer builds; a command added to the app appears without editing this.
"""

from __future__ import annotations

import re
from typing import Any

import typer

PAGE = "reference/cli.md"
# typer's help text ends with the default it shows: "...  [default: 3; x>=1]"
DEFAULT = re.compile(r"\s*\[default: (?P<default>[^\]]*)\]$")


def cli_group() -> Any:
    """The command group behind `kvprof`, as typer builds it (afresh on each call)."""
    from kvprof.cli import app

    return typer.main.get_command(app)


def registered(group: Any) -> list[tuple[str, Any]]:
    """The group's commands, in the order `kvprof --help` lists them."""
    ctx = typer.Context(group, info_name="kvprof")
    commands = ((name, group.get_command(ctx, name)) for name in group.list_commands(ctx))
    return [(name, command) for name, command in commands if command is not None and not command.hidden]


def cell(text: str) -> str:
    """Text as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def parameter_rows(command: Any, ctx: Any) -> list[str]:
    """One table row per argument and option of a command, from the help record `--help` prints."""
    rows = []
    for param in command.params:
        record = param.get_help_record(ctx)
        if param.hidden or record is None:
            continue
        names, _, kind = record[0].partition(" <")
        kind = f"`<{kind}`" if kind else "flag"
        if param.param_type_name == "argument":
            names += " (argument)"
        match = DEFAULT.search(record[1])
        text = record[1][: match.start()] if match else record[1]
        shown = f"`{cell(match['default'])}`" if match else ""
        rows.append(f"| `{names.replace(', ', '`, `').replace(' / ', '` / `')}` | {kind} | {shown} | {cell(text)} |")
    return rows


def command_section(path: str, command: Any, parent: Any, level: int) -> str:
    """Usage, help and parameter table of one command (`parent`: the root's context, None for the root)."""
    ctx = typer.Context(command, info_name=path.split()[-1], parent=parent)
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    lines = [f"{'#' * level} `{path}`", "", "```text", usage, "```", ""]
    if command.help:
        lines += [command.help.strip(), ""]
    rows = parameter_rows(command, ctx)
    if rows:
        lines += ["| name | type | default | help |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)


def render(group: Any) -> str:
    """The whole reference page: the root command, then every registered command."""
    root = typer.Context(group, info_name="kvprof")
    sections = [
        "# CLI reference",
        "",
        "Generated from the typer app (`kvprof.cli.app`) when the site is built: every command, its usage, help and "
        "options, as `kvprof COMMAND --help` shows them.",
        "",
        command_section("kvprof", group, None, 2),
    ]
    sections += [command_section(f"kvprof {name}", command, root, 2) for name, command in registered(group)]
    return "\n".join(sections)


def on_files(files: Any, config: Any) -> Any:
    """Add the generated page to the site's files (MkDocs calls this before it builds the nav)."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render(cli_group())))
    return files
