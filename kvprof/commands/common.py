"""Options and helpers every command shares: --out, --device, --dtype, --seed, the console, result files."""

from __future__ import annotations

import datetime as _dt
import platform
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import kvprof
from kvprof.fileio import write_json

console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 140)
progress_console = Console(stderr=True)

OutOption = Annotated[Path, typer.Option("--out", help="Directory for results (created if missing).")]
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA if present, else CPU), cpu, cuda or cuda:N.")]
DtypeOption = Annotated[str, typer.Option(
    "--dtype", help="Model dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed; a fixed seed gives identical results.")]


def progress() -> Progress:
    """A rich progress bar on stderr (stdout stays clean for tables)."""
    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=progress_console, transient=False)


def result_envelope(kind: str, payload: dict, args: dict) -> dict:
    """The schema-versioned wrapper of every JSON result file."""
    import torch

    return {
        "schema": f"kvprof.result.{kind}", "version": 1, "kvprof": kvprof.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in args.items()},
        **payload,
    }


def write_result(out: Path, kind: str, payload: dict, args: dict) -> Path:
    """Write `OUT/<kind>.json` atomically and return its path."""
    return write_json(out / f"{kind}.json", result_envelope(kind, payload, args))


def demo_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo world's short lora-mode sample trace (and its model, unless --model is given): the default when
    no TRACE is passed."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["lora_short"], model or str(world.model)
