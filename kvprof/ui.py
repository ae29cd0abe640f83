"""The terminal: a rich console for results on stdout, and progress bars on stderr."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 140)
progress_console = Console(stderr=True)


def progress() -> Progress:
    """A rich progress bar on stderr (stdout stays clean for tables): what runs, how far, time spent and left."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=progress_console,
        transient=False,
    )


def describe_bytes(count: float) -> str:
    """`count` bytes in GiB, MiB or KiB, three significant figures."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"
