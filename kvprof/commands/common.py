"""Options and helpers every command shares: --out, --device, --dtype, --seed, --min-span / --span-boundaries, the
console (`kvprof.ui`, re-exported here), result files, dashboard sections on the terminal."""

from __future__ import annotations

import datetime as _dt
import inspect
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

import kvprof
from kvprof.fileio import RESULT_SCHEMA, RESULT_VERSION, write_json
from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.model.agents import AgentSet
    from kvprof.report import Section

__all__ = [
    "DeviceOption",
    "DtypeOption",
    "MinSpanOption",
    "OutOption",
    "SeedOption",
    "SpanBoundariesOption",
    "command_args",
    "console",
    "demo_trace",
    "print_adapters",
    "print_sections",
    "progress",
    "result_envelope",
    "write_result",
]

OutOption = Annotated[Path, typer.Option("--out", help="Directory for results (created if missing).")]
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA if present, else CPU), cpu, cuda or cuda:N.")]
DtypeOption = Annotated[
    str,
    typer.Option("--dtype", help="Model dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed; a fixed seed gives identical results.")]
MinSpanOption = Annotated[
    int,
    typer.Option(
        "--min-span",
        help="The shortest run of ids, read again at other positions than a turn computed them, counted as a moved "
        "span (at least 8).",
    ),
]
SpanBoundariesOption = Annotated[
    str,
    typer.Option(
        "--span-boundaries",
        help="messages: a moved span begins and ends where a message (a segment of the trace) begins or ends, in the "
        "reading turn or in the turn it comes from, as chunk caches reuse whole messages; ids: any run of equal ids. "
        "Turns generated online (--online) are matched by ids.",
    ),
]


def result_envelope(kind: str, payload: dict, args: dict, workers: list[dict] | None = None) -> dict:
    """The schema-versioned wrapper of every JSON result file; `workers`: the Ray workers (host, device, CPU, ...)
    a distributed run replayed on, listed in its environment."""
    import torch

    from kvprof.profiling import cpu_description

    envelope = {
        "schema": f"{RESULT_SCHEMA}{kind}",
        "version": RESULT_VERSION,
        "kvprof": kvprof.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu": cpu_description(),
            "cpu_threads": torch.get_num_threads(),
        },
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in args.items()},
        **payload,
    }
    if workers is not None:
        envelope["environment"]["workers"] = workers
    return envelope


def write_result(out: Path, kind: str, payload: dict, args: dict, workers: list[dict] | None = None) -> Path:
    """Write `OUT/<kind>.json` atomically (`result_envelope`) and return its path."""
    return write_json(out / f"{kind}.json", result_envelope(kind, payload, args, workers))


def command_args(command: Callable, **given) -> dict:
    """The `args` a result of `command` records when it runs with the options `given` and defaults for the rest:
    what a stage of `kvprof demo` records for the command it stands for."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(command).parameters.items()}
    unknown = given.keys() - defaults.keys()
    if unknown:
        raise TypeError(f"{command.__module__} has no options {', '.join(sorted(unknown))}")
    return defaults | given


def note(line: str) -> None:
    """A line the user should notice (a wait, a retry), in yellow and without markup."""
    console.print(line, style="yellow", markup=False)


def print_adapters(agents: AgentSet) -> None:
    """One line per agent that runs a LoRA adapter: the adapter's folder, rank, alpha, projections and layers."""
    for name, info in agents.adapters.items():
        console.print(f"agent [bold]{name}[/]: adapter {info.path} ({info.describe()}, {info.layers} layers)")


def print_layers(agents: AgentSet) -> None:
    """The model's layers by kind (attention, window, position encoding: `kvprof.model.layers.describe_layers`)."""
    from kvprof.model.layers import describe_layers

    console.print(f"model {agents.model_name}: {describe_layers(agents.layer_kinds)}", markup=False)


def print_sections(sections: list[Section]) -> None:
    """Dashboard sections on the terminal: a rule with the title, then the card, the text and the tables (not the
    figures)."""
    for section in sections:
        console.rule(section.title)
        for line in section.card:
            console.print(line, style="bold", markup=False)
        for line in section.text:
            console.print(line)
        for table in section.tables:
            console.print(table.to_rich())


def demo_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo world's short lora-mode sample trace (and its model, unless --model is given): the default when
    no TRACE is passed."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["lora_short"], model or str(world.model)


def demo_prompt_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo world's prompt-mode tuning trace (and its model, unless --model is given): the default of
    fit-anchors and tune-tau."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["prompt_tune"], model or str(world.model)
