"""The `kvprof` command line: one line per command; each command lives in kvprof/commands/."""

from __future__ import annotations

import sys

import click
import typer

import kvprof
from kvprof.commands import bench, capture, demo, inspect, rank_analysis, replay, report
from kvprof.errors import KvprofError

app = typer.Typer(
    name="kvprof",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Profile KV-cache sharing between LLM agents that share one base model (LoRA adapters or role prompts).",
)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the kvprof version and exit.")) -> None:
    if version:
        typer.echo(f"kvprof {kvprof.__version__}")
        raise typer.Exit()


app.command("capture")(capture.command)
app.command("inspect")(inspect.command)
app.command("replay")(replay.command)
app.command("report")(report.command)
app.command("rank-analysis")(rank_analysis.command)
app.command("bench")(bench.command)
app.command("demo")(demo.command)


def _quiet_libraries() -> None:
    """Keep transformers' loading bars and deprecation chatter out of kvprof's own output."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


INTERRUPTED = 130


def main() -> None:
    """Entry point: user mistakes (`KvprofError`) print one line and exit 2, without a traceback; Ctrl-C exits 130."""
    _quiet_libraries()
    try:
        code = app(standalone_mode=False)  # typer turns Ctrl-C inside a command into this return value
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as usage:
        usage.show()
        sys.exit(usage.exit_code)
    except click.exceptions.Abort:
        sys.exit(INTERRUPTED)
    except KvprofError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        code = INTERRUPTED
    if code == INTERRUPTED:
        typer.echo(
            "interrupted; nothing half-written was kept (capture and replay continue from their checkpoint "
            "with --resume).",
            err=True,
        )
    if isinstance(code, int) and code:
        sys.exit(code)
