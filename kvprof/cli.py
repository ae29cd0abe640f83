"""The `kvprof` command line: one line per command; each command lives in kvprof/commands/."""

from __future__ import annotations

import os
import sys

import typer

import kvprof
from kvprof.commands import (
    bench,
    capture,
    common,
    demo,
    fit_anchors,
    import_chat,
    inspect,
    rank_analysis,
    recommend,
    replay,
    report,
    serve_bench,
    simulate,
    tune_tau,
)
from kvprof.errors import KvprofError

USAGE = 2  # exit code of a usage error or a user mistake
INTERRUPTED = 130

app = typer.Typer(
    name="kvprof",
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help text: formatting it with rich costs ~0.2 s of every --help (the budget is 0.5 s)
    rich_markup_mode=None,
    help="Profile KV-cache sharing between LLM agents that share one base model (LoRA adapters or role prompts).",
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the kvprof version and exit."),
) -> None:
    """`--version` prints the version; without a command, the help is shown (exit 2: no command ran)."""
    if version:
        typer.echo(f"kvprof {kvprof.__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(USAGE)


app.command("capture")(capture.command)
app.command("import-chat")(import_chat.command)
app.command("inspect")(inspect.command)
app.command("replay")(replay.command)
app.command("report")(report.command)
app.command("rank-analysis")(rank_analysis.command)
app.command("fit-anchors")(fit_anchors.command)
app.command("tune-tau")(tune_tau.command)
app.command("bench")(bench.command)
app.command("serve-bench")(serve_bench.command)
app.command("simulate")(simulate.command)
app.command("recommend")(recommend.command)
app.command("demo")(demo.command)


def _quiet_libraries() -> None:
    """Keep transformers' loading bars and deprecation chatter out of kvprof's output: through the environment
    variables transformers and huggingface_hub read on import (unless the user set them, so `--help` imports
    neither), directly if transformers is already imported. bitsandbytes' missing-kernel warning on AVX512-BF16 CPUs
    is silenced (its fallback is exact); its errors are shown."""
    import logging
    import warnings

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported before (kvprof called in-process): set it directly
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def usage_line(err: typer.TyperException) -> str:
    """A usage error as one line: typer's message, then where the command's help is."""
    message = " ".join(err.format_message().split())
    ctx = getattr(err, "ctx", None)
    if ctx is None:
        return f"error: {message}"
    return f"error: {message}{'' if message.endswith(('.', '?', '!')) else '.'} See '{ctx.command_path} --help'."


def main() -> None:
    """Entry point: usage errors and user mistakes (`KvprofError`) print one line and exit 2, without a traceback;
    Ctrl-C exits 130."""
    _quiet_libraries()
    common.start_command()
    try:
        # typer turns Ctrl-C inside a command and `typer.Exit` into this value; the program is "kvprof" however it
        # was started (click would otherwise name it after `python -m ...`)
        code = app(prog_name="kvprof", standalone_mode=False)
    except typer.TyperException as usage:
        typer.echo(usage_line(usage), err=True)
        sys.exit(USAGE)
    except typer.Abort:
        sys.exit(INTERRUPTED)
    except KvprofError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(USAGE)
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
