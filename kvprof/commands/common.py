"""What the commands share besides their options (`kvprof.commands.options`), progress displays
(`kvprof.commands.displays`) and what they print of their results (`kvprof.report.terminal`): result files, the
console, torch threads, the demo world's default traces."""

from __future__ import annotations

import datetime as _dt
import inspect
import platform
from pathlib import Path

import kvprof
from kvprof.fileio import RESULT_SCHEMA, RESULT_VERSION, write_json
from kvprof.results.base import Envelope, Environment, ResultFile
from kvprof.threads import LoadMeter, ThreadChoice, choose_threads
from kvprof.ui import console, progress

__all__ = [
    "command_args",
    "console",
    "demo_prompt_trace",
    "demo_trace",
    "note",
    "progress",
    "result_envelope",
    "start_command",
    "use_threads",
    "write_result",
]

# This invocation's thread choice and the meter of the machine's load since it started (`start_command`), which
# its result records; empty outside a command.
_INVOCATION: dict[str, ThreadChoice | LoadMeter] = {}


def start_command() -> None:
    """Forget the last invocation's threads and start metering the machine's load (the command line, once per
    command: in-process runs follow one another)."""
    _INVOCATION.clear()
    _INVOCATION["meter"] = LoadMeter()


def use_threads(threads: int | None) -> ThreadChoice:
    """A command that runs models: set its torch threads (`--threads`, else the default from the cores free), say
    so, and record it for the result."""
    meter = _INVOCATION.get("meter")
    choice = choose_threads(threads, meter if isinstance(meter, LoadMeter) else None)
    _INVOCATION["threads"] = choice
    console.print(f"running {choice.describe()}", markup=False)
    return choice


def result_envelope(kind: str, payload: dict, args: dict, workers: list[dict] | None = None) -> dict:
    """`payload` in the schema-versioned envelope of every JSON result (`kvprof.results.base.Envelope`); `workers`:
    a distributed run's Ray workers."""
    import torch

    from kvprof.profiling import cpu_description, peak_host_bytes

    choice, meter = _INVOCATION.get("threads"), _INVOCATION.get("meter")
    envelope = Envelope(
        schema=f"{RESULT_SCHEMA}{kind}",
        version=RESULT_VERSION,
        kvprof=kvprof.__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        environment=Environment(
            python=platform.python_version(),
            torch=torch.__version__,
            cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            cpu=cpu_description(),
            cpu_threads=torch.get_num_threads(),
            threads_chosen=choice.describe() if isinstance(choice, ThreadChoice) else None,
            load=meter.reading().to_json() if isinstance(meter, LoadMeter) else None,
            workers=workers,
            peak_host_bytes=peak_host_bytes(),
        ),
        args={key: str(value) if isinstance(value, Path) else value for key, value in args.items()},
    )
    return envelope.to_json() | payload


def write_result(
    out: Path, kind: str, payload: dict | ResultFile, args: dict, workers: list[dict] | None = None
) -> Path:
    """Write `OUT/<kind>.json` atomically (`result_envelope`) and return its path; a typed result writes its JSON."""
    if isinstance(payload, ResultFile):
        assert payload.KIND == kind, f"a {payload.KIND} result written as {kind}"
        payload = payload.to_json()
    return write_json(out / f"{kind}.json", result_envelope(kind, payload, args, workers))


def command_args(name: str, **given) -> dict:
    """The `args` a `kvprof NAME` result records with options `given`, defaults for the rest (read from the typer
    app, so no command imports another): what a demo stage records."""
    from kvprof.cli import app

    (command,) = [entry.callback for entry in app.registered_commands if entry.name == name]
    assert command is not None, f"kvprof {name} has no callback"
    defaults = {key: parameter.default for key, parameter in inspect.signature(command).parameters.items()}
    unknown = given.keys() - defaults.keys()
    if unknown:
        raise TypeError(f"kvprof {name} has no options {', '.join(sorted(unknown))}")
    return defaults | given


def note(line: str) -> None:
    """A line the user should notice (a wait, a retry), in yellow and without markup."""
    console.print(line, style="yellow", markup=False)


def demo_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo's short lora-mode trace (and its model unless --model): the default TRACE."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["lora_short"], model or str(world.model)


def demo_prompt_trace(model: str | None) -> tuple[Path, str | None]:
    """The demo's prompt-mode tuning trace (and its model unless --model): fit-anchors' and tune-tau's default."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    return world.sample_traces["prompt_tune"], model or str(world.model)
