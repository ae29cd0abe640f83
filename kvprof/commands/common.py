"""What the commands share besides their options (`kvprof.commands.options`) and progress displays
(`kvprof.commands.displays`): result files, the console and terminal sections, the demo world's default traces,
and a replay's tables and page."""

from __future__ import annotations

import datetime as _dt
import inspect
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import kvprof
from kvprof.fileio import RESULT_SCHEMA, RESULT_VERSION, write_json
from kvprof.results.base import Envelope, Environment, ResultFile
from kvprof.threads import LoadMeter, ThreadChoice, choose_threads
from kvprof.ui import console, progress

if TYPE_CHECKING:
    from kvprof.model.agents import AgentSet
    from kvprof.report import Section
    from kvprof.results.recommend import RecommendResult
    from kvprof.results.replay import ReplayResult

__all__ = [
    "command_args",
    "console",
    "demo_prompt_trace",
    "demo_trace",
    "note",
    "print_adapters",
    "print_layers",
    "print_sections",
    "print_skipped",
    "progress",
    "result_envelope",
    "show_recommendation",
    "show_replay",
    "start_command",
    "use_threads",
    "write_replay_page",
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
    choice = choose_threads(threads)
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


def print_adapters(agents: AgentSet) -> None:
    """One line per agent that runs a LoRA adapter: the adapter's folder, rank, alpha, projections and layers."""
    for name, info in agents.adapters.items():
        console.print(f"agent [bold]{name}[/]: adapter {info.path} ({info.describe()}, {info.layers} layers)")


def print_layers(agents: AgentSet) -> None:
    """The model's layers by kind (attention, window, position encoding: `kvprof.model.layers.describe_layers`)."""
    from kvprof.model.layers import describe_layers

    console.print(f"model {agents.model_name}: {describe_layers(agents.layer_kinds)}", markup=False)


def print_sections(sections: list[Section]) -> None:
    """Dashboard sections on the terminal: title rule, card, text, tables (no figures)."""
    for section in sections:
        console.rule(section.title)
        for line in section.card:
            console.print(line, style="bold", markup=False)
        for line in section.text:
            console.print(line)
        for table in section.tables:
            console.print(table.to_rich())


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


def print_skipped(skipped: dict[str, str]) -> None:
    """One line per refusal reason, naming the variants it skipped."""
    for reason in dict.fromkeys(skipped.values()):
        labels = ", ".join(label for label, why in skipped.items() if why == reason)
        console.print(f"[yellow]skipped {labels}[/]: {reason}")


def show_recommendation(result: RecommendResult) -> None:
    """A recommendation's tables (candidates, held-out confirmation, sensitivity), then its decision in bold."""
    from kvprof.report.recommend import candidates_table, decision_lines, heldout_table, sensitivity_table

    console.print(candidates_table(result).to_rich())
    heldout = heldout_table(result)
    if heldout is not None:
        console.print(heldout.to_rich())
    console.print(sensitivity_table(result).to_rich())
    for line in decision_lines(result):
        console.print(line, style="bold", markup=False)


def show_replay(result: ReplayResult) -> None:
    """A replay's terminal output: a warning if the dense run does not reproduce a captured trace, then the tables."""
    from kvprof.report.replay import (
        contention_text,
        cost_table,
        delta_table,
        dense_check,
        fidelity_table,
        memory_claims_table,
        policy_notes,
        reuse_table,
        timeline_note,
    )

    check = dense_check(result)
    if check.startswith("WARNING"):
        console.print(f"[bold red]{check}[/]")
    contention = contention_text(result.timing or {})
    if contention and contention.startswith("CONTENDED"):
        console.print(f"WARNING: {contention}.", style="bold red", markup=False)
    timeline = timeline_note(result)
    if timeline:
        console.print(timeline)
    console.print(fidelity_table(result).to_rich())
    console.print(reuse_table(result).to_rich())
    delta = delta_table(result)
    if delta is not None:
        console.print(delta.to_rich())
    console.print(cost_table(result).to_rich())
    claims = memory_claims_table(result)
    if claims is not None:
        console.print(claims.to_rich())
    for line in policy_notes(result):
        console.print(line)


def write_replay_page(out: Path, result: ReplayResult) -> Path:
    """OUT/replay.html: a replay's dashboard page."""
    from kvprof.report import write_html
    from kvprof.report.replay import sections

    return write_html(out / "replay.html", "kvprof replay", sections(result), subtitle=result.trace or "")
